//! The system netstack's per-packet hot path: `parse_ip` + `parse_tcp` +
//! `rewrite_tcp`, IPv4 and IPv6, at 64, 1500 and 9000-byte packets.
//!
//! The rewrite touches only headers (RFC 1624 incremental checksums), so
//! the 9000-byte case should cost about what the 64-byte case does; a gap
//! would mean something reads the payload.
//!
//! Run: `cargo bench -p kerntun-benches --bench packet`.

use std::hint::black_box;
use std::net::{IpAddr, SocketAddr};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kerntun::packet::{
    self, Ipv4Packet, Ipv6Packet, TcpPacket, checksum, ipv4, ipv6, protocol, tcp, tcp_flags,
};

/// A TCP ACK|PSH segment of `total` bytes from `src` to `dst`, with valid
/// checksums, built through the crate's own views.
fn tcp_packet(src: SocketAddr, dst: SocketAddr, total: usize) -> Vec<u8> {
    let mut buf = vec![0u8; total];
    let ip_len = match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut p = Ipv4Packet::new_unchecked(&mut buf[..]);
            p.set_version_header_len(ipv4::HEADER_LEN);
            p.set_total_len(total as u16);
            p.set_unfragmented(true);
            p.set_ttl(64);
            p.set_protocol(protocol::TCP);
            p.set_src_addr(s);
            p.set_dst_addr(d);
            p.fill_checksum();
            ipv4::HEADER_LEN
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut p = Ipv6Packet::new_unchecked(&mut buf[..]);
            p.set_version_clear_flow();
            p.set_payload_len((total - ipv6::HEADER_LEN) as u16);
            p.set_next_header(protocol::TCP);
            p.set_hop_limit(64);
            p.set_src_addr(&s);
            p.set_dst_addr(&d);
            ipv6::HEADER_LEN
        }
        _ => unreachable!("same family"),
    };
    let mut t = TcpPacket::new_unchecked(&mut buf[ip_len..]);
    t.set_src_port(src.port());
    t.set_dst_port(dst.port());
    t.set_seq_number(0x1234_5678);
    t.set_ack_number(0x9abc_def0);
    t.set_header_len(tcp::HEADER_LEN);
    t.set_flags(tcp_flags::ACK | tcp_flags::PSH);
    t.set_window(65535);
    for (i, b) in buf[ip_len + tcp::HEADER_LEN..].iter_mut().enumerate() {
        *b = i as u8;
    }
    let ip = packet::parse_ip(&buf).expect("valid fixture");
    assert!(checksum::fill_transport_checksum(&mut buf, &ip));
    assert!(checksum::verify_transport_checksum(&buf, &ip));
    buf
}

fn addrs(v6: bool) -> [SocketAddr; 4] {
    let s = |a: &str| a.parse::<SocketAddr>().expect("address");
    if v6 {
        [
            s("[fd00::9]:12345"),
            s("[2606:4700::1111]:443"),
            s("[fd00::2]:10001"),
            s("[fd00::1]:40000"),
        ]
    } else {
        [
            s("10.0.0.9:12345"),
            s("1.1.1.1:443"),
            s("198.18.0.2:10001"),
            s("198.18.0.1:40000"),
        ]
    }
}

fn rewrite(c: &mut Criterion) {
    let mut g = c.benchmark_group("rewrite_tcp");
    // One element = one packet: criterion reports packets per second.
    g.throughput(Throughput::Elements(1));
    for (family, v6) in [("ipv4", false), ("ipv6", true)] {
        let [client, server, nat, gw] = addrs(v6);
        // Alternate between the app's tuple and the NAT tuple, so every
        // iteration is a real uplink or downlink-shaped rewrite and the
        // packet stays valid.
        let tuples = [(nat, gw), (client, server)];
        for size in [64usize, 1500, 9000] {
            let mut buf = tcp_packet(client, server, size);
            let mut which = 0usize;
            g.bench_with_input(BenchmarkId::new(family, size), &size, |b, _| {
                b.iter(|| {
                    let pkt = black_box(&mut buf[..]);
                    let ip = packet::parse_ip(pkt).expect("valid ip");
                    let t = packet::parse_tcp(pkt, &ip).expect("valid tcp");
                    let (src, dst) = tuples[which];
                    which ^= 1;
                    packet::rewrite_tcp(pkt, &ip, src, dst).expect("rewrite");
                    black_box(t.payload_len)
                })
            });
            let ip = packet::parse_ip(&buf).expect("still valid");
            assert!(checksum::verify_transport_checksum(&buf, &ip));
        }
    }
    g.finish();
}

