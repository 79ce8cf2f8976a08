//! UDP header view (RFC 768), the datagram parser, and the header builder
//! used to send datagrams back into the TUN.

use std::net::{IpAddr, SocketAddr};

use super::checksum::{self, nonzero};
use super::{IpInfo, Reject, ipv4, ipv6, protocol};

/// Field offsets of the UDP header (RFC 768).
pub mod field {
    use std::ops::Range;

    pub const SRC_PORT: Range<usize> = 0..2;
    pub const DST_PORT: Range<usize> = 2..4;
    /// Header plus data, in bytes.
    pub const LENGTH: Range<usize> = 4..6;
    pub const CHECKSUM: Range<usize> = 6..8;
}

/// Length of the UDP header.
pub const HEADER_LEN: usize = field::CHECKSUM.end;

/// Length of the IPv4 (no options) + UDP headers.
pub const IPV4_UDP_HEADERS: usize = ipv4::HEADER_LEN + HEADER_LEN;
/// Length of the IPv6 (no extension headers) + UDP headers.
pub const IPV6_UDP_HEADERS: usize = ipv6::HEADER_LEN + HEADER_LEN;

/// Largest packet [`write_udp_headers`] builds: the IPv4 total length field
/// is 16 bits, and one limit for both families keeps buffers uniform.
const MAX_PACKET: usize = u16::MAX as usize;

header_view! {
    /// A read/write view of a UDP header over a buffer (the transport segment).
    pub struct UdpPacket, at least HEADER_LEN bytes;
    pub src_port, set_src_port: u16 = field::SRC_PORT;
    pub dst_port, set_dst_port: u16 = field::DST_PORT;
    /// The length field: header plus data.
    pub len, set_len: u16 = field::LENGTH;
    pub checksum, set_checksum: u16 = field::CHECKSUM;
}

impl<T: AsRef<[u8]>> UdpPacket<T> {
    /// Wraps an untrusted segment (exactly the IP payload) after checking
    /// the 8-byte header is present and 8 <= length field <= segment
    /// length. After this no accessor can panic.
    pub fn new_checked(buffer: T) -> Result<Self, Reject> {
        let b = buffer.as_ref();
        let Some(hdr) = b.first_chunk::<HEADER_LEN>() else {
            return Err(Reject::UdpTruncated);
        };
        let len = usize::from(UdpPacket::new_unchecked(hdr).len());
        // A length of 0 over IPv6 would mean a jumbogram (RFC 2675 4),
        // which parse_ip already refuses; here it is simply too short.
        if len < HEADER_LEN || len > b.len() {
            return Err(Reject::UdpBadLength);
        }
        Ok(UdpPacket { buffer })
    }

    /// Whether the length field is zero (never true after `new_checked`).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Summary of a validated UDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpInfo {
    pub src_port: u16,
    pub dst_port: u16,
    /// Offset of the datagram payload in the packet buffer.
    pub payload_offset: usize,
    /// Payload length per the UDP length field (IP bytes beyond it are
    /// ignored).
    pub payload_len: usize,
}

/// Validates the UDP header of the packet `ip` describes: 8 bytes present,
/// 8 <= length field <= `ip.len - ip.l4_offset`. The checksum is checked
/// apart ([`check_datagram`]), on the uplink only.
pub fn parse_udp(buf: &[u8], ip: &IpInfo) -> Result<UdpInfo, Reject> {
    if ip.protocol != protocol::UDP {
        return Err(Reject::UnsupportedProtocol);
    }
    let seg = buf.get(ip.l4_offset..ip.len).ok_or(Reject::UdpTruncated)?;
    let u = UdpPacket::new_checked(seg)?;
    Ok(UdpInfo {
        src_port: u.src_port(),
        dst_port: u.dst_port(),
        payload_offset: ip.l4_offset + HEADER_LEN,
        payload_len: usize::from(u.len()) - HEADER_LEN,
    })
}

/// The uplink's check of a datagram from the app, before it may open a
/// flow or reach an outbound: the checksum over pseudo-header, header and
/// payload up to the UDP length (RFC 768; zero means none over IPv4 and is
/// invalid over IPv6, RFC 8200 8.1), else [`Reject::UdpBadChecksum`]. `udp`
/// must come from [`parse_udp`] on this buffer.
#[inline]
pub fn check_datagram(buf: &[u8], ip: &IpInfo, udp: &UdpInfo) -> Result<(), Reject> {
    if checksum::verify_segment(buf, ip, udp.payload_offset + udp.payload_len) {
        Ok(())
    } else {
        Err(Reject::UdpBadChecksum)
    }
}

