//! The sans-I/O heart of the system netstack: one TCP packet and the flow
//! table in, one decision out. No descriptors, no clock (time is passed in),
//! no allocation, no locks beyond the table's shard locks — so it can be
//! fuzzed with packet sequences and its outcome checked against the table's
//! invariants (`fuzz/fuzz_targets/translate.rs`).
//!
//! The caller (the engine's system stack) counts the outcome and acts on
//! it: writes rewritten packets back, admits and holds new flows, and
//! closes what a new SYN displaced.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::IpNet;
use std::time::Instant;

use super::window::{Dir, SynAck};
use super::{Evicted, FlowKey, NatError, NatTable, Refused, Uplink, WindowBudget};
use crate::drops::EngineDrop;
use crate::packet::{self, IpInfo, Reject, TcpInfo};

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

/// The decision for one TCP packet. `P` is what the engine attaches to a
/// half-open flow ([`NatTable::admit`]): a SYN that displaced another flow
/// hands that flow's back, for the engine to close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpStep<P = ()> {
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
        /// The table was full and evicted its oldest unanswered entry.
        evicted: Option<Evicted<P>>,
        /// The SYN replaced a half-open flow of its 4-tuple (another ISN):
        /// what was attached to it.
        replaced: Option<P>,
    },
    /// An RST answering the packet was written in place (`len` bytes), because
    /// the NAT table refused the flow or the segment belongs to no flow.
    Reset {
        len: usize,
        cause: EngineDrop,
        /// The table was full and evicted an unanswered entry, then refused
        /// the SYN all the same (no free port).
        evicted: Option<Evicted<P>>,
    },
    /// Nothing to write; count `cause`.
    Drop(Cause),
}

/// Translate one TCP packet in place. A SYN retransmit of a flow whose SYN
/// the table holds while its outbound connects is absorbed.
#[inline]
pub fn translate_tcp<P>(
    buf: &mut [u8],
    ip: &IpInfo,
    nat: &NatTable<P>,
    addrs: &StackAddrs,
    now: Instant,
) -> TcpStep<P> {
    let mut off = WindowClamp::OFF;
    translate_tcp_clamped(buf, ip, nat, addrs, &mut off, DataSums::Verify, now)
}

/// Whose job it is to verify the checksums of the app's data segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataSums {
    /// The uplink verifies every segment from the app.
    Verify,
    /// The kernel that receives the rewritten segments verifies every byte
    /// of them (a Linux TUN written without `virtio_net_hdr` marks each
    /// packet's checksum unchecked, and the local TCP checks it before it
    /// takes the data: `core/tests/kernel_checksums.rs`). The uplink then skips the pass over the payload for
    /// the data segments (ACK or ACK|PSH, with payload) of a flow the table
    /// holds, the bulk of an upload. A corrupt one stays corrupt: the
    /// rewrite updates its checksum incrementally (RFC 1624) and a merge
    /// takes the payload's sum from the stored checksum
    /// (`packet::coalesce::append_verified`), so the merged checksum is
    /// off by the same amount and the kernel drops the segment (or the
    /// whole merge), which the app sends again. Every other segment, and a
    /// data segment the table does not take, is verified as with
    /// [`DataSums::Verify`], so nothing corrupt creates a flow or is
    /// answered.
    Kernel,
}

impl DataSums {
    /// Whether the uplink may leave the checksum of segment `tcp` to the
    /// kernel (until the table takes it or refuses it).
    #[inline]
    fn deferred(self, tcp: &TcpInfo) -> bool {
        use packet::tcp_flags::{ACK, PSH};
        self == DataSums::Kernel && tcp.payload_len > 0 && tcp.flags & !PSH == ACK
    }
}

/// The window clamp of [`translate_tcp_clamped`] (module `nat::window`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowClamp {
    /// What the clamp is derived from; `None`: windows pass unchanged.
    pub budget: Option<WindowBudget>,
    /// Segments whose window was lowered so far (the caller takes it).
    pub clamped: u64,
    /// Set when the segment was a pure ACK whose window was held at its
    /// edge for want of a grant ([`crate::nat::GRANTS`]): the caller keeps
    /// the packet as written and asks [`NatTable::regrant`] to reopen it.
    pub parked: Option<Parked>,
}

/// A pure ACK held at its edge: what [`NatTable::regrant`] needs to
/// reopen its window later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parked {
    /// The flow's NAT port.
    pub port: u16,
    /// The listener's ACK toward the app (else the app's toward the
    /// listener).
    pub down: bool,
    /// The ACK's sequence number.
    pub seq: u32,
    /// What the ACK acknowledges.
    pub ack: u32,
    /// The window field before the clamp.
    pub field: u16,
    /// The window scale of the ACK's sender.
    pub shift: u8,
}

impl Parked {
    /// Whether this ACK may take the place of `older`, the copy kept for
    /// the same flow direction. Not when it is behind `older` in sequence,
    /// as a zero-window probe is (TCP sends it at SND.UNA - 1): written
    /// again with a grant, it would not be taken as a window update (its
    /// receiver takes windows only from segments at or past SND.WL1), and
    /// `older`'s would be lost with it. Both ends of a flow whose windows
    /// are held may probe; the answer to a probe reopens a window only
    /// after the prober's persist timer, so a lost copy costs that wait.
    pub fn replaces(&self, older: &Parked) -> bool {
        self.seq.wrapping_sub(older.seq) as i32 >= 0
    }
}

impl WindowClamp {
    /// No clamping.
    pub const OFF: Self = Self {
        budget: None,
        clamped: 0,
        parked: None,
    };
}

