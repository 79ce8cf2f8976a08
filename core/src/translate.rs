//! The sans-I/O heart of the system netstack: one TCP packet and the NAT
//! table in, one decision out. No descriptors, no clock (time is passed in),
//! no allocation, no locks beyond the NAT table's shard locks — so it can be
//! fuzzed with packet sequences and its outcome checked against the table's
//! invariants (`fuzz/fuzz_targets/translate.rs`).
//!
//! The caller (the engine's `Processor`) counts the outcome and acts on it:
//! writes rewritten packets back, routes and holds new flows.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::IpNet;
use std::time::Instant;

use crate::nat::{FlowKey, NatError, NatTable, Uplink};
use crate::packet::{self, IpInfo, Reject, TcpInfo};
use crate::stats::EngineDrop;

/// Gateway, NAT address and listener port of one address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FamilyAddrs {
    pub gateway: IpAddr,
    pub nat: IpAddr,
    pub listen_port: u16,
}

/// The system stack's addresses, per family (`None` = family disabled).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StackAddrs {
    pub v4: Option<FamilyAddrs>,
    pub v6: Option<FamilyAddrs>,
}

impl StackAddrs {
    /// The family of `addr`, if enabled.
    #[inline]
    pub fn family(&self, addr: IpAddr) -> Option<FamilyAddrs> {
        match addr {
            IpAddr::V4(_) => self.v4,
            IpAddr::V6(_) => self.v6,
        }
    }
}

/// The NAT address of a gateway prefix: gateway + 1, which must stay inside the
/// prefix and not be its broadcast address (IPv4).
pub fn nat_address(net: IpNet) -> Option<IpAddr> {
    match net {
        IpNet::V4(n) => {
            let next = u32::from(n.addr()).checked_add(1)?;
            let a = Ipv4Addr::from(next);
            (n.contains(&a) && a != n.broadcast() && a != n.network()).then_some(IpAddr::V4(a))
        }
        IpNet::V6(n) => {
            let next = u128::from(n.addr()).checked_add(1)?;
            let a = Ipv6Addr::from(next);
            n.contains(&a).then_some(IpAddr::V6(a))
        }
    }
}

/// Why a packet was not forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    Reject(Reject),
    Engine(EngineDrop),
}

/// The decision for one TCP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpStep {
    /// App -> kernel listener: rewritten in place to the NAT tuple; write back `len` bytes.
    Uplink(usize),
    /// Kernel listener -> app: restored in place to the original tuple; write back `len` bytes.
    Downlink(usize),
    /// A SYN created NAT entry `port` for `key`; the buffer is unchanged. The
    /// caller routes it, admits it, and holds it while the outbound connects.
    /// `generation` is the one the entry was created with: everything the
    /// caller does later for this flow carries it, so it can never touch a
    /// newer flow that reuses the port.
    NewFlow {
        key: FlowKey,
        port: u16,
        generation: u64,
        tcp: TcpInfo,
    },
    /// An RST answering the packet was written in place (`len` bytes), because
    /// the NAT table refused the flow or the segment belongs to no flow.
    Reset { len: usize, cause: EngineDrop },
    /// Nothing to write; count `cause`.
    Drop(Cause),
}

