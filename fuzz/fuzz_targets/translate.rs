//! Fuzz target for the system netstack's translation step with a live flow
//! table: the input is a program of operations (structured TCP packets in
//! both directions, raw packets, the half-open transitions an engine makes
//! (admit, connected, connect failed, making room), accepts, closes, clock
//! jumps, cleanups).
//!
//! Invariants checked after every operation: nothing panics; the table's
//! forward and reverse maps agree, exactly its admitted half-open flows
//! carry an attachment, and its counters match a scan
//! (`check_invariants`); a packet the step forwarded still parses, carries
//! the NAT tuple (uplink) or a mapped original tuple (downlink), and its
//! transport checksum verifies whenever the input's did; an attachment
//! (a unique token here) comes back once, from the transition that ended
//! its flow's stage, and at the end every one has. With the window clamp
//! on (the first input byte, odd), a forwarded packet's window is never
//! above the input's, and an open window never closes.
#![no_main]

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use kerntun::nat::{Accepted, Evicted, NatConfig, NatTable, Stage, WindowBudget};
use kerntun::packet::{self, checksum};
use kerntun::translate::{DataSums, FamilyAddrs, StackAddrs, TcpStep, WindowClamp, translate_tcp_clamped};
use libfuzzer_sys::fuzz_target;

const GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const NAT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const LISTEN: u16 = 40000;

