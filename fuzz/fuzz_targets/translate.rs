//! Fuzz target for the system netstack's translation step with a live NAT
//! table: the input is a program of operations (structured TCP packets in
//! both directions, raw packets, accepts, closes, clock jumps, cleanups).
//!
//! Invariants checked after every operation: nothing panics; the NAT table's
//! forward and reverse maps agree and its counters match a scan
//! (`check_invariants`); a packet the step forwarded still parses, carries
//! the NAT tuple (uplink) or a mapped original tuple (downlink), and its
//! transport checksum verifies whenever the input's did.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use kerntun::nat::{Accepted, Clock, ManualClock, NatConfig, NatTable};
use kerntun::packet::{self, checksum};
use kerntun::translate::{FamilyAddrs, StackAddrs, TcpStep, translate_tcp};
use libfuzzer_sys::fuzz_target;

const GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const NAT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const LISTEN: u16 = 40000;

/// A valid IPv4/TCP packet with correct checksums.
fn tcp4(src: SocketAddr, dst: SocketAddr, flags: u8, payload: &[u8]) -> Vec<u8> {
    let (IpAddr::V4(s), IpAddr::V4(d)) = (src.ip(), dst.ip()) else {
        unreachable!("v4 only")
    };
    let total = 40 + payload.len();
    let mut p = vec![0u8; total];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p[8] = 64;
    p[9] = 6;
    p[12..16].copy_from_slice(&s.octets());
    p[16..20].copy_from_slice(&d.octets());
    let hc = checksum::finish(checksum::sum_bytes(&p[..20]));
    p[10..12].copy_from_slice(&hc.to_be_bytes());
    p[20..22].copy_from_slice(&src.port().to_be_bytes());
    p[22..24].copy_from_slice(&dst.port().to_be_bytes());
    p[24..28].copy_from_slice(&1000u32.to_be_bytes());
    p[28..32].copy_from_slice(&2000u32.to_be_bytes());
    p[32] = 5 << 4;
    p[33] = flags;
    p[34..36].copy_from_slice(&65535u16.to_be_bytes());
    p[40..].copy_from_slice(payload);
    let ip = packet::parse_ip(&p).expect("built packet parses");
    checksum::fill_transport_checksum(&mut p, &ip);
    p
}

fn client(i: u8) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1 + (i % 4))), 50000 + u16::from(i % 8))
}

fn server(i: u8) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(1, 1, 1, 1 + (i % 3))), 443 + u16::from(i % 2))
}

fuzz_target!(|data: &[u8]| {
    let clock = Arc::new(ManualClock::new());
    let cfg = NatConfig {
        port_range: 20000..=20015,
        max_entries: 12,
        ..NatConfig::default()
    };
    let nat = Arc::new(NatTable::new(cfg, clock.clone()));
    let addrs = StackAddrs {
        v4: Some(FamilyAddrs {
            gateway: IpAddr::V4(GATEWAY),
            nat: IpAddr::V4(NAT),
            listen_port: LISTEN,
        }),
        v6: None,
    };
    let mut accepted: Vec<Accepted> = Vec::new();
    let mut guards = Vec::new();
    let mut i = 0;
    while i + 2 <= data.len() {
        let (op, arg) = (data[i], data[i + 1]);
        i += 2;
        let now = clock.now();
        let mut pkt = match op % 8 {
            // App -> server: SYN, ACK, data, FIN, RST by flag choice.
            0 | 1 => {
                let flags = [0x02, 0x10, 0x18, 0x11, 0x14, 0x12][usize::from(arg >> 4) % 6];
                tcp4(client(arg), server(arg >> 2), flags, &[arg; 3])
            }
            // Kernel listener -> app for some NAT port in the range.
            2 => tcp4(
                SocketAddr::new(IpAddr::V4(GATEWAY), LISTEN),
                SocketAddr::new(IpAddr::V4(NAT), 20000 + u16::from(arg % 18)),
                0x18,
                &[arg; 5],
            ),
            // Raw bytes from the input.
            3 => {
                let n = usize::from(arg).min(data.len() - i);
                let raw = data[i..i + n].to_vec();
                i += n;
                raw
            }
            4 => {
                if let Ok(a) = nat.accept(20000 + u16::from(arg % 16), now) {
                    if arg & 1 == 0 {
                        guards.push(nat.guard(&a));
                    }
                    accepted.push(a);
                }
                Vec::new()
            }
            5 => {
                if !accepted.is_empty() {
                    let a = accepted[usize::from(arg) % accepted.len()];
                    nat.mark_closing(a.port, a.generation, now);
                }
                if !guards.is_empty() && arg & 1 == 1 {
                    guards.swap_remove(usize::from(arg) % guards.len());
                }
                Vec::new()
            }
            6 => {
                clock.advance(Duration::from_millis(u64::from(arg) * 250));
                Vec::new()
            }
            _ => {
                nat.cleanup(now);
                Vec::new()
            }
        };
        if !pkt.is_empty() {
            if let Ok(ip) = packet::parse_ip(&pkt) {
                if ip.protocol == 6 {
                    let verified = checksum::verify_transport_checksum(&pkt, &ip);
                    let step = translate_tcp(&mut pkt, &ip, &nat, &addrs, now, |p| p % 5 == 0);
                    match step {
                        TcpStep::Uplink(n) | TcpStep::Downlink(n) => {
                            let out = packet::parse_ip(&pkt[..n]).expect("forwarded packet parses");
                            let tcp = packet::parse_tcp(&pkt[..n], &out).expect("forwarded tcp parses");
                            if verified {
                                assert!(checksum::verify_transport_checksum(&pkt[..n], &out));
                            }
                            if matches!(step, TcpStep::Uplink(_)) {
                                assert_eq!(out.src, IpAddr::V4(NAT));
                                assert_eq!((out.dst, tcp.dst_port), (IpAddr::V4(GATEWAY), LISTEN));
                                assert!(nat.downlink(tcp.src_port, now).is_some(), "uplink port is mapped");
                            } else {
                                assert_ne!(out.src, IpAddr::V4(GATEWAY), "downlink restored");
                            }
                        }
                        TcpStep::Reset { len, .. } => {
                            let out = packet::parse_ip(&pkt[..len]).expect("rst parses");
                            assert!(checksum::verify_transport_checksum(&pkt[..len], &out));
                        }
                        TcpStep::NewFlow { port, .. } => {
                            assert!(nat.state(port).is_some(), "new flow is in the table");
                        }
                        TcpStep::Drop(_) => {}
                    }
                }
            }
        }
        if let Err(e) = nat.check_invariants() {
            panic!("NAT invariant broken after op {op}: {e}");
        }
    }
    drop(guards);
    if let Err(e) = nat.check_invariants() {
        panic!("NAT invariant broken after guards dropped: {e}");
    }
});