/// [`translate_tcp`], lowering the advertised window of every segment it
/// rewrites in either direction (SYNs and RSTs excepted) to the share of
/// `clamp.budget` each busy flow gets, once the flow's window scaling is
/// known (module `nat::window`). It records the window scale options of
/// the app's SYN and of the listener's SYN-ACK as they pass, clamped or
/// not.
#[inline]
pub fn translate_tcp_clamped<P>(
    buf: &mut [u8],
    ip: &IpInfo,
    nat: &NatTable<P>,
    addrs: &StackAddrs,
    clamp: &mut WindowClamp,
    sums: DataSums,
    now: Instant,
) -> TcpStep<P> {
    let tcp = match packet::parse_tcp(buf, ip) {
        Ok(t) => t,
        Err(r) => return TcpStep::Drop(Cause::Reject(r)),
    };
    let Some(fam) = addrs.family(ip.dst) else {
        return TcpStep::Drop(Cause::Engine(EngineDrop::FamilyDisabled));
    };
    if packet::is_downlink(ip, &tcp, fam.gateway, fam.nat, fam.listen_port) {
        use packet::tcp_flags::{ACK, SYN};
        let syn_ack = (tcp.flags & (SYN | ACK) == SYN | ACK).then(|| SynAck {
            option: packet::window_scale(buf, ip, &tcp),
            seq: tcp.seq,
            ack: tcp.ack,
            window: packet::window_field(buf, ip),
        });
        let data = tcp.payload_len > 0;
        let Some((key, scale)) = nat.downlink_segment(tcp.dst_port, syn_ack, data, now) else {
            return TcpStep::Drop(Cause::Engine(EngineDrop::NoMapping));
        };
        return match packet::rewrite_tcp(buf, ip, key.server, key.client) {
            Ok(()) => {
                let shift = scale.shifts().map(|(_, listener)| listener);
                let at = (tcp.dst_port, Dir::Down);
                clamp_segment(buf, ip, &tcp, shift, at, nat, clamp, now);
                TcpStep::Downlink(ip.len)
            }
            Err(r) => TcpStep::Drop(Cause::Reject(r)),
        };
    }
    // From the app: nothing malformed may create a NAT entry or reach the
    // kernel listener (the downlink above is the local TCP's own). A data
    // segment whose checksum is left to the kernel (`DataSums::Kernel`)
    // may refresh its flow's entry before the kernel drops it.
    let deferred = sums.deferred(&tcp);
    let checked = if deferred {
        packet::check_flags(&tcp)
    } else {
        packet::check_segment(buf, ip, &tcp)
    };
    if let Err(r) = checked {
        return TcpStep::Drop(Cause::Reject(r));
    }
    let key = FlowKey {
        client: SocketAddr::new(ip.src, tcp.src_port),
        server: SocketAddr::new(ip.dst, tcp.dst_port),
    };
    let syn_only = tcp.is_syn_only();
    let app_closing = tcp.flags & (packet::tcp_flags::FIN | packet::tcp_flags::RST) != 0;
    let data = tcp.payload_len > 0;
    match nat.uplink_data(&key, syn_only.then_some(tcp.seq), app_closing, data, now) {
        Ok(Uplink {
            port,
            created: true,
            generation,
            evicted,
            replaced,
            ..
        }) => {
            let option = packet::window_scale(buf, ip, &tcp);
            nat.record_app_syn(port, generation, option, packet::window_field(buf, ip));
            TcpStep::NewFlow {
                key,
                port,
                generation,
                tcp,
                evicted,
                replaced,
            }
        }
        Ok(Uplink { held: true, .. }) => {
            TcpStep::Drop(Cause::Engine(EngineDrop::SynWhileConnecting))
        }
        Ok(Uplink { port, scale, .. }) => {
            let nat_src = SocketAddr::new(fam.nat, port);
            let listener = SocketAddr::new(fam.gateway, fam.listen_port);
            match packet::rewrite_tcp(buf, ip, nat_src, listener) {
                Ok(()) => {
                    let shift = scale.shifts().map(|(app, _)| app);
                    clamp_segment(buf, ip, &tcp, shift, (port, Dir::Up), nat, clamp, now);
                    TcpStep::Uplink(ip.len)
                }
                Err(r) => TcpStep::Drop(Cause::Reject(r)),
            }
        }
        Err(Refused { error, evicted }) => {
            // Only a SYN evicts, and a SYN was verified above.
            if deferred
                && evicted.is_none()
                && let Err(r) = packet::check_segment(buf, ip, &tcp)
            {
                return TcpStep::Drop(Cause::Reject(r));
            }
            let cause = match error {
                NatError::TableFull => EngineDrop::NatTableFull,
                NatError::NoFreePort => EngineDrop::NatNoFreePort,
                _ => EngineDrop::StrayTcp,
            };
            // Answer with an RST (never to an RST: RFC 9293 3.10.7.1) so the
            // app fails fast instead of retransmitting into a blackhole. Only
            // a SYN can have evicted an entry, and a SYN always gets its RST:
            // `len` is 0 with an eviction only if no RST could be built.
            match packet::tcp_rst_reply(buf, ip, &tcp) {
                0 if evicted.is_none() => TcpStep::Drop(Cause::Engine(cause)),
                len => TcpStep::Reset {
                    len,
                    cause,
                    evicted,
                },
            }
        }
    }
}

