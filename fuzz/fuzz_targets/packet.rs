//! Fuzz target for the packet layer.
//!
//! The whole input is the packet; the parser ignores bytes past the
//! IP-declared length, so the fuzzer can append bytes freely. The last
//! [`CTL`] bytes of the input (zero-padded) also choose the tuple the TCP
//! rewrite goes to, so a raw packet is a valid seed as it is.
//!
//! Invariants: nothing panics; whatever parses is internally consistent; a
//! TCP rewrite to any same-family tuple and back restores the original bytes
//! (checksum fields may only flip between 0x0000 and 0xFFFF, the two ones'
//! complement zeros); a checksum that verified before a rewrite or an echo
//! reply still verifies after; RST replies, rebuilt UDP datagrams and ICMP
//! port unreachable errors parse and carry valid checksums.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use kerntun::packet::{
    self, IPV4_UDP_HEADERS, IPV6_UDP_HEADERS, IpInfo, Ipv4Packet, checksum, tcp_flags,
};
use libfuzzer_sys::fuzz_target;

/// Control bytes: two IPv6 addresses and two ports (IPv4 uses a prefix).
const CTL: usize = 36;

fn tuple(data: &[u8], v4: bool) -> (SocketAddr, SocketAddr) {
    let mut c = [0u8; CTL];
    let tail = &data[data.len().saturating_sub(CTL)..];
    c[..tail.len()].copy_from_slice(tail);
    let port = |i: usize| u16::from_be_bytes([c[i], c[i + 1]]);
    if v4 {
        let a = |i: usize| IpAddr::V4(Ipv4Addr::new(c[i], c[i + 1], c[i + 2], c[i + 3]));
        (
            SocketAddr::new(a(0), port(8)),
            SocketAddr::new(a(4), port(10)),
        )
    } else {
        let a = |i: usize| {
            let mut o = [0u8; 16];
            o.copy_from_slice(&c[i..i + 16]);
            IpAddr::V6(Ipv6Addr::from(o))
        };
        (
            SocketAddr::new(a(0), port(32)),
            SocketAddr::new(a(16), port(34)),
        )
    }
}

fn ipv4_header_ok(buf: &[u8]) -> bool {
    Ipv4Packet::new_checked(buf).is_ok_and(|p| p.verify_checksum())
}

/// Equal, or the two representations of ones' complement zero.
fn same_checksum(a: &[u8], b: &[u8]) -> bool {
    a == b || matches!((a, b), ([0, 0], [0xff, 0xff]) | ([0xff, 0xff], [0, 0]))
}

fn check_udp(data: &[u8], ip: &IpInfo) {
    let Ok(u) = packet::parse_udp(data, ip) else {
        return;
    };
    assert!(u.payload_offset + u.payload_len <= ip.len);
    let payload = &data[u.payload_offset..u.payload_offset + u.payload_len];
    let src = SocketAddr::new(ip.src, u.src_port);
    let dst = SocketAddr::new(ip.dst, u.dst_port);
    let headers = if ip.src.is_ipv4() {
        IPV4_UDP_HEADERS
    } else {
        IPV6_UDP_HEADERS
    };
    let mut b = vec![0u8; headers + payload.len()];
    b[headers..].copy_from_slice(payload);
    // An IPv6 datagram near 64 KiB does not fit the 65535-byte limit.
    let Ok(n) = packet::write_udp_headers(&mut b, src, dst, payload.len()) else {
        assert!(headers + payload.len() > 65535);
        return;
    };
    assert_eq!(n, b.len());
    let rip = packet::parse_ip(&b).expect("built UDP parses");
    assert_eq!(
        (rip.src, rip.dst, rip.protocol, rip.len),
        (ip.src, ip.dst, 17, n)
    );
    let ru = packet::parse_udp(&b, &rip).expect("built UDP header parses");
    assert_eq!((ru.src_port, ru.dst_port), (u.src_port, u.dst_port));
    assert_eq!(
        &b[ru.payload_offset..ru.payload_offset + ru.payload_len],
        payload
    );
    assert!(checksum::verify_transport_checksum(&b, &rip));
    if ip.src.is_ipv4() {
        assert!(ipv4_header_ok(&b));
    }
}

fn check_echo(data: &[u8], ip: &IpInfo) {
    let mut b = data.to_vec();
    let Ok(n) = packet::echo_reply_in_place(&mut b, ip) else {
        assert_eq!(b, data, "nothing written on error");
        return;
    };
    assert_eq!(n, ip.len);
    assert_eq!(b[n..], data[n..]);
    let rip = packet::parse_ip(&b).expect("echo reply parses");
    assert_eq!((rip.src, rip.dst), (ip.dst, ip.src));
    assert_eq!(
        (rip.protocol, rip.l4_offset, rip.len),
        (ip.protocol, ip.l4_offset, ip.len)
    );
    if checksum::verify_transport_checksum(data, ip) {
        assert!(checksum::verify_transport_checksum(&b, &rip));
    }
    if ip.src.is_ipv4() && ipv4_header_ok(data) {
        assert!(ipv4_header_ok(&b));
    }
}

