//! Write-back coalescing: a userspace GRO for devices without offload.
//!
//! A phone's TUN carries one MTU-sized packet per read and per write, and the
//! kernel's TCP receive of every packet the engine writes back runs in the
//! engine's context. [`append`] merges the next in-order segment of a TCP
//! flow into the one before it, in place, so the kernel receives one larger
//! segment instead of several (Linux accepts a locally delivered IP packet
//! above the device MTU on a TUN without offload).
//!
//! Two segments merge only when the result is what the sender could have
//! sent as one segment, so the receiving TCP sees nothing a sender could
//! not have produced:
//! * same addresses and ports, IPv4 without options (same TOS, TTL, DF) or
//!   IPv6 without extension headers (same traffic class, flow label, hop
//!   limit);
//! * both carry data; the head is a plain ACK segment, the next one ACK or
//!   ACK|PSH (a PSH ends the run: nothing is appended after it); no SYN,
//!   FIN, RST, URG, ECE or CWR;
//! * equal acknowledgement number, window and TCP options (timestamps
//!   included), and the next segment starts where the head ends;
//! * a corrupted segment is never folded into a merge that verifies:
//!   [`append`] sums the next payload and checks it; [`append_verified`]
//!   reads the payload's sum back out of the stored checksum instead, so a
//!   segment whose checksum is wrong makes the merged checksum wrong by as
//!   much. It is for a caller whose segments were verified (the kernel
//!   listener's own are computed by the local TCP) or whose merges the
//!   receiving kernel verifies (a TUN written without offload).
//!
//! The merged checksums are updated from partial sums (RFC 1624): the TCP
//! length in the pseudo-header, the appended payload (byte-swapped when it
//! starts at an odd offset, RFC 1071 2(B)), the PSH bit; the IPv4 header
//! checksum for the new total length. Besides the copy, [`append`] costs
//! one pass over the appended payload and [`append_verified`] none: its
//! sum is the complement of the pseudo-header's and the TCP header's
//! (checksum field included), since the whole segment sums to zero.

use super::checksum::{self, finish, fold, nonzero, replaced, sum_bytes};
use super::tcp::{HEADER_LEN as TCP_HEADER_LEN, PlainTcp, field as tcpf, flags, parse_plain_tcp};
use super::{IpInfo, ipv4, ipv6, parse_ip, protocol};

/// Flags that forbid a merge (anything but ACK and PSH).
const STOP: u8 = flags::SYN | flags::FIN | flags::RST | flags::URG | flags::ECE | flags::CWR;

/// Largest IP packet a merge may produce: the IPv4 total length and the
/// IPv6 payload length are 16 bits.
pub const MAX_PACKET: usize = 65_535;

/// Append the payload of `next` (a whole IP packet) to the TCP segment at
/// `buf[..head_len]` when `next` continues it (module docs); the merged
/// packet may grow up to `buf.len()` and [`MAX_PACKET`]. Returns the new
/// length of the head, or `None` with `buf` untouched.
pub fn append(buf: &mut [u8], head_len: usize, next: &[u8]) -> Option<usize> {
    append_parsing(buf, head_len, next, Next::Unchecked)
}

/// [`append`] without summing `next`'s payload: its sum is derived from the
/// stored checksum (module docs). A `next` whose checksum does not verify
/// leaves the merge's checksum failing (wrong by the same amount): for
/// segments verified before, or merges whose receiver verifies them.
pub fn append_verified(buf: &mut [u8], head_len: usize, next: &[u8]) -> Option<usize> {
    append_parsing(buf, head_len, next, Next::Verified)
}

/// [`append_verified`] for a caller that holds the headers of both
/// segments (`packet::tcp::parse_plain_tcp`): `head` describes the packet
/// at `buf[..head.ip.len]` and `n` the packet `next`. On a merge `head` is
/// updated to describe the merged packet (its length is `head.ip.len`) and
/// the answer is true; otherwise `buf` and `head` are untouched. The
/// write-back parses each segment once this way.
pub fn append_verified_plain(
    buf: &mut [u8],
    head: &mut PlainTcp,
    next: &[u8],
    n: &PlainTcp,
) -> bool {
    append_with(buf, head, next, n, Next::Verified)
}

