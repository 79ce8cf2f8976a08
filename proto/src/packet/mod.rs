//! Packet layer of the system netstack: zero-copy views over caller-owned
//! buffers, the in-place 4-tuple rewrite, and the disposition every I/O driver
//! acts on.
//!
//! Untrusted input (anything read from the TUN) goes through [`parse_ip`] and
//! the `parse_*` functions, which perform every length check once; after
//! that, accessors and rewrites index without further checks and cannot
//! panic. The functions that take an [`IpInfo`] still re-check it against the
//! buffer (a few compares), so a stale or foreign `IpInfo` is an error, never
//! a panic.
//!
//! Nothing here allocates, performs I/O or reads a clock.
//!
//! Layout: [`checksum`] (RFC 1071 partial sums, RFC 1624 update), one file
//! per header with its `Packet` view and a `mod field` of offsets
//! ([`ipv4`], [`ipv6`], [`tcp`], [`udp`], [`icmp`]), and the engine-facing
//! functions re-exported here.

use std::net::IpAddr;

#[macro_use]
mod view;

pub mod ackthin;
pub mod checksum;
pub mod coalesce;
pub mod frag;
pub mod icmp;
pub mod ipv4;
pub mod ipv6;
pub mod tcp;
pub mod udp;

#[cfg(any(test, feature = "testutil"))]
#[doc(hidden)]
pub mod testutil;

pub use icmp::{echo_reply_in_place, port_unreachable};
pub use ipv4::Ipv4Packet;
pub use ipv6::Ipv6Packet;
pub use tcp::{
    TcpInfo, TcpPacket, check_flags, check_segment, clamp_window, flags as tcp_flags, parse_tcp,
    rewrite_tcp, set_window, tcp_rst_reply, window_field, window_scale,
};
pub use udp::{
    IPV4_UDP_HEADERS, IPV6_UDP_HEADERS, UdpInfo, UdpPacket, check_datagram, parse_udp,
    write_udp_headers,
};

/// IP protocol numbers this layer knows (IANA "Assigned Internet Protocol
/// Numbers"; RFC 792, 793/9293, 768, 4443).
pub mod protocol {
    /// ICMP for IPv4 (RFC 792).
    pub const ICMP: u8 = 1;
    /// TCP (RFC 9293).
    pub const TCP: u8 = 6;
    /// UDP (RFC 768).
    pub const UDP: u8 = 17;
    /// ICMPv6 (RFC 4443).
    pub const ICMPV6: u8 = 58;
}

/// TTL / hop limit of every packet this layer originates or answers: the
/// IANA-recommended default TTL (RFC 1700, "Assigned Numbers"), also what
/// Linux and Darwin use.
pub const DEFAULT_TTL: u8 = 64;

named_enum! {
    /// Why a packet was rejected. Every variant is counted by the engine.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum Reject {
        /// Zero-length buffer.
        Empty => "empty",
        /// IP version nibble is neither 4 nor 6.
        BadVersion => "bad_version",
        /// Shorter than the 20-byte fixed IPv4 header.
        Ipv4Truncated => "ipv4_truncated",
        /// IHL below 5 (RFC 791 3.1: the minimum header is 5 words).
        Ipv4BadHeaderLength => "ipv4_bad_header_length",
        /// Total length below the header length or beyond the buffer.
        Ipv4BadTotalLength => "ipv4_bad_total_length",
        /// More-fragments set or a nonzero fragment offset: not a whole packet
        /// (the engine hands it to reassembly, [`frag`]).
        Ipv4Fragment => "ipv4_fragment",
        /// Shorter than the 40-byte fixed IPv6 header.
        Ipv6Truncated => "ipv6_truncated",
        /// 40 + payload length exceeds the buffer.
        Ipv6BadPayloadLength => "ipv6_bad_payload_length",
        /// Payload length 0 with a Hop-by-Hop header: a jumbogram (RFC 2675),
        /// which a TUN never needs.
        Ipv6Jumbogram => "ipv6_jumbogram",
        /// An extension header runs past the declared packet length.
        Ipv6ExtTruncated => "ipv6_ext_truncated",
        /// Fragment header (44): not a whole packet (the engine hands it to
        /// reassembly, [`frag`]).
        Ipv6Fragment => "ipv6_fragment",
        /// ESP (50): everything after it is encrypted.
        Ipv6Esp => "ipv6_esp",
        /// Routing header with segments left != 0: the destination field is
        /// not the final destination (RFC 8200 4.4), so neither the NAT tuple nor
        /// the pseudo-header (RFC 8200 8.1) would be right.
        Ipv6RoutingSegmentsLeft => "ipv6_routing_segments_left",
        /// The transport protocol is not the one the parser was asked for.
        UnsupportedProtocol => "unsupported_protocol",
        /// Fewer than 20 bytes of TCP header.
        TcpTruncated => "tcp_truncated",
        /// TCP data offset below 5 or beyond the segment.
        TcpBadDataOffset => "tcp_bad_data_offset",
        /// An uplink TCP segment whose checksum does not verify.
        TcpBadChecksum => "tcp_bad_checksum",
        /// A combination of control bits no TCP endpoint sends (no flags,
        /// SYN+FIN, SYN+RST, FIN without ACK, ...): see [`tcp::valid_flags`].
        TcpBadFlags => "tcp_bad_flags",
        /// Fewer than 8 bytes of UDP header.
        UdpTruncated => "udp_truncated",
        /// UDP length field below 8 or beyond the IP payload.
        UdpBadLength => "udp_bad_length",
        /// A UDP datagram whose checksum does not verify (or is zero over
        /// IPv6, RFC 8200 8.1).
        UdpBadChecksum => "udp_bad_checksum",
        /// Fewer than 8 bytes of ICMP echo header.
        IcmpTruncated => "icmp_truncated",
        /// ICMP message other than an echo request with code 0.
        IcmpNotEchoRequest => "icmp_not_echo_request",
        /// Addresses of different families, or not the packet's family.
        FamilyMismatch => "family_mismatch",
        /// The buffer cannot hold the packet to build or the `IpInfo` given.
        BufferTooSmall => "buffer_too_small",
    }
}

