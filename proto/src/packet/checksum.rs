//! The Internet checksum (RFC 1071) as partial sums, and the RFC 1624
//! incremental update used by the in-place NAT rewrite.
//!
//! A *partial sum* is a `u32` holding a ones' complement sum that has been
//! folded to at most 16 bits but not complemented. Partial sums of
//! even-length pieces may simply be added (up to 2^16 of them fit in a `u32`)
//! and are folded and complemented once at the end ([`finish`]); this is the
//! "defer the carries" trick of RFC 1071 section 2(C). Only the last piece of
//! a message may have odd length (RFC 1071 4.1 pads it with a zero byte).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{IpInfo, protocol};

/// Partial sum of `data` taken as big-endian 16-bit words.
///
/// Summed as native-order 64-bit words with end-around carry, and swapped
/// once at the end on a little-endian machine: the sum of 16-bit words
/// taken in the other byte order is the byte-swapped sum (RFC 1071 2(B)),
/// and since 2^16 is congruent to 1 modulo 0xFFFF, a 64-bit word counts as
/// the sum of its four 16-bit halves and each carry out of it as 1. About
/// half the instructions of summing 32-bit big-endian words
/// (docs/notes.md, "The checksum sum").
#[inline]
pub fn sum_bytes(data: &[u8]) -> u32 {
    let mut acc: u64 = 0;
    let mut carries: u64 = 0;
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let mut word = [0u8; 8];
        word.copy_from_slice(w);
        let (sum, carry) = acc.overflowing_add(u64::from_ne_bytes(word));
        acc = sum;
        carries += u64::from(carry);
    }
    let rest = words.remainder();
    let tail = if rest.is_empty() { 0 } else { tail_sum(rest) };
    let (sum, carry) = acc.overflowing_add(tail);
    carries += u64::from(carry);
    let folded = fold64((sum & 0xffff_ffff) + (sum >> 32) + carries);
    if cfg!(target_endian = "little") {
        u32::from((folded as u16).swap_bytes())
    } else {
        folded
    }
}

/// The 1 to 7 bytes after [`sum_bytes`]'s last whole word, as a value to
/// add to its accumulator: a 4-, a 2- and a 1-byte piece by the length's
/// bits, each on 16-bit lanes of the words' byte order (which lanes does
/// not matter: 2^16 is 1 modulo 0xFFFF), and a last odd byte as the high
/// half of a word whose low half is zero (RFC 1071 4.1), its lane's first
/// byte in memory. The tail used to be copied into a zeroed word: a copy of
/// run-time length, which became a call to the C library's `memcpy` and a
/// word loaded from bytes just stored one by one, most of the time of the
/// short sums (addresses, headers) each packet takes (docs/notes.md, "The
/// checksum sum").
#[inline]
fn tail_sum(mut rest: &[u8]) -> u64 {
    let mut tail: u64 = 0;
    if let [a, b, c, d, more @ ..] = rest {
        tail += u64::from(u32::from_ne_bytes([*a, *b, *c, *d]));
        rest = more;
    }
    if let [a, b, more @ ..] = rest {
        tail += u64::from(u16::from_ne_bytes([*a, *b]));
        rest = more;
    }
    if let [a] = rest {
        tail += u64::from(u16::from_ne_bytes([*a, 0]));
    }
    tail
}

/// Folds a 64-bit accumulator to a 16-bit-wide partial sum (end-around carry).
#[inline]
const fn fold64(mut acc: u64) -> u32 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u32
}

/// Folds a partial sum to 16 bits with end-around carry. Two rounds are
/// enough: the first leaves at most 0x1FFFE, the second at most 0xFFFF.
#[inline]
pub const fn fold(sum: u32) -> u16 {
    let s = (sum & 0xffff) + (sum >> 16);
    let s = (s & 0xffff) + (s >> 16);
    s as u16
}

/// Folds and complements: the value to store in a checksum field.
#[inline]
pub const fn finish(sum: u32) -> u16 {
    !fold(sum)
}