/// Translate one TCP packet in place. `held(port)` says whether the SYN of
/// the flow at `port` is still held by a pending outbound connect (a SYN
/// retransmit is then absorbed).
#[inline]
pub fn translate_tcp(
    buf: &mut [u8],
    ip: &IpInfo,
    nat: &NatTable,
    addrs: &StackAddrs,
    now: Instant,
    held: impl FnOnce(u16) -> bool,
) -> TcpStep {
    let tcp = match packet::parse_tcp(buf, ip) {
        Ok(t) => t,
        Err(r) => return TcpStep::Drop(Cause::Reject(r)),
    };
    let Some(fam) = addrs.family(ip.dst) else {
        return TcpStep::Drop(Cause::Engine(EngineDrop::FamilyDisabled));
    };
    if packet::is_downlink(ip, &tcp, fam.gateway, fam.nat, fam.listen_port) {
        let Some(key) = nat.downlink(tcp.dst_port, now) else {
            return TcpStep::Drop(Cause::Engine(EngineDrop::NoMapping));
        };
        return match packet::rewrite_tcp(buf, ip, key.server, key.client) {
            Ok(()) => TcpStep::Downlink(ip.len),
            Err(r) => TcpStep::Drop(Cause::Reject(r)),
        };
    }
    let key = FlowKey {
        client: SocketAddr::new(ip.src, tcp.src_port),
        server: SocketAddr::new(ip.dst, tcp.dst_port),
    };
    let syn_only = tcp.is_syn_only();
    match nat.uplink(&key, syn_only.then_some(tcp.seq), now) {
        Ok(Uplink {
            port,
            created: true,
            generation,
        }) => TcpStep::NewFlow {
            key,
            port,
            generation,
            tcp,
        },
        Ok(Uplink { port, .. }) => {
            if syn_only && held(port) {
                return TcpStep::Drop(Cause::Engine(EngineDrop::SynWhileConnecting));
            }
            let nat_src = SocketAddr::new(fam.nat, port);
            let listener = SocketAddr::new(fam.gateway, fam.listen_port);
            match packet::rewrite_tcp(buf, ip, nat_src, listener) {
                Ok(()) => TcpStep::Uplink(ip.len),
                Err(r) => TcpStep::Drop(Cause::Reject(r)),
            }
        }
        Err(e) => {
            let cause = match e {
                NatError::TableFull => EngineDrop::NatTableFull,
                NatError::NoFreePort => EngineDrop::NatNoFreePort,
                _ => EngineDrop::StrayTcp,
            };
            // Answer with an RST (never to an RST: RFC 9293 3.10.7.1) so the
            // app fails fast instead of retransmitting into a blackhole.
            match packet::tcp_rst_reply(buf, ip, &tcp) {
                0 => TcpStep::Drop(Cause::Engine(cause)),
                len => TcpStep::Reset { len, cause },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nat::{ManualClock, NatConfig};
    use crate::packet::tcp_flags::{ACK, RST, SYN};
    use crate::packet::testutil::tcp_v4;
    use std::sync::Arc;

    fn addrs() -> StackAddrs {
        StackAddrs {
            v4: Some(FamilyAddrs {
                gateway: "198.18.0.1".parse().expect("ip"),
                nat: "198.18.0.2".parse().expect("ip"),
                listen_port: 40000,
            }),
            v6: None,
        }
    }

    fn table(max_entries: usize) -> (NatTable, Instant) {
        let clock = Arc::new(ManualClock::new());
        let now = crate::nat::Clock::now(&*clock);
        let cfg = NatConfig {
            max_entries,
            ..NatConfig::default()
        };
        (NatTable::new(cfg, clock), now)
    }

    fn step(nat: &NatTable, now: Instant, pkt: &mut [u8]) -> TcpStep {
        let ip = packet::parse_ip(pkt).expect("valid ip");
        translate_tcp(pkt, &ip, nat, &addrs(), now, |_| false)
    }

    #[test]
    fn syn_creates_flow_then_data_and_replies_translate() {
        let (nat, now) = table(16);
        let mut syn = tcp_v4("10.0.0.9:51000", "1.1.1.1:443", 100, 0, SYN, &[], b"");
        let before = syn.clone();
        let TcpStep::NewFlow { key, port, .. } = step(&nat, now, &mut syn) else {
            panic!("a SYN creates a flow");
        };
        assert_eq!(syn, before, "NewFlow leaves the buffer alone");
        assert_eq!(key.server, "1.1.1.1:443".parse().expect("sa"));
        nat.accept(port, now).expect("accept");

        let mut data = tcp_v4("10.0.0.9:51000", "1.1.1.1:443", 101, 1, ACK, &[], b"hello");
        assert_eq!(step(&nat, now, &mut data), TcpStep::Uplink(data.len()));
        let ip = packet::parse_ip(&data).expect("ip");
        assert_eq!(ip.src, "198.18.0.2".parse::<IpAddr>().expect("ip"));
        assert!(packet::checksum::verify_transport_checksum(&data, &ip));

        let nat_port = port.to_string();
        let mut reply = tcp_v4(
            "198.18.0.1:40000",
            &format!("198.18.0.2:{nat_port}"),
            1,
            106,
            ACK,
            &[],
            b"world",
        );
        assert_eq!(step(&nat, now, &mut reply), TcpStep::Downlink(reply.len()));
        let expect = tcp_v4("1.1.1.1:443", "10.0.0.9:51000", 1, 106, ACK, &[], b"world");
        assert_eq!(
            reply, expect,
            "downlink restores the original tuple byte for byte"
        );
    }

    #[test]
    fn unmapped_downlink_is_dropped_never_forwarded() {
        let (nat, now) = table(16);
        let mut reply = tcp_v4("198.18.0.1:40000", "198.18.0.2:12345", 1, 1, ACK, &[], b"x");
        let before = reply.clone();
        assert_eq!(
            step(&nat, now, &mut reply),
            TcpStep::Drop(Cause::Engine(EngineDrop::NoMapping))
        );
        assert_eq!(reply, before);
    }

    #[test]
    fn stray_segment_gets_rst_but_an_rst_gets_nothing() {
        let (nat, now) = table(16);
        let mut stray = tcp_v4("10.0.0.9:1", "1.1.1.1:80", 5, 9, ACK, &[], b"late");
        let TcpStep::Reset { len, cause } = step(&nat, now, &mut stray) else {
            panic!("stray data is answered with an RST");
        };
        assert_eq!(cause, EngineDrop::StrayTcp);
        let ip = packet::parse_ip(&stray[..len]).expect("rst");
        let t = packet::parse_tcp(&stray[..len], &ip).expect("rst tcp");
        assert_ne!(t.flags & RST, 0);
        assert_eq!(t.seq, 9, "RST takes the segment's ACK as its sequence");
        let mut rst = tcp_v4("10.0.0.9:1", "1.1.1.1:80", 5, 9, RST | ACK, &[], b"");
        assert_eq!(
            step(&nat, now, &mut rst),
            TcpStep::Drop(Cause::Engine(EngineDrop::StrayTcp))
        );
        assert!(nat.is_empty(), "nothing was allocated for strays");
    }

    #[test]
    fn full_table_answers_syn_with_rst() {
        let (nat, now) = table(1);
        let mut a = tcp_v4("10.0.0.9:1000", "1.1.1.1:443", 1, 0, SYN, &[], b"");
        assert!(matches!(step(&nat, now, &mut a), TcpStep::NewFlow { .. }));
        let mut b = tcp_v4("10.0.0.9:1001", "1.1.1.1:443", 1, 0, SYN, &[], b"");
        assert!(matches!(
            step(&nat, now, &mut b),
            TcpStep::Reset {
                cause: EngineDrop::NatTableFull,
                ..
            }
        ));
    }

    #[test]
    fn held_syn_retransmit_is_absorbed() {
        let (nat, now) = table(16);
        let mut syn = tcp_v4("10.0.0.9:2000", "1.1.1.1:443", 1, 0, SYN, &[], b"");
        let TcpStep::NewFlow { port, .. } = step(&nat, now, &mut syn.clone()) else {
            panic!("new flow");
        };
        let ip = packet::parse_ip(&syn).expect("ip");
        let held = translate_tcp(&mut syn, &ip, &nat, &addrs(), now, |p| p == port);
        assert_eq!(
            held,
            TcpStep::Drop(Cause::Engine(EngineDrop::SynWhileConnecting))
        );
        let released = translate_tcp(&mut syn, &ip, &nat, &addrs(), now, |_| false);
        assert_eq!(
            released,
            TcpStep::Uplink(syn.len()),
            "after release it goes to the kernel"
        );
    }
}
