//! TCP header view (RFC 9293 3.1), the in-place NAT rewrite, and the RST
//! reply.

use std::net::{IpAddr, SocketAddr};

use super::checksum::{self, nonzero, overwrite, update};
use super::{IpInfo, Reject, ipv4, ipv6, protocol};

/// Field offsets of the TCP header (RFC 9293 3.1).
pub mod field {
    use std::ops::Range;

    pub const SRC_PORT: Range<usize> = 0..2;
    pub const DST_PORT: Range<usize> = 2..4;
    /// Both ports: the words a NAT rewrite replaces.
    pub const PORTS: Range<usize> = 0..4;
    pub const SEQ: Range<usize> = 4..8;
    pub const ACK: Range<usize> = 8..12;
    /// Data offset in 32-bit words (high nibble).
    pub const DATA_OFF: usize = 12;
    pub const FLAGS: usize = 13;
    pub const WINDOW: Range<usize> = 14..16;
    pub const CHECKSUM: Range<usize> = 16..18;
    pub const URGENT: Range<usize> = 18..20;
}

/// Length of a TCP header without options (data offset 5).
pub const HEADER_LEN: usize = field::URGENT.end;

/// Control bits, the flags octet of RFC 9293 3.1 (CWR and ECE from RFC 3168).
pub mod flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
    pub const URG: u8 = 0x20;
    pub const ECE: u8 = 0x40;
    pub const CWR: u8 = 0x80;
}

header_view! {
    /// A read/write view of a TCP header over a buffer (the transport segment).
    pub struct TcpPacket, at least HEADER_LEN bytes;
    pub src_port, set_src_port: u16 = field::SRC_PORT;
    pub dst_port, set_dst_port: u16 = field::DST_PORT;
    pub seq_number, set_seq_number: u32 = field::SEQ;
    pub ack_number, set_ack_number: u32 = field::ACK;
    pub flags, set_flags: u8 = field::FLAGS;
    pub window, set_window: u16 = field::WINDOW;
    pub checksum, set_checksum: u16 = field::CHECKSUM;
    pub urgent, set_urgent: u16 = field::URGENT;
}

impl<T: AsRef<[u8]>> TcpPacket<T> {
    /// Wraps an untrusted segment (exactly the IP payload) after checking
    /// the 20-byte header is present and 5 <= data offset <= segment length
    /// in words. After this no accessor can panic.
    pub fn new_checked(buffer: T) -> Result<Self, Reject> {
        let b = buffer.as_ref();
        let Some(hdr) = b.first_chunk::<HEADER_LEN>() else {
            return Err(Reject::TcpTruncated);
        };
        let header_len = TcpPacket::new_unchecked(hdr).header_len();
        if header_len < HEADER_LEN || header_len > b.len() {
            return Err(Reject::TcpBadDataOffset);
        }
        Ok(TcpPacket { buffer })
    }

    /// Header length in bytes (data offset * 4).
    pub fn header_len(&self) -> usize {
        usize::from(self.buffer.as_ref()[field::DATA_OFF] >> 4) * 4
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> TcpPacket<T> {
    /// Sets the data offset from a header length in bytes (a multiple of 4)
    /// and clears the reserved bits.
    pub fn set_header_len(&mut self, len: usize) {
        self.buffer.as_mut()[field::DATA_OFF] = (((len / 4) as u8) & 0x0f) << 4;
    }
}

/// Summary of a validated TCP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpInfo {
    pub src_port: u16,
    pub dst_port: u16,
    pub seq: u32,
    pub ack: u32,
    /// The flags octet; see [`flags`].
    pub flags: u8,
    /// Header length in bytes, options included.
    pub header_len: usize,
    pub payload_len: usize,
}

impl TcpInfo {
    /// SYN set and ACK clear: a connection request (or its retransmit),
    /// never part of an established flow.
    pub fn is_syn_only(&self) -> bool {
        self.flags & (flags::SYN | flags::ACK) == flags::SYN
    }
}

/// Whether `flags` is a combination of control bits some TCP endpoint
/// sends. PSH, ECE and CWR may go with anything; of SYN, FIN, RST, ACK and
/// URG only these pass: SYN (URG), SYN+ACK, RST, RST+ACK, FIN+ACK (URG),
/// ACK (URG). No flags at all (a "null scan"), SYN+FIN, SYN+RST, FIN
/// without ACK ("FIN scan", "Xmas") and the like are no TCP endpoint's
/// output: they come from scanners and crafted packets, and a stack
/// behind a stateful firewall never sees them.
#[inline]
pub const fn valid_flags(f: u8) -> bool {
    use flags::*;
    const SYN_URG: u8 = SYN | URG;
    const SYN_ACK: u8 = SYN | ACK;
    const RST_ACK: u8 = RST | ACK;
    const FIN_ACK: u8 = FIN | ACK;
    const FIN_ACK_URG: u8 = FIN | ACK | URG;
    const ACK_URG: u8 = ACK | URG;
    matches!(
        f & !(PSH | ECE | CWR),
        SYN | SYN_URG | SYN_ACK | RST | RST_ACK | FIN_ACK | FIN_ACK_URG | ACK | ACK_URG
    )
}

/// [`check_segment`] without the checksum: the control bits only.
#[inline]
pub fn check_flags(tcp: &TcpInfo) -> Result<(), Reject> {
    if valid_flags(tcp.flags) {
        Ok(())
    } else {
        Err(Reject::TcpBadFlags)
    }
}

/// The uplink's check of a segment from the app, before it may create a
/// flow or reach an outbound: valid control bits ([`valid_flags`], else
/// [`Reject::TcpBadFlags`]), then the checksum over pseudo-header and
/// segment ([`Reject::TcpBadChecksum`]). `tcp` must come from [`parse_tcp`]
/// on this buffer. The kernel listener's own segments (the system stack's
/// downlink) skip it: they come from the local TCP, checksummed.
#[inline]
pub fn check_segment(buf: &[u8], ip: &IpInfo, tcp: &TcpInfo) -> Result<(), Reject> {
    check_flags(tcp)?;
    if !checksum::verify_segment(buf, ip, ip.len) {
        return Err(Reject::TcpBadChecksum);
    }
    Ok(())
}

/// What the headers the kernel saved for a listener's connection
/// (`TCP_SAVED_SYN`: the IP header, IPv6 extension headers, then the TCP
/// header) say about the SYN that opened it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SavedSyn {
    /// Nothing was saved: a SYN cookie completed the handshake (the
    /// listener's SYN queue was full), or the listener lacks the option.
    Missing,
    /// The SYN's initial sequence number.
    Isn(u32),
    /// Something was saved that does not read as a TCP SYN: too short,
    /// another IP version or protocol, an extension-header chain that does
    /// not walk (cut short, a fragment, ESP, a routing header with segments
    /// left), or a segment without SYN. The kernel saves no such thing for
    /// the app's rewritten SYN, so the connection is not the app's.
    Unreadable,
}

