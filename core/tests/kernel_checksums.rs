//! What the per-packet driver leaves to the kernel (`translate::DataSums`):
//! a Linux TUN written without `virtio_net_hdr` hands each packet to the
//! kernel unchecked, so a local TCP verifies its checksum before taking the
//! data, for a segment of the MTU and for one above it (a merge). Here a
//! test plays the app on a TUN of its own in a namespace of its own: a
//! handshake with a local listener, then segments whose payload no longer
//! matches their checksum, which the listener must not take, then the
//! same segments intact, which it must.

use std::io::{ErrorKind, Read};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};
use std::time::{Duration, Instant};

use kerntun::packet::{self, checksum, tcp_flags};
use kerntun_testkit::Netns;

const TUN_ADDR: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const APP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 99, 0, 2), 40_000);
const PORT: u16 = 7_000;

/// An IPv4/TCP segment from the app to the listener with valid checksums.
fn segment(seq: u32, ack: u32, flags: u8, payload: &[u8]) -> Vec<u8> {
    let total = 40 + payload.len();
    let mut p = vec![0u8; total];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p[6] = 0x40; // DF
    p[8] = 64;
    p[9] = 6;
    p[12..16].copy_from_slice(&APP.ip().octets());
    p[16..20].copy_from_slice(&TUN_ADDR.octets());
    let hc = checksum::finish(checksum::sum_bytes(&p[..20]));
    p[10..12].copy_from_slice(&hc.to_be_bytes());
    p[20..22].copy_from_slice(&APP.port().to_be_bytes());
    p[22..24].copy_from_slice(&PORT.to_be_bytes());
    p[24..28].copy_from_slice(&seq.to_be_bytes());
    p[28..32].copy_from_slice(&ack.to_be_bytes());
    p[32] = 5 << 4;
    p[33] = flags;
    p[34..36].copy_from_slice(&65_535u16.to_be_bytes());
    p[40..].copy_from_slice(payload);
    let ip = packet::parse_ip(&p).expect("built packet parses");
    assert!(checksum::fill_transport_checksum(&mut p, &ip));
    p
}

/// The listener's SYN-ACK to the app: its initial sequence number.
fn syn_ack(dev: &tun_rs::SyncDevice) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut buf = [0u8; 2048];
    while Instant::now() < deadline {
        let n = match dev.recv(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => panic!("tun read: {e}"),
        };
        let pkt = &buf[..n];
        let Ok(ip) = packet::parse_ip(pkt) else {
            continue;
        };
        let Ok(tcp) = packet::parse_tcp(pkt, &ip) else {
            continue;
        };
        if tcp.dst_port == APP.port() && tcp.flags & tcp_flags::SYN != 0 {
            return tcp.seq;
        }
    }
    panic!("no SYN-ACK within 5 s");
}

/// The namespace's `Tcp: InCsumErrors` count (`/proc/net/snmp`).
fn in_csum_errors(ns: &Netns) -> u64 {
    let snmp = ns.exec("cat", &["/proc/net/snmp"]).expect("snmp");
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next().expect("names"), tcp.next().expect("values"));
    let at = names
        .split_whitespace()
        .position(|n| n == "InCsumErrors")
        .expect("InCsumErrors");
    values
        .split_whitespace()
        .nth(at)
        .expect("value")
        .parse()
        .expect("count")
}

/// What the accepted socket holds within `wait`, or as soon as it holds
/// `enough` bytes.
fn received(conn: &mut std::net::TcpStream, wait: Duration, enough: usize) -> Vec<u8> {
    let deadline = Instant::now() + wait;
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    while Instant::now() < deadline && got.len() < enough {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("read: {e}"),
        }
    }
    got
}

fn corrupt_segments_are_dropped_by_the_kernel() {
    let ns = Netns::new("csum").expect("netns");
    let handle = ns
        .spawn(|| {
            let dev = tun_rs::DeviceBuilder::new()
                .name("ktcsum0".to_string())
                .mtu(1500)
                .ipv4(TUN_ADDR, 24, None)
                .build_sync()
                .expect("tun");
            dev.set_nonblocking(true).expect("nonblocking");
            let listener = TcpListener::bind((TUN_ADDR, PORT)).expect("listen");
            dev.send(&segment(1000, 0, tcp_flags::SYN, b""))
                .expect("syn");
            let isn = syn_ack(&dev);
            dev.send(&segment(1001, isn.wrapping_add(1), tcp_flags::ACK, b""))
                .expect("ack");
            let (conn, peer) = listener.accept().expect("accept");
            assert_eq!(peer, std::net::SocketAddr::V4(APP));
            conn.set_nonblocking(true).expect("nonblocking");
            let ack = isn.wrapping_add(1);
            // One segment of the MTU and one of 3000 bytes, as a merge
            // writes: spoilt after their checksums were computed.
            let small: Vec<u8> = (0..1000u32).map(|i| (i * 13) as u8).collect();
            let large: Vec<u8> = (0..3000u32).map(|i| (i * 7 + 1) as u8).collect();
            let seq2 = 1001 + small.len() as u32;
            let mut spoilt = Vec::new();
            for (seq, data) in [(1001, &small), (seq2, &large)] {
                let mut p = segment(seq, ack, tcp_flags::ACK | tcp_flags::PSH, data);
                let last = p.len() - 1;
                p[last] ^= 0x20;
                spoilt.push(p);
            }
            (dev, conn, ack, small, large, seq2, spoilt)
        })
        .expect("spawn");
    let (dev, mut conn, ack, small, large, seq2, spoilt) = handle.join().expect("setup");
    let before = in_csum_errors(&ns);
    for p in &spoilt {
        dev.send(p).expect("spoilt segment");
    }
    let got = received(&mut conn, Duration::from_millis(300), 1);
    assert!(
        got.is_empty(),
        "the listener took {} spoilt bytes",
        got.len()
    );
    let after = in_csum_errors(&ns);
    assert!(after >= before + 2, "InCsumErrors {before} -> {after}");
    for (seq, data) in [(1001, &small), (seq2, &large)] {
        let p = segment(seq, ack, tcp_flags::ACK | tcp_flags::PSH, data);
        dev.send(&p).expect("intact segment");
    }
    let want: Vec<u8> = small.iter().chain(large.iter()).copied().collect();
    let got = received(&mut conn, Duration::from_secs(5), want.len());
    assert_eq!(got, want, "the intact segments, in order");
}

kerntun_testkit::root_tests!(
    corrupt_segments_are_dropped_by_the_kernel;
    a_linux_tun_without_offload_hands_packets_to_the_kernel_unchecked(),
);