fn check_unreachable(data: &[u8], ip: &IpInfo) {
    let mut b = [0u8; packet::icmp::ERROR_MAX_V6];
    let Some(n) = packet::port_unreachable(data, ip, &mut b) else {
        return;
    };
    let max = if ip.src.is_ipv4() {
        packet::icmp::ERROR_MAX_V4
    } else {
        packet::icmp::ERROR_MAX_V6
    };
    assert!(n <= max);
    let rip = packet::parse_ip(&b[..n]).expect("ICMP error parses");
    assert_eq!((rip.src, rip.dst, rip.len), (ip.dst, ip.src, n));
    assert!(checksum::verify_transport_checksum(&b[..n], &rip));
    if ip.src.is_ipv4() {
        assert!(ipv4_header_ok(&b[..n]));
    }
    let quote = &b[rip.l4_offset + packet::icmp::ERROR_HEADER_LEN..n];
    assert!(quote.len() >= ip.l4_offset + 8);
    assert_eq!(quote, &data[..quote.len()]);
}

fn check_tcp(data: &[u8], ip: &IpInfo) {
    let Ok(tcp) = packet::parse_tcp(data, ip) else {
        return;
    };
    assert_eq!(ip.l4_offset + tcp.header_len + tcp.payload_len, ip.len);

    // RST reply: the buffer always holds a valid TCP packet, so only an
    // incoming RST yields nothing.
    let mut b = data.to_vec();
    let n = packet::tcp_rst_reply(&mut b, ip, &tcp);
    if tcp.flags & tcp_flags::RST != 0 {
        assert_eq!(n, 0);
    } else {
        assert_eq!(n, if ip.src.is_ipv4() { 40 } else { 60 });
        let rip = packet::parse_ip(&b[..n]).expect("RST parses");
        assert_eq!((rip.src, rip.dst), (ip.dst, ip.src));
        let rt = packet::parse_tcp(&b[..n], &rip).expect("RST TCP parses");
        assert_eq!((rt.src_port, rt.dst_port), (tcp.dst_port, tcp.src_port));
        assert!(rt.flags & tcp_flags::RST != 0);
        assert!(checksum::verify_transport_checksum(&b[..n], &rip));
        if ip.src.is_ipv4() {
            assert!(ipv4_header_ok(&b[..n]));
        }
    }

    // Rewrite to a fuzzer-chosen tuple of the same family, then back.
    let v4 = ip.src.is_ipv4();
    let (nsrc, ndst) = tuple(data, v4);
    let tcp_ok = checksum::verify_transport_checksum(data, ip);
    let hdr_ok = v4 && ipv4_header_ok(data);
    let mut b = data.to_vec();
    packet::rewrite_tcp(&mut b, ip, nsrc, ndst).expect("rewrite of a parsed TCP packet");
    let ip2 = packet::parse_ip(&b).expect("rewritten packet parses");
    assert_eq!((ip2.src, ip2.dst), (nsrc.ip(), ndst.ip()));
    assert_eq!(
        (ip2.protocol, ip2.l4_offset, ip2.len),
        (ip.protocol, ip.l4_offset, ip.len)
    );
    let t2 = packet::parse_tcp(&b, &ip2).expect("rewritten TCP parses");
    assert_eq!((t2.src_port, t2.dst_port), (nsrc.port(), ndst.port()));
    assert_eq!((t2.seq, t2.ack, t2.flags), (tcp.seq, tcp.ack, tcp.flags));
    let csum = ip.l4_offset + 16..ip.l4_offset + 18;
    assert_ne!(
        &b[csum.clone()],
        &[0, 0],
        "a rewrite never writes a zero TCP checksum"
    );
    if tcp_ok {
        assert!(checksum::verify_transport_checksum(&b, &ip2));
    }
    if hdr_ok {
        assert!(ipv4_header_ok(&b));
    }

    let osrc = SocketAddr::new(ip.src, tcp.src_port);
    let odst = SocketAddr::new(ip.dst, tcp.dst_port);
    packet::rewrite_tcp(&mut b, &ip2, osrc, odst).expect("rewrite back");
    assert!(same_checksum(&b[csum.clone()], &data[csum.clone()]));
    b[csum.clone()].copy_from_slice(&data[csum]);
    if v4 {
        assert!(same_checksum(&b[10..12], &data[10..12]));
        b[10..12].copy_from_slice(&data[10..12]);
    }
    assert_eq!(b, data, "rewrite there and back restores the packet");
}

fuzz_target!(|data: &[u8]| {
    let Ok(ip) = packet::parse_ip(data) else {
        return;
    };
    assert!(ip.l4_offset <= ip.len && ip.len <= data.len());
    check_udp(data, &ip);
    check_echo(data, &ip);
    check_unreachable(data, &ip);
    check_tcp(data, &ip);
});