/// The `~m + m'` term of RFC 1624 eqn. 3 for every 16-bit word replaced
/// when `old` becomes `new` (same even length), as one partial sum.
///
/// `~m` summed over the words equals the complement of their folded sum
/// (negation is complement in ones' complement arithmetic), so this costs
/// two sums, not one per word.
#[inline]
pub fn replaced(old: &[u8], new: &[u8]) -> u32 {
    u32::from(!fold(sum_bytes(old))) + sum_bytes(new)
}

/// Writes `new` over `field` (of the same length) and returns the
/// [`replaced`] delta of the change.
#[inline]
pub(crate) fn overwrite(field: &mut [u8], new: &[u8]) -> u32 {
    let delta = replaced(field, new);
    field.copy_from_slice(new);
    delta
}

/// RFC 1624 eqn. 3: `HC' = ~(~HC + ~m + m')`, with `delta` the accumulated
/// `~m + m'` of all replaced words (see [`replaced`]), folded once.
///
/// Eqn. 3 (unlike eqn. 2 of RFC 1141) yields 0xFFFF only when every term
/// is zero. It can still yield 0x0000 where a full sum gives 0xFFFF: when
/// every covered word is zero after the change, the running sum lands on
/// 0xFFFF (ones' complement -0) instead of 0, and a receiver that folds
/// and complements rejects the zero. Only a checksum without a pseudo
/// header can cover nothing but zeros (an ICMPv4 echo reply with id,
/// sequence and data all zero, found by the `packet` fuzz target); writing
/// every updated transport checksum through [`nonzero`] covers it, since
/// 0xFFFF verifies for any data whose sum is 0 or 0xFFFF.
#[inline]
pub const fn update(checksum: u16, delta: u32) -> u16 {
    !fold(!checksum as u32 + delta)
}

/// TCP, UDP and ICMP write a computed checksum of 0x0000 as 0xFFFF, its
/// other ones' complement representation: for UDP a transmitted zero means
/// "no checksum" (RFC 768, RFC 8200 8.1); for TCP both verify; for an
/// incremental update of a message that is all zeros, only 0xFFFF does
/// (see [`update`]). One rule, so a rewrite never emits 0x0000.
#[inline]
pub const fn nonzero(checksum: u16) -> u16 {
    if checksum == 0 { 0xffff } else { checksum }
}

/// Partial sum of the IPv4 pseudo-header (RFC 793 3.1 / RFC 9293 3.1,
/// RFC 768): source, destination, zero, protocol, transport length.
#[inline]
pub fn pseudo_header_v4(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, len: u16) -> u32 {
    sum_bytes(&src.octets()) + sum_bytes(&dst.octets()) + u32::from(protocol) + u32::from(len)
}

/// Partial sum of the IPv6 pseudo-header (RFC 8200 8.1): source,
/// destination, 32-bit upper-layer length, 24 zero bits, next header.
#[inline]
pub fn pseudo_header_v6(src: &Ipv6Addr, dst: &Ipv6Addr, next_header: u8, len: u32) -> u32 {
    sum_bytes(&src.octets())
        + sum_bytes(&dst.octets())
        + (len >> 16)
        + (len & 0xffff)
        + u32::from(next_header)
}

/// Offset of the checksum field inside the transport header of `protocol`,
/// for the four protocols whose checksum this module knows.
pub fn checksum_offset(protocol: u8) -> Option<usize> {
    match protocol {
        protocol::TCP => Some(16),
        protocol::UDP => Some(6),
        protocol::ICMP | protocol::ICMPV6 => Some(2),
        _ => None,
    }
}

/// Partial sum over the transport segment of `ip` (checksum field included
/// as stored) plus its pseudo-header, and the stored field. `None` if the
/// protocol has no known checksum, the segment is too short to hold the
/// field, `ip` does not fit `buf`, or ICMP is carried by the wrong family.
fn transport_sum(buf: &[u8], ip: &IpInfo) -> Option<(u32, u16)> {
    segment_sum(buf, ip, ip.len)
}

