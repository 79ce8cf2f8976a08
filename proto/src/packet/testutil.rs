//! Test-only packet builders with an independent, byte-at-a-time reference
//! checksum (RFC 1071 in its plainest form), so tests compare the packet
//! layer against code that shares nothing with it.
#![allow(
    clippy::unwrap_used,
    clippy::too_many_arguments,
    clippy::len_without_is_empty,
    missing_debug_implementations
)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::IpInfo;

/// xorshift64*: a seeded, dependency-free PRNG for loop-style property tests.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform-ish in `0..n` (0 when n == 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    pub fn byte(&mut self) -> u8 {
        (self.next_u64() >> 56) as u8
    }
}

/// Folded (not complemented) ones' complement sum, one 16-bit word at a
/// time with the carry folded after every addition.
pub fn reference_sum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut i = 0;
    while i < data.len() {
        let hi = u32::from(data[i]) << 8;
        let lo = if i + 1 < data.len() {
            u32::from(data[i + 1])
        } else {
            0
        };
        sum += hi | lo;
        sum = (sum & 0xffff) + (sum >> 16);
        i += 2;
    }
    sum as u16
}

fn v4(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

fn v6(s: &str) -> Ipv6Addr {
    s.parse().unwrap()
}

fn sock(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn checksum_field(protocol: u8) -> Option<usize> {
    match protocol {
        6 => Some(16),
        17 => Some(6),
        1 | 58 => Some(2),
        _ => None,
    }
}

/// Reference transport checksum over `pseudo ++ segment` with the field
/// zeroed, without the 0 -> 0xFFFF mapping.
fn reference_transport(pseudo: &[u8], segment: &[u8], field: usize) -> u16 {
    let mut seg = segment.to_vec();
    seg[field..field + 2].copy_from_slice(&[0, 0]);
    let mut all = pseudo.to_vec();
    all.extend_from_slice(&seg);
    !reference_sum(&all)
}

fn pseudo_v4(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.push(0);
    p.push(protocol);
    p.extend_from_slice(&(len as u16).to_be_bytes());
    p
}

fn pseudo_v6(src: &Ipv6Addr, dst: &Ipv6Addr, next: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&(len as u32).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, next]);
    p
}

/// Fills the transport checksum of a segment with the reference
/// computation (TCP/UDP: 0 written as 0xFFFF).
fn fill_reference(pseudo: &[u8], protocol: u8, segment: &mut [u8]) {
    let Some(field) = checksum_field(protocol) else {
        return;
    };
    if segment.len() < field + 2 {
        return;
    }
    let mut c = reference_transport(pseudo, segment, field);
    if c == 0 && (protocol == 6 || protocol == 17) {
        c = 0xffff;
    }
    segment[field..field + 2].copy_from_slice(&c.to_be_bytes());
}

/// The TCP checksum of `pkt` recomputed by the reference, before the
/// 0 -> 0xFFFF mapping.
pub fn raw_tcp_checksum(pkt: &[u8], ip: &IpInfo) -> u16 {
    let seg = &pkt[ip.l4_offset..ip.len];
    let pseudo = match (ip.src, ip.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => pseudo_v4(s, d, 6, seg.len()),
        (IpAddr::V6(s), IpAddr::V6(d)) => pseudo_v6(&s, &d, 6, seg.len()),
        _ => panic!("mixed families"),
    };
    reference_transport(&pseudo, seg, 16)
}

pub fn fix_ipv4_header_checksum(pkt: &mut [u8]) {
    let hl = usize::from(pkt[0] & 0x0f) * 4;
    pkt[10..12].copy_from_slice(&[0, 0]);
    let c = !reference_sum(&pkt[..hl]);
    pkt[10..12].copy_from_slice(&c.to_be_bytes());
}

/// A TCP segment with checksum 0 and window 65535; `options` must be a
/// multiple of 4 bytes.
pub fn tcp_segment(
    sport: u16,
    dport: u16,
    seq: u32,
    ack: u32,
    flags: u8,
    options: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    assert_eq!(options.len() % 4, 0, "options must fill whole words");
    let mut s = Vec::new();
    s.extend_from_slice(&sport.to_be_bytes());
    s.extend_from_slice(&dport.to_be_bytes());
    s.extend_from_slice(&seq.to_be_bytes());
    s.extend_from_slice(&ack.to_be_bytes());
    s.push((((20 + options.len()) / 4) as u8) << 4);
    s.push(flags);
    s.extend_from_slice(&0xffffu16.to_be_bytes());
    s.extend_from_slice(&[0, 0, 0, 0]);
    s.extend_from_slice(options);
    s.extend_from_slice(payload);
    s
}