/// A valid IPv4/TCP packet with correct checksums, acknowledging 2000 plus
/// `step` KiB and advertising a window from `step` (so the window clamp's
/// edges move, forward and back).
fn tcp4(src: SocketAddr, dst: SocketAddr, flags: u8, payload: &[u8], step: u8) -> Vec<u8> {
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
    let ack = 2000u32.wrapping_add(u32::from(step) << 10);
    p[28..32].copy_from_slice(&ack.to_be_bytes());
    p[32] = 5 << 4;
    p[33] = flags;
    let window = [65535u16, 0, 1, 300, 4096][usize::from(step % 5)];
    p[34..36].copy_from_slice(&window.to_be_bytes());
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

/// Tokens attached to half-open flows and not had back yet.
#[derive(Default)]
struct Attached(HashSet<u64>);

impl Attached {
    fn back(&mut self, token: u64) {
        assert!(self.0.remove(&token), "token {token} back twice or never attached");
    }

    fn evicted(&mut self, e: Option<Evicted<u64>>) {
        if let Some(token) = e.and_then(|e| e.payload) {
            self.back(token);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let start = Instant::now();
    let mut now = start;
    let cfg = NatConfig {
        port_range: 20000..=20015,
        max_entries: 12,
        ..NatConfig::default()
    };
    let nat: NatTable<u64> = NatTable::new(cfg, start);
    let addrs = StackAddrs {
        v4: Some(FamilyAddrs {
            gateway: IpAddr::V4(GATEWAY),
            nat: IpAddr::V4(NAT),
            listen_port: LISTEN,
        }),
        v6: None,
    };
    // Accepted flows: (port, generation) of the accept, and whether a
    // session still holds it (and marks it Closing when the input ends).
    let mut accepted: Vec<(u16, u64, bool)> = Vec::new();
    // The generation each port's latest SYN was given, as the step said.
    let mut opened = [0u64; 16];
    let mut attached = Attached::default();
    let mut tokens = 0u64;
    let mut clamp = match data.first() {
        Some(&b) if b & 1 == 1 => WindowClamp {
            budget: Some(WindowBudget { queue_packets: u32::from(b >> 1) * 8, mss: 1460 }),
            clamped: 0,
            parked: None,
        },
        _ => WindowClamp::OFF,
    };
    let mut i = 1;
    while i + 2 <= data.len() {
        let (op, arg) = (data[i], data[i + 1]);
        i += 2;
        let port = 20000 + u16::from(arg % 16);
        let generation = opened[usize::from(arg % 16)];
        let mut pkt = match op % 12 {
            // App -> server: SYN, ACK, data, FIN, RST by flag choice.
            0 | 1 => {
                let flags = [0x02, 0x10, 0x18, 0x11, 0x14, 0x12][usize::from(arg >> 4) % 6];
                let mut p = tcp4(client(arg), server(arg >> 2), flags, &[arg; 3], arg.rotate_left(3));
                if op & 0x40 != 0 {
                    // Spoilt on the way: the checksum no longer verifies.
                    let last = p.len() - 1;
                    p[last] ^= 0x01;
                }
                p
            }
            // Kernel listener -> app for some NAT port in the range.
            2 => tcp4(
                SocketAddr::new(IpAddr::V4(GATEWAY), LISTEN),
                SocketAddr::new(IpAddr::V4(NAT), 20000 + u16::from(arg % 18)),
                0x18,
                &[arg; 5],
                arg.rotate_left(5),
            ),
            // Raw bytes from the input.
            3 => {
                let n = usize::from(arg).min(data.len() - i);
                let raw = data[i..i + n].to_vec();
                i += n;
                raw
            }
            4 => {
                if let Ok(a) = nat.accept(port, now) {
                    let Accepted { port, generation, stage, payload, .. } = a;
                    assert_eq!(payload.is_some(), stage != Stage::New);
                    if let Some(token) = payload {
                        attached.back(token);
                    }
                    accepted.push((port, generation, arg & 1 == 0));
                }
                Vec::new()
            }
            5 => {
                if !accepted.is_empty() {
                    let k = usize::from(arg) % accepted.len();
                    let (port, generation, _) = accepted[k];
                    nat.mark_closing(port, generation, now);
                    if arg & 1 == 1 {
                        accepted.swap_remove(k);
                    }
                }
                Vec::new()
            }
            6 => {
                now = now.checked_add(Duration::from_millis(u64::from(arg) * 250)).unwrap_or(now);
                Vec::new()
            }
            // Admit the flow at a port, Connecting or Ready.
            7 => {
                let stage = if arg & 0x80 == 0 { Stage::Connecting } else { Stage::Ready };
                tokens += 1;
                match nat.admit(port, generation, stage, tokens, now) {
                    Ok(()) => assert!(attached.0.insert(tokens)),
                    Err(back) => assert_eq!(back, tokens),
                }
                Vec::new()
            }
            // Its connect succeeded: a new token for what it made.
            8 => {
                tokens += 1;
                let mut old = None;
                match nat.connected(port, generation, now, tokens, |o, n| {
                    old = Some(o);
                    n
                }) {
                    Ok(()) => {
                        attached.back(old.expect("merged"));
                        assert!(attached.0.insert(tokens));
                    }
                    Err(back) => assert_eq!(back, tokens),
                }
                Vec::new()
            }
            // Its connect failed (or admission refused it).
            9 => {
                if let Some(token) = nat.abort_half_open(port, generation, now).and_then(|a| a.payload) {
                    attached.back(token);
                }
                Vec::new()
            }
            // Room for a SYN from some client, under a small admission limit.
            10 => {
                let evicted = nat.make_room(client(arg).ip(), usize::from(arg >> 5), now);
                attached.evicted(evicted);
                Vec::new()
            }
            _ => {
                let done = nat.cleanup(now);
                for token in done.timed_out.into_iter().chain(done.expired) {
                    attached.back(token);
                }
                Vec::new()
            }
        };
        if !pkt.is_empty() {
            if let Ok(ip) = packet::parse_ip(&pkt) {
                if ip.protocol == 6 {
                    let verified = checksum::verify_transport_checksum(&pkt, &ip);
                    let window_in = packet::window_field(&pkt, &ip);
                    // Either mode, by the op's top bit (one stack has one).
                    let sums = if op & 0x80 == 0 { DataSums::Verify } else { DataSums::Kernel };
                    let step = translate_tcp_clamped(&mut pkt, &ip, &nat, &addrs, &mut clamp, sums, now);
                    match step {
                        TcpStep::Uplink(n) | TcpStep::Downlink(n) => {
                            let out = packet::parse_ip(&pkt[..n]).expect("forwarded packet parses");
                            let tcp = packet::parse_tcp(&pkt[..n], &out).expect("forwarded tcp parses");
                            let verifies = checksum::verify_transport_checksum(&pkt[..n], &out);
                            if verified {
                                assert!(verifies);
                            }
                            if matches!(step, TcpStep::Uplink(_)) {
                                // What the uplink forwards unverified stays
                                // wrong, so the kernel behind drops it.
                                assert!(verified || sums == DataSums::Kernel, "unverified uplink");
                                assert_eq!(verifies, verified, "the rewrite mended a checksum");
                            }
                            let window_out = packet::window_field(&pkt[..n], &out);
                            assert!(window_out <= window_in, "the clamp raised a window");
                            assert_eq!(window_out == 0, window_in == 0, "the clamp closed a window");
                            if matches!(step, TcpStep::Uplink(_)) {
                                assert_eq!(out.src, IpAddr::V4(NAT));
                                assert_eq!((out.dst, tcp.dst_port), (IpAddr::V4(GATEWAY), LISTEN));
                                assert!(nat.downlink(tcp.src_port, now).is_some(), "uplink port is mapped");
                            } else {
                                assert_ne!(out.src, IpAddr::V4(GATEWAY), "downlink restored");
                            }
                        }
                        TcpStep::Reset { len, evicted, .. } => {
                            let out = packet::parse_ip(&pkt[..len]).expect("rst parses");
                            assert!(checksum::verify_transport_checksum(&pkt[..len], &out));
                            attached.evicted(evicted);
                        }
                        TcpStep::NewFlow { port, generation, evicted, replaced, .. } => {
                            assert!(nat.state(port).is_some(), "new flow is in the table");
                            opened[usize::from(port - 20000)] = generation;
                            attached.evicted(evicted);
                            if let Some(token) = replaced {
                                attached.back(token);
                            }
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
    // The sessions still open end; every flow expires: all that was
    // attached has come back.
    for (port, generation, held) in accepted {
        if held {
            nat.mark_closing(port, generation, now);
        }
    }
    let done = nat.cleanup(now + Duration::from_secs(10_000));
    for token in done.timed_out.into_iter().chain(done.expired) {
        attached.back(token);
    }
    if let Err(e) = nat.check_invariants() {
        panic!("NAT invariant broken after the final cleanup: {e}");
    }
    assert!(attached.0.is_empty(), "never came back: {:?}", attached.0);
});