impl Reject {
    /// Index into a `[_; Reject::COUNT]` counter array.
    pub fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Reject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::error::Error for Reject {}

/// Bytes every packet buffer of the engine keeps free in front of the IP
/// header, so a device header is written in place instead of copying the
/// packet: Linux's 10-byte `virtio_net_hdr` when offload is on, utun's
/// 4-byte address family on Darwin (`crate::tun`).
pub const HEADROOM: usize = 10;

/// What the I/O driver does with a packet after processing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// The first `len` bytes of the buffer were rewritten in place; write them to the TUN.
    WriteBack(usize),
    /// Nothing to write (consumed or dropped; drops are counted by the processor).
    Done,
}

/// Summary of a validated IP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpInfo {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// Transport protocol after the IPv6 extension-header walk (6, 17, 1, 58, ...).
    pub protocol: u8,
    /// Offset of the transport header.
    pub l4_offset: usize,
    /// Packet length per the IP header (<= buffer length; trailing bytes ignored).
    pub len: usize,
}

/// Validates the IP header of `buf` and locates the transport header.
///
/// IPv4 (RFC 791): IHL >= 5, header length <= total length <= buffer,
/// fragments (MF set or offset != 0) rejected. IPv6 (RFC 8200): payload
/// length within the buffer, then the extension-header walk: Hop-by-Hop (0),
/// Routing (43) and Destination Options (60) are `(len + 1) * 8` bytes
/// (RFC 8200 4.3-4.6), AH (51) is `(len + 2) * 4` bytes (RFC 4302 2.2);
/// Fragment (44) and ESP (50) are rejected; any other next header ends the
/// walk and is the transport protocol. `len` is the IP-declared length;
/// trailing bytes in the buffer (link padding) are ignored. The IPv4 header
/// checksum is not verified: packets come from the local kernel, and the
/// rewrite updates it incrementally, so a bad one stays bad.
#[inline]
pub fn parse_ip(buf: &[u8]) -> Result<IpInfo, Reject> {
    match buf.first() {
        None => Err(Reject::Empty),
        Some(b) => match b >> 4 {
            4 => ipv4::parse(buf),
            6 => ipv6::parse(buf),
            _ => Err(Reject::BadVersion),
        },
    }
}