/// Merge `next`, a segment read but not yet translated, into `head` (the
/// packet at `buf[..head.ip.len]`, translated), given `raw_head`: the head's
/// own IP and TCP headers as they were before translation. `next` merges
/// when its headers equal `raw_head`'s in every field a merge compares and
/// the rest of the rules hold (module docs). A translation that gives both
/// the same result (the same flow's entry, the same window, in the same
/// drain) then makes of `next` exactly the segment [`append_verified_plain`]
/// would merge: it changes addresses, ports and the window, which the merge
/// takes from the head, and the checksum, from which the payload's sum is
/// read with `next`'s own pseudo-header. `verified`: as in
/// [`append_verified`]; false sums the payload and refuses a `next` whose
/// checksum fails, as [`append`] does. On a merge `head` describes the
/// merged packet and the answer is true; otherwise nothing is changed.
pub fn append_untranslated(
    buf: &mut [u8],
    head: &mut PlainTcp,
    raw_head: &[u8],
    next: &[u8],
    n: &PlainTcp,
    verified: bool,
) -> bool {
    if raw_head.len() != n.ip.l4_offset + n.tcp.header_len || !same_flow(raw_head, next, n) {
        return false;
    }
    let checked = if verified {
        Next::Verified
    } else {
        Next::Unchecked
    };
    let Some(new_len) = join(buf, head, next, n, checked) else {
        return false;
    };
    grown(head, n, new_len);
    true
}

/// Whether [`append_with`] must check the next segment's checksum.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Next {
    Unchecked,
    Verified,
}

/// [`append_with`] on headers parsed here; the head must be exactly the
/// packet `buf[..head_len]` describes.
fn append_parsing(buf: &mut [u8], head_len: usize, next: &[u8], checked: Next) -> Option<usize> {
    let mut head = parse_plain_tcp(buf.get(..head_len)?).filter(|h| h.ip.len == head_len)?;
    let n = parse_plain_tcp(next)?;
    append_with(buf, &mut head, next, &n, checked).then_some(head.ip.len)
}

/// Merge `next` into the head (both described by their headers): on a
/// merge, `head` then describes the merged packet; otherwise `buf` and
/// `head` are untouched.
fn append_with(
    buf: &mut [u8],
    head: &mut PlainTcp,
    next: &[u8],
    n: &PlainTcp,
    checked: Next,
) -> bool {
    let Some(head_bytes) = buf.get(..head.ip.len) else {
        return false;
    };
    if !same_flow(head_bytes, next, n) {
        return false;
    }
    let Some(new_len) = join(buf, head, next, n, checked) else {
        return false;
    };
    grown(head, n, new_len);
    true
}

/// `head` after `n` was appended to it, `new_len` bytes in all.
fn grown(head: &mut PlainTcp, n: &PlainTcp, new_len: usize) {
    head.ip.len = new_len;
    head.tcp.payload_len += n.tcp.payload_len;
    head.tcp.flags |= n.tcp.flags & flags::PSH;
}