/// Read the SYN the kernel saved for a listener's connection. IPv6
/// extension headers are walked as for a live packet
/// ([`ipv6::walk_extension_headers`]); the bytes are headers only (the
/// IPv6 payload length counts a payload that is not there), so the walk is
/// bounded by what was saved.
pub fn saved_syn(headers: &[u8]) -> SavedSyn {
    let Some(&first) = headers.first() else {
        return SavedSyn::Missing;
    };
    let tcp_at = match first >> 4 {
        4 => {
            let ihl = usize::from(first & 0x0f) * 4;
            if ihl < ipv4::HEADER_LEN || headers.get(ipv4::field::PROTOCOL) != Some(&protocol::TCP)
            {
                return SavedSyn::Unreadable;
            }
            ihl
        }
        6 => {
            let Some(&next) = headers.get(ipv6::field::NEXT_HEADER) else {
                return SavedSyn::Unreadable;
            };
            match ipv6::walk_extension_headers(headers, next) {
                Ok((protocol::TCP, at)) => at,
                _ => return SavedSyn::Unreadable,
            }
        }
        _ => return SavedSyn::Unreadable,
    };
    let Some(tcp) = headers.get(tcp_at..tcp_at + HEADER_LEN) else {
        return SavedSyn::Unreadable;
    };
    if tcp[field::FLAGS] & flags::SYN == 0 {
        return SavedSyn::Unreadable;
    }
    let seq = &tcp[field::SEQ];
    SavedSyn::Isn(u32::from_be_bytes([seq[0], seq[1], seq[2], seq[3]]))
}

/// The IP and TCP headers of a TCP segment carried without IPv4 options
/// or IPv6 extension headers ([`parse_plain_tcp`]): the only segments the
/// write-back merges or holds (`coalesce`, `ackthin`). Parsed once per
/// segment and handed to both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlainTcp {
    pub ip: IpInfo,
    pub tcp: TcpInfo,
}

/// The headers of a TCP segment carried without IPv4 options or IPv6
/// extension headers; `None` for anything else, malformed input included.
#[inline]
pub fn parse_plain_tcp(pkt: &[u8]) -> Option<PlainTcp> {
    let ip = super::parse_ip(pkt).ok()?;
    let plain_l4 = if ip.src.is_ipv4() {
        ipv4::HEADER_LEN
    } else {
        ipv6::HEADER_LEN
    };
    if ip.protocol != protocol::TCP || ip.l4_offset != plain_l4 {
        return None;
    }
    let tcp = parse_tcp(pkt, &ip).ok()?;
    Some(PlainTcp { ip, tcp })
}

/// Validates the TCP header of the packet `ip` describes: at least 20
/// bytes, data offset >= 5 and within `ip.len`.
#[inline]
pub fn parse_tcp(buf: &[u8], ip: &IpInfo) -> Result<TcpInfo, Reject> {
    if ip.protocol != protocol::TCP {
        return Err(Reject::UnsupportedProtocol);
    }
    let seg = buf.get(ip.l4_offset..ip.len).ok_or(Reject::TcpTruncated)?;
    let t = TcpPacket::new_checked(seg)?;
    let header_len = t.header_len();
    Ok(TcpInfo {
        src_port: t.src_port(),
        dst_port: t.dst_port(),
        seq: t.seq_number(),
        ack: t.ack_number(),
        flags: t.flags(),
        header_len,
        payload_len: seg.len() - header_len,
    })
}

/// Rewrites source and destination address and port of a TCP packet in
/// place: the NAT step, in both directions.
///
/// Checksums are updated with RFC 1624 eqn. 3: the `~m + m'` terms of every
/// replaced 16-bit word (IPv4: 4 address words and 2 ports; IPv6: 16
/// address words and 2 ports; the addresses are in the TCP pseudo-header,
/// RFC 9293 3.1 / RFC 8200 8.1) are accumulated unfolded and folded once.
/// The IPv4 header checksum takes the same address delta. A TCP checksum
/// that comes out 0 is written as 0xFFFF. Nothing past the TCP checksum is
/// read or written, so the cost does not depend on the payload.
///
/// `ip` must come from [`super::parse_ip`] on this buffer and
/// [`parse_tcp`] must have succeeded; a mismatching `ip` is an error, not a
/// panic. `Err(FamilyMismatch)` if `src`/`dst` are not both of the packet's
/// family; nothing is written on error.
#[inline]
pub fn rewrite_tcp(
    buf: &mut [u8],
    ip: &IpInfo,
    src: SocketAddr,
    dst: SocketAddr,
) -> Result<(), Reject> {
    let pkt = buf.get_mut(..ip.len).ok_or(Reject::BufferTooSmall)?;
    let (hdr, seg) = pkt
        .split_at_mut_checked(ip.l4_offset)
        .ok_or(Reject::TcpTruncated)?;
    let tcp = seg
        .first_chunk_mut::<HEADER_LEN>()
        .ok_or(Reject::TcpTruncated)?;
    let addr_delta = match (src.ip(), dst.ip(), hdr.first().map(|b| b >> 4)) {
        (IpAddr::V4(s), IpAddr::V4(d), Some(4)) => {
            let h = hdr
                .first_chunk_mut::<{ ipv4::HEADER_LEN }>()
                .ok_or(Reject::Ipv4BadHeaderLength)?;
            let new = concat::<4, 8>(s.octets(), d.octets());
            let delta = overwrite(&mut h[ipv4::field::ADDRS], &new);
            let mut v = ipv4::Ipv4Packet::new_unchecked(h);
            v.set_checksum(update(v.checksum(), delta));
            delta
        }
        (IpAddr::V6(s), IpAddr::V6(d), Some(6)) => {
            let h = hdr
                .first_chunk_mut::<{ ipv6::HEADER_LEN }>()
                .ok_or(Reject::Ipv6Truncated)?;
            let new = concat::<16, 32>(s.octets(), d.octets());
            overwrite(&mut h[ipv6::field::ADDRS], &new)
        }
        _ => return Err(Reject::FamilyMismatch),
    };
    let ports = concat::<2, 4>(src.port().to_be_bytes(), dst.port().to_be_bytes());
    let delta = addr_delta + overwrite(&mut tcp[field::PORTS], &ports);
    update_checksum(tcp, delta);
    Ok(())
}

