//! ICMP / ICMPv6 echo view (RFC 792, RFC 4443 4.1-4.2), the in-place
//! echo reply, and the "port unreachable" error that answers a refused
//! datagram ([`port_unreachable`]).

use std::net::IpAddr;

use super::checksum::{finish, nonzero, overwrite, pseudo_header_v6, replaced, sum_bytes, update};
use super::{DEFAULT_TTL, IpInfo, Reject, ipv4, ipv6, protocol};

/// Field offsets of an echo request/reply, identical in ICMP (RFC 792) and
/// ICMPv6 (RFC 4443 4.1).
pub mod field {
    use std::ops::Range;

    pub const TYPE: usize = 0;
    pub const CODE: usize = 1;
    /// Type and code together: the word the reply rewrites.
    pub const TYPE_CODE: Range<usize> = 0..2;
    pub const CHECKSUM: Range<usize> = 2..4;
    pub const IDENT: Range<usize> = 4..6;
    pub const SEQ: Range<usize> = 6..8;
}

/// Length of the echo header (type, code, checksum, identifier, sequence).
pub const ECHO_HEADER_LEN: usize = field::SEQ.end;

/// ICMP message types used here.
pub mod types {
    /// ICMPv4 echo reply (RFC 792).
    pub const ECHO_REPLY_V4: u8 = 0;
    /// ICMPv4 echo request (RFC 792).
    pub const ECHO_REQUEST_V4: u8 = 8;
    /// ICMPv6 echo request (RFC 4443 4.1).
    pub const ECHO_REQUEST_V6: u8 = 128;
    /// ICMPv6 echo reply (RFC 4443 4.2).
    pub const ECHO_REPLY_V6: u8 = 129;
    /// ICMPv4 destination unreachable (RFC 792).
    pub const UNREACHABLE_V4: u8 = 3;
    /// ICMPv6 destination unreachable (RFC 4443 3.1).
    pub const UNREACHABLE_V6: u8 = 1;
    /// ICMPv4 code "port unreachable" (RFC 792).
    pub const PORT_UNREACHABLE_V4: u8 = 3;
    /// ICMPv6 code "port unreachable" (RFC 4443 3.1).
    pub const PORT_UNREACHABLE_V6: u8 = 4;
}

/// Length of an error message's header: type, code, checksum and 4 unused
/// bytes (RFC 792, RFC 4443 3.1), then the quoted packet.
pub const ERROR_HEADER_LEN: usize = 8;

/// The longest ICMPv4 error written: the quote is as much of the refused
/// packet as fits in 576 bytes in all (RFC 1812 4.3.2.3; every IPv4 host
/// takes 576-byte datagrams, RFC 791), at least its IP header and 8 bytes
/// (RFC 792), which hold the UDP ports a socket is found by.
pub const ERROR_MAX_V4: usize = 576;

/// The longest ICMPv6 error written: as much of the refused packet as fits
/// in the IPv6 minimum MTU (RFC 4443 2.4(c)).
pub const ERROR_MAX_V6: usize = 1280;

header_view! {
    /// A read/write view of an ICMP echo header over a buffer (the ICMP
    /// message).
    pub struct IcmpPacket, at least ECHO_HEADER_LEN bytes;
    pub msg_type, set_msg_type: u8 = field::TYPE;
    pub code: u8 = field::CODE;
    pub checksum, set_checksum: u16 = field::CHECKSUM;
    pub ident: u16 = field::IDENT;
    pub seq: u16 = field::SEQ;
}

impl<T: AsRef<[u8]>> IcmpPacket<T> {
    /// Wraps an untrusted message after checking the 8-byte echo header is
    /// present.
    pub fn new_checked(buffer: T) -> Result<Self, Reject> {
        if buffer.as_ref().len() < ECHO_HEADER_LEN {
            return Err(Reject::IcmpTruncated);
        }
        Ok(IcmpPacket { buffer })
    }
}

