//! The gate in front of the smoltcp stack, sans-I/O: what one TCP packet
//! from the TUN is, decided from the packet alone before any state is
//! touched. The engine's per-packet path ([`super::SmoltcpStack::tcp`]) and
//! the `smol` fuzz target both go through it, and then hand a SYN's flow to
//! [`super::Sockets::syn`], which classifies it against the sockets and
//! marks a new one connecting.

use std::net::{IpAddr, SocketAddr};

use crate::nat::FlowKey;
use crate::packet::{self, IpInfo, Reject, TcpInfo};
use crate::stats::EngineDrop;

/// The gate's decision for one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Not a TCP segment that parses: count and drop.
    Reject(Reject),
    /// Not for smoltcp (family off, an address smoltcp cannot answer):
    /// count and drop.
    Drop(EngineDrop),
    /// Feed it to smoltcp.
    Input,
    /// A connection request (SYN without ACK) of this flow: the stack says
    /// whether it is new ([`super::Sockets::syn`]).
    Syn(FlowKey, TcpInfo),
}

/// Classify `pkt` (a whole IP packet, `ip` its parsed header). `family`:
/// whether the engine serves the packet's address family.
pub(crate) fn gate(pkt: &[u8], ip: &IpInfo, family: bool) -> Gate {
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
    let key = FlowKey::new(
        SocketAddr::new(ip.src, tcp.src_port),
        SocketAddr::new(ip.dst, tcp.dst_port),
    );
    Gate::Syn(key, tcp)
}

/// Addresses smoltcp may answer from or to: unicast only (its routing
/// asserts on anything else, and no real flow uses them).
pub(crate) fn is_unicast(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(v) => !(v.is_unspecified() || v.is_multicast() || v.is_broadcast()),
        IpAddr::V6(v) => !(v.is_unspecified() || v.is_multicast()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::parse_ip;
    use crate::packet::tcp::flags::{ACK, SYN};
    use crate::packet::testutil::tcp_v4;

    fn run(pkt: &[u8], family: bool) -> Gate {
        let ip = parse_ip(pkt).expect("test input");
        gate(pkt, &ip, family)
    }

    /// The gate needs nothing but the packet: a SYN names its flow, other
    /// segments go to smoltcp, and what smoltcp must not see is counted.
    #[test]
    fn packets_are_classified_from_their_bytes_alone() {
        let syn = tcp_v4("10.0.0.9:40000", "1.1.1.1:443", 1000, 0, SYN, &[], &[]);
        let key = FlowKey::new(
            "10.0.0.9:40000".parse().expect("sa"),
            "1.1.1.1:443".parse().expect("sa"),
        );
        assert!(matches!(run(&syn, true), Gate::Syn(k, _) if k == key));
        let ack = tcp_v4("10.0.0.9:40000", "1.1.1.1:443", 1001, 7, ACK, &[], b"x");
        assert_eq!(run(&ack, true), Gate::Input);
        assert_eq!(
            run(&syn, false),
            Gate::Drop(EngineDrop::FamilyDisabled),
            "family off"
        );
        let multicast = tcp_v4("10.0.0.9:40000", "224.0.0.1:443", 1000, 0, SYN, &[], &[]);
        assert_eq!(run(&multicast, true), Gate::Drop(EngineDrop::StrayTcp));
        let mut bad = syn.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        assert!(matches!(run(&bad, true), Gate::Reject(_)), "bad checksum");
    }
}