/// `a` then `b` in one array (`W` is twice `N`): the new value of two
/// adjacent fields, such as source and destination.
#[inline]
fn concat<const N: usize, const W: usize>(a: [u8; N], b: [u8; N]) -> [u8; W] {
    let mut out = [0u8; W];
    out[..N].copy_from_slice(&a);
    out[N..].copy_from_slice(&b);
    out
}

/// The first `H` bytes of `buf` (an IP header) and the TCP header after
/// them, or None if `buf` is shorter.
#[inline]
fn ip_and_tcp<const H: usize>(buf: &mut [u8]) -> Option<(&mut [u8; H], &mut [u8; HEADER_LEN])> {
    let (ip, rest) = buf.split_first_chunk_mut::<H>()?;
    Some((ip, rest.first_chunk_mut::<HEADER_LEN>()?))
}

/// Applies the RFC 1624 `delta` to the checksum of the TCP header `tcp`,
/// writing a zero result as 0xFFFF ([`nonzero`]).
#[inline]
fn update_checksum(tcp: &mut [u8; HEADER_LEN], delta: u32) {
    let mut t = TcpPacket::new_unchecked(tcp);
    t.set_checksum(nonzero(update(t.checksum(), delta)));
}

/// Option kinds this crate reads (RFC 9293 3.1, RFC 7323 2.2).
mod option {
    pub const END: u8 = 0;
    pub const NOP: u8 = 1;
    pub const WINDOW_SCALE: u8 = 3;
}

/// Largest shift a window scale option may carry (RFC 7323 2.3: a larger
/// one is used as 14).
pub const MAX_WINDOW_SCALE: u8 = 14;

/// The window scale option of the segment `tcp` describes (its shift, at
/// most [`MAX_WINDOW_SCALE`]), or `None` if it carries none. Only a SYN's
/// option means anything (RFC 7323 2.2); the caller asks for SYNs only. A
/// malformed option list ends the walk: what was not found is not there.
pub fn window_scale(buf: &[u8], ip: &IpInfo, tcp: &TcpInfo) -> Option<u8> {
    let start = ip.l4_offset.checked_add(HEADER_LEN)?;
    let end = ip.l4_offset.checked_add(tcp.header_len)?;
    let mut opts = buf.get(start..end)?;
    while let Some((&kind, rest)) = opts.split_first() {
        match kind {
            option::END => return None,
            option::NOP => opts = rest,
            _ => {
                let len = usize::from(*rest.first()?);
                if len < 2 || len > opts.len() {
                    return None;
                }
                if kind == option::WINDOW_SCALE && len == 3 {
                    return Some(opts[2].min(MAX_WINDOW_SCALE));
                }
                opts = &opts[len..];
            }
        }
    }
    None
}

/// The window field of the TCP segment at `ip.l4_offset` (0 if the packet
/// is too short to hold a TCP header).
#[inline]
pub fn window_field(buf: &[u8], ip: &IpInfo) -> u16 {
    buf.get(ip.l4_offset..)
        .and_then(|seg| seg.first_chunk::<HEADER_LEN>())
        .map_or(0, |h| {
            u16::from_be_bytes([h[field::WINDOW.start], h[field::WINDOW.start + 1]])
        })
}

/// Lowers the window field of the TCP packet `ip` describes to `max`, if
/// it is larger, and updates the checksum incrementally (RFC 1624 eqn. 3,
/// one word). A zero window stays zero and `max` is taken as at least 1,
/// so a window is never raised and an open one never closed. Returns
/// whether the field changed; a packet too short to hold a TCP header is
/// left alone.
#[inline]
pub fn clamp_window(buf: &mut [u8], ip: &IpInfo, max: u16) -> bool {
    let new = max.max(1);
    window_field(buf, ip) > new && set_window(buf, ip, new)
}

/// Set the TCP window field of the segment in `buf` to `new`, updating the
/// checksum incrementally (RFC 1624 eqn. 3, one word); false if unchanged
/// or too short to hold a TCP header. Window grants raise a parked ACK's
/// window with it.
pub fn set_window(buf: &mut [u8], ip: &IpInfo, new: u16) -> bool {
    let Some(tcp) = buf
        .get_mut(ip.l4_offset..)
        .and_then(|seg| seg.first_chunk_mut::<HEADER_LEN>())
    else {
        return false;
    };
    let w = &tcp[field::WINDOW];
    let old = u16::from_be_bytes([w[0], w[1]]);
    if old == new {
        return false;
    }
    let delta = overwrite(&mut tcp[field::WINDOW], &new.to_be_bytes());
    update_checksum(tcp, delta);
    true
}