pub fn udp_segment(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let mut s = Vec::new();
    s.extend_from_slice(&sport.to_be_bytes());
    s.extend_from_slice(&dport.to_be_bytes());
    s.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    s.extend_from_slice(&[0, 0]);
    s.extend_from_slice(payload);
    s
}

/// An ICMP/ICMPv6 echo message (identifier 0x4b54, sequence 7), checksum 0.
pub fn echo_message(msg_type: u8, data: &[u8]) -> Vec<u8> {
    let mut s = vec![msg_type, 0, 0, 0, 0x4b, 0x54, 0, 7];
    s.extend_from_slice(data);
    s
}

/// IPv4 packet (DF, TTL 64, ident 0, as the crate's builders emit) with
/// the given options and correct header and transport checksums.
pub fn ipv4_packet_with_options(
    src: &str,
    dst: &str,
    options: &[u8],
    protocol: u8,
    l4: &[u8],
) -> Vec<u8> {
    assert_eq!(options.len() % 4, 0);
    let (s, d) = (v4(src), v4(dst));
    let hl = 20 + options.len();
    let total = hl + l4.len();
    let mut p = vec![0x40 | (hl / 4) as u8, 0];
    p.extend_from_slice(&(total as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0x40, 0, 64, protocol, 0, 0]);
    p.extend_from_slice(&s.octets());
    p.extend_from_slice(&d.octets());
    p.extend_from_slice(options);
    fix_ipv4_header_checksum(&mut p);
    let mut seg = l4.to_vec();
    let pseudo = if protocol == 1 {
        Vec::new()
    } else {
        pseudo_v4(s, d, protocol, seg.len())
    };
    fill_reference(&pseudo, protocol, &mut seg);
    p.extend_from_slice(&seg);
    p
}

pub fn ipv4_packet(src: &str, dst: &str, protocol: u8, l4: &[u8]) -> Vec<u8> {
    ipv4_packet_with_options(src, dst, &[], protocol, l4)
}

/// IPv6 extension headers for the builders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtHdr {
    /// Hop-by-Hop Options, `(units + 1) * 8` bytes of Pad1.
    HopByHop { units: u8 },
    /// Destination Options, `(units + 1) * 8` bytes of Pad1.
    DestOpts { units: u8 },
    /// An 8-byte Routing header of experimental type 253 (RFC 4727).
    Routing { segments_left: u8 },
    /// Authentication Header of `(words + 2) * 4` bytes.
    Ah { words: u8 },
    /// Fragment header, first fragment (M set).
    Fragment,
    /// ESP: SPI and sequence; everything after is opaque.
    Esp,
}

impl ExtHdr {
    pub fn code(&self) -> u8 {
        match self {
            ExtHdr::HopByHop { .. } => 0,
            ExtHdr::DestOpts { .. } => 60,
            ExtHdr::Routing { .. } => 43,
            ExtHdr::Ah { .. } => 51,
            ExtHdr::Fragment => 44,
            ExtHdr::Esp => 50,
        }
    }

    pub fn len(&self) -> usize {
        match *self {
            ExtHdr::HopByHop { units } | ExtHdr::DestOpts { units } => (usize::from(units) + 1) * 8,
            ExtHdr::Routing { .. } | ExtHdr::Fragment | ExtHdr::Esp => 8,
            ExtHdr::Ah { words } => (usize::from(words) + 2) * 4,
        }
    }

    fn bytes(&self, next: u8) -> Vec<u8> {
        let mut b = vec![0u8; self.len()];
        match *self {
            ExtHdr::HopByHop { units } | ExtHdr::DestOpts { units } => {
                b[0] = next;
                b[1] = units;
            }
            ExtHdr::Routing { segments_left } => {
                b[0] = next;
                b[2] = 253;
                b[3] = segments_left;
            }
            ExtHdr::Ah { words } => {
                b[0] = next;
                b[1] = words;
                b[4..8].copy_from_slice(&0x100u32.to_be_bytes());
                b[8..12].copy_from_slice(&1u32.to_be_bytes());
            }
            ExtHdr::Fragment => {
                b[0] = next;
                b[2..4].copy_from_slice(&1u16.to_be_bytes());
                b[4..8].copy_from_slice(&0xabcdu32.to_be_bytes());
            }
            ExtHdr::Esp => {
                b[0..4].copy_from_slice(&0x200u32.to_be_bytes());
                b[4..8].copy_from_slice(&1u32.to_be_bytes());
            }
        }
        b
    }
}

