//! The sans-I/O gate in front of the smoltcp stack: what becomes of one TCP
//! packet from the TUN before smoltcp sees it. The engine's per-packet path
//! ([`super::SmolTcp::tcp`]) and the `smol` fuzz target both go through it.

use std::net::SocketAddr;

use super::stack::{Key, SmolStack, Syn, is_unicast};
use crate::packet::{self, IpInfo, Reject, TcpInfo};
use crate::stats::EngineDrop;

/// The gate's decision for one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Not a TCP segment that parses: count and drop.
    Reject(Reject),
    /// Not for smoltcp (family off, an address smoltcp cannot answer, a SYN
    /// retransmitted while its connect is in flight): count and drop.
    Drop(EngineDrop),
    /// Feed it to smoltcp.
    Input,
    /// A new connection's SYN, now marked connecting: admit, route and
    /// connect it, then give smoltcp the SYN.
    New(Key, TcpInfo),
    /// The socket budget is spent: answer the SYN with an RST.
    Full(TcpInfo),
}

/// Classify `pkt` (a whole IP packet, `ip` its parsed header). `family`:
/// whether the engine serves the packet's address family.
pub(crate) fn gate(stack: &SmolStack, pkt: &[u8], ip: &IpInfo, family: bool) -> Gate {
    let tcp = match packet::parse_tcp(pkt, ip) {
        Ok(t) => t,
        Err(r) => return Gate::Reject(r),
    };
    // Nothing malformed may mark a connect or reach smoltcp.
    if let Err(r) = packet::check_segment(pkt, ip, &tcp) {
        return Gate::Reject(r);
    }
    if !family {
        return Gate::Drop(EngineDrop::FamilyDisabled);
    }
    // smoltcp's routing asserts on anything else, and no real flow uses them.
    if !is_unicast(ip.src) || !is_unicast(ip.dst) {
        return Gate::Drop(EngineDrop::StrayTcp);
    }
    if !tcp.is_syn_only() {
        return Gate::Input;
    }
    let key = (
        SocketAddr::new(ip.src, tcp.src_port),
        SocketAddr::new(ip.dst, tcp.dst_port),
    );
    match stack.syn(key) {
        Syn::Known => Gate::Input,
        Syn::Connecting => Gate::Drop(EngineDrop::SynWhileConnecting),
        Syn::Full => Gate::Full(tcp),
        Syn::New => Gate::New(key, tcp),
    }
}