/// What the uplink adds per packet since malformed input is dropped before
/// it can create state: `check_segment` (flag table, then the checksum over
/// pseudo-header and segment, one pass over the payload) on top of the
/// parse. Unlike the rewrite, this grows with the packet size.
fn uplink_check(c: &mut Criterion) {
    let mut g = c.benchmark_group("check_segment");
    g.throughput(Throughput::Elements(1));
    for (family, v6) in [("ipv4", false), ("ipv6", true)] {
        let [client, server, ..] = addrs(v6);
        for size in [64usize, 1500, 9000] {
            let buf = tcp_packet(client, server, size);
            g.bench_with_input(BenchmarkId::new(family, size), &size, |b, _| {
                b.iter(|| {
                    let pkt = black_box(&buf[..]);
                    let ip = packet::parse_ip(pkt).expect("valid ip");
                    let t = packet::parse_tcp(pkt, &ip).expect("valid tcp");
                    black_box(packet::check_segment(pkt, &ip, &t)).expect("valid");
                })
            });
        }
    }
    g.finish();
}

/// A flow's next segment merged into the one held before it (the
/// per-packet driver's write-back, `packet::coalesce`): `append` sums the
/// next payload to check its checksum, `append_verified` (what the driver
/// calls, its segments being checked on arrival) reads the payload's sum
/// back out of the checksum. Each iteration also copies the held segment
/// back in place, the same for both.
fn merge(c: &mut Criterion) {
    let mut g = c.benchmark_group("merge");
    g.throughput(Throughput::Elements(1));
    type Append = fn(&mut [u8], usize, &[u8]) -> Option<usize>;
    let ways: [(&str, Append); 2] = [
        ("append", packet::coalesce::append),
        ("append_verified", packet::coalesce::append_verified),
    ];
    for (family, v6) in [("ipv4", false), ("ipv6", true)] {
        let [client, server, ..] = addrs(v6);
        for size in [1500usize, 9000] {
            let (head, next) = consecutive(client, server, size);
            let mut buf = vec![0u8; packet::coalesce::MAX_PACKET];
            for (name, append) in ways {
                let id = BenchmarkId::new(format!("{name}/{family}"), size);
                g.bench_with_input(id, &size, |b, _| {
                    b.iter(|| {
                        buf[..head.len()].copy_from_slice(&head);
                        let n = append(black_box(&mut buf), head.len(), black_box(&next));
                        black_box(n.expect("merges"))
                    })
                });
            }
        }
    }
    g.finish();
}

/// `checksum::sum_bytes` alone, at the short lengths each packet sums
/// several times (an IPv4 address, an IPv4 header, a TCP header with
/// timestamps) and at one MTU-sized payload.
fn sum(c: &mut Criterion) {
    let mut g = c.benchmark_group("sum_bytes");
    g.throughput(Throughput::Elements(1));
    let data: Vec<u8> = (0..1500u32).map(|i| (i * 7 + 3) as u8).collect();
    for len in [4usize, 20, 32, 1448] {
        g.bench_with_input(BenchmarkId::from_parameter(len), &len, |b, &len| {
            b.iter(|| checksum::sum_bytes(black_box(&data[..len])))
        });
    }
    g.finish();
}

/// Two consecutive ACK segments of `total` bytes each, valid checksums.
fn consecutive(src: SocketAddr, dst: SocketAddr, total: usize) -> (Vec<u8>, Vec<u8>) {
    let mut head = tcp_packet(src, dst, total);
    let ip = packet::parse_ip(&head).expect("valid ip");
    let payload = packet::parse_tcp(&head, &ip)
        .expect("valid tcp")
        .payload_len;
    head[ip.l4_offset + 13] = tcp_flags::ACK;
    assert!(checksum::fill_transport_checksum(&mut head, &ip));
    let mut next = head.clone();
    let seq = 0x1234_5678u32.wrapping_add(payload as u32);
    next[ip.l4_offset + 4..ip.l4_offset + 8].copy_from_slice(&seq.to_be_bytes());
    assert!(checksum::fill_transport_checksum(&mut next, &ip));
    (head, next)
}

criterion_group!(benches, rewrite, uplink_check, merge, sum);
criterion_main!(benches);