/// Writes IP and UDP headers in front of a payload that is already at
/// `buf[headers..headers + payload_len]`, where `headers` is
/// [`IPV4_UDP_HEADERS`] or [`IPV6_UDP_HEADERS`] by the family of `src`.
///
/// IPv4: no options, TTL 64, DF, identification 0 (RFC 6864 4.1: atomic
/// datagrams may carry any ID), header checksum. IPv6: hop limit 64, no
/// extension headers. The UDP checksum is computed in full over the
/// pseudo-header, header and payload; a result of 0 is sent as 0xFFFF
/// (RFC 768; mandatory over IPv6, RFC 8200 8.1). Returns the total length.
///
/// `Err(FamilyMismatch)` if `src` and `dst` differ in family;
/// `Err(BufferTooSmall)` if the packet does not fit `buf` or would exceed
/// 65535 bytes. Nothing is written on error.
pub fn write_udp_headers(
    buf: &mut [u8],
    src: SocketAddr,
    dst: SocketAddr,
    payload_len: usize,
) -> Result<usize, Reject> {
    let headers = match (src.ip(), dst.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => IPV4_UDP_HEADERS,
        (IpAddr::V6(_), IpAddr::V6(_)) => IPV6_UDP_HEADERS,
        _ => return Err(Reject::FamilyMismatch),
    };
    let total = headers
        .checked_add(payload_len)
        .filter(|&t| t <= MAX_PACKET)
        .ok_or(Reject::BufferTooSmall)?;
    let pkt = buf.get_mut(..total).ok_or(Reject::BufferTooSmall)?;
    // Both fit in 16 bits: total <= 65535.
    let udp_len = (HEADER_LEN + payload_len) as u16;
    let (ip_hdr, rest) = pkt.split_at_mut(headers - HEADER_LEN);
    let Some((udp_hdr, payload)) = rest.split_first_chunk_mut::<HEADER_LEN>() else {
        return Err(Reject::BufferTooSmall);
    };
    let pseudo = match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let h = ip_hdr
                .first_chunk_mut::<{ ipv4::HEADER_LEN }>()
                .ok_or(Reject::BufferTooSmall)?;
            ipv4::emit_header(h, s, d, protocol::UDP, udp_len);
            checksum::pseudo_header_v4(s, d, protocol::UDP, udp_len)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let h = ip_hdr
                .first_chunk_mut::<{ ipv6::HEADER_LEN }>()
                .ok_or(Reject::BufferTooSmall)?;
            ipv6::emit_header(h, &s, &d, protocol::UDP, udp_len);
            checksum::pseudo_header_v6(&s, &d, protocol::UDP, u32::from(udp_len))
        }
        _ => return Err(Reject::FamilyMismatch),
    };
    let mut u = UdpPacket::new_unchecked(&mut *udp_hdr);
    u.set_src_port(src.port());
    u.set_dst_port(dst.port());
    u.set_len(udp_len);
    u.set_checksum(0);
    let sum = pseudo + checksum::sum_bytes(&udp_hdr[..]) + checksum::sum_bytes(payload);
    UdpPacket::new_unchecked(udp_hdr).set_checksum(nonzero(checksum::finish(sum)));
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::checksum::verify_transport_checksum;
    use crate::packet::testutil::*;
    use crate::packet::{Ipv4Packet, parse_ip};
    use proptest::prelude::*;

    /// Datagrams pass with a verifying checksum (IPv4's zero "none"
    /// included), fail with any flipped bit, a zero over IPv6, or a length
    /// field that moves the checksummed range.
    #[test]
    fn check_datagram_verifies_up_to_the_udp_length() {
        let v4 = udp_v4("10.0.0.9:5353", "1.1.1.1:53", b"query bytes");
        let v6 = udp_v6("[fd00::9]:5353", "[2001:db8::1]:53", b"odd");
        let mut rng = crate::packet::testutil::Rng::new(768);
        for p in [&v4, &v6] {
            let ip = parse_ip(p).expect("ip");
            let u = parse_udp(p, &ip).expect("udp");
            assert_eq!(check_datagram(p, &ip, &u), Ok(()));
            for _ in 0..200 {
                let mut q = p.clone();
                let at = ip.l4_offset + rng.below(ip.len - ip.l4_offset);
                q[at] ^= 1 << rng.below(8);
                let Ok(u) = parse_udp(&q, &ip) else { continue };
                assert_eq!(
                    check_datagram(&q, &ip, &u),
                    Err(Reject::UdpBadChecksum),
                    "flipped bit at {at}"
                );
            }
            let mut q = p.clone();
            q[ip.l4_offset + 6..ip.l4_offset + 8].copy_from_slice(&[0, 0]);
            let want = if ip.src.is_ipv4() {
                Ok(())
            } else {
                Err(Reject::UdpBadChecksum)
            };
            assert_eq!(check_datagram(&q, &ip, &u), want, "a zero checksum");
        }
        // Bytes after the UDP length (inside the IP payload) are not
        // covered, as Linux trims them before verifying.
        let mut p = udp_v4("10.0.0.9:5353", "1.1.1.1:53", b"abc");
        p.extend_from_slice(&[0xee; 5]);
        let p = set_ip_len(&p, p.len());
        let ip = parse_ip(&p).expect("ip");
        let u = parse_udp(&p, &ip).expect("udp");
        assert_eq!(u.payload_len, 3);
        assert_eq!(check_datagram(&p, &ip, &u), Ok(()));
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    fn build(src: SocketAddr, dst: SocketAddr, payload: &[u8], spare: usize) -> (Vec<u8>, usize) {
        let headers = if src.is_ipv4() {
            IPV4_UDP_HEADERS
        } else {
            IPV6_UDP_HEADERS
        };
        let mut buf = vec![0xa5; headers + payload.len() + spare];
        buf[headers..headers + payload.len()].copy_from_slice(payload);
        let n = write_udp_headers(&mut buf, src, dst, payload.len()).expect("fits");
        (buf, n)
    }

    fn check_round_trip(src: SocketAddr, dst: SocketAddr, payload: &[u8]) {
        let (buf, n) = build(src, dst, payload, 7);
        let ip = parse_ip(&buf).expect("valid ip");
        assert_eq!((ip.src, ip.dst, ip.len), (src.ip(), dst.ip(), n));
        assert_eq!(ip.protocol, protocol::UDP);
        let u = parse_udp(&buf, &ip).expect("valid udp");
        assert_eq!((u.src_port, u.dst_port), (src.port(), dst.port()));
        assert_eq!(
            &buf[u.payload_offset..u.payload_offset + u.payload_len],
            payload
        );
        assert!(verify_transport_checksum(&buf, &ip));
        assert_ne!(UdpPacket::new_unchecked(&buf[ip.l4_offset..]).checksum(), 0);
        // Same bytes as the independent test builder.
        let reference = if src.is_ipv4() {
            assert!(Ipv4Packet::new_unchecked(&buf[..]).verify_checksum());
            udp_v4(&src.to_string(), &dst.to_string(), payload)
        } else {
            udp_v6(&src.to_string(), &dst.to_string(), payload)
        };
        assert_eq!(&buf[..n], &reference[..]);
    }

    #[test]
    fn dns_query_v4_and_v6() {
        let query = dns_query();
        check_round_trip(sa("198.18.0.1:53"), sa("10.0.0.9:53000"), &query);
        check_round_trip(sa("[fd00::1]:53"), sa("[fd00::9]:53000"), &query);
        check_round_trip(sa("10.0.0.1:1"), sa("10.0.0.2:2"), b"");
        check_round_trip(sa("10.0.0.1:1"), sa("10.0.0.2:2"), b"odd");
    }

    proptest! {
        #[test]
        fn builder_round_trips(
            v6 in any::<bool>(), a in any::<u128>(), b in any::<u128>(),
            sp in any::<u16>(), dp in any::<u16>(),
            payload in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            let (src, dst): (SocketAddr, SocketAddr) = if v6 {
                ((std::net::Ipv6Addr::from(a), sp).into(), (std::net::Ipv6Addr::from(b), dp).into())
            } else {
                ((std::net::Ipv4Addr::from(a as u32), sp).into(), (std::net::Ipv4Addr::from(b as u32), dp).into())
            };
            check_round_trip(src, dst, &payload);
        }
    }

    /// A datagram whose checksum computes to 0 is sent with 0xFFFF.
    #[test]
    fn zero_checksum_sent_as_ffff() {
        for (src, dst) in [
            (sa("10.0.0.1:1000"), sa("10.0.0.2:2000")),
            (sa("[fd00::1]:1000"), sa("[fd00::2]:2000")),
        ] {
            let (probe, _) = build(src, dst, &[0, 0], 0);
            let ip = parse_ip(&probe).expect("valid");
            // Put the probe's checksum into the payload: the new sum is
            // 0xFFFF and its complement 0.
            let c = UdpPacket::new_unchecked(&probe[ip.l4_offset..]).checksum();
            let (buf, _) = build(src, dst, &c.to_be_bytes(), 0);
            assert_eq!(
                UdpPacket::new_unchecked(&buf[ip.l4_offset..]).checksum(),
                0xffff
            );
            assert!(verify_transport_checksum(&buf, &ip));
        }
    }

    #[test]
    fn builder_errors() {
        let mut buf = [0u8; 100];
        assert_eq!(
            write_udp_headers(&mut buf, sa("10.0.0.1:1"), sa("[::1]:1"), 0),
            Err(Reject::FamilyMismatch)
        );
        assert_eq!(
            write_udp_headers(&mut buf, sa("10.0.0.1:1"), sa("10.0.0.2:1"), 73),
            Err(Reject::BufferTooSmall)
        );
        assert_eq!(
            write_udp_headers(&mut buf, sa("10.0.0.1:1"), sa("10.0.0.2:1"), 72),
            Ok(100)
        );
        assert_eq!(
            write_udp_headers(&mut buf, sa("[::1]:1"), sa("[::2]:1"), 53),
            Err(Reject::BufferTooSmall)
        );
        assert_eq!(
            write_udp_headers(&mut buf, sa("[::1]:1"), sa("[::2]:1"), usize::MAX),
            Err(Reject::BufferTooSmall)
        );
        let mut big = vec![0u8; 70_000];
        assert_eq!(
            write_udp_headers(&mut big, sa("10.0.0.1:1"), sa("10.0.0.2:1"), 65_535 - 28),
            Ok(65_535)
        );
        assert_eq!(
            write_udp_headers(&mut big, sa("10.0.0.1:1"), sa("10.0.0.2:1"), 65_535 - 27),
            Err(Reject::BufferTooSmall)
        );
        assert_eq!(
            write_udp_headers(&mut big, sa("[::1]:1"), sa("[::2]:1"), 65_535 - 47),
            Err(Reject::BufferTooSmall)
        );
    }

    #[test]
    fn parse_checks() {
        let p = udp_v6("[fd00::9]:5353", "[fd00::1]:53", b"abcdef");
        let ip = parse_ip(&p).expect("valid");
        for n in 0..HEADER_LEN {
            let cut = set_ip_len(&p, ip.l4_offset + n);
            let cip = parse_ip(&cut).expect("ip valid");
            assert_eq!(parse_udp(&cut, &cip), Err(Reject::UdpTruncated), "len {n}");
        }
        for bad in [0u16, 1, 7, 15] {
            let mut b = p.clone();
            b[ip.l4_offset + 4..ip.l4_offset + 6].copy_from_slice(&bad.to_be_bytes());
            assert_eq!(
                parse_udp(&b, &ip),
                Err(Reject::UdpBadLength),
                "len field {bad}"
            );
        }
        // A length field shorter than the IP payload: trailing bytes ignored.
        let mut b = p.clone();
        b[ip.l4_offset + 4..ip.l4_offset + 6].copy_from_slice(&10u16.to_be_bytes());
        let u = parse_udp(&b, &ip).expect("valid");
        assert_eq!((u.payload_offset, u.payload_len), (48, 2));
        let t = tcp_v4("10.0.0.1:1", "10.0.0.2:2", 0, 0, 2, &[], b"");
        let tip = parse_ip(&t).expect("valid");
        assert_eq!(parse_udp(&t, &tip), Err(Reject::UnsupportedProtocol));
    }
}