/// IPv6 packet (hop limit 64) with an extension-header chain and a correct
/// transport checksum.
pub fn ipv6_packet(src: &str, dst: &str, ext: &[ExtHdr], protocol: u8, l4: &[u8]) -> Vec<u8> {
    let (s, d) = (v6(src), v6(dst));
    let first = ext.first().map_or(protocol, ExtHdr::code);
    let ext_len: usize = ext.iter().map(ExtHdr::len).sum();
    let mut p = vec![0x60, 0, 0, 0];
    p.extend_from_slice(&((ext_len + l4.len()) as u16).to_be_bytes());
    p.push(first);
    p.push(64);
    p.extend_from_slice(&s.octets());
    p.extend_from_slice(&d.octets());
    for (i, h) in ext.iter().enumerate() {
        let next = ext.get(i + 1).map_or(protocol, ExtHdr::code);
        p.extend_from_slice(&h.bytes(next));
    }
    let mut seg = l4.to_vec();
    fill_reference(&pseudo_v6(&s, &d, protocol, seg.len()), protocol, &mut seg);
    p.extend_from_slice(&seg);
    p
}

/// The segment `l4(source port, destination port)` from socket address
/// `src` to `dst`, in an IPv4 packet (`v6_ext` None) or an IPv6 packet with
/// the extension headers `v6_ext`.
fn between(
    src: &str,
    dst: &str,
    v6_ext: Option<&[ExtHdr]>,
    protocol: u8,
    l4: impl FnOnce(u16, u16) -> Vec<u8>,
) -> Vec<u8> {
    let (s, d) = (sock(src), sock(dst));
    let seg = l4(s.port(), d.port());
    let (s_ip, d_ip) = (s.ip().to_string(), d.ip().to_string());
    match v6_ext {
        None => ipv4_packet(&s_ip, &d_ip, protocol, &seg),
        Some(ext) => ipv6_packet(&s_ip, &d_ip, ext, protocol, &seg),
    }
}

pub fn tcp_v4(
    src: &str,
    dst: &str,
    seq: u32,
    ack: u32,
    flags: u8,
    options: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    between(src, dst, None, 6, |sport, dport| {
        tcp_segment(sport, dport, seq, ack, flags, options, payload)
    })
}

pub fn tcp_v6(
    src: &str,
    dst: &str,
    ext: &[ExtHdr],
    seq: u32,
    ack: u32,
    flags: u8,
    options: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    between(src, dst, Some(ext), 6, |sport, dport| {
        tcp_segment(sport, dport, seq, ack, flags, options, payload)
    })
}

pub fn udp_v4(src: &str, dst: &str, payload: &[u8]) -> Vec<u8> {
    between(src, dst, None, 17, |sport, dport| {
        udp_segment(sport, dport, payload)
    })
}

pub fn udp_v6(src: &str, dst: &str, payload: &[u8]) -> Vec<u8> {
    between(src, dst, Some(&[]), 17, |sport, dport| {
        udp_segment(sport, dport, payload)
    })
}

pub fn icmp_echo_v4(src: &str, dst: &str, msg_type: u8, data: &[u8]) -> Vec<u8> {
    ipv4_packet(src, dst, 1, &echo_message(msg_type, data))
}

pub fn icmp_echo_v6(src: &str, dst: &str, ext: &[ExtHdr], msg_type: u8, data: &[u8]) -> Vec<u8> {
    ipv6_packet(src, dst, ext, 58, &echo_message(msg_type, data))
}

/// `pkt` cut to `len` bytes with the IP length fields (and IPv4 header
/// checksum) made to match, so only the layer above sees the cut.
pub fn set_ip_len(pkt: &[u8], len: usize) -> Vec<u8> {
    let mut p = pkt[..len].to_vec();
    if p[0] >> 4 == 4 {
        p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        fix_ipv4_header_checksum(&mut p);
    } else {
        p[4..6].copy_from_slice(&((len - 40) as u16).to_be_bytes());
    }
    p
}

/// `pkt` with its transport part cut to `n` bytes (see [`set_ip_len`]).
pub fn set_l4_len(pkt: &[u8], n: usize) -> Vec<u8> {
    let l4 = super::parse_ip(pkt).unwrap().l4_offset;
    set_ip_len(pkt, l4 + n)
}