/// [`transport_sum`] over `buf[ip.l4_offset..end]`: a UDP datagram ends
/// where its length field says, which may be before the IP payload does
/// (RFC 768: the pseudo-header carries the UDP length).
fn segment_sum(buf: &[u8], ip: &IpInfo, end: usize) -> Option<(u32, u16)> {
    let field = checksum_offset(ip.protocol)?;
    if end > ip.len {
        return None;
    }
    let seg = buf.get(ip.l4_offset..end)?;
    let stored = seg.get(field..field + 2)?;
    let stored = u16::from_be_bytes([stored[0], stored[1]]);
    let len = u32::try_from(seg.len()).ok()?;
    let pseudo = match (ip.src, ip.dst, ip.protocol) {
        // ICMPv4 has no pseudo-header (RFC 792); ICMPv6 does (RFC 4443 2.3).
        (IpAddr::V4(_), IpAddr::V4(_), protocol::ICMP) => 0,
        (IpAddr::V4(s), IpAddr::V4(d), p) if p != protocol::ICMPV6 => {
            pseudo_header_v4(s, d, p, u16::try_from(len).ok()?)
        }
        (IpAddr::V6(s), IpAddr::V6(d), p) if p != protocol::ICMP => {
            pseudo_header_v6(&s, &d, p, len)
        }
        _ => return None,
    };
    Some((pseudo + sum_bytes(seg), stored))
}

/// The checksum the transport header of `ip` should carry, computed over
/// the whole segment as if its checksum field were zero. TCP and UDP results
/// go through [`nonzero`]. Costs a pass over the payload: tests, the RST and
/// UDP builders, and fuzzing use it, never the rewrite.
pub fn compute_transport_checksum(buf: &[u8], ip: &IpInfo) -> Option<u16> {
    let (sum, stored) = transport_sum(buf, ip)?;
    // Adding ~field removes the stored field from the sum (ones' complement
    // subtraction), which is the sum "with the field zeroed".
    let c = finish(sum + u32::from(!stored));
    Some(match ip.protocol {
        protocol::TCP | protocol::UDP => nonzero(c),
        _ => c,
    })
}

/// Writes [`compute_transport_checksum`] into the packet. Returns false (and
/// writes nothing) when it cannot be computed.
pub fn fill_transport_checksum(buf: &mut [u8], ip: &IpInfo) -> bool {
    let Some(c) = compute_transport_checksum(buf, ip) else {
        return false;
    };
    let Some(field) = checksum_offset(ip.protocol) else {
        return false;
    };
    match buf.get_mut(ip.l4_offset + field..ip.l4_offset + field + 2) {
        Some(f) => {
            f.copy_from_slice(&c.to_be_bytes());
            true
        }
        None => false,
    }
}

/// Whether the transport checksum of `ip` verifies: the sum over
/// pseudo-header and segment, checksum included, folds to 0xFFFF (RFC 1071
/// "the result will be all 1 bits"). A zero UDP checksum over IPv4 means the
/// sender computed none (RFC 768) and verifies; over IPv6 it is invalid
/// (RFC 8200 8.1). False when the checksum cannot be computed.
pub fn verify_transport_checksum(buf: &[u8], ip: &IpInfo) -> bool {
    verify_segment(buf, ip, ip.len)
}