/// Whether `next` (a plain TCP segment, its headers `n`) belongs where the
/// headers at the start of `head` do: the same addresses, ports,
/// acknowledgement number, window and TCP options, and the IP fields a
/// merge must not hide a difference in (IPv4: TOS, TTL, DF; IPv6: traffic
/// class, flow label, hop limit). Only the headers of `head` are read, so
/// it may be a copy of them alone.
#[inline]
fn same_flow(head: &[u8], next: &[u8], n: &PlainTcp) -> bool {
    let l4 = n.ip.l4_offset;
    let end = l4 + n.tcp.header_len;
    let (Some(h), Some(x)) = (head.get(..end), next.get(..end)) else {
        return false;
    };
    let ip_same = if n.ip.src.is_ipv4() {
        // Version and IHL, TOS; flags, fragment offset, TTL and protocol;
        // the addresses. Left out: total length, identification, checksum.
        h[..ipv4::field::TOTAL_LEN.start] == x[..ipv4::field::TOTAL_LEN.start]
            && h[ipv4::field::FLAGS_FRAG.start..ipv4::field::CHECKSUM.start]
                == x[ipv4::field::FLAGS_FRAG.start..ipv4::field::CHECKSUM.start]
            && h[ipv4::field::ADDRS] == x[ipv4::field::ADDRS]
    } else {
        // Everything but the payload length.
        h[ipv6::field::VER_TC_FLOW] == x[ipv6::field::VER_TC_FLOW]
            && h[ipv6::field::NEXT_HEADER..l4] == x[ipv6::field::NEXT_HEADER..l4]
    };
    // Ports; acknowledgement number and data offset; window; options. The
    // sequence number, flags, checksum and urgent pointer are the caller's
    // (`join`).
    let (ht, xt) = (&h[l4..], &x[l4..]);
    ip_same
        && ht[tcpf::PORTS] == xt[tcpf::PORTS]
        && ht[tcpf::ACK.start..=tcpf::DATA_OFF] == xt[tcpf::ACK.start..=tcpf::DATA_OFF]
        && ht[tcpf::WINDOW] == xt[tcpf::WINDOW]
        && ht[TCP_HEADER_LEN..] == xt[TCP_HEADER_LEN..]
}

/// Append `next`'s payload to the head at `buf[..head.ip.len]`, whose flow
/// `next` was found to share ([`same_flow`]): the rest of the merge rules
/// (flags, payload on both, `next` starting where the head ends, equal
/// header lengths, the size bound), then the copy and the checksums. The
/// merged packet's length, or `None` with `buf` untouched.
fn join(
    buf: &mut [u8],
    head: &PlainTcp,
    next: &[u8],
    n: &PlainTcp,
    checked: Next,
) -> Option<usize> {
    let PlainTcp { ip: hip, tcp: htcp } = *head;
    let PlainTcp { ip: nip, tcp: ntcp } = *n;
    let head_len = hip.len;
    // The flags tests refuse every STOP flag: the head must be a plain ACK
    // and the next segment ACK or ACK|PSH.
    if hip.l4_offset != nip.l4_offset
        || hip.src.is_ipv4() != nip.src.is_ipv4()
        || htcp.flags != flags::ACK
        || ntcp.flags & !flags::PSH != flags::ACK
        || htcp.payload_len == 0
        || ntcp.payload_len == 0
        || ntcp.seq != htcp.seq.wrapping_add(htcp.payload_len as u32)
        || htcp.header_len != ntcp.header_len
        || next.len() < nip.len
        || buf.len() < head_len
    {
        return None;
    }
    let new_len = head_len + ntcp.payload_len;
    if new_len > MAX_PACKET.min(buf.len()) {
        return None;
    }
    let payload = &next[nip.l4_offset + ntcp.header_len..nip.len];
    let payload_sum = match checked {
        Next::Unchecked => {
            let sum = sum_bytes(payload);
            if fold(head_sum(next, &nip, ntcp.header_len)? + sum) != 0xffff {
                return None;
            }
            sum
        }
        // pseudo + header + payload folds to 0xFFFF (negative zero), so
        // the payload's sum is the complement of the rest's.
        Next::Verified => u32::from(!fold(head_sum(next, &nip, ntcp.header_len)?)),
    };

    // Checksum delta: the pseudo-header's TCP length, the appended payload
    // (swapped if it lands at an odd offset of the segment), the PSH bit.
    let old_tcp_len = (head_len - hip.l4_offset) as u32;
    let new_tcp_len = (new_len - hip.l4_offset) as u32;
    let mut delta = if hip.src.is_ipv4() {
        replaced(
            &(old_tcp_len as u16).to_be_bytes(),
            &(new_tcp_len as u16).to_be_bytes(),
        )
    } else {
        replaced(&old_tcp_len.to_be_bytes(), &new_tcp_len.to_be_bytes())
    };
    delta += if htcp.payload_len % 2 == 1 {
        u32::from(fold(payload_sum).swap_bytes())
    } else {
        payload_sum
    };
    let l4 = hip.l4_offset;
    let flags_word = l4 + tcpf::DATA_OFF..l4 + tcpf::FLAGS + 1;
    let old_flags: [u8; 2] = buf[flags_word.clone()].try_into().ok()?;
    let mut new_flags = old_flags;
    new_flags[1] |= ntcp.flags & flags::PSH;
    delta += replaced(&old_flags, &new_flags);
    let csum_at = l4 + tcpf::CHECKSUM.start;
    let old_csum = u16::from_be_bytes([buf[csum_at], buf[csum_at + 1]]);
    let new_csum = nonzero(finish(u32::from(!old_csum) + delta));

    buf[head_len..new_len].copy_from_slice(payload);
    buf[flags_word].copy_from_slice(&new_flags);
    buf[csum_at..csum_at + 2].copy_from_slice(&new_csum.to_be_bytes());
    if hip.src.is_ipv4() {
        let old = (head_len as u16).to_be_bytes();
        let new = (new_len as u16).to_be_bytes();
        buf[ipv4::field::TOTAL_LEN].copy_from_slice(&new);
        let at = ipv4::field::CHECKSUM.start;
        let c = u16::from_be_bytes([buf[at], buf[at + 1]]);
        let c = finish(u32::from(!c) + replaced(&old, &new));
        buf[ipv4::field::CHECKSUM].copy_from_slice(&c.to_be_bytes());
    } else {
        let payload_len = ((new_len - ipv6::HEADER_LEN) as u16).to_be_bytes();
        buf[ipv6::field::PAYLOAD_LEN].copy_from_slice(&payload_len);
    }
    Some(new_len)
}