/// Turns an ICMPv4 echo request (type 8, code 0) or ICMPv6 echo request
/// (type 128, code 0) into its reply in place and returns the length to
/// write back (`ip.len`).
///
/// Addresses are swapped and the type becomes 0 / 129; identifier,
/// sequence and data stay, as RFC 792 and RFC 4443 4.2 require. The ICMP
/// checksum is updated incrementally (RFC 1624 eqn. 3) for the type word
/// only: ICMPv4 has no pseudo-header, and the ICMPv6 pseudo-header (RFC 4443
/// 2.3) sums both addresses, which a swap leaves unchanged. TTL / hop limit
/// is reset to 64; the IPv4 header checksum takes the TTL word's delta (the
/// address swap again leaves it unchanged). IPv4 options and IPv6 extension
/// headers are kept as they are.
///
/// `Err(UnsupportedProtocol)` if `ip` is not ICMP of the packet's family,
/// `Err(IcmpTruncated)` below 8 bytes, `Err(IcmpNotEchoRequest)` for any
/// other message. The caller checks the destination is the gateway.
pub fn echo_reply_in_place(buf: &mut [u8], ip: &IpInfo) -> Result<usize, Reject> {
    let pkt = buf.get_mut(..ip.len).ok_or(Reject::BufferTooSmall)?;
    let version = pkt.first().map(|b| b >> 4);
    let (hdr, msg) = pkt
        .split_at_mut_checked(ip.l4_offset)
        .ok_or(Reject::IcmpTruncated)?;
    let (want_proto, request, reply) = match version {
        Some(4) => (protocol::ICMP, types::ECHO_REQUEST_V4, types::ECHO_REPLY_V4),
        Some(6) => (
            protocol::ICMPV6,
            types::ECHO_REQUEST_V6,
            types::ECHO_REPLY_V6,
        ),
        _ => return Err(Reject::BadVersion),
    };
    if ip.protocol != want_proto {
        return Err(Reject::UnsupportedProtocol);
    }
    let icmp = msg
        .first_chunk_mut::<ECHO_HEADER_LEN>()
        .ok_or(Reject::IcmpTruncated)?;
    let view = IcmpPacket::new_unchecked(&*icmp);
    if view.msg_type() != request || view.code() != 0 {
        return Err(Reject::IcmpNotEchoRequest);
    }
    let old_sum = view.checksum();
    // Check the IP header fits before writing anything.
    match version {
        Some(4) => {
            let h = hdr
                .first_chunk_mut::<{ ipv4::HEADER_LEN }>()
                .ok_or(Reject::Ipv4BadHeaderLength)?;
            let ttl_word = [DEFAULT_TTL, h[ipv4::field::PROTOCOL]];
            let delta = overwrite(&mut h[ipv4::field::TTL..=ipv4::field::PROTOCOL], &ttl_word);
            let (s, d) = h[ipv4::field::ADDRS].split_at_mut(4);
            s.swap_with_slice(d);
            let mut v = ipv4::Ipv4Packet::new_unchecked(h);
            let hc = update(v.checksum(), delta);
            v.set_checksum(hc);
        }
        _ => {
            let h = hdr
                .first_chunk_mut::<{ ipv6::HEADER_LEN }>()
                .ok_or(Reject::Ipv6Truncated)?;
            h[ipv6::field::HOP_LIMIT] = DEFAULT_TTL;
            let (s, d) = h[ipv6::field::ADDRS].split_at_mut(16);
            s.swap_with_slice(d);
        }
    }
    let delta = replaced(&icmp[field::TYPE_CODE], &[reply, 0]);
    let mut v = IcmpPacket::new_unchecked(icmp);
    v.set_msg_type(reply);
    // Through `nonzero`: a reply whose words are all zero (id, sequence
    // and data) would otherwise get 0x0000, which receivers reject.
    v.set_checksum(nonzero(update(old_sum, delta)));
    Ok(ip.len)
}