/// Builds, in place over the packet that triggered it, a TCP RST answering
/// `tcp`, following RFC 9293 3.10.7.1 (a segment reaching a CLOSED port):
///
/// * if the segment had ACK: `<SEQ=SEG.ACK><CTL=RST>`;
/// * otherwise `<SEQ=0><ACK=SEG.SEQ+SEG.LEN><CTL=RST,ACK>`, where SEG.LEN
///   counts the payload plus one for SYN and one for FIN.
///
/// Addresses and ports are swapped; headers are minimal (IPv4 20 bytes, DF,
/// or IPv6 40 bytes without extension headers; TCP 20 bytes, window 0),
/// TTL / hop limit 64, checksums computed in full. Returns the new length
/// (40 or 60), or 0 (nothing to send) if the segment itself carries RST (a
/// reset is never answered, RFC 9293 3.10.7.1), the addresses in `ip` are
/// of mixed families, or `buf` is too short.
pub fn tcp_rst_reply(buf: &mut [u8], ip: &IpInfo, tcp: &TcpInfo) -> usize {
    if tcp.flags & flags::RST != 0 {
        return 0;
    }
    let (seq, ack, ctl) = if tcp.flags & flags::ACK != 0 {
        (tcp.ack, 0, flags::RST)
    } else {
        let seg_len = (tcp.payload_len as u32)
            .wrapping_add(u32::from(tcp.flags & flags::SYN != 0))
            .wrapping_add(u32::from(tcp.flags & flags::FIN != 0));
        (0, tcp.seq.wrapping_add(seg_len), flags::RST | flags::ACK)
    };
    let emit_tcp = |t: &mut [u8; HEADER_LEN], pseudo: u32| {
        let mut p = TcpPacket::new_unchecked(&mut *t);
        p.set_src_port(tcp.dst_port);
        p.set_dst_port(tcp.src_port);
        p.set_seq_number(seq);
        p.set_ack_number(ack);
        p.set_header_len(HEADER_LEN);
        p.set_flags(ctl);
        p.set_window(0);
        p.set_checksum(0);
        p.set_urgent(0);
        let c = nonzero(checksum::finish(pseudo + checksum::sum_bytes(&t[..])));
        TcpPacket::new_unchecked(t).set_checksum(c);
    };
    const TCP_LEN: u16 = HEADER_LEN as u16;
    match (ip.src, ip.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            const LEN: usize = ipv4::HEADER_LEN + HEADER_LEN;
            let Some((h, t)) = ip_and_tcp::<{ ipv4::HEADER_LEN }>(buf) else {
                return 0;
            };
            ipv4::emit_header(h, d, s, protocol::TCP, TCP_LEN);
            emit_tcp(t, checksum::pseudo_header_v4(d, s, protocol::TCP, TCP_LEN));
            LEN
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            const LEN: usize = ipv6::HEADER_LEN + HEADER_LEN;
            let Some((h, t)) = ip_and_tcp::<{ ipv6::HEADER_LEN }>(buf) else {
                return 0;
            };
            ipv6::emit_header(h, &d, &s, protocol::TCP, TCP_LEN);
            emit_tcp(
                t,
                checksum::pseudo_header_v6(&d, &s, protocol::TCP, u32::from(TCP_LEN)),
            );
            LEN
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::checksum::{compute_transport_checksum, verify_transport_checksum};
    use crate::packet::testutil::*;
    use crate::packet::{Ipv4Packet, is_downlink, parse_ip};
    use proptest::prelude::*;
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

    /// The shift is found behind other options, capped at 14, and absent
    /// when the list has none, ends first, or is malformed.
    #[test]
    fn window_scale_reads_the_syn_option() {
        let ws = |opts: &[u8]| {
            let p = tcp_v4("10.0.0.9:1000", "1.1.1.1:443", 1, 0, flags::SYN, opts, b"");
            let ip = parse_ip(&p).expect("ip");
            let t = parse_tcp(&p, &ip).expect("tcp");
            window_scale(&p, &ip, &t)
        };
        // MSS, SACK permitted, timestamps, NOP, window scale 7: a Linux SYN.
        let linux = [
            2, 4, 5, 0xb4, 4, 2, 8, 10, 0, 0, 0x12, 0x34, 0, 0, 0, 0, 1, 3, 3, 7,
        ];
        assert_eq!(ws(&linux), Some(7));
        assert_eq!(ws(&[1, 3, 3, 0]), Some(0));
        assert_eq!(ws(&[1, 3, 3, 15]), Some(MAX_WINDOW_SCALE), "capped");
        assert_eq!(ws(&[]), None);
        assert_eq!(ws(&[2, 4, 5, 0xb4]), None, "MSS only");
        assert_eq!(ws(&[0, 3, 3, 7]), None, "after the end of the list");
        assert_eq!(ws(&[2, 0, 3, 3, 7, 0, 0, 0]), None, "length 0: malformed");
        assert_eq!(ws(&[2, 9, 0, 0]), None, "length past the header");
        assert_eq!(ws(&[3, 4, 7, 0]), None, "wrong length for window scale");
        let v6 = tcp_v6(
            "[fd00::9]:1000",
            "[2001:db8::1]:443",
            &[ExtHdr::HopByHop { units: 0 }],
            1,
            0,
            flags::SYN | flags::ACK,
            &linux,
            b"",
        );
        let ip = parse_ip(&v6).expect("ip");
        let t = parse_tcp(&v6, &ip).expect("tcp");
        assert_eq!(
            window_scale(&v6, &ip, &t),
            Some(7),
            "behind an extension header"
        );
    }

    /// Clamping lowers only larger windows, never closes an open one,
    /// leaves a zero window alone, and keeps the checksum what a full
    /// recomputation gives (IPv4 and IPv6, random payloads and windows).
    #[test]
    fn clamp_window_keeps_the_checksum_valid() {
        let window =
            |p: &[u8], ip: &IpInfo| TcpPacket::new_unchecked(&p[ip.l4_offset..ip.len]).window();
        let mut rng = crate::packet::testutil::Rng::new(23);
        for i in 0..400 {
            let payload: Vec<u8> = (0..rng.below(80)).map(|_| rng.byte()).collect();
            let mut p = if i % 2 == 0 {
                tcp_v4(
                    "10.0.0.9:1000",
                    "1.1.1.1:443",
                    7,
                    9,
                    flags::ACK,
                    &[],
                    &payload,
                )
            } else {
                tcp_v6(
                    "[fd00::9]:1000",
                    "[2001:db8::1]:443",
                    &[],
                    7,
                    9,
                    flags::ACK,
                    &[],
                    &payload,
                )
            };
            let ip = parse_ip(&p).expect("ip");
            let w = (rng.next_u64() & 0xffff) as u16;
            {
                let seg = &mut p[ip.l4_offset..ip.len];
                let mut t = TcpPacket::new_unchecked(&mut *seg);
                t.set_window(w);
                t.set_checksum(0);
            }
            let c = compute_transport_checksum(&p, &ip).expect("sum");
            TcpPacket::new_unchecked(&mut p[ip.l4_offset..ip.len]).set_checksum(c);
            let max = (rng.next_u64() & 0xffff) as u16;
            let changed = clamp_window(&mut p, &ip, max);
            let after = window(&p, &ip);
            let expect = if w == 0 { 0 } else { w.min(max.max(1)) };
            assert_eq!(after, expect, "window {w} clamped to {max}");
            assert_eq!(changed, after != w);
            assert!(verify_transport_checksum(&p, &ip), "window {w} -> {after}");
            let sum = TcpPacket::new_unchecked(&p[ip.l4_offset..ip.len]).checksum();
            assert_ne!(sum, 0, "a rewrite never writes checksum 0");
        }
        // A nonzero window clamped to 0 stays open (1), a zero one stays 0.
        let mut p = tcp_v4("10.0.0.9:1000", "1.1.1.1:443", 7, 9, flags::ACK, &[], b"x");
        let ip = parse_ip(&p).expect("ip");
        assert!(clamp_window(&mut p, &ip, 0));
        assert_eq!(window(&p, &ip), 1);
        TcpPacket::new_unchecked(&mut p[ip.l4_offset..ip.len]).set_window(0);
        assert!(!clamp_window(&mut p, &ip, 0));
        assert_eq!(window(&p, &ip), 0);
    }

    /// The table, spelled out: every combination of the five bits
    /// that matter, and PSH/ECE/CWR never changing the answer.
    #[test]
    fn valid_flags_is_conntracks_table() {
        use flags::*;
        let valid = [
            SYN,
            SYN | URG,
            SYN | ACK,
            RST,
            RST | ACK,
            FIN | ACK,
            FIN | ACK | URG,
            ACK,
            ACK | URG,
        ];
        for f in 0..=u8::MAX {
            let core = f & (FIN | SYN | RST | ACK | URG);
            assert_eq!(valid_flags(f), valid.contains(&core), "flags {f:#04x}");
        }
        for bad in [
            0,
            FIN,
            SYN | FIN,
            SYN | RST,
            FIN | PSH | URG,
            SYN | FIN | RST | PSH | ACK | URG,
            RST | FIN,
        ] {
            assert!(!valid_flags(bad), "{bad:#04x}");
        }
        assert!(valid_flags(SYN | ECE | CWR), "an ECN-setup SYN");
        assert!(valid_flags(ACK | PSH));
        assert!(valid_flags(RST | ACK | PSH));
    }

    /// A segment from the app passes only with valid flags and a checksum
    /// that verifies, both families; any flipped bit is caught.
    #[test]
    fn check_segment_needs_flags_and_checksum() {
        let pkts = [
            tcp_v4(
                "10.0.0.9:40000",
                "1.1.1.1:443",
                7,
                0,
                flags::SYN,
                &[2, 4, 5, 180],
                b"",
            ),
            tcp_v4(
                "10.0.0.9:40000",
                "1.1.1.1:443",
                7,
                9,
                flags::ACK | flags::PSH,
                &[],
                b"hello world",
            ),
            tcp_v6(
                "[fd00::9]:40000",
                "[2001:db8::1]:443",
                &[],
                7,
                0,
                flags::SYN,
                &[],
                b"",
            ),
            tcp_v6(
                "[fd00::9]:40000",
                "[2001:db8::1]:443",
                &[ExtHdr::DestOpts { units: 0 }],
                7,
                9,
                flags::FIN | flags::ACK,
                &[],
                b"odd",
            ),
        ];
        let mut rng = crate::packet::testutil::Rng::new(1071);
        for p in pkts {
            let ip = parse_ip(&p).expect("ip");
            let t = parse_tcp(&p, &ip).expect("tcp");
            assert_eq!(check_segment(&p, &ip, &t), Ok(()));
            for _ in 0..200 {
                let mut q = p.clone();
                let at = ip.l4_offset + rng.below(ip.len - ip.l4_offset);
                q[at] ^= 1 << rng.below(8);
                let Ok(t) = parse_tcp(&q, &ip) else { continue };
                let r = check_segment(&q, &ip, &t);
                assert!(
                    matches!(r, Err(Reject::TcpBadChecksum | Reject::TcpBadFlags)),
                    "a flipped bit at {at} passed: {r:?}"
                );
            }
            let mut q = p.clone();
            q[ip.l4_offset + field::FLAGS] = 0; // a null scan
            let t = parse_tcp(&q, &ip).expect("tcp");
            assert_eq!(check_segment(&q, &ip, &t), Err(Reject::TcpBadFlags));
        }
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    /// Rewrites `pkt` to `src -> dst` and checks every checksum against a
    /// full recomputation, and the result against a packet built from
    /// scratch with the new tuple.
    fn check_rewrite(pkt: &[u8], src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
        let mut out = pkt.to_vec();
        let ip = parse_ip(&out).expect("valid ip");
        parse_tcp(&out, &ip).expect("valid tcp");
        rewrite_tcp(&mut out, &ip, src, dst).expect("rewrite");
        let ip2 = parse_ip(&out).expect("still valid ip");
        assert_eq!((ip2.src, ip2.dst), (src.ip(), dst.ip()));
        assert_eq!((ip2.l4_offset, ip2.len), (ip.l4_offset, ip.len));
        let t = parse_tcp(&out, &ip2).expect("still valid tcp");
        assert_eq!((t.src_port, t.dst_port), (src.port(), dst.port()));
        let stored = TcpPacket::new_unchecked(&out[ip2.l4_offset..]).checksum();
        assert_eq!(Some(stored), compute_transport_checksum(&out, &ip2));
        assert!(verify_transport_checksum(&out, &ip2));
        if src.is_ipv4() {
            let v = Ipv4Packet::new_unchecked(&out[..]);
            assert!(v.verify_checksum());
            let mut full = out.clone();
            Ipv4Packet::new_unchecked(&mut full[..]).fill_checksum();
            assert_eq!(full[10..12], out[10..12], "ipv4 header checksum");
        }
        // Everything but addresses, ports and checksums is untouched.
        let mut expect = pkt.to_vec();
        let (a, b) = if src.is_ipv4() { (12, 20) } else { (8, 40) };
        expect[a..b].copy_from_slice(&out[a..b]);
        let l4 = ip.l4_offset;
        expect[l4..l4 + 4].copy_from_slice(&out[l4..l4 + 4]);
        expect[l4 + 16..l4 + 18].copy_from_slice(&out[l4 + 16..l4 + 18]);
        if src.is_ipv4() {
            expect[10..12].copy_from_slice(&out[10..12]);
        }
        assert_eq!(expect, out);
        out
    }

    fn arb_v4() -> impl Strategy<Value = SocketAddr> {
        (any::<u32>(), any::<u16>())
            .prop_map(|(a, p)| SocketAddrV4::new(Ipv4Addr::from(a), p).into())
    }

    fn arb_v6() -> impl Strategy<Value = SocketAddr> {
        (any::<u128>(), any::<u16>())
            .prop_map(|(a, p)| SocketAddrV6::new(Ipv6Addr::from(a), p, 0, 0).into())
    }

    fn arb_ext() -> impl Strategy<Value = Vec<ExtHdr>> {
        proptest::collection::vec(
            prop_oneof![
                (0u8..4).prop_map(|units| ExtHdr::HopByHop { units }),
                (0u8..4).prop_map(|units| ExtHdr::DestOpts { units }),
                Just(ExtHdr::Routing { segments_left: 0 }),
                (1u8..8).prop_map(|w| ExtHdr::Ah { words: w * 2 }),
            ],
            0..4,
        )
    }

    proptest! {
        // Under Miri, PROPTEST_CASES decides (CI sets a handful).
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 4 } else { 2000 }))]

        /// Incremental update vs full recomputation, IPv4.
        #[test]
        fn rewrite_v4_matches_full(
            from in (arb_v4(), arb_v4()),
            to in (arb_v4(), arb_v4()),
            seq in any::<u32>(), ack in any::<u32>(), fl in any::<u8>(),
            opts in 0usize..11,
            payload in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let options = vec![1u8; opts * 4]; // NOPs
            let p = tcp_v4(&from.0.to_string(), &from.1.to_string(), seq, ack, fl, &options, &payload);
            check_rewrite(&p, to.0, to.1);
        }

        /// Incremental update vs full recomputation, IPv6 (starting from a
        /// correct checksum), with extension-header chains.
        #[test]
        fn rewrite_v6_matches_full(
            from in (arb_v6(), arb_v6()),
            to in (arb_v6(), arb_v6()),
            ext in arb_ext(),
            seq in any::<u32>(), fl in any::<u8>(),
            payload in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let p = tcp_v6(&from.0.to_string(), &from.1.to_string(), &ext, seq, 0, fl, &[], &payload);
            let ip = parse_ip(&p).expect("valid");
            prop_assert!(verify_transport_checksum(&p, &ip));
            check_rewrite(&p, to.0, to.1);
        }

        /// Rewriting there and back restores the original bytes.
        #[test]
        fn rewrite_round_trip(
            from in (arb_v6(), arb_v6()),
            to in (arb_v6(), arb_v6()),
            payload in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let p = tcp_v6(&from.0.to_string(), &from.1.to_string(), &[], 1, 2, flags::ACK, &[], &payload);
            let mut b = p.clone();
            let ip = parse_ip(&b).expect("valid");
            rewrite_tcp(&mut b, &ip, to.0, to.1).expect("rewrite");
            let ip = parse_ip(&b).expect("valid");
            rewrite_tcp(&mut b, &ip, from.0, from.1).expect("rewrite back");
            prop_assert_eq!(b, p);
        }
    }

    /// A rewrite whose checksum comes out as 0x0000 writes 0xFFFF instead.
    #[test]
    fn zero_checksum_written_as_ffff() {
        for (src, dst, nsrc, ndst) in [
            (
                "10.0.0.9:12345",
                "1.1.1.1:443",
                "198.18.0.2:10001",
                "198.18.0.1:40000",
            ),
            (
                "[fd00::9]:12345",
                "[2001:db8::1]:443",
                "[fd00::2]:10001",
                "[fd00::1]:40000",
            ),
        ] {
            // Two payload bytes are chosen so the rewritten packet's
            // checksum, computed in full, is exactly 0x0000.
            let mk = |adj: u16| {
                if src.starts_with('[') {
                    tcp_v6(src, dst, &[], 1, 0, flags::SYN, &[], &adj.to_be_bytes())
                } else {
                    tcp_v4(src, dst, 1, 0, flags::SYN, &[], &adj.to_be_bytes())
                }
            };
            let mut probe = mk(0);
            let ip = parse_ip(&probe).expect("valid");
            rewrite_tcp(&mut probe, &ip, sa(nsrc), sa(ndst)).expect("rewrite");
            let ip2 = parse_ip(&probe).expect("valid");
            let raw = raw_tcp_checksum(&probe, &ip2);
            // Adding `raw` to the payload makes the rewritten sum 0xFFFF,
            // whose complement is 0.
            let p = mk(raw);
            let mut out = p.clone();
            let ip = parse_ip(&out).expect("valid");
            rewrite_tcp(&mut out, &ip, sa(nsrc), sa(ndst)).expect("rewrite");
            let ip2 = parse_ip(&out).expect("valid");
            assert_eq!(raw_tcp_checksum(&out, &ip2), 0, "constructed the zero case");
            let l4 = ip2.l4_offset;
            assert_eq!(out[l4 + 16..l4 + 18], [0xff, 0xff]);
            assert!(verify_transport_checksum(&out, &ip2));
        }
    }

    /// Uplink rewrite to the NAT tuple, then the kernel's reply rewritten
    /// back, give exactly the packets built from scratch.
    #[test]
    fn downlink_restore() {
        for (client, server, nat, gw) in [
            (
                "10.0.0.9:12345",
                "1.1.1.1:443",
                "198.18.0.2:10001",
                "198.18.0.1:40000",
            ),
            (
                "[fd00::9]:12345",
                "[2606:4700::1111]:443",
                "[fd00::2]:10001",
                "[fd00::1]:40000",
            ),
        ] {
            let (client, server, nat, gw) = (sa(client), sa(server), sa(nat), sa(gw));
            let build = |s: SocketAddr, d: SocketAddr, seq, ack, fl, payload: &[u8]| {
                if s.is_ipv4() {
                    tcp_v4(
                        &s.to_string(),
                        &d.to_string(),
                        seq,
                        ack,
                        fl,
                        &[2, 4, 5, 0xb4],
                        payload,
                    )
                } else {
                    tcp_v6(
                        &s.to_string(),
                        &d.to_string(),
                        &[],
                        seq,
                        ack,
                        fl,
                        &[2, 4, 5, 0xa0],
                        payload,
                    )
                }
            };
            // Uplink SYN from the app.
            let mut up = build(client, server, 1000, 0, flags::SYN, b"");
            let ip = parse_ip(&up).expect("valid");
            let t = parse_tcp(&up, &ip).expect("valid");
            assert!(t.is_syn_only());
            assert!(!is_downlink(&ip, &t, gw.ip(), nat.ip(), gw.port()));
            rewrite_tcp(&mut up, &ip, nat, gw).expect("uplink");
            assert_eq!(up, build(nat, gw, 1000, 0, flags::SYN, b""));
            // The kernel listener's SYN-ACK, and a data segment.
            for (fl, payload) in [
                (flags::SYN | flags::ACK, &b""[..]),
                (flags::ACK | flags::PSH, b"HTTP/1.1 200 OK\r\n"),
            ] {
                let mut down = build(gw, nat, 5000, 1001, fl, payload);
                let ip = parse_ip(&down).expect("valid");
                let t = parse_tcp(&down, &ip).expect("valid");
                assert!(is_downlink(&ip, &t, gw.ip(), nat.ip(), gw.port()));
                rewrite_tcp(&mut down, &ip, server, client).expect("downlink");
                assert_eq!(down, build(server, client, 5000, 1001, fl, payload));
            }
        }
    }

    #[test]
    fn rewrite_rejects_other_family_and_stale_info() {
        let p = tcp_v4("10.0.0.9:1", "10.0.0.1:2", 0, 0, flags::SYN, &[], b"");
        let ip = parse_ip(&p).expect("valid");
        let mut b = p.clone();
        assert_eq!(
            rewrite_tcp(&mut b, &ip, sa("10.0.0.1:1"), sa("[::1]:2")),
            Err(Reject::FamilyMismatch)
        );
        assert_eq!(
            rewrite_tcp(&mut b, &ip, sa("[::1]:1"), sa("[::1]:2")),
            Err(Reject::FamilyMismatch)
        );
        assert_eq!(b, p, "nothing written on error");
        // An `IpInfo` that does not fit this buffer.
        let mut short = p[..30].to_vec();
        assert_eq!(
            rewrite_tcp(&mut short, &ip, sa("10.0.0.1:1"), sa("10.0.0.2:2")),
            Err(Reject::BufferTooSmall)
        );
        let bad = IpInfo {
            l4_offset: 30,
            ..ip
        };
        assert_eq!(
            rewrite_tcp(&mut b, &bad, sa("10.0.0.1:1"), sa("10.0.0.2:2")),
            Err(Reject::TcpTruncated)
        );
        let bad = IpInfo {
            l4_offset: 8,
            len: 28,
            ..ip
        };
        assert_eq!(
            rewrite_tcp(&mut b, &bad, sa("10.0.0.1:1"), sa("10.0.0.2:2")),
            Err(Reject::Ipv4BadHeaderLength)
        );
    }

    #[test]
    fn parse_fields_and_options() {
        let p = tcp_v4(
            "10.0.0.9:12345",
            "1.1.1.1:443",
            0xdead_beef,
            0x0102_0304,
            flags::ACK | flags::PSH | flags::ECE,
            &[1, 1, 1, 1, 1, 1, 1, 1],
            b"abc",
        );
        let ip = parse_ip(&p).expect("valid");
        let t = parse_tcp(&p, &ip).expect("valid");
        assert_eq!(
            t,
            TcpInfo {
                src_port: 12345,
                dst_port: 443,
                seq: 0xdead_beef,
                ack: 0x0102_0304,
                flags: flags::ACK | flags::PSH | flags::ECE,
                header_len: 28,
                payload_len: 3,
            }
        );
        assert!(!t.is_syn_only());
        let v = TcpPacket::new_checked(&p[20..]).expect("valid");
        assert_eq!(v.window(), 65535);
        assert_eq!(v.urgent(), 0);
    }

    /// Every cut of the TCP header (IP length adjusted so the IP layer is
    /// consistent) is `TcpTruncated`; every bad data offset is rejected.
    #[test]
    fn truncated_and_bad_data_offset() {
        for p in [
            tcp_v4("10.0.0.9:1", "10.0.0.1:2", 0, 0, flags::SYN, &[], b""),
            tcp_v6(
                "[fd00::9]:1",
                "[fd00::1]:2",
                &[ExtHdr::DestOpts { units: 0 }],
                0,
                0,
                flags::SYN,
                &[],
                b"",
            ),
        ] {
            let l4 = parse_ip(&p).expect("valid").l4_offset;
            for n in 0..HEADER_LEN {
                let cut = set_ip_len(&p, l4 + n);
                let ip = parse_ip(&cut).expect("ip still valid");
                assert_eq!(
                    parse_tcp(&cut, &ip),
                    Err(Reject::TcpTruncated),
                    "tcp len {n}"
                );
            }
            for doff in (0..5u8).chain(6..16) {
                let mut b = p.clone();
                b[l4 + 12] = doff << 4;
                let ip = parse_ip(&b).expect("valid");
                assert_eq!(
                    parse_tcp(&b, &ip),
                    Err(Reject::TcpBadDataOffset),
                    "doff {doff}"
                );
            }
        }
        let u = udp_v4("10.0.0.9:1", "10.0.0.1:2", b"");
        let ip = parse_ip(&u).expect("valid");
        assert_eq!(parse_tcp(&u, &ip), Err(Reject::UnsupportedProtocol));
    }

    fn check_rst(trigger: &[u8], want_seq: u32, want_ack: u32, want_flags: u8) {
        let ip = parse_ip(trigger).expect("valid");
        let t = parse_tcp(trigger, &ip).expect("valid");
        let mut b = trigger.to_vec();
        let n = tcp_rst_reply(&mut b, &ip, &t);
        let want_len = if ip.src.is_ipv4() { 40 } else { 60 };
        assert_eq!(n, want_len);
        let out = &b[..n];
        let rip = parse_ip(out).expect("rst ip valid");
        assert_eq!((rip.src, rip.dst, rip.len), (ip.dst, ip.src, n));
        assert_eq!(rip.l4_offset, want_len - 20);
        if ip.src.is_ipv4() {
            let v = Ipv4Packet::new_unchecked(out);
            assert!(v.verify_checksum());
            assert_eq!(v.ttl(), 64);
        } else {
            assert_eq!(out[7], 64);
        }
        let rt = parse_tcp(out, &rip).expect("rst tcp valid");
        assert_eq!((rt.src_port, rt.dst_port), (t.dst_port, t.src_port));
        assert_eq!((rt.seq, rt.ack, rt.flags), (want_seq, want_ack, want_flags));
        assert_eq!((rt.header_len, rt.payload_len), (20, 0));
        assert_eq!(TcpPacket::new_unchecked(&out[rip.l4_offset..]).window(), 0);
        assert!(verify_transport_checksum(out, &rip));
    }

    #[test]
    fn rst_reply_fields_and_checksums() {
        for (c, s) in [
            ("10.0.0.9:12345", "1.1.1.1:443"),
            ("[fd00::9]:12345", "[2001:db8::1]:443"),
        ] {
            let build = |seq, ack, fl, payload: &[u8]| {
                if c.starts_with('[') {
                    tcp_v6(
                        c,
                        s,
                        &[ExtHdr::HopByHop { units: 0 }],
                        seq,
                        ack,
                        fl,
                        &[1, 1, 1, 1],
                        payload,
                    )
                } else {
                    tcp_v4(c, s, seq, ack, fl, &[1, 1, 1, 1], payload)
                }
            };
            // SYN: no ACK -> <SEQ=0><ACK=SEG.SEQ+1><CTL=RST,ACK>.
            check_rst(
                &build(1000, 0, flags::SYN, b""),
                0,
                1001,
                flags::RST | flags::ACK,
            );
            // Payload without ACK, plus FIN; sequence wraps.
            check_rst(
                &build(u32::MAX - 1, 0, flags::FIN, b"abcd"),
                0,
                3,
                flags::RST | flags::ACK,
            );
            // ACK set -> <SEQ=SEG.ACK><CTL=RST>.
            check_rst(
                &build(5, 777, flags::ACK | flags::PSH, b"data"),
                777,
                0,
                flags::RST,
            );
            check_rst(&build(5, 9, flags::SYN | flags::ACK, b""), 9, 0, flags::RST);
            // A reset is never answered.
            let p = build(5, 9, flags::RST | flags::ACK, b"");
            let ip = parse_ip(&p).expect("valid");
            let t = parse_tcp(&p, &ip).expect("valid");
            assert_eq!(tcp_rst_reply(&mut p.clone(), &ip, &t), 0);
        }
    }

    #[test]
    fn rst_reply_short_buffer_is_zero() {
        let p = tcp_v6(
            "[fd00::9]:1",
            "[fd00::1]:2",
            &[],
            0,
            0,
            flags::SYN,
            &[],
            b"",
        );
        let ip = parse_ip(&p).expect("valid");
        let t = parse_tcp(&p, &ip).expect("valid");
        for n in 0..60 {
            assert_eq!(tcp_rst_reply(&mut p[..n].to_vec(), &ip, &t), 0, "len {n}");
        }
        let mixed = IpInfo {
            dst: "10.0.0.1".parse().expect("addr"),
            ..ip
        };
        assert_eq!(tcp_rst_reply(&mut p.clone(), &mixed, &t), 0);
    }

    #[test]
    fn saved_syn_reads_the_sequence_number_of_a_syn_only() {
        let mut v4 = [0u8; 40];
        v4[0] = 0x45;
        v4[9] = 6;
        v4[20 + 4..20 + 8].copy_from_slice(&0xdead_beefu32.to_be_bytes());
        v4[20 + 12] = 5 << 4;
        v4[20 + 13] = flags::SYN;
        assert_eq!(saved_syn(&v4), SavedSyn::Isn(0xdead_beef));
        // IPv4 options move the TCP header.
        let mut opts = [0u8; 44];
        opts[0] = 0x46;
        opts[9] = 6;
        opts[24 + 4..24 + 8].copy_from_slice(&7u32.to_be_bytes());
        opts[24 + 13] = flags::SYN | flags::ECE;
        assert_eq!(saved_syn(&opts), SavedSyn::Isn(7));
        let mut v6 = [0u8; 60];
        v6[0] = 0x60;
        v6[6] = 6;
        v6[40 + 4..40 + 8].copy_from_slice(&42u32.to_be_bytes());
        v6[40 + 13] = flags::SYN;
        assert_eq!(saved_syn(&v6), SavedSyn::Isn(42));
        // Nothing saved: the unverified case, not a mismatch.
        assert_eq!(saved_syn(&[]), SavedSyn::Missing);
        // Saved, but not a SYN, not TCP, a chain that does not walk, an
        // IHL below 5, another version.
        for (base, at, byte) in [
            (&v4[..], 20 + 13, flags::ACK), // not a SYN
            (&v4[..], 9, 17),               // not TCP
            (&v6[..], 6, 0),                // a chain that does not walk
            (&v4[..], 0, 0x44),             // an IHL below 5
            (&v4[..], 0, 0x55),             // another version
        ] {
            let mut p = base.to_vec();
            p[at] = byte;
            assert_eq!(saved_syn(&p), SavedSyn::Unreadable, "byte {at} = {byte:#x}");
        }
        // Cut short.
        assert_eq!(saved_syn(&v4[..30]), SavedSyn::Unreadable);
        assert_eq!(saved_syn(&v6[..7]), SavedSyn::Unreadable);
    }

    /// The headers the kernel saves for an IPv6 SYN: the fixed header, the
    /// extension headers and the TCP header with its options (no payload,
    /// although the payload length counts one).
    fn saved_v6_syn(ext: &[ExtHdr], isn: u32) -> Vec<u8> {
        let mss = [2, 4, 0x05, 0xb4];
        let mut p = tcp_v6(
            "[fd00:18::2]:40000",
            "[fd00:18::1]:8080",
            ext,
            isn,
            0,
            flags::SYN,
            &mss,
            b"some payload",
        );
        let headers = ipv6::HEADER_LEN + ext.iter().map(ExtHdr::len).sum::<usize>() + 24;
        p.truncate(headers);
        p
    }

    /// A SYN with extension headers is read, not taken for a missing one:
    /// the accept loop then compares its ISN with the NAT entry's.
    #[test]
    fn saved_v6_syn_walks_its_extension_headers() {
        for chain in [
            &[ExtHdr::HopByHop { units: 0 }][..],
            &[ExtHdr::DestOpts { units: 3 }],
            &[ExtHdr::Routing { segments_left: 0 }],
            &[
                ExtHdr::HopByHop { units: 1 },
                ExtHdr::Routing { segments_left: 0 },
                ExtHdr::DestOpts { units: 0 },
            ],
            &[ExtHdr::HopByHop { units: 0 }, ExtHdr::Ah { words: 4 }],
            // The largest Destination Options header (2048 bytes).
            &[ExtHdr::DestOpts { units: 255 }],
        ] {
            let h = saved_v6_syn(chain, 0x0102_0304);
            assert_eq!(saved_syn(&h), SavedSyn::Isn(0x0102_0304), "{chain:?}");
        }
    }

    /// Cut anywhere before the end of the TCP header's first 20 bytes, a
    /// saved SYN with extension headers is unreadable (never an ISN read
    /// from the wrong bytes, never "missing"); a routing header with
    /// segments left, a fragment header and ESP are unreadable whole.
    #[test]
    fn saved_v6_syn_cut_short_or_with_a_foreign_chain_is_unreadable() {
        let chain = [ExtHdr::HopByHop { units: 1 }, ExtHdr::DestOpts { units: 2 }];
        let h = saved_v6_syn(&chain, 99);
        let tcp_at = ipv6::HEADER_LEN + chain.iter().map(ExtHdr::len).sum::<usize>();
        for n in 1..tcp_at + HEADER_LEN {
            assert_eq!(saved_syn(&h[..n]), SavedSyn::Unreadable, "cut at {n}");
        }
        for n in tcp_at + HEADER_LEN..=h.len() {
            assert_eq!(saved_syn(&h[..n]), SavedSyn::Isn(99), "cut at {n}");
        }
        for chain in [
            &[ExtHdr::Routing { segments_left: 1 }][..],
            &[ExtHdr::HopByHop { units: 0 }, ExtHdr::Fragment],
            &[ExtHdr::Esp],
        ] {
            let h = saved_v6_syn(chain, 5);
            assert_eq!(saved_syn(&h), SavedSyn::Unreadable, "{chain:?}");
        }
        // A chain that ends in UDP is not a TCP SYN.
        let mut udp = saved_v6_syn(&[ExtHdr::DestOpts { units: 0 }], 5);
        udp[ipv6::HEADER_LEN] = protocol::UDP;
        assert_eq!(saved_syn(&udp), SavedSyn::Unreadable);
    }

    proptest! {
        /// Garbage never panics, and an empty read is the only "missing".
        #[test]
        fn saved_syn_of_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..160)) {
            let r = saved_syn(&bytes);
            prop_assert_eq!(r == SavedSyn::Missing, bytes.is_empty());
            if let SavedSyn::Isn(_) = r {
                prop_assert!(bytes.len() >= ipv4::HEADER_LEN + HEADER_LEN);
            }
        }
    }
}