/// Lower the window of a rewritten segment whose sender scales its windows
/// by `shift` (`None`: not known yet, left alone) to its flow's share of
/// the budget, but never so far that the right edge its direction already
/// advertised moves back (`NatTable::clamp_field`). `at` is the flow's NAT
/// port and the segment's direction. SYNs (their window is never scaled)
/// and RSTs pass as they are, as does every segment without a budget.
#[inline]
#[allow(clippy::too_many_arguments)]
fn clamp_segment<P>(
    buf: &mut [u8],
    ip: &IpInfo,
    tcp: &TcpInfo,
    shift: Option<u8>,
    at: (u16, Dir),
    nat: &NatTable<P>,
    clamp: &mut WindowClamp,
    now: Instant,
) {
    use packet::tcp_flags::{ACK, RST, SYN};
    let (Some(budget), Some(shift)) = (clamp.budget, shift) else {
        return;
    };
    if tcp.flags & (SYN | RST | ACK) != ACK {
        return;
    }
    let field = packet::window_field(buf, ip);
    let (port, dir) = at;
    let want = if tcp.payload_len == 0 {
        let (want, parked) = nat.granted_want(port, dir, budget, now);
        if parked {
            clamp.parked = Some(Parked {
                port,
                down: dir == Dir::Down,
                seq: tcp.seq,
                ack: tcp.ack,
                field,
                shift,
            });
        }
        want
    } else {
        budget.per_flow(nat.busy_flows(now))
    };
    let max = nat.clamp_field(port, dir, tcp.ack, field, shift, want);
    if packet::clamp_window(buf, ip, max) {
        clamp.clamped += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nat::{NatConfig, Stage};
    use crate::packet::tcp_flags::{ACK, RST, SYN};
    use crate::packet::testutil::tcp_v4;

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
        let now = Instant::now();
        let cfg = NatConfig {
            max_entries,
            ..NatConfig::default()
        };
        (NatTable::new(cfg, now), now)
    }

    fn step(nat: &NatTable, now: Instant, pkt: &mut [u8]) -> TcpStep {
        let ip = packet::parse_ip(pkt).expect("valid ip");
        translate_tcp(pkt, &ip, nat, &addrs(), now)
    }

    /// [`translate_tcp_clamped`] with every segment verified.
    fn clamped(
        buf: &mut [u8],
        ip: &IpInfo,
        nat: &NatTable,
        addrs: &StackAddrs,
        clamp: &mut WindowClamp,
        now: Instant,
    ) -> TcpStep {
        translate_tcp_clamped(buf, ip, nat, addrs, clamp, DataSums::Verify, now)
    }

    /// `p` with its TCP checksum field spoilt.
    fn corrupt(mut p: Vec<u8>) -> Vec<u8> {
        let ip = packet::parse_ip(&p).expect("ip");
        p[ip.l4_offset + 16] ^= 0x5a;
        p
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
        let TcpStep::Reset { len, cause, .. } = step(&nat, now, &mut stray) else {
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

    /// Malformed segments from the app are counted rejects that create no
    /// entry, get no RST and leave an existing flow's entry untouched:
    /// a bad checksum (IPv4 and IPv6) and each invalid flag combination.
    #[test]
    fn malformed_uplink_creates_nothing_and_is_rejected() {
        use crate::packet::tcp_flags::{FIN, PSH, URG};
        use crate::packet::testutil::tcp_v6;
        let (nat, now) = table(16);
        let mut v6addrs = addrs();
        v6addrs.v6 = Some(FamilyAddrs {
            gateway: "fd00:18::1".parse().expect("ip"),
            nat: "fd00:18::2".parse().expect("ip"),
            listen_port: 40000,
        });
        let bad_sum = [
            corrupt(tcp_v4("10.0.0.9:3000", "1.1.1.1:443", 1, 0, SYN, &[], b"")),
            corrupt(tcp_v6(
                "[fd00:18::9]:3000",
                "[2001:db8::1]:443",
                &[],
                1,
                0,
                SYN,
                &[],
                b"",
            )),
        ];
        for mut p in bad_sum {
            let ip = packet::parse_ip(&p).expect("ip");
            assert_eq!(
                translate_tcp(&mut p, &ip, &nat, &v6addrs, now),
                TcpStep::Drop(Cause::Reject(Reject::TcpBadChecksum))
            );
        }
        for flags in [
            0,
            FIN,
            SYN | FIN,
            SYN | RST,
            FIN | PSH | URG,
            SYN | FIN | RST | ACK,
        ] {
            let mut p = tcp_v4("10.0.0.9:3001", "1.1.1.1:443", 1, 0, flags, &[], b"x");
            assert_eq!(
                step(&nat, now, &mut p),
                TcpStep::Drop(Cause::Reject(Reject::TcpBadFlags)),
                "flags {flags:#04x}"
            );
        }
        assert!(nat.is_empty(), "no entry for malformed segments");
        // An established flow: a corrupted segment does not reach it.
        let mut syn = tcp_v4("10.0.0.9:3002", "1.1.1.1:443", 1, 0, SYN, &[], b"");
        let TcpStep::NewFlow { port, .. } = step(&nat, now, &mut syn) else {
            panic!("new flow");
        };
        nat.accept(port, now).expect("accept");
        let mut data = corrupt(tcp_v4(
            "10.0.0.9:3002",
            "1.1.1.1:443",
            2,
            1,
            ACK,
            &[],
            b"hi",
        ));
        let before = data.clone();
        assert_eq!(
            step(&nat, now, &mut data),
            TcpStep::Drop(Cause::Reject(Reject::TcpBadChecksum))
        );
        assert_eq!(data, before, "not rewritten");
        assert_eq!(nat.len(), 1);
    }

    /// With the data's checksums left to the kernel: a data segment of a
    /// flow the table holds is rewritten unverified and a corrupt one keeps
    /// a checksum that fails (so the listener's kernel drops it); a corrupt
    /// data segment of no flow, a corrupt pure ACK, FIN or SYN are rejected
    /// as with every segment verified, and create or answer nothing.
    #[test]
    fn data_left_to_the_kernel_stays_corrupt_and_nothing_else_passes() {
        use crate::packet::checksum::verify_transport_checksum;
        use crate::packet::tcp_flags::{FIN, PSH};
        let (nat, now) = table(16);
        let kernel = |pkt: &mut [u8]| {
            let ip = packet::parse_ip(pkt).expect("ip");
            let mut off = WindowClamp::OFF;
            translate_tcp_clamped(pkt, &ip, &nat, &addrs(), &mut off, DataSums::Kernel, now)
        };
        let bad = Cause::Reject(Reject::TcpBadChecksum);
        let stray = corrupt(tcp_v4(
            "10.0.0.9:3100",
            "1.1.1.1:443",
            2,
            1,
            ACK,
            &[],
            b"hi",
        ));
        assert_eq!(
            kernel(&mut stray.clone()),
            TcpStep::Drop(bad),
            "no flow: no RST"
        );
        let syn = corrupt(tcp_v4("10.0.0.9:3100", "1.1.1.1:443", 1, 0, SYN, &[], b""));
        assert_eq!(kernel(&mut syn.clone()), TcpStep::Drop(bad));
        assert!(nat.is_empty());

        let mut syn = tcp_v4("10.0.0.9:3100", "1.1.1.1:443", 1, 0, SYN, &[], b"");
        let TcpStep::NewFlow { port, .. } = kernel(&mut syn) else {
            panic!("new flow");
        };
        nat.accept(port, now).expect("accept");
        for (flags, payload) in [(ACK, &b""[..]), (FIN | ACK, b""), (FIN | ACK, b"hi")] {
            let mut p = corrupt(tcp_v4(
                "10.0.0.9:3100",
                "1.1.1.1:443",
                2,
                1,
                flags,
                &[],
                payload,
            ));
            assert_eq!(kernel(&mut p), TcpStep::Drop(bad), "flags {flags:#04x}");
        }
        for flags in [ACK, ACK | PSH] {
            let good = tcp_v4("10.0.0.9:3100", "1.1.1.1:443", 2, 1, flags, &[], b"hello");
            for (mut p, sound) in [(good.clone(), true), (corrupt(good), false)] {
                assert_eq!(kernel(&mut p), TcpStep::Uplink(p.len()));
                let ip = packet::parse_ip(&p).expect("ip");
                let tcp = packet::parse_tcp(&p, &ip).expect("tcp");
                assert_eq!((tcp.src_port, tcp.dst_port), (port, 40000), "rewritten");
                assert_eq!(verify_transport_checksum(&p, &ip), sound);
            }
        }
        assert_eq!(nat.len(), 1);
    }

    #[test]
    fn full_table_answers_syn_with_rst() {
        let (nat, now) = table(1);
        let mut a = tcp_v4("10.0.0.9:1000", "1.1.1.1:443", 1, 0, SYN, &[], b"");
        let TcpStep::NewFlow { port, .. } = step(&nat, now, &mut a) else {
            panic!("new flow");
        };
        // Only an answered (accepted) flow holds its entry against a newcomer.
        nat.accept(port, now).expect("accept");
        let mut b = tcp_v4("10.0.0.9:1001", "1.1.1.1:443", 1, 0, SYN, &[], b"");
        assert!(matches!(
            step(&nat, now, &mut b),
            TcpStep::Reset {
                cause: EngineDrop::NatTableFull,
                ..
            }
        ));
    }

    /// A full table of SYNs nobody answered takes the newest and evicts
    /// the oldest: a flood never locks out the next connection.
    #[test]
    fn full_table_of_unanswered_syns_takes_the_newcomer() {
        let (nat, now) = table(4);
        for p in 1000..1010 {
            let mut syn = tcp_v4(&format!("10.0.0.9:{p}"), "1.1.1.1:443", 1, 0, SYN, &[], b"");
            assert!(matches!(step(&nat, now, &mut syn), TcpStep::NewFlow { .. }));
        }
        assert_eq!(nat.len(), 4);
        assert_eq!(nat.error_counts().evicted, 6);
    }

    #[test]
    fn held_syn_retransmit_is_absorbed() {
        let (nat, now) = table(16);
        let mut syn = tcp_v4("10.0.0.9:2000", "1.1.1.1:443", 1, 0, SYN, &[], b"");
        let TcpStep::NewFlow {
            port, generation, ..
        } = step(&nat, now, &mut syn.clone())
        else {
            panic!("new flow");
        };
        // Admitted, its outbound connecting: the table holds the SYN.
        nat.admit(port, generation, Stage::Connecting, (), now)
            .expect("admit");
        let ip = packet::parse_ip(&syn).expect("ip");
        let held = translate_tcp(&mut syn, &ip, &nat, &addrs(), now);
        assert_eq!(
            held,
            TcpStep::Drop(Cause::Engine(EngineDrop::SynWhileConnecting))
        );
        nat.connected(port, generation, now, (), |(), ()| ())
            .expect("connected");
        let released = translate_tcp(&mut syn, &ip, &nat, &addrs(), now);
        assert_eq!(
            released,
            TcpStep::Uplink(syn.len()),
            "after release it goes to the kernel"
        );
    }

    /// The window of the packet `p` and whether its checksum verifies.
    fn window_of(p: &[u8]) -> (u16, bool) {
        let ip = packet::parse_ip(p).expect("ip");
        let w = packet::TcpPacket::new_unchecked(&p[ip.l4_offset..ip.len]).window();
        (w, packet::checksum::verify_transport_checksum(p, &ip))
    }

    /// The phone's TUN queue (500 packets) at MTU 1500, and a clamp on it.
    fn phone_clamp() -> (WindowBudget, WindowClamp) {
        let budget = WindowBudget {
            queue_packets: 500,
            mss: 1460,
        };
        let clamp = WindowClamp {
            budget: Some(budget),
            clamped: 0,
            parked: None,
        };
        (budget, clamp)
    }

    /// SYN options with window scale `ws` (MSS 1460, NOP, window scale).
    fn ws_opts(ws: u8) -> [u8; 8] {
        [2, 4, 5, 0xb4, 1, 3, 3, ws]
    }

    /// A flow through its handshake (the app's SYN with window scale
    /// `app`, accepted, and the listener's SYN-ACK with `listener`, whose
    /// window passes unchanged): its NAT port.
    fn handshake(
        nat: &NatTable,
        clamp: &mut WindowClamp,
        now: Instant,
        cport: u16,
        app: Option<u8>,
        listener: Option<u8>,
    ) -> u16 {
        let opts = |ws: Option<u8>| ws.map_or(Vec::new(), |w| ws_opts(w).to_vec());
        let client = format!("10.0.0.9:{cport}");
        let mut syn = tcp_v4(&client, "1.1.1.1:443", 100, 0, SYN, &opts(app), b"");
        let ip = packet::parse_ip(&syn).expect("ip");
        let TcpStep::NewFlow { port, .. } = clamped(&mut syn, &ip, nat, &addrs(), clamp, now)
        else {
            panic!("a SYN creates a flow");
        };
        nat.accept(port, now).expect("accept");
        let nat_addr = format!("198.18.0.2:{port}");
        let mut syn_ack = tcp_v4(
            "198.18.0.1:40000",
            &nat_addr,
            500,
            101,
            SYN | ACK,
            &opts(listener),
            b"",
        );
        let ip = packet::parse_ip(&syn_ack).expect("ip");
        let step = clamped(&mut syn_ack, &ip, nat, &addrs(), clamp, now);
        assert_eq!(step, TcpStep::Downlink(syn_ack.len()));
        assert_eq!(
            window_of(&syn_ack),
            (0xffff, true),
            "a SYN-ACK's window is never clamped"
        );
        port
    }

    /// Both directions are clamped to the flow's share of the queue at
    /// each sender's own shift, checksums verify after the incremental
    /// update, and the clamp is counted.
    #[test]
    fn window_clamp_lowers_both_directions_at_each_senders_shift() {
        let (nat, now) = table(16);
        let (budget, mut clamp) = phone_clamp();
        let port = handshake(&nat, &mut clamp, now, 3000, Some(7), Some(9));
        assert_eq!(nat.busy_flows(now), 0, "no payload yet");
        // The app's data makes its direction busy: one share of the queue.
        let share = budget.per_flow(1);

        let mut up = tcp_v4("10.0.0.9:3000", "1.1.1.1:443", 101, 501, ACK, &[], b"data");
        let ip = packet::parse_ip(&up).expect("ip");
        let step = clamped(&mut up, &ip, &nat, &addrs(), &mut clamp, now);
        assert_eq!(step, TcpStep::Uplink(up.len()));
        assert_eq!(
            window_of(&up),
            ((share >> 7) as u16, true),
            "the app's shift"
        );

        let nat_addr = format!("198.18.0.2:{port}");
        let mut down = tcp_v4("198.18.0.1:40000", &nat_addr, 501, 105, ACK, &[], b"reply");
        let ip = packet::parse_ip(&down).expect("ip");
        let step = clamped(&mut down, &ip, &nat, &addrs(), &mut clamp, now);
        assert_eq!(step, TcpStep::Downlink(down.len()));
        // The listener's data makes the second direction busy.
        assert_eq!(nat.busy_flows(now), 2);
        assert_eq!(
            window_of(&down),
            ((budget.per_flow(2) >> 9) as u16, true),
            "the listener's shift"
        );
        assert_eq!(clamp.clamped, 2);

        // The same segment without a budget: unchanged, not counted.
        let mut plain = tcp_v4("10.0.0.9:3000", "1.1.1.1:443", 105, 506, ACK, &[], b"");
        let ip = packet::parse_ip(&plain).expect("ip");
        let mut off = WindowClamp::OFF;
        clamped(&mut plain, &ip, &nat, &addrs(), &mut off, now);
        assert_eq!(window_of(&plain), (0xffff, true));
        assert_eq!(off.clamped, 0);
    }

    /// More flows carrying data, smaller shares, down to the floor; pure
    /// ACKs do not count; a flow whose SYNs lacked the option is clamped
    /// unscaled; a window already below the share, a zero window and an
    /// RST pass unchanged.
    #[test]
    fn window_clamp_shares_the_queue_among_busy_flows() {
        let (nat, now) = table(128);
        let (_, mut clamp) = phone_clamp();
        let send = |nat: &NatTable, clamp: &mut WindowClamp, cport: u16, payload: &[u8], at| {
            let client = format!("10.0.0.9:{cport}");
            let mut p = tcp_v4(&client, "1.1.1.1:443", 101, 501, ACK, &[], payload);
            let ip = packet::parse_ip(&p).expect("ip");
            clamped(&mut p, &ip, nat, &addrs(), clamp, at);
        };
        for cport in 4000..4016 {
            handshake(&nat, &mut clamp, now, cport, None, Some(7));
            send(&nat, &mut clamp, cport, b"data", now);
            send(&nat, &mut clamp, cport, b"more", now);
        }
        assert_eq!(nat.busy_flows(now), 16, "once per direction and epoch");
        for cport in 4016..4020 {
            handshake(&nat, &mut clamp, now, cport, None, Some(7));
            send(&nat, &mut clamp, cport, b"", now);
        }
        assert_eq!(nat.busy_flows(now), 16, "pure ACKs do not count");
        // Flow 4000's first segments offered 64 KiB beyond ack 501: a
        // segment with that ack keeps it; one past it gets the share.
        let mut up = tcp_v4("10.0.0.9:4000", "1.1.1.1:443", 101, 501, ACK, &[], b"x");
        let ip = packet::parse_ip(&up).expect("ip");
        clamped(&mut up, &ip, &nat, &addrs(), &mut clamp, now);
        assert_eq!(window_of(&up), (0xffff, true), "the edge is kept");
        let past = 501 + 0xffff;
        let mut up = tcp_v4("10.0.0.9:4000", "1.1.1.1:443", 101, past, ACK, &[], b"x");
        let ip = packet::parse_ip(&up).expect("ip");
        clamped(&mut up, &ip, &nat, &addrs(), &mut clamp, now);
        let want = 375 / 16 * 1460;
        assert_eq!(
            window_of(&up),
            (want as u16, true),
            "no app option: unscaled"
        );

        let mut small = tcp_v4("10.0.0.9:4001", "1.1.1.1:443", 101, 501, ACK, &[], b"");
        let ip = packet::parse_ip(&small).expect("ip");
        packet::TcpPacket::new_unchecked(&mut small[ip.l4_offset..ip.len]).set_window(1000);
        packet::checksum::fill_transport_checksum(&mut small, &ip);
        clamped(&mut small, &ip, &nat, &addrs(), &mut clamp, now);
        assert_eq!(window_of(&small), (1000, true), "never raised");

        let mut zero = tcp_v4("10.0.0.9:4002", "1.1.1.1:443", 101, 501, ACK, &[], b"");
        let ip = packet::parse_ip(&zero).expect("ip");
        packet::TcpPacket::new_unchecked(&mut zero[ip.l4_offset..ip.len]).set_window(0);
        packet::checksum::fill_transport_checksum(&mut zero, &ip);
        clamped(&mut zero, &ip, &nat, &addrs(), &mut clamp, now);
        assert_eq!(window_of(&zero), (0, true), "a zero window stays closed");

        let mut rst = tcp_v4(
            "10.0.0.9:4003",
            "1.1.1.1:443",
            101,
            501,
            RST | ACK,
            &[],
            b"",
        );
        let ip = packet::parse_ip(&rst).expect("ip");
        clamped(&mut rst, &ip, &nat, &addrs(), &mut clamp, now);
        assert_eq!(window_of(&rst).0, 0xffff, "an RST passes as it is");

        for cport in 4020..4100 {
            handshake(&nat, &mut clamp, now, cport, None, None);
            send(&nat, &mut clamp, cport, b"data", now);
        }
        let mut up = tcp_v4("10.0.0.9:4005", "1.1.1.1:443", 101, past, ACK, &[], b"x");
        let ip = packet::parse_ip(&up).expect("ip");
        clamped(&mut up, &ip, &nat, &addrs(), &mut clamp, now);
        let floor = (crate::nat::FLOOR_SEGMENTS * 1460) as u16;
        assert_eq!(window_of(&up), (floor, true), "96 busy flows: the floor");

        // Flows that went quiet stop counting two epochs later: a new flow
        // then has the whole share.
        let later = now + std::time::Duration::from_millis(3 * crate::nat::EPOCH_MS);
        handshake(&nat, &mut clamp, later, 4200, Some(7), Some(7));
        let mut up = tcp_v4("10.0.0.9:4200", "1.1.1.1:443", 101, 501, ACK, &[], b"x");
        let ip = packet::parse_ip(&up).expect("ip");
        clamped(&mut up, &ip, &nat, &addrs(), &mut clamp, later);
        assert_eq!(nat.busy_flows(later), 1);
        assert_eq!(window_of(&up), (((375 * 1460u32) >> 7) as u16, true));
    }

    /// `n` flows from client ports `first..`, each through its handshake
    /// and one upload data segment, so that each counts as a busy
    /// direction: their NAT ports.
    fn busy_uploads(
        nat: &NatTable,
        clamp: &mut WindowClamp,
        now: Instant,
        first: u16,
        n: usize,
    ) -> Vec<u16> {
        (first..first + n as u16)
            .map(|cport| {
                let port = handshake(nat, clamp, now, cport, Some(7), Some(7));
                let client = format!("10.0.0.9:{cport}");
                let mut p = tcp_v4(&client, "1.1.1.1:443", 101, 501, ACK, &[], b"x");
                let ip = packet::parse_ip(&p).expect("ip");
                clamped(&mut p, &ip, nat, &addrs(), clamp, now);
                port
            })
            .collect()
    }

    /// When more flows get busy, the share falls, but a flow's window
    /// never moves the right edge it already advertised back: it closes
    /// as the acknowledgments reach that edge, then holds the new share.
    /// The listener's SYN-ACK window (64 KiB, unscaled) is the first edge
    /// of the downlink direction.
    /// With more busy directions than grants, a pure ACK without a grant
    /// is parked, its edge kept; grants go to parked ACKs oldest first,
    /// `GRANTS` at a time, and reopen them to the share of `GRANTS`; a
    /// holder's next ACK advertises that share; an expired grant goes to
    /// the next parked ACK.
    #[test]
    fn grants_share_the_queue_among_their_holders_and_park_the_rest() {
        use crate::nat::{GRANT_MS, GRANTS, Regrant};
        let (nat, now) = table(64);
        let (budget, mut clamp) = phone_clamp();
        // Acknowledging past the edge the SYN-ACK offered.
        const PAST: u32 = 102 + 200_000;
        let ports = busy_uploads(&nat, &mut clamp, now, 7000, GRANTS + 4);
        assert_eq!(nat.busy_flows(now), GRANTS + 4);
        let share = (budget.granted() >> 7) as u16;
        let ack = |clamp: &mut WindowClamp, port: u16| {
            let nat_addr = format!("198.18.0.2:{port}");
            let mut p = tcp_v4("198.18.0.1:40000", &nat_addr, 501, PAST, ACK, &[], b"");
            let ip = packet::parse_ip(&p).expect("ip");
            clamp.parked = None;
            clamped(&mut p, &ip, &nat, &addrs(), clamp, now);
            (window_of(&p), clamp.parked)
        };
        let mut parked = Vec::new();
        for &port in &ports {
            let ((w, ok), p) = ack(&mut clamp, port);
            assert!(ok);
            assert_eq!(w, 1, "the SYN-ACK's edge is kept (passed): closed");
            let p = p.expect("no grant yet: parked");
            assert_eq!((p.port, p.down, p.ack), (port, true, PAST));
            parked.push(p);
        }
        let regrant = |p: &Parked, at| nat.regrant(p.port, p.down, p.ack, p.field, 7, budget, at);
        for p in &parked[..GRANTS] {
            assert_eq!(regrant(p, now), Regrant::Open(share));
        }
        assert_eq!(
            regrant(&parked[GRANTS], now),
            Regrant::Wait,
            "every grant is held"
        );
        let ((w, _), p) = ack(&mut clamp, ports[0]);
        assert_eq!((w, p), (share, None), "a holder's ACK");
        let later = now + std::time::Duration::from_millis(GRANT_MS);
        assert_eq!(
            regrant(&parked[GRANTS], later),
            Regrant::Open(share),
            "a grant expired"
        );
        let gone = Parked {
            port: 1,
            ..parked[0]
        };
        assert_eq!(regrant(&gone, later), Regrant::Gone, "no such flow");
    }

    /// A parked ACK's copy is replaced by the direction's next parked ACK,
    /// not by a zero-window probe behind it in sequence (SND.UNA - 1),
    /// whose window its receiver would not take.
    #[test]
    fn a_zero_window_probe_does_not_replace_a_parked_ack() {
        use crate::nat::GRANTS;
        let (nat, now) = table(64);
        let (_, mut clamp) = phone_clamp();
        let ports = busy_uploads(&nat, &mut clamp, now, 7100, GRANTS + 2);
        let nat_addr = format!("198.18.0.2:{}", ports[0]);
        let mut parked_at = |seq: u32| {
            let mut p = tcp_v4("198.18.0.1:40000", &nat_addr, seq, 102, ACK, &[], b"");
            let ip = packet::parse_ip(&p).expect("ip");
            clamp.parked = None;
            clamped(&mut p, &ip, &nat, &addrs(), &mut clamp, now);
            clamp.parked.expect("more busy flows than grants: parked")
        };
        let copy = parked_at(501);
        assert_eq!(copy.seq, 501);
        let probe = parked_at(500);
        assert!(!probe.replaces(&copy), "a probe behind the copy");
        assert!(parked_at(501).replaces(&copy), "the same sequence");
        assert!(parked_at(600).replaces(&copy), "a later ACK");
        let wrapped = Parked { seq: 2, ..copy };
        let behind = Parked {
            seq: u32::MAX - 1,
            ..copy
        };
        assert!(!behind.replaces(&wrapped), "across the wrap");
    }

    #[test]
    fn window_clamp_never_moves_a_right_edge_back() {
        let (nat, now) = table(64);
        let (budget, mut clamp) = phone_clamp();
        let port = handshake(&nat, &mut clamp, now, 6000, Some(7), Some(7));
        let nat_addr = format!("198.18.0.2:{port}");
        let down = |nat: &NatTable, clamp: &mut WindowClamp, ack: u32| {
            let mut p = tcp_v4("198.18.0.1:40000", &nat_addr, 501, ack, ACK, &[], b"");
            let ip = packet::parse_ip(&p).expect("ip");
            clamped(&mut p, &ip, nat, &addrs(), clamp, now);
            window_of(&p)
        };
        // One busy direction (this flow's app data): the whole share.
        let mut up = tcp_v4("10.0.0.9:6000", "1.1.1.1:443", 101, 501, ACK, &[], b"x");
        let ip = packet::parse_ip(&up).expect("ip");
        clamped(&mut up, &ip, &nat, &addrs(), &mut clamp, now);
        assert_eq!(nat.busy_flows(now), 1);
        let wide = (budget.per_flow(1) >> 7) as u16;
        assert_eq!(down(&nat, &mut clamp, 102), (wide, true));
        let edge = 102 + (u32::from(wide) << 7);

        // 31 more busy directions: the share is 11 segments.
        for cport in 6001..6032 {
            handshake(&nat, &mut clamp, now, cport, Some(7), Some(7));
            let client = format!("10.0.0.9:{cport}");
            let mut p = tcp_v4(&client, "1.1.1.1:443", 101, 501, ACK, &[], b"x");
            let ip = packet::parse_ip(&p).expect("ip");
            clamped(&mut p, &ip, &nat, &addrs(), &mut clamp, now);
        }
        assert_eq!(nat.busy_flows(now), 32);
        let narrow = (budget.per_flow(32) >> 7) as u16;
        assert!(narrow < wide / 4, "{narrow} {wide}");

        // Acknowledgments short of the edge keep it, rounding up.
        for ack in [102, 50_000, 300_000] {
            let (w, ok) = down(&nat, &mut clamp, ack);
            assert!(ok);
            assert!(w >= narrow, "{ack}: {w}");
            assert!(
                ack + (u32::from(w) << 7) >= edge,
                "{ack}: {w} moves the edge back"
            );
            assert!(
                ack + (u32::from(w) << 7) < edge + 128,
                "{ack}: {w} no more than kept"
            );
        }
        // Past the edge, with more busy directions than grants and none
        // held: closed, and parked until a grant reopens it to the
        // holders' share.
        assert_eq!(down(&nat, &mut clamp, edge + 1), (1, true));
        let parked = clamp.parked.expect("parked");
        let granted = nat.regrant(
            parked.port,
            parked.down,
            edge + 1,
            parked.field,
            7,
            budget,
            now,
        );
        let share = budget.granted() >> 7;
        assert_eq!(granted, crate::nat::Regrant::Open(share as u16));
        assert_eq!(
            down(&nat, &mut clamp, edge + 5_000),
            (share as u16, true),
            "a holder"
        );
    }

    /// Until the listener's SYN-ACK has passed, the flow's scaling is not
    /// known and its segments are not clamped.
    #[test]
    fn window_clamp_waits_for_the_syn_ack() {
        let (nat, now) = table(16);
        let (_, mut clamp) = phone_clamp();
        let mut syn = tcp_v4(
            "10.0.0.9:5000",
            "1.1.1.1:443",
            100,
            0,
            SYN,
            &ws_opts(7),
            b"",
        );
        let ip = packet::parse_ip(&syn).expect("ip");
        let TcpStep::NewFlow { port, .. } = clamped(&mut syn, &ip, &nat, &addrs(), &mut clamp, now)
        else {
            panic!("new flow");
        };
        nat.accept(port, now).expect("accept");
        let mut up = tcp_v4("10.0.0.9:5000", "1.1.1.1:443", 101, 501, ACK, &[], b"x");
        let ip = packet::parse_ip(&up).expect("ip");
        clamped(&mut up, &ip, &nat, &addrs(), &mut clamp, now);
        assert_eq!(window_of(&up), (0xffff, true));
        assert_eq!(clamp.clamped, 0);
    }

    /// A run of segments merged as they were read
    /// (`coalesce::append_untranslated`, from the head's headers as read)
    /// comes out byte for byte as the same run translated one by one and
    /// merged (`coalesce::append_verified_plain`): in both directions, with
    /// the window clamped, and with another flow turning busy in the middle
    /// of the run (its share, the clamp's `want`, shrinks; the edge the head
    /// advertised keeps the window). Each path has a table of its own, set
    /// up alike.
    #[test]
    fn merging_untranslated_segments_equals_translating_each() {
        use crate::packet::coalesce;
        use crate::packet::tcp::parse_plain_tcp;
        const TS: [u8; 12] = [1, 1, 8, 10, 0, 0, 0, 7, 0, 0, 0, 9];
        for down in [false, true] {
            let setup = || {
                let (nat, now) = table(16);
                let (_, mut clamp) = phone_clamp();
                let port = handshake(&nat, &mut clamp, now, 3000, Some(7), Some(9));
                (nat, now, clamp, port)
            };
            let (nat_a, now, mut clamp_a, port) = setup();
            let (nat_b, _, mut clamp_b, port_b) = setup();
            assert_eq!(port, port_b, "both tables allocate alike");
            let nat_addr = format!("198.18.0.2:{port}");
            let seg = |i: u32| {
                let payload = vec![i as u8 + 1; 1000 + i as usize];
                let seq = (0..i).map(|k| 1000 + k).sum::<u32>();
                if down {
                    tcp_v4(
                        "198.18.0.1:40000",
                        &nat_addr,
                        501 + seq,
                        101,
                        ACK,
                        &TS,
                        &payload,
                    )
                } else {
                    tcp_v4(
                        "10.0.0.9:3000",
                        "1.1.1.1:443",
                        101 + seq,
                        501,
                        ACK,
                        &TS,
                        &payload,
                    )
                }
            };
            let other = |nat: &NatTable, clamp: &mut WindowClamp| {
                handshake(nat, clamp, now, 3001, Some(7), Some(9));
                let mut p = tcp_v4("10.0.0.9:3001", "1.1.1.1:443", 101, 501, ACK, &[], b"x");
                let ip = packet::parse_ip(&p).expect("ip");
                let step = clamped(&mut p, &ip, nat, &addrs(), clamp, now);
                assert_eq!(step, TcpStep::Uplink(p.len()));
            };
            let translate = |nat: &NatTable, clamp: &mut WindowClamp, p: &mut Vec<u8>| {
                let ip = packet::parse_ip(p).expect("ip");
                let step = clamped(p, &ip, nat, &addrs(), clamp, now);
                let want = if down {
                    TcpStep::Downlink(p.len())
                } else {
                    TcpStep::Uplink(p.len())
                };
                assert_eq!(step, want);
            };
            let head = |nat: &NatTable, clamp: &mut WindowClamp| {
                let mut h = seg(0);
                translate(nat, clamp, &mut h);
                let plain = parse_plain_tcp(&h).expect("plain");
                let mut buf = vec![0u8; coalesce::MAX_PACKET];
                buf[..h.len()].copy_from_slice(&h);
                (buf, plain)
            };

            // Translated one by one, then merged.
            let (mut buf_a, mut head_a) = head(&nat_a, &mut clamp_a);
            for i in 1..6 {
                if i == 3 {
                    other(&nat_a, &mut clamp_a);
                }
                let mut p = seg(i);
                translate(&nat_a, &mut clamp_a, &mut p);
                let n = parse_plain_tcp(&p).expect("plain");
                assert!(
                    coalesce::append_verified_plain(&mut buf_a, &mut head_a, &p, &n),
                    "down {down}: segment {i} merges once translated"
                );
            }

            // Merged as read.
            let raw_head = seg(0);
            let (mut buf_b, mut head_b) = head(&nat_b, &mut clamp_b);
            let raw_len = head_b.ip.l4_offset + head_b.tcp.header_len;
            for i in 1..6 {
                if i == 3 {
                    other(&nat_b, &mut clamp_b);
                }
                let p = seg(i);
                let n = parse_plain_tcp(&p).expect("plain");
                assert!(
                    coalesce::append_untranslated(
                        &mut buf_b,
                        &mut head_b,
                        &raw_head[..raw_len],
                        &p,
                        &n,
                        true
                    ),
                    "down {down}: segment {i} merges as read"
                );
            }
            assert_eq!(head_a, head_b);
            assert_eq!(
                buf_a[..head_a.ip.len],
                buf_b[..head_b.ip.len],
                "down {down}"
            );
            assert!(window_of(&buf_b[..head_b.ip.len]).1, "the merge verifies");
            assert!(clamp_a.clamped > 0, "the run's windows were clamped");

            // What differs from the head as read in a field the merge
            // compares is refused, and the head is left as it was.
            let before = buf_b[..head_b.ip.len].to_vec();
            let next = seg(6);
            let mut spoilt = [
                next.clone(), // the window
                next.clone(), // the acknowledgement number
                next.clone(), // the TTL
                next.clone(), // a timestamp
                seg(7),       // not where the head ends
            ];
            spoilt[0][20 + 15] ^= 1;
            spoilt[1][20 + 11] ^= 1;
            spoilt[2][8] ^= 1;
            spoilt[3][20 + 20 + 7] ^= 1;
            for (k, p) in spoilt.iter().enumerate() {
                let n = parse_plain_tcp(p).expect("plain");
                assert!(
                    !coalesce::append_untranslated(
                        &mut buf_b,
                        &mut head_b,
                        &raw_head[..raw_len],
                        p,
                        &n,
                        true
                    ),
                    "down {down}: case {k} is refused"
                );
                assert_eq!(buf_b[..head_b.ip.len], before[..]);
            }
        }
    }
}