/// Writes into `out` the ICMP "destination unreachable, port unreachable"
/// error answering the packet `orig` (parsed as `ip`) and returns its
/// length: from the address the packet was sent to, back to its sender,
/// quoting the packet's start (its IP header and as much after it as
/// [`ERROR_MAX_V4`] / [`ERROR_MAX_V6`] allow, and `out` holds). This is what
/// a host with no socket on the port answers, and what a connected UDP
/// socket reports as `ECONNREFUSED` (Linux, Darwin, Android alike), the
/// error a refused TCP connection gives too.
///
/// Checksums are computed in full: the IPv4 header's, the ICMPv4 message's
/// (no pseudo-header, RFC 792), the ICMPv6 message's over its pseudo-header
/// (RFC 4443 2.3). The IP header is [`ipv4::emit_header`]'s or
/// [`ipv6::emit_header`]'s (TTL 64; IPv4 with DF, atomic at 576 bytes).
///
/// `None`, and nothing to send, where no error may be sent (RFC 1122
/// 3.2.2, RFC 4443 2.4(e)): for an ICMP packet (errors never answer
/// errors; nothing here refuses ICMP), a packet to a multicast or the
/// limited broadcast address, a packet from an address that names no
/// single host (unspecified, multicast, broadcast, loopback), or when `out`
/// cannot hold the headers, the refused packet's IP header and 8 bytes.
/// Subnet broadcasts are not known here; the engine routes only unicast
/// destinations into the TUN. Never panics, never allocates.
pub fn port_unreachable(orig: &[u8], ip: &IpInfo, out: &mut [u8]) -> Option<usize> {
    if matches!(ip.protocol, protocol::ICMP | protocol::ICMPV6) {
        return None;
    }
    let orig = orig.get(..ip.len)?;
    let (outer, max) = match (ip.src, ip.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let bad_src = s.is_unspecified() || s.is_multicast() || s.is_broadcast();
            if bad_src || s.is_loopback() || d.is_multicast() || d.is_broadcast() {
                return None;
            }
            (ipv4::HEADER_LEN, ERROR_MAX_V4)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            if s.is_unspecified() || s.is_multicast() || s.is_loopback() || d.is_multicast() {
                return None;
            }
            (ipv6::HEADER_LEN, ERROR_MAX_V6)
        }
        _ => return None,
    };
    let headers = outer + ERROR_HEADER_LEN;
    let room = max.min(out.len()).checked_sub(headers)?;
    // RFC 792: the IP header and the first 64 bits of its payload at least.
    if room < ip.l4_offset + 8 || orig.len() < ip.l4_offset + 8 {
        return None;
    }
    let quote = orig.len().min(room);
    let total = headers + quote;
    // Lengths below 1280: they fit every field.
    let msg_len = (ERROR_HEADER_LEN + quote) as u16;
    let (hdr, rest) = out.get_mut(..total)?.split_at_mut(outer);
    let (icmp, quoted) = rest.split_at_mut(ERROR_HEADER_LEN);
    quoted.copy_from_slice(&orig[..quote]);
    icmp.fill(0);
    let pseudo = match (ip.src, ip.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let h = hdr.first_chunk_mut::<{ ipv4::HEADER_LEN }>()?;
            ipv4::emit_header(h, d, s, protocol::ICMP, msg_len);
            icmp[field::TYPE] = types::UNREACHABLE_V4;
            icmp[field::CODE] = types::PORT_UNREACHABLE_V4;
            0
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let h = hdr.first_chunk_mut::<{ ipv6::HEADER_LEN }>()?;
            ipv6::emit_header(h, &d, &s, protocol::ICMPV6, msg_len);
            icmp[field::TYPE] = types::UNREACHABLE_V6;
            icmp[field::CODE] = types::PORT_UNREACHABLE_V6;
            pseudo_header_v6(&d, &s, protocol::ICMPV6, u32::from(msg_len))
        }
        _ => return None,
    };
    let sum = pseudo + sum_bytes(icmp) + sum_bytes(quoted);
    icmp[field::CHECKSUM].copy_from_slice(&finish(sum).to_be_bytes());
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::checksum::{compute_transport_checksum, verify_transport_checksum};
    use crate::packet::testutil::*;
    use crate::packet::{Ipv4Packet, parse_ip};

    fn check_reply(req: &[u8]) {
        let ip = parse_ip(req).expect("valid");
        assert!(verify_transport_checksum(req, &ip));
        let mut b = req.to_vec();
        b.extend_from_slice(&[0xee; 3]); // trailing bytes stay untouched
        let n = echo_reply_in_place(&mut b, &ip).expect("echo request");
        assert_eq!(n, req.len());
        assert_eq!(b[n..], [0xee; 3]);
        let rip = parse_ip(&b[..n]).expect("reply valid");
        assert_eq!((rip.src, rip.dst), (ip.dst, ip.src));
        assert_eq!((rip.l4_offset, rip.protocol), (ip.l4_offset, ip.protocol));
        // The incremental checksum equals a full recomputation.
        assert!(verify_transport_checksum(&b[..n], &rip));
        let stored = IcmpPacket::new_unchecked(&b[rip.l4_offset..]).checksum();
        let full = compute_transport_checksum(&b[..n], &rip).map(nonzero);
        assert_eq!(Some(stored), full);
        let v = IcmpPacket::new_unchecked(&b[rip.l4_offset..]);
        let q = IcmpPacket::new_unchecked(&req[ip.l4_offset..]);
        assert_eq!((v.code(), v.ident(), v.seq()), (0, q.ident(), q.seq()));
        assert_eq!(b[rip.l4_offset + 8..n], req[ip.l4_offset + 8..]);
        if ip.src.is_ipv4() {
            assert_eq!(v.msg_type(), types::ECHO_REPLY_V4);
            let h = Ipv4Packet::new_unchecked(&b[..]);
            assert_eq!(h.ttl(), 64);
            assert!(h.verify_checksum());
        } else {
            assert_eq!(v.msg_type(), types::ECHO_REPLY_V6);
            assert_eq!(b[7], 64);
        }
    }

    #[test]
    fn echo_replies_verify() {
        let mut rng = Rng::new(792);
        // Under Miri (CI, .ci/run) 500 rounds took most of its packet tests'
        // time; 25 still cover both families and the extension header.
        let rounds = if cfg!(miri) { 25 } else { 500 };
        for i in 0..rounds {
            let len = rng.below(200);
            let data: Vec<u8> = (0..len).map(|_| rng.byte()).collect();
            let src = format!("10.{}.{}.{}", rng.byte(), rng.byte(), rng.byte());
            let mut v4 = icmp_echo_v4(&src, "198.18.0.1", types::ECHO_REQUEST_V4, &data);
            v4[8] = rng.byte(); // any incoming TTL
            fix_ipv4_header_checksum(&mut v4);
            check_reply(&v4);
            let src6 = format!("fd00::{:x}:{:x}", rng.byte(), i);
            let ext: &[ExtHdr] = if i % 3 == 0 {
                &[ExtHdr::DestOpts { units: 1 }]
            } else {
                &[]
            };
            let mut v6 = icmp_echo_v6(&src6, "fd00::1", ext, types::ECHO_REQUEST_V6, &data);
            v6[7] = rng.byte();
            check_reply(&v6);
        }
    }

    /// An echo request whose id, sequence and data are all zero: the reply
    /// covers nothing but zeros, and its checksum must be 0xFFFF (RFC 1624
    /// eqn. 3 alone gives 0x0000, which the kernel rejects). Found by the
    /// `packet` fuzz target.
    #[test]
    fn an_all_zero_echo_reply_verifies() {
        let mut req = [
            0x45, 0x02, 0x00, 0x22, 0x00, 0x00, 0x40, 0x00, 0x40, 0x01, 0x6a, 0xa5, 0x0a, 0x00,
            0x3b, 0x09, 0xc6, 0x12, 0x00, 0x01, 0x08, 0x00, 0xf7, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0,
        ];
        fix_ipv4_header_checksum(&mut req);
        check_reply(&req);
        let mut b = req.to_vec();
        let ip = parse_ip(&req).expect("valid");
        echo_reply_in_place(&mut b, &ip).expect("echo request");
        assert_eq!(IcmpPacket::new_unchecked(&b[20..]).checksum(), 0xffff);
    }

    #[test]
    fn only_echo_requests() {
        for (t, code) in [(0u8, 0u8), (3, 1), (8, 1), (13, 0)] {
            let mut p = icmp_echo_v4("10.0.0.9", "198.18.0.1", t, b"x");
            p[21] = code;
            let ip = parse_ip(&p).expect("valid");
            assert_eq!(
                echo_reply_in_place(&mut p, &ip),
                Err(Reject::IcmpNotEchoRequest),
                "{t}/{code}"
            );
        }
        for t in [129u8, 1, 135, 8] {
            let mut p = icmp_echo_v6("fd00::9", "fd00::1", &[], t, b"x");
            let ip = parse_ip(&p).expect("valid");
            assert_eq!(
                echo_reply_in_place(&mut p, &ip),
                Err(Reject::IcmpNotEchoRequest),
                "{t}"
            );
        }
        // ICMPv4 inside IPv6 and a non-ICMP packet.
        let mut p = ipv6_packet(
            "fd00::9",
            "fd00::1",
            &[],
            protocol::ICMP,
            &[8, 0, 0, 0, 0, 0, 0, 0],
        );
        let ip = parse_ip(&p).expect("valid");
        assert_eq!(
            echo_reply_in_place(&mut p, &ip),
            Err(Reject::UnsupportedProtocol)
        );
        let mut p = udp_v4("10.0.0.9:1", "198.18.0.1:2", b"");
        let ip = parse_ip(&p).expect("valid");
        assert_eq!(
            echo_reply_in_place(&mut p, &ip),
            Err(Reject::UnsupportedProtocol)
        );
    }

    #[test]
    fn truncated_at_every_length() {
        for p in [
            icmp_echo_v4("10.0.0.9", "198.18.0.1", 8, b""),
            icmp_echo_v6("fd00::9", "fd00::1", &[], 128, b""),
        ] {
            let l4 = parse_ip(&p).expect("valid").l4_offset;
            for n in 0..ECHO_HEADER_LEN {
                let mut cut = set_ip_len(&p, l4 + n);
                let ip = parse_ip(&cut).expect("ip valid");
                let before = cut.clone();
                assert_eq!(
                    echo_reply_in_place(&mut cut, &ip),
                    Err(Reject::IcmpTruncated)
                );
                assert_eq!(cut, before, "nothing written on error");
            }
        }
    }

    /// The error parses, both checksums verify (recomputed from scratch by
    /// `reference_sum`, not by the builder's own sums), it goes from the
    /// refused packet's destination to its source, and it quotes the
    /// packet's first bytes, as many as the family's limit allows.
    fn check_unreachable(orig: &[u8]) -> Vec<u8> {
        let ip = parse_ip(orig).expect("valid");
        let mut out = vec![0x5a; ERROR_MAX_V6 + 7];
        let n = port_unreachable(orig, &ip, &mut out).expect("answered");
        assert!(out[n..].iter().all(|&b| b == 0x5a), "nothing past n");
        let e = &out[..n];
        let eip = parse_ip(e).expect("error parses");
        assert_eq!((eip.src, eip.dst, eip.len), (ip.dst, ip.src, n));
        let msg = &e[eip.l4_offset..];
        let (max, want) = if ip.src.is_ipv4() {
            assert_eq!(eip.protocol, protocol::ICMP);
            assert!(Ipv4Packet::new_unchecked(e).verify_checksum());
            assert!(Ipv4Packet::new_unchecked(e).dont_frag());
            // ICMPv4: no pseudo-header.
            assert_eq!(reference_sum(msg), 0xffff, "ICMPv4 checksum");
            (ERROR_MAX_V4, [3, 3])
        } else {
            assert_eq!(eip.protocol, protocol::ICMPV6);
            let mut pseudo = Vec::new();
            for a in [eip.src, eip.dst] {
                if let IpAddr::V6(a) = a {
                    pseudo.extend_from_slice(&a.octets());
                }
            }
            pseudo.extend_from_slice(&(msg.len() as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, protocol::ICMPV6]);
            pseudo.extend_from_slice(msg);
            assert_eq!(reference_sum(&pseudo), 0xffff, "ICMPv6 checksum");
            (ERROR_MAX_V6, [1, 4])
        };
        assert_eq!(msg[..2], want, "type, code");
        assert_eq!(msg[4..8], [0; 4], "unused");
        let quote = &msg[ERROR_HEADER_LEN..];
        assert_eq!(
            quote.len(),
            ip.len.min(max - eip.l4_offset - ERROR_HEADER_LEN)
        );
        assert_eq!(quote, &orig[..quote.len()]);
        assert!(verify_transport_checksum(e, &eip));
        e.to_vec()
    }

    #[test]
    fn port_unreachable_quotes_and_verifies() {
        let mut rng = Rng::new(4443);
        // Under Miri a few rounds (both lengths, both families): 300 took
        // 453 s there.
        let rounds = if cfg!(miri) { 8 } else { 300 };
        for i in 0..rounds {
            // Short datagrams are quoted whole, long ones cut at the limit
            // (576 / 1280 bytes in all).
            let len = if i % 4 == 0 {
                1200 + rng.below(300)
            } else {
                rng.below(600)
            };
            let data: Vec<u8> = (0..len).map(|_| rng.byte()).collect();
            let src = format!(
                "10.{}.{}.{}:{}",
                rng.byte(),
                rng.byte(),
                1 + rng.byte() % 200,
                1024 + i
            );
            let v4 = udp_v4(&src, "203.0.113.9:443", &data);
            let e = check_unreachable(&v4);
            assert!(e.len() <= ERROR_MAX_V4);
            let src6 = format!("[fd00::{:x}:{:x}]:{}", rng.byte(), i, 1024 + i);
            let v6 = udp_v6(&src6, "[2001:db8::9]:443", &data);
            let e = check_unreachable(&v6);
            assert!(e.len() <= ERROR_MAX_V6);
        }
        // With IPv4 options: the whole header and 8 bytes at least.
        let opts = [1u8; 40];
        let p = ipv4_packet_with_options(
            "10.0.0.2",
            "203.0.113.9",
            &opts,
            17,
            &udp_segment(5, 6, b"x"),
        );
        check_unreachable(&p);
    }

    #[test]
    fn port_unreachable_refuses_where_rfcs_forbid() {
        let mut out = [0u8; ERROR_MAX_V6];
        for (src, dst) in [
            ("10.0.0.2:5", "224.0.0.251:5353"),
            ("10.0.0.2:5", "255.255.255.255:67"),
            ("0.0.0.0:68", "203.0.113.9:67"),
            ("127.0.0.1:5", "203.0.113.9:67"),
            ("[fd00::2]:5", "[ff02::fb]:5353"),
            ("[::]:5", "[2001:db8::9]:5"),
            ("[::1]:5", "[2001:db8::9]:5"),
        ] {
            let p = if src.starts_with('[') {
                udp_v6(src, dst, b"q")
            } else {
                udp_v4(src, dst, b"q")
            };
            let ip = parse_ip(&p).expect("valid");
            assert_eq!(port_unreachable(&p, &ip, &mut out), None, "{src} -> {dst}");
        }
        // Errors never answer ICMP.
        let p = icmp_echo_v4("10.0.0.9", "203.0.113.9", 8, b"x");
        let ip = parse_ip(&p).expect("valid");
        assert_eq!(port_unreachable(&p, &ip, &mut out), None);
        // An output buffer that cannot hold the IP header and 8 bytes.
        let p = udp_v4("10.0.0.2:5", "203.0.113.9:6", &[7; 100]);
        let ip = parse_ip(&p).expect("valid");
        let need = 20 + ERROR_HEADER_LEN + 20 + 8;
        assert_eq!(port_unreachable(&p, &ip, &mut out[..need - 1]), None);
        let n = port_unreachable(&p, &ip, &mut out[..need]).expect("minimal quote");
        assert_eq!(n, need);
    }
}