/// A DNS query for `example.com A` with the RD bit (RFC 1035 4.1).
pub fn dns_query() -> Vec<u8> {
    let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in ["example", "com"] {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// The fuzz seed corpus: real, well-formed packets. The committed copy in
/// `fuzz/corpus/packet/` is checked against this list by a test; run it with
/// `KERNTUN_WRITE_CORPUS=1` to regenerate the files.
pub fn corpus() -> Vec<(&'static str, Vec<u8>)> {
    use super::tcp_flags::{ACK, FIN, PSH, SYN};
    // MSS 1460, SACK permitted, timestamps, NOP, window scale 7: a Linux SYN.
    let syn_opts = [
        2, 4, 5, 0xb4, 4, 2, 8, 10, 0, 0, 0x12, 0x34, 0, 0, 0, 0, 1, 3, 3, 7,
    ];
    let ts_opts = [1, 1, 8, 10, 0, 0, 0x12, 0x40, 0, 0, 0x56, 0x78];
    let http = b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n";
    let mut frag_v4 = udp_v4("10.0.0.9:40000", "1.1.1.1:443", &[0x5a; 64]);
    frag_v4[6] = 0x20; // MF, offset 0: a first fragment
    fix_ipv4_header_checksum(&mut frag_v4);
    let frag_l4 = udp_segment(40000, 443, &[0x5a; 64]);
    vec![
        (
            "tcp4_syn",
            tcp_v4(
                "10.0.0.9:51234",
                "1.1.1.1:443",
                0x1000_0000,
                0,
                SYN,
                &syn_opts,
                b"",
            ),
        ),
        (
            "tcp4_data",
            tcp_v4(
                "10.0.0.9:51234",
                "1.1.1.1:80",
                0x1000_0001,
                0x2000_0001,
                ACK | PSH,
                &ts_opts,
                http,
            ),
        ),
        (
            "tcp4_fin",
            tcp_v4(
                "198.18.0.1:40000",
                "198.18.0.2:10001",
                5,
                6,
                FIN | ACK,
                &[],
                b"",
            ),
        ),
        (
            "tcp6_syn",
            tcp_v6(
                "[fd00::9]:51234",
                "[2606:4700::1111]:443",
                &[],
                0x1000_0000,
                0,
                SYN,
                &syn_opts,
                b"",
            ),
        ),
        (
            "tcp6_data",
            tcp_v6(
                "[fd00::9]:51234",
                "[2606:4700::1111]:80",
                &[],
                7,
                9,
                ACK | PSH,
                &ts_opts,
                http,
            ),
        ),
        (
            "tcp6_hbh_dstopts",
            tcp_v6(
                "[fd00::9]:51234",
                "[2001:db8::1]:443",
                &[ExtHdr::HopByHop { units: 0 }, ExtHdr::DestOpts { units: 1 }],
                1,
                0,
                SYN,
                &[],
                b"",
            ),
        ),
        (
            "tcp6_routing_ah",
            tcp_v6(
                "[fd00::9]:51234",
                "[2001:db8::1]:443",
                &[
                    ExtHdr::Routing { segments_left: 0 },
                    ExtHdr::Ah { words: 4 },
                ],
                1,
                2,
                ACK,
                &[],
                b"x",
            ),
        ),
        (
            "udp4_dns",
            udp_v4("10.0.0.9:53000", "198.18.0.1:53", &dns_query()),
        ),
        (
            "udp6_dns",
            udp_v6("[fd00::9]:53000", "[fd00::1]:53", &dns_query()),
        ),
        (
            "icmp4_echo",
            icmp_echo_v4(
                "10.0.0.9",
                "198.18.0.1",
                8,
                b"abcdefghijklmnopqrstuvwabcdefghi",
            ),
        ),
        (
            "icmp6_echo",
            icmp_echo_v6(
                "fd00::9",
                "fd00::1",
                &[],
                128,
                b"abcdefghijklmnopqrstuvwabcdefghi",
            ),
        ),
        ("frag4_first", frag_v4),
        (
            "frag6",
            ipv6_packet("fd00::9", "2001:db8::1", &[ExtHdr::Fragment], 17, &frag_l4),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::checksum::verify_transport_checksum;
    use crate::packet::parse_ip;

    #[test]
    fn corpus_is_well_formed() {
        for (name, p) in corpus() {
            match parse_ip(&p) {
                Ok(ip) => assert!(verify_transport_checksum(&p, &ip), "{name}"),
                Err(r) => assert!(name.starts_with("frag"), "{name}: {r:?}"),
            }
        }
    }

    #[test]
    fn committed_fuzz_corpus_matches_generator() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/packet");
        let write = std::env::var_os("KERNTUN_WRITE_CORPUS").is_some();
        if write {
            std::fs::create_dir_all(&dir).expect("corpus dir");
        }
        for (name, p) in corpus() {
            let path = dir.join(name);
            if write {
                std::fs::write(&path, &p).expect("write corpus file");
            }
            let committed = std::fs::read(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (regenerate with KERNTUN_WRITE_CORPUS=1)",
                    path.display()
                )
            });
            assert_eq!(committed, p, "{name} drifted from the generator");
        }
    }
}