/// Segment `index` of the merged packet `pkt` cut back into payloads of
/// `size` bytes, written to `out`: what the device takes when it refuses
/// the merged packet (a kernel before 6.6 allocates a TUN write in one
/// piece, and a large one can fail with `ENOBUFS` when memory is
/// fragmented). Each segment has the merged headers with its own sequence
/// number, lengths and checksums (computed in full: the path is rare); PSH
/// stays on the last one only; IPv4 segments share the merged packet's
/// identification (they are atomic datagrams, DF set or not, RFC 6864).
/// Cut at the first merged segment's payload length, a run of equal
/// segments comes back as it was read. Returns the segment's length, or
/// `None` past the last segment, for `size` 0, a packet that is no plain
/// TCP data segment, or an `out` too short.
pub fn segment_at(pkt: &[u8], size: usize, index: usize, out: &mut [u8]) -> Option<usize> {
    let PlainTcp { ip, tcp } = parse_plain_tcp(pkt).filter(|p| p.tcp.flags & STOP == 0)?;
    let start = index.checked_mul(size)?;
    if size == 0 || start >= tcp.payload_len {
        return None;
    }
    let end = start.saturating_add(size).min(tcp.payload_len);
    let hdr = ip.l4_offset + tcp.header_len;
    let len = hdr + (end - start);
    let seg = out.get_mut(..len)?;
    seg[..hdr].copy_from_slice(&pkt[..hdr]);
    seg[hdr..].copy_from_slice(&pkt[hdr + start..hdr + end]);
    let l4 = ip.l4_offset;
    let seq = tcp.seq.wrapping_add(start as u32);
    seg[l4 + tcpf::SEQ.start..l4 + tcpf::SEQ.end].copy_from_slice(&seq.to_be_bytes());
    if end < tcp.payload_len {
        seg[l4 + tcpf::FLAGS] &= !flags::PSH;
    }
    if ip.src.is_ipv4() {
        seg[ipv4::field::TOTAL_LEN].copy_from_slice(&(len as u16).to_be_bytes());
        seg[ipv4::field::CHECKSUM].copy_from_slice(&[0, 0]);
        let c = finish(sum_bytes(&seg[..ipv4::HEADER_LEN]));
        seg[ipv4::field::CHECKSUM].copy_from_slice(&c.to_be_bytes());
    } else {
        let payload_len = ((len - ipv6::HEADER_LEN) as u16).to_be_bytes();
        seg[ipv6::field::PAYLOAD_LEN].copy_from_slice(&payload_len);
    }
    let seg_ip = parse_ip(seg).ok()?;
    checksum::fill_transport_checksum(seg, &seg_ip).then_some(len)
}