/// The system netstack's downlink test: the packet comes from the kernel
/// listener (`gateway:listen_port`) and goes to the NAT address.
#[inline]
pub fn is_downlink(
    ip: &IpInfo,
    tcp: &TcpInfo,
    gateway: IpAddr,
    nat: IpAddr,
    listen_port: u16,
) -> bool {
    tcp.src_port == listen_port && ip.src == gateway && ip.dst == nat
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;
    use std::collections::HashSet;
    use std::net::SocketAddr;

    #[test]
    fn reject_table_is_consistent() {
        let mut names = HashSet::new();
        for (i, r) in Reject::ALL.iter().enumerate() {
            assert_eq!(r.index(), i, "{r:?}");
            let name = r.as_str();
            assert!(names.insert(name), "duplicate name {name}");
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{name} is not snake_case"
            );
            assert_eq!(r.to_string(), name);
        }
        assert_eq!(Reject::ALL.len(), Reject::COUNT);
    }

    /// One input per reason, and together they cover `Reject::ALL`.
    #[test]
    fn every_reject_reason_is_produced() {
        let v4 = tcp_v4(
            "10.0.0.9:12345",
            "1.1.1.1:443",
            1,
            0,
            tcp_flags::SYN,
            &[],
            b"",
        );
        let v6 = tcp_v6(
            "[fd00::9]:12345",
            "[2001:db8::1]:443",
            &[],
            1,
            0,
            tcp_flags::SYN,
            &[],
            b"",
        );
        let mut seen = HashSet::new();
        let mut expect = |r: Result<(), Reject>, want: Reject| {
            assert_eq!(r, Err(want));
            seen.insert(want);
        };
        let ip_only = |b: &[u8]| parse_ip(b).map(|_| ());

        expect(ip_only(&[]), Reject::Empty);
        expect(ip_only(&[0x50; 40]), Reject::BadVersion);
        expect(ip_only(&v4[..19]), Reject::Ipv4Truncated);
        let mut p = v4.clone();
        p[0] = 0x44;
        expect(ip_only(&p), Reject::Ipv4BadHeaderLength);
        let mut p = v4.clone();
        p[2..4].copy_from_slice(&41u16.to_be_bytes());
        expect(ip_only(&p), Reject::Ipv4BadTotalLength);
        let mut p = v4.clone();
        p[6] |= 0x20; // MF
        expect(ip_only(&p), Reject::Ipv4Fragment);
        expect(ip_only(&v6[..39]), Reject::Ipv6Truncated);
        let mut p = v6.clone();
        p[4..6].copy_from_slice(&21u16.to_be_bytes());
        expect(ip_only(&p), Reject::Ipv6BadPayloadLength);
        let mut p = v6[..40].to_vec();
        p[4..6].copy_from_slice(&0u16.to_be_bytes());
        p[6] = ipv6::ext::HOP_BY_HOP;
        expect(ip_only(&p), Reject::Ipv6Jumbogram);
        let mut p = v6.clone();
        p[6] = ipv6::ext::DEST_OPTS;
        p[41] = 3; // 32 bytes claimed, 20 present
        expect(ip_only(&p), Reject::Ipv6ExtTruncated);
        let frag = ipv6_packet("fd00::9", "fd00::1", &[ExtHdr::Fragment], 17, &[0; 8]);
        expect(ip_only(&frag), Reject::Ipv6Fragment);
        let esp = ipv6_packet("fd00::9", "fd00::1", &[ExtHdr::Esp], 17, &[0; 8]);
        expect(ip_only(&esp), Reject::Ipv6Esp);
        let rh = ipv6_packet(
            "fd00::9",
            "fd00::1",
            &[ExtHdr::Routing { segments_left: 1 }],
            6,
            &[0; 20],
        );
        expect(ip_only(&rh), Reject::Ipv6RoutingSegmentsLeft);

        let ip4 = parse_ip(&v4).expect("valid");
        expect(
            parse_udp(&v4, &ip4).map(|_| ()),
            Reject::UnsupportedProtocol,
        );
        let short = set_l4_len(&v4, 19);
        let ip = parse_ip(&short).expect("valid ip");
        expect(parse_tcp(&short, &ip).map(|_| ()), Reject::TcpTruncated);
        let mut p = v4.clone();
        p[32] = 0x40;
        expect(parse_tcp(&p, &ip4).map(|_| ()), Reject::TcpBadDataOffset);
        let udp = udp_v4("10.0.0.9:5353", "10.0.0.1:53", b"q");
        let short = set_l4_len(&udp, 7);
        let ip = parse_ip(&short).expect("valid ip");
        expect(parse_udp(&short, &ip).map(|_| ()), Reject::UdpTruncated);
        let mut p = udp.clone();
        p[24..26].copy_from_slice(&7u16.to_be_bytes());
        let ip = parse_ip(&p).expect("valid ip");
        expect(parse_udp(&p, &ip).map(|_| ()), Reject::UdpBadLength);
        let mut ping = icmp_echo_v4("10.0.0.9", "198.18.0.1", 8, b"");
        let short = set_l4_len(&ping, 7);
        let ip = parse_ip(&short).expect("valid ip");
        let mut short = short.clone();
        expect(
            echo_reply_in_place(&mut short, &ip).map(|_| ()),
            Reject::IcmpTruncated,
        );
        ping[20] = 0; // an echo reply, not a request
        let ip = parse_ip(&ping).expect("valid ip");
        expect(
            echo_reply_in_place(&mut ping, &ip).map(|_| ()),
            Reject::IcmpNotEchoRequest,
        );
        let mut p = v4.clone();
        let v6_addr: SocketAddr = "[::1]:1".parse().expect("addr");
        expect(
            rewrite_tcp(&mut p, &ip4, v6_addr, v6_addr),
            Reject::FamilyMismatch,
        );
        let mut small = [0u8; 30];
        let a: SocketAddr = "10.0.0.1:1".parse().expect("addr");
        expect(
            write_udp_headers(&mut small, a, a, 3).map(|_| ()),
            Reject::BufferTooSmall,
        );

        let mut p = v4.clone();
        p[20 + 16] ^= 0x01; // the TCP checksum field
        let t = parse_tcp(&p, &ip4).expect("valid");
        expect(check_segment(&p, &ip4, &t), Reject::TcpBadChecksum);
        let p = tcp_v4(
            "10.0.0.9:12345",
            "1.1.1.1:443",
            1,
            0,
            tcp_flags::SYN | tcp_flags::FIN,
            &[],
            b"",
        );
        let ip = parse_ip(&p).expect("valid ip");
        let t = parse_tcp(&p, &ip).expect("valid");
        expect(check_segment(&p, &ip, &t), Reject::TcpBadFlags);
        let mut p = udp.clone();
        p[20 + 6] ^= 0x01; // the UDP checksum field
        let ip = parse_ip(&p).expect("valid ip");
        let u = parse_udp(&p, &ip).expect("valid");
        expect(check_datagram(&p, &ip, &u), Reject::UdpBadChecksum);

        let missing: Vec<_> = Reject::ALL.iter().filter(|r| !seen.contains(r)).collect();
        assert!(missing.is_empty(), "not produced: {missing:?}");
    }

    #[test]
    fn parse_ip_ignores_trailing_bytes() {
        let mut p = tcp_v4("10.0.0.9:1", "10.0.0.1:2", 0, 0, tcp_flags::SYN, &[], b"x");
        let len = p.len();
        p.extend_from_slice(&[0xee; 6]);
        let ip = parse_ip(&p).expect("valid");
        assert_eq!(ip.len, len);
        assert_eq!(ip.l4_offset, 20);
        assert_eq!(ip.protocol, protocol::TCP);
        let tcp = parse_tcp(&p, &ip).expect("valid");
        assert_eq!(tcp.payload_len, 1);
    }

    /// Arbitrary bytes, and valid packets with random bytes flipped, never
    /// panic anywhere in the layer, and whatever parses is consistent.
    fn exercise(bytes: &[u8]) {
        let Ok(ip) = parse_ip(bytes) else { return };
        assert!(ip.l4_offset <= ip.len && ip.len <= bytes.len());
        let mut b = bytes.to_vec();
        let _ = echo_reply_in_place(&mut b, &ip);
        let _ = parse_udp(bytes, &ip);
        if let Ok(t) = parse_tcp(bytes, &ip) {
            assert!(ip.l4_offset + t.header_len + t.payload_len == ip.len);
            let mut b = bytes.to_vec();
            let any4: SocketAddr = "1.2.3.4:5".parse().expect("addr");
            let any6: SocketAddr = "[1::2]:3".parse().expect("addr");
            let a = if ip.src.is_ipv4() { any4 } else { any6 };
            assert_eq!(rewrite_tcp(&mut b, &ip, a, a), Ok(()));
            let mut b = bytes.to_vec();
            let n = tcp_rst_reply(&mut b, &ip, &t);
            assert!(n == 0 || n == 40 || n == 60);
        }
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            exercise(&bytes);
        }
    }

    #[test]
    fn mutated_packets_never_panic() {
        let mut rng = Rng::new(8200);
        let seeds: Vec<Vec<u8>> = corpus().into_iter().map(|(_, p)| p).collect();
        // Fewer rounds under Miri (it interprets every instruction).
        let rounds = if cfg!(miri) { 300 } else { 50_000 };
        for _ in 0..rounds {
            let mut p = seeds[rng.below(seeds.len())].clone();
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(p.len());
                p[i] = rng.byte();
            }
            p.truncate(p.len() - rng.below(8).min(p.len()));
            exercise(&p);
        }
    }

    #[test]
    fn downlink_test() {
        let gw: IpAddr = "198.18.0.1".parse().expect("addr");
        let nat: IpAddr = "198.18.0.2".parse().expect("addr");
        let p = tcp_v4(
            "198.18.0.1:40000",
            "198.18.0.2:10001",
            0,
            0,
            tcp_flags::ACK,
            &[],
            b"",
        );
        let ip = parse_ip(&p).expect("valid");
        let tcp = parse_tcp(&p, &ip).expect("valid");
        assert!(is_downlink(&ip, &tcp, gw, nat, 40000));
        assert!(!is_downlink(&ip, &tcp, gw, nat, 40001));
        assert!(!is_downlink(&ip, &tcp, nat, gw, 40000));
        let v6gw: IpAddr = "fd00::1".parse().expect("addr");
        assert!(!is_downlink(&ip, &tcp, v6gw, nat, 40000));
    }
}