/// [`verify_transport_checksum`] over the segment `buf[ip.l4_offset..end]`
/// (`end` <= `ip.len`): what the uplink checks before a packet may create
/// state or reach an outbound. One pass over the payload, with the same
/// 32-bit-word summing the rest of this module uses.
///
/// Packets from the Linux offload reader verify too: tun-rs completes a
/// `CHECKSUM_PARTIAL` packet's checksum (`gso_none_checksum`) and computes
/// every segment's in full when it splits a super-packet. A completed sum
/// of +0 stored as 0x0000 instead of 0xFFFF still folds to 0xFFFF here.
#[inline]
pub fn verify_segment(buf: &[u8], ip: &IpInfo, end: usize) -> bool {
    match segment_sum(buf, ip, end) {
        Some((_, 0)) if ip.protocol == protocol::UDP && ip.src.is_ipv4() => true,
        Some((sum, _)) => fold(sum) == 0xffff,
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::testutil::{Rng, reference_sum};
    use proptest::prelude::*;

    #[test]
    fn rfc1071_example() {
        // RFC 1071 3: bytes 00 01 f2 03 f4 f5 f6 f7 sum to ddf2 (folded).
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(fold(sum_bytes(&data)), 0xddf2);
        assert_eq!(finish(sum_bytes(&data)), !0xddf2);
    }

    #[test]
    fn odd_lengths_pad_low_byte() {
        assert_eq!(fold(sum_bytes(&[0xab])), 0xab00);
        assert_eq!(fold(sum_bytes(&[0x01, 0x02, 0x03])), 0x0102 + 0x0300);
        assert_eq!(sum_bytes(&[]), 0);
    }

    #[test]
    fn fold_bounds() {
        assert_eq!(fold(0), 0);
        assert_eq!(fold(0xffff), 0xffff);
        assert_eq!(fold(0x1_0000), 1);
        assert_eq!(fold(0x1_fffe), 0xffff);
        assert_eq!(fold(u32::MAX), 0xffff);
    }

    /// Every tail length (0-7 bytes after the last whole word) after 0 to
    /// 9 whole words, at every alignment of the slice.
    #[test]
    fn every_tail_and_offset_matches_reference() {
        let data: Vec<u8> = (0..80u32).map(|i| (i * 151 + 7) as u8).collect();
        for offset in 0..8 {
            for len in 0..=72 {
                let s = &data[offset..offset + len];
                assert_eq!(fold(sum_bytes(s)), reference_sum(s), "{len} at {offset}");
            }
        }
        assert_eq!(fold(sum_bytes(&[0xff; 7])), reference_sum(&[0xff; 7]));
    }

    proptest! {
        #[test]
        fn sum_matches_reference(data in proptest::collection::vec(any::<u8>(), 0..2000)) {
            prop_assert_eq!(fold(sum_bytes(&data)), reference_sum(&data));
        }

        #[test]
        fn partial_sums_add(a in proptest::collection::vec(any::<u16>(), 0..300),
                            b in proptest::collection::vec(any::<u8>(), 0..300)) {
            let a: Vec<u8> = a.iter().flat_map(|w| w.to_be_bytes()).collect();
            let whole: Vec<u8> = a.iter().chain(b.iter()).copied().collect();
            prop_assert_eq!(fold(sum_bytes(&a) + sum_bytes(&b)), fold(sum_bytes(&whole)));
        }
    }

    /// RFC 1624 eqn. 3 over random messages and random replacements agrees
    /// with recomputing from scratch, including the all-ones corner.
    #[test]
    fn incremental_matches_full() {
        let mut rng = Rng::new(0x1624);
        // Miri interprets every instruction; a few hundred cases still cover
        // the corner cases there, the native run does the volume.
        let rounds = if cfg!(miri) { 200 } else { 20_000 };
        for _ in 0..rounds {
            let len = 2 * rng.below(40) + 2;
            let mut msg: Vec<u8> = (0..len).map(|_| rng.byte()).collect();
            if rng.below(8) == 0 {
                // Messages that sum to 0xFFFF exercise the zero result.
                msg.iter_mut().for_each(|b| *b = 0xff);
            }
            let hc = finish(sum_bytes(&msg));
            let at = 2 * rng.below(len / 2);
            let n = 2 * (1 + rng.below((len - at) / 2));
            let new: Vec<u8> = (0..n).map(|_| rng.byte()).collect();
            let delta = replaced(&msg[at..at + n], &new);
            msg[at..at + n].copy_from_slice(&new);
            let full = finish(sum_bytes(&msg));
            let inc = update(hc, delta);
            if msg.iter().all(|&b| b == 0) {
                // The only disagreement: a message of zeros sums to +0,
                // whose complement a full computation writes as 0xFFFF while
                // eqn. 3 (nonzero terms) yields the equivalent 0x0000.
                assert_eq!((inc, full), (0, 0xffff));
            } else {
                // Otherwise they agree exactly, not just modulo the zeros.
                assert_eq!(inc, full, "msg {msg:02x?}");
            }
        }
    }

    #[test]
    fn nonzero_maps_only_zero() {
        assert_eq!(nonzero(0), 0xffff);
        assert_eq!(nonzero(1), 1);
        assert_eq!(nonzero(0xffff), 0xffff);
    }
}