/// Whether a segment (its headers parsed, `packet::tcp::parse_plain_tcp`)
/// could start or continue a merge at all: it carries data and no flags
/// beyond ACK/PSH. The write-back asks it before it copies a segment aside
/// to merge into.
#[inline]
pub fn candidate_plain(p: &PlainTcp) -> bool {
    p.tcp.payload_len > 0 && p.tcp.flags & !flags::PSH == flags::ACK
}

/// The partial sum of the pseudo-header and the TCP header of `pkt`, its
/// checksum field included: with the payload's sum added, it folds to
/// 0xFFFF exactly when the checksum verifies.
fn head_sum(pkt: &[u8], ip: &IpInfo, header_len: usize) -> Option<u32> {
    let l4 = &pkt[ip.l4_offset..ip.len];
    let len = l4.len();
    let pseudo = match (ip.src, ip.dst) {
        (std::net::IpAddr::V4(s), std::net::IpAddr::V4(d)) => {
            checksum::pseudo_header_v4(s, d, protocol::TCP, len as u16)
        }
        (std::net::IpAddr::V6(s), std::net::IpAddr::V6(d)) => {
            checksum::pseudo_header_v6(&s, &d, protocol::TCP, len as u32)
        }
        _ => return None,
    };
    // The header is a whole number of 32-bit words, so the payload's sum
    // adds at an even offset.
    Some(pseudo + sum_bytes(&l4[..header_len]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::checksum::verify_transport_checksum;
    use crate::packet::parse_tcp;
    use crate::packet::tcp_flags::{ACK, FIN, PSH, RST, SYN};
    use crate::packet::testutil::{Rng, tcp_v4, tcp_v6};

    const C4: &str = "198.18.0.2:40000";
    const S4: &str = "198.18.0.1:5201";
    const C6: &str = "[fd00:18::2]:40000";
    const S6: &str = "[fd00:18::1]:5201";
    /// A timestamp option (NOP NOP TS), as Linux sends on every segment.
    const TS: [u8; 12] = [1, 1, 8, 10, 0, 0, 0, 7, 0, 0, 0, 9];

    fn seg(v6: bool, seq: u32, flags: u8, opts: &[u8], payload: &[u8]) -> Vec<u8> {
        if v6 {
            tcp_v6(C6, S6, &[], seq, 77, flags, opts, payload)
        } else {
            tcp_v4(C4, S4, seq, 77, flags, opts, payload)
        }
    }

    /// Merge `segs` in order into a 64 KiB buffer; the packets that result.
    fn merge_all(segs: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let out = merge_all_with(segs, append);
        if segs.iter().all(|s| parse_ip(s).is_ok() && valid(s)) {
            assert_eq!(
                merge_all_verified(segs),
                out,
                "verified and checked merges agree"
            );
        }
        out
    }

    /// [`merge_all`] with [`append_verified`], which the write-back's way
    /// ([`merge_all_plain`]) must match.
    fn merge_all_verified(segs: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let out = merge_all_with(segs, append_verified);
        assert_eq!(merge_all_plain(segs), out, "merging on parsed headers");
        out
    }

    /// [`merge_all_verified`] the way the write-back merges: each segment's
    /// headers parsed once and the head's carried from merge to merge
    /// ([`append_verified_plain`]), which must describe the merged packet
    /// as a fresh parse of it does.
    fn merge_all_plain(segs: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; MAX_PACKET];
        let mut len = 0;
        let mut head: Option<PlainTcp> = None;
        for s in segs {
            if let (Some(h), Some(n)) = (head.as_mut(), parse_plain_tcp(s))
                && append_verified_plain(&mut buf, h, s, &n)
            {
                len = h.ip.len;
                assert_eq!(
                    parse_plain_tcp(&buf[..len]),
                    Some(*h),
                    "the head after a merge"
                );
                continue;
            }
            if len > 0 {
                out.push(buf[..len].to_vec());
            }
            buf[..s.len()].copy_from_slice(s);
            len = s.len();
            head = parse_plain_tcp(s).filter(|p| p.ip.len == s.len());
        }
        if len > 0 {
            out.push(buf[..len].to_vec());
        }
        out
    }

    fn merge_all_with(
        segs: &[Vec<u8>],
        append: fn(&mut [u8], usize, &[u8]) -> Option<usize>,
    ) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; MAX_PACKET];
        let mut len = 0;
        for s in segs {
            if len > 0
                && let Some(n) = append(&mut buf, len, s)
            {
                len = n;
                continue;
            }
            if len > 0 {
                out.push(buf[..len].to_vec());
            }
            buf[..s.len()].copy_from_slice(s);
            len = s.len();
        }
        if len > 0 {
            out.push(buf[..len].to_vec());
        }
        out
    }

    fn valid(p: &[u8]) -> bool {
        let ip = parse_ip(p).expect("ip");
        let v4_ok = !ip.src.is_ipv4() || fold(sum_bytes(&p[..ipv4::HEADER_LEN])) == 0xffff;
        v4_ok && verify_transport_checksum(p, &ip)
    }

    #[test]
    fn a_run_becomes_the_segment_the_sender_could_have_sent() {
        for v6 in [false, true] {
            for opts in [&[][..], &TS[..]] {
                // Odd lengths put later payloads at odd offsets.
                let parts: [&[u8]; 4] = [b"hello", b" wor", b"ld, odd", b"!"];
                let mut seq = 1000u32;
                let mut segs = Vec::new();
                for (i, p) in parts.iter().enumerate() {
                    let f = if i == parts.len() - 1 { ACK | PSH } else { ACK };
                    segs.push(seg(v6, seq, f, opts, p));
                    seq += p.len() as u32;
                }
                let merged = merge_all(&segs);
                let want = seg(v6, 1000, ACK | PSH, opts, b"hello world, odd!");
                assert_eq!(merge_all_verified(&segs), merged);
                assert_eq!(merged, vec![want], "v6 {v6}, options {}", opts.len());
            }
        }
    }

    /// A merged run cut back at its first segment's size gives the very
    /// packets that were merged, byte for byte (IPv4 and IPv6, options or
    /// not, odd sizes, PSH on the last); a run of unequal segments comes
    /// back as valid segments carrying every byte in order.
    #[test]
    fn a_refused_merge_is_cut_back_into_the_segments_it_was() {
        let mut rng = Rng::new(66);
        for round in 0..if cfg!(miri) { 8 } else { 200 } {
            let v6 = round % 2 == 1;
            let opts: &[u8] = if round % 4 < 2 { &TS } else { &[] };
            let size = 1 + rng.below(1400);
            let n = 2 + rng.below(20);
            let last = 1 + rng.below(size);
            let mut seq = rng.next_u64() as u32;
            let first_seq = seq;
            let mut segs = Vec::new();
            let mut bytes = Vec::new();
            for i in 0..n {
                let len = if i == n - 1 { last } else { size };
                let payload: Vec<u8> = (0..len).map(|_| rng.byte()).collect();
                let f = if i == n - 1 && round % 3 == 0 {
                    ACK | PSH
                } else {
                    ACK
                };
                segs.push(seg(v6, seq, f, opts, &payload));
                bytes.extend_from_slice(&payload);
                seq = seq.wrapping_add(len as u32);
            }
            let merged = merge_all(&segs);
            assert_eq!(merged.len(), 1, "round {round}: one run");
            let mut out = vec![0u8; MAX_PACKET];
            let mut back = Vec::new();
            while let Some(len) = segment_at(&merged[0], size, back.len(), &mut out) {
                assert!(valid(&out[..len]), "round {round}");
                back.push(out[..len].to_vec());
            }
            assert_eq!(back, segs, "round {round}: v6 {v6}, size {size}, n {n}");
            // Cut elsewhere: other segments, the same bytes in order.
            let other = 1 + rng.below(3 * size);
            let mut got = Vec::new();
            let mut i = 0;
            while let Some(len) = segment_at(&merged[0], other, i, &mut out) {
                let ip = parse_ip(&out[..len]).expect("ip");
                let t = parse_tcp(&out[..len], &ip).expect("tcp");
                assert!(valid(&out[..len]));
                assert_eq!(t.seq, first_seq.wrapping_add(got.len() as u32));
                got.extend_from_slice(&out[ip.l4_offset + t.header_len..len]);
                i += 1;
            }
            assert_eq!(got, bytes, "round {round}: cut at {other}");
        }
        let one = seg(false, 1, ACK, &[], b"abc");
        let mut out = vec![0u8; 100];
        assert_eq!(segment_at(&one, 0, 0, &mut out), None, "size 0");
        assert_eq!(segment_at(&one, 3, 1, &mut out), None, "past the end");
        assert_eq!(segment_at(&one, 3, 0, &mut out[..10]), None, "short out");
        let syn = seg(false, 1, SYN, &[], b"");
        assert_eq!(segment_at(&syn, 3, 0, &mut out), None, "no data segment");
    }

    #[test]
    fn random_runs_match_a_segment_built_whole() {
        let mut rng = Rng::new(1624);
        // Miri runs the packet tests in CI: fewer rounds there.
        for round in 0..if cfg!(miri) { 8 } else { 400 } {
            let v6 = round % 2 == 1;
            let n = 1 + rng.below(6);
            let mut seq = rng.next_u64() as u32;
            let start = seq;
            let mut all = Vec::new();
            let mut segs = Vec::new();
            for i in 0..n {
                let len = 1 + rng.below(1400);
                let p: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
                let f = if i == n - 1 && rng.below(2) == 0 {
                    ACK | PSH
                } else {
                    ACK
                };
                segs.push(seg(v6, seq, f, &TS, &p));
                seq = seq.wrapping_add(len as u32);
                all.extend_from_slice(&p);
            }
            let last_psh = segs.last().is_some_and(|s| {
                let ip = parse_ip(s).expect("ip");
                parse_tcp(s, &ip).expect("tcp").flags & PSH != 0
            });
            let merged = merge_all(&segs);
            let want = seg(v6, start, if last_psh { ACK | PSH } else { ACK }, &TS, &all);
            assert_eq!(merged, vec![want.clone()], "round {round}");
            assert_eq!(merge_all_verified(&segs), merged, "round {round}");
            assert!(valid(&want));
        }
    }

    /// The payload sum read back from a checksum is a ones' complement
    /// zero of either sign where the payload sums to zero (all zeros) or to
    /// 0xFFFF (all ones), at even and odd offsets: the merged segment is
    /// still byte for byte the one a sender would have built whole.
    #[test]
    fn a_verified_merge_handles_payloads_that_sum_to_zero() {
        for v6 in [false, true] {
            for first in [&b"a"[..], b"ab"] {
                for fill in [0x00u8, 0xff] {
                    for len in [1usize, 2, 3, 6] {
                        let tail = vec![fill; len];
                        let segs = vec![
                            seg(v6, 500, ACK, &TS, first),
                            seg(v6, 500 + first.len() as u32, ACK, &TS, &tail),
                        ];
                        let all = [first, &tail[..]].concat();
                        let want = seg(v6, 500, ACK, &TS, &all);
                        assert_eq!(merge_all_verified(&segs), vec![want.clone()]);
                        assert_eq!(merge_all(&segs), vec![want]);
                    }
                }
            }
        }
    }

    /// A segment whose payload was spoilt after its checksum was computed,
    /// merged by `append_verified` (its checksum left to the kernel behind),
    /// spoils the merge's checksum, at either end of the run: the receiving
    /// TCP drops the merge rather than take the spoilt bytes.
    #[test]
    fn a_verified_merge_of_a_corrupt_segment_fails_its_checksum() {
        for v6 in [false, true] {
            for bad in 0..3 {
                let mut segs: Vec<Vec<u8>> = (0..3u32)
                    .map(|i| seg(v6, 100 + 5 * i, ACK, &TS, b"abcde"))
                    .collect();
                let last = segs[bad].len() - 1;
                segs[bad][last] ^= 0x10;
                let merged = merge_all_verified(&segs);
                assert_eq!(merged.len(), 1, "the run merges");
                let ip = parse_ip(&merged[0]).expect("ip");
                assert!(!verify_transport_checksum(&merged[0], &ip), "segment {bad}");
            }
        }
    }

    #[test]
    fn what_must_not_merge_stays_apart() {
        for v6 in [false, true] {
            let a = seg(v6, 100, ACK, &[], b"aaaa");
            // Out of order, a gap, a retransmit.
            for seq in [99, 105, 100] {
                assert_eq!(
                    merge_all(&[a.clone(), seg(v6, seq, ACK, &[], b"bb")]).len(),
                    2,
                    "seq {seq}"
                );
            }
            // FIN, RST, SYN inside a run; a PSH ends it.
            for f in [ACK | FIN, ACK | RST, SYN | ACK] {
                assert_eq!(
                    merge_all(&[a.clone(), seg(v6, 104, f, &[], b"bb")]).len(),
                    2,
                    "flags {f:#x}"
                );
            }
            let pushed = seg(v6, 100, ACK | PSH, &[], b"aaaa");
            assert_eq!(merge_all(&[pushed, seg(v6, 104, ACK, &[], b"bb")]).len(), 2);
            // Pure ACKs (duplicate ACKs carry meaning) and different options.
            assert_eq!(
                merge_all(&[seg(v6, 100, ACK, &[], b""), seg(v6, 100, ACK, &[], b"")]).len(),
                2
            );
            let mut ts2 = TS;
            ts2[7] = 8;
            assert_eq!(
                merge_all(&[
                    seg(v6, 100, ACK, &TS, b"aaaa"),
                    seg(v6, 104, ACK, &ts2, b"bb")
                ])
                .len(),
                2
            );
        }
        // Another flow (ports, then family).
        let a = seg(false, 100, ACK, &[], b"aaaa");
        let other = tcp_v4("198.18.0.2:40001", S4, 104, 77, ACK, &[], b"bb");
        assert_eq!(merge_all(&[a.clone(), other]).len(), 2);
        assert_eq!(merge_all(&[a, seg(true, 104, ACK, &[], b"bb")]).len(), 2);
    }

    #[test]
    fn a_corrupted_next_segment_is_not_folded_in() {
        for v6 in [false, true] {
            let a = seg(v6, 100, ACK, &[], b"aaaa");
            let mut b = seg(v6, 104, ACK, &[], b"bbbb");
            let last = b.len() - 1;
            b[last] ^= 0x20;
            assert_eq!(merge_all(&[a, b]).len(), 2);
        }
    }

    #[test]
    fn the_result_never_outgrows_the_buffer_or_an_ip_packet() {
        let a = seg(false, 0, ACK, &[], &[1; 1000]);
        let b = seg(false, 1000, ACK, &[], &[2; 1000]);
        let mut buf = vec![0u8; a.len() + 999];
        buf[..a.len()].copy_from_slice(&a);
        assert_eq!(append(&mut buf, a.len(), &b), None, "no room");
        assert_eq!(buf[..a.len()], a[..], "untouched");
        // 44 segments of 1460 bytes reach the 16-bit IP length limit.
        let mut segs = Vec::new();
        for i in 0..50u32 {
            segs.push(seg(false, i * 1460, ACK, &[], &[i as u8; 1460]));
        }
        let merged = merge_all(&segs);
        assert_eq!(merged.len(), 2);
        assert!(merged.iter().all(|p| p.len() <= MAX_PACKET && valid(p)));
        let candidate = |p: &[u8]| parse_plain_tcp(p).is_some_and(|h| candidate_plain(&h));
        assert!(candidate(&segs[0]) && !candidate(&seg(false, 0, ACK, &[], b"")));
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_never_change_a_refused_head() {
        let mut rng = Rng::new(7);
        let head = seg(false, 100, ACK, &TS, b"head");
        for _ in 0..if cfg!(miri) { 50 } else { 2000 } {
            let len = rng.below(120);
            let mut next: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            if rng.below(2) == 0 && next.len() > 20 {
                next[0] = 0x45;
            }
            let mut buf = vec![0u8; 4096];
            buf[..head.len()].copy_from_slice(&head);
            let before = buf.clone();
            if append(&mut buf, head.len(), &next).is_none() {
                assert_eq!(buf, before);
            }
            let _ = parse_plain_tcp(&next).map(|h| candidate_plain(&h));
        }
    }
}
