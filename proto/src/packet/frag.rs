//! Reassembly of the IP fragments an app sends (RFC 791 3.2, RFC 8200 4.5),
//! bounded: a datagram larger than the TUN's MTU leaves the app's kernel as
//! fragments, which the engine must put back together before its payload
//! can be relayed.
//!
//! Only UDP datagrams are reassembled (TCP never needs it: its segments are
//! sized by the MSS). The rules:
//!
//! * overlapping fragments discard the whole datagram (RFC 5722 for IPv6,
//!   and for IPv4 too: a correct sender never overlaps, and an overlap is
//!   how a fragment rewrites what a filter already judged, RFC 1858), a
//!   fragment inside what is held already is a duplicate and ignored;
//! * every fragment but the last carries a multiple of 8 bytes, and none
//!   may end past 65535 bytes of datagram;
//! * the first fragment must hold the whole header chain up to and
//!   including the UDP header (RFC 7112); tiny or offset-1 fragments
//!   (RFC 1858) cannot then overwrite it;
//! * an incomplete datagram is discarded after [`Limits::timeout`].
//!
//! Memory is bounded per source address and in total; a datagram that
//! would go past a bound first evicts the oldest one (of that source, or of
//! all). Every discard is reported to the caller ([`FragDrop`]), which
//! counts it. Nothing here reads a clock or does I/O: `now` is passed in.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use super::{ipv4, ipv6, protocol, udp};

/// Bounds of one reassembler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes held in incomplete datagrams, all sources together.
    pub total_bytes: usize,
    /// Bytes held for one source address.
    pub per_source_bytes: usize,
    /// How long an incomplete datagram is kept (Linux `ipfrag_time`: 30 s).
    pub timeout: Duration,
    /// Incomplete datagrams held at once: each fragment looks its datagram
    /// up among them, so this bounds the work per fragment too.
    pub max_datagrams: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            total_bytes: 1 << 20,
            per_source_bytes: 256 << 10,
            timeout: Duration::from_secs(30),
            max_datagrams: 256,
        }
    }
}

/// Why a fragment (or the datagram it belonged to) was discarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragDrop {
    /// It overlaps a fragment already held: the whole datagram goes.
    Overlap,
    /// Malformed: not a multiple of 8 bytes before the last, past 65535
    /// bytes, empty, a first fragment without the UDP header, a last
    /// fragment that disagrees with the length already known, not UDP.
    Malformed,
    /// The datagram went past a memory bound, or was evicted for a newer one.
    NoRoom,
    /// The datagram did not complete within the timeout.
    Timeout,
    /// An exact copy of a fragment already held: ignored, the datagram is
    /// kept (Linux counts these as dropped too).
    Duplicate,
}

/// One fragment, parsed.
struct Fragment<'a> {
    key: Key,
    offset: usize,
    more: bool,
    data: &'a [u8],
    /// The offset-0 fragment's headers before the fragment data (IPv4: the
    /// IP header; IPv6: the fixed and unfragmentable headers) and where the
    /// next-header byte to restore sits (IPv6).
    head: Option<(&'a [u8], usize)>,
    /// Protocol of the fragmented payload.
    proto: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    src: IpAddr,
    dst: IpAddr,
    id: u32,
    v6: bool,
}

#[derive(Debug)]
struct Datagram {
    key: Key,
    first: Instant,
    /// Headers of the offset-0 fragment, once it came; the byte to patch.
    head: Option<(Vec<u8>, usize)>,
    /// Payload bytes at their offsets.
    data: Vec<u8>,
    /// Received ranges, sorted, disjoint.
    have: Vec<(usize, usize)>,
    /// Payload length, once the last fragment came.
    total: Option<usize>,
    proto: u8,
    /// The longest fragment (whole IP packet) that came.
    longest: usize,
}

/// What a datagram costs besides its bytes (its entry, ranges and
/// headers), so many tiny ones cannot slip under the byte bounds.
const OVERHEAD: usize = 128;

impl Datagram {
    fn held(&self) -> usize {
        OVERHEAD + self.data.capacity() + self.head.as_ref().map_or(0, |h| h.0.capacity())
    }
}

/// The reassembler of one engine's uplink.
#[derive(Debug)]
pub struct Reassembler {
    limits: Limits,
    /// Incomplete datagrams, oldest first.
    pending: Vec<Datagram>,
    held: usize,
    /// The longest fragment of the datagram the last [`Reassembler::push`]
    /// completed.
    last_longest: usize,
}

/// Largest IP payload a datagram may reassemble to.
const MAX_PAYLOAD: usize = 65_535;

impl Reassembler {
    pub fn new(limits: Limits) -> Self {
        Reassembler {
            limits,
            pending: Vec::new(),
            held: 0,
            last_longest: 0,
        }
    }

    /// The length of the longest fragment (a whole IP packet) of the
    /// datagram the last [`Reassembler::push`] completed: what the path
    /// from its source carried in one packet, so a reply of that size
    /// comes back the same way (0 before any datagram completed).
    pub fn longest_fragment(&self) -> usize {
        self.last_longest
    }

    /// Incomplete datagrams held.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Bytes held in incomplete datagrams.
    pub fn held_bytes(&self) -> usize {
        self.held
    }

    /// Take one fragment (`pkt`, a whole IP packet that `parse_ip` refused
    /// as a fragment). `Ok(Some(n))`: the datagram is complete and `out`
    /// holds it, `n` bytes, as one unfragmented IP packet. `Ok(None)`: held.
    /// `Err`: this fragment (and, for `Overlap`, its datagram) is discarded;
    /// `dropped` is called once per other datagram discarded on the way
    /// (evicted for room, or expired).
    pub fn push(
        &mut self,
        pkt: &[u8],
        now: Instant,
        out: &mut Vec<u8>,
        mut dropped: impl FnMut(FragDrop),
    ) -> Result<Option<usize>, FragDrop> {
        self.expire(now, &mut dropped);
        let f = parse(pkt)?;
        if f.proto != protocol::UDP {
            return Err(FragDrop::Malformed);
        }
        let end = f.offset + f.data.len();
        if end > MAX_PAYLOAD || (f.more && (f.data.is_empty() || f.data.len() % 8 != 0)) {
            return Err(FragDrop::Malformed);
        }
        if f.offset == 0 && f.data.len() < udp::HEADER_LEN {
            return Err(FragDrop::Malformed); // RFC 7112 / RFC 1858
        }
        if f.offset == 0 && !f.more {
            // An atomic fragment (RFC 6946): whole already.
            let (head, nh_at) = f.head.ok_or(FragDrop::Malformed)?;
            let whole = Whole {
                v6: f.key.v6,
                proto: f.proto,
                head,
                nh_at,
                data: f.data,
            };
            self.last_longest = pkt.len();
            return whole.write(out).map(Some);
        }
        let i = match self.pending.iter().position(|d| d.key == f.key) {
            Some(i) => i,
            None => {
                self.make_room(f.key.src, end, &mut dropped)?;
                self.pending.push(Datagram {
                    key: f.key,
                    first: now,
                    head: None,
                    data: Vec::new(),
                    have: Vec::new(),
                    total: None,
                    proto: f.proto,
                    longest: 0,
                });
                self.pending.len() - 1
            }
        };
        let before = self.pending[i].held();
        if self.pending[i].have.is_empty() {
            self.held += OVERHEAD; // a new entry, before its bytes
        }
        match add(&mut self.pending[i], &f, end) {
            Ok(()) => {}
            Err(FragDrop::Duplicate) => return Err(FragDrop::Duplicate),
            Err(e) => {
                // Overlapping or inconsistent: the whole datagram is suspect.
                self.pending.remove(i);
                self.held -= before.min(self.held);
                return Err(e);
            }
        }
        let d = &mut self.pending[i];
        d.longest = d.longest.max(pkt.len());
        let after = d.held();
        self.held += after.saturating_sub(before);
        let d = &self.pending[i];
        let complete = d.head.is_some()
            && d.total
                .is_some_and(|t| d.have.len() == 1 && d.have[0] == (0, t));
        if !complete {
            if self.source_held(f.key.src) > self.limits.per_source_bytes
                || self.held > self.limits.total_bytes
            {
                let d = self.pending.remove(i);
                self.held -= d.held().min(self.held);
                return Err(FragDrop::NoRoom);
            }
            return Ok(None);
        }
        let d = self.pending.remove(i);
        self.held -= d.held().min(self.held);
        let (Some((head, nh_at)), Some(total)) = (&d.head, d.total) else {
            return Err(FragDrop::Malformed); // complete implies both
        };
        let whole = Whole {
            v6: d.key.v6,
            proto: d.proto,
            head,
            nh_at: *nh_at,
            data: d.data.get(..total).ok_or(FragDrop::Malformed)?,
        };
        self.last_longest = d.longest;
        whole.write(out).map(Some)
    }

    /// Discard datagrams older than the timeout.
    pub fn expire(&mut self, now: Instant, mut dropped: impl FnMut(FragDrop)) {
        let timeout = self.limits.timeout;
        let mut held = self.held;
        self.pending.retain(|d| {
            let keep = now.saturating_duration_since(d.first) < timeout;
            if !keep {
                held -= d.held().min(held);
                dropped(FragDrop::Timeout);
            }
            keep
        });
        self.held = held;
    }

    fn source_held(&self, src: IpAddr) -> usize {
        self.pending
            .iter()
            .filter(|d| d.key.src == src)
            .map(Datagram::held)
            .sum()
    }

    /// Evict the oldest datagrams (of `src` first) until one of `want`
    /// bytes fits both bounds; `NoRoom` if it never could.
    fn make_room(
        &mut self,
        src: IpAddr,
        want: usize,
        dropped: &mut impl FnMut(FragDrop),
    ) -> Result<(), FragDrop> {
        if want > self.limits.per_source_bytes || want > self.limits.total_bytes {
            return Err(FragDrop::NoRoom);
        }
        while self.source_held(src) + want > self.limits.per_source_bytes {
            let Some(i) = self.pending.iter().position(|d| d.key.src == src) else {
                break;
            };
            let d = self.pending.remove(i);
            self.held -= d.held().min(self.held);
            dropped(FragDrop::NoRoom);
        }
        while (self.held + want > self.limits.total_bytes
            || self.pending.len() >= self.limits.max_datagrams)
            && !self.pending.is_empty()
        {
            let d = self.pending.remove(0);
            self.held -= d.held().min(self.held);
            dropped(FragDrop::NoRoom);
        }
        Ok(())
    }
}

/// Add fragment `f` (ending at `end`) to `d`.
fn add(d: &mut Datagram, f: &Fragment<'_>, end: usize) -> Result<(), FragDrop> {
    if f.proto != d.proto {
        return Err(FragDrop::Malformed);
    }
    if !f.more {
        match d.total {
            Some(t) if t != end => return Err(FragDrop::Malformed),
            _ => {}
        }
        if d.have.last().is_some_and(|&(_, e)| e > end) {
            return Err(FragDrop::Malformed);
        }
        d.total = Some(end);
    } else if d.total.is_some_and(|t| end > t) {
        return Err(FragDrop::Malformed);
    }
    // Sorted, disjoint ranges: `at` is the first starting after `offset`.
    // Inside what is held already: a duplicate (kept out, datagram kept);
    // reaching into it: an overlap. The Linux kernel's rule
    // (`inet_frag_queue_insert`), RFC 5722 with its erratum 3089.
    let at = d.have.partition_point(|&(s, _)| s <= f.offset);
    if at > 0 && end <= d.have[at - 1].1 {
        return Err(FragDrop::Duplicate);
    }
    let overlaps_prev = at > 0 && d.have[at - 1].1 > f.offset;
    let overlaps_next = d.have.get(at).is_some_and(|&(s, _)| s < end);
    if overlaps_prev || overlaps_next {
        return Err(FragDrop::Overlap);
    }
    if d.data.len() < end {
        d.data.resize(end, 0);
    }
    d.data[f.offset..end].copy_from_slice(f.data);
    // Merge with neighbours that touch.
    let mut range = (f.offset, end);
    let mut at = at;
    if at > 0 && d.have[at - 1].1 == range.0 {
        range.0 = d.have[at - 1].0;
        d.have.remove(at - 1);
        at -= 1;
    }
    if d.have.get(at).is_some_and(|&(s, _)| s == range.1) {
        range.1 = d.have[at].1;
        d.have.remove(at);
    }
    d.have.insert(at, range);
    if f.offset == 0
        && let Some((head, nh_at)) = f.head
    {
        d.head = Some((head.to_vec(), nh_at));
    }
    Ok(())
}

/// A complete datagram's parts: the offset-0 fragment's headers and the
/// reassembled payload.
struct Whole<'a> {
    v6: bool,
    proto: u8,
    head: &'a [u8],
    /// Where the next-header byte to restore sits (IPv6).
    nh_at: usize,
    data: &'a [u8],
}

impl Whole<'_> {
    /// Write it into `out` as one unfragmented IP packet; its length.
    /// `Malformed` if it would exceed 65535 bytes.
    fn write(&self, out: &mut Vec<u8>) -> Result<usize, FragDrop> {
        let len = self.head.len() + self.data.len();
        let max = if self.v6 {
            ipv6::HEADER_LEN + MAX_PAYLOAD
        } else {
            MAX_PAYLOAD
        };
        if len > max || self.nh_at >= self.head.len() {
            return Err(FragDrop::Malformed);
        }
        out.clear();
        out.extend_from_slice(self.head);
        out.extend_from_slice(self.data);
        if self.v6 {
            // Payload length, and the next header the fragment header named.
            let plen = (len - ipv6::HEADER_LEN) as u16;
            out[4..6].copy_from_slice(&plen.to_be_bytes());
            out[self.nh_at] = self.proto;
        } else {
            out[2..4].copy_from_slice(&(len as u16).to_be_bytes());
            out[6..8].copy_from_slice(&[0, 0]); // no MF, offset 0 (DF cleared)
            out[10..12].copy_from_slice(&[0, 0]);
            let ihl = self.head.len();
            let c = super::checksum::finish(super::checksum::sum_bytes(&out[..ihl]));
            out[10..12].copy_from_slice(&c.to_be_bytes());
        }
        Ok(len)
    }
}

/// Write the fragment of `pkt` (a whole, unfragmented IP packet without
/// IPv6 extension headers, as `udp::write_udp_headers` builds them) that
/// starts at payload offset `offset` into `out`, each fragment at most
/// `mtu` bytes: the reply side of reassembly, for datagrams larger than the
/// TUN's MTU (the app's stack reassembles them). IPv4 fragments carry the
/// header with DF cleared, MF and the offset (RFC 791 3.2); IPv6 ones a
/// Fragment header after the fixed header (RFC 8200 4.5), as a source node
/// may add. `id` is the datagram's identification. Returns the fragment's
/// length and the next offset (`None` once the payload is done, or if the
/// MTU leaves no room for 8 payload bytes, `out` is too small, or `pkt` is
/// not such a packet).
pub fn fragment_at(
    pkt: &[u8],
    mtu: usize,
    id: u32,
    offset: usize,
    out: &mut [u8],
) -> Option<(usize, usize)> {
    let (head, room) = match pkt.first()? >> 4 {
        4 => (ipv4::HEADER_LEN, mtu.checked_sub(ipv4::HEADER_LEN)?),
        6 => (
            ipv6::HEADER_LEN,
            mtu.checked_sub(ipv6::HEADER_LEN + FRAG_HEADER_LEN)?,
        ),
        _ => return None,
    };
    let chunk = room & !7;
    let payload = pkt.get(head..)?;
    if chunk == 0 || offset >= payload.len() || offset % 8 != 0 {
        return None;
    }
    let n = chunk.min(payload.len() - offset);
    let more = offset + n < payload.len();
    let data = &payload[offset..offset + n];
    if head == ipv4::HEADER_LEN {
        if pkt[0] != 0x45 {
            return None; // options would need copying rules (RFC 791 3.1)
        }
        let len = head + n;
        let f = out.get_mut(..len)?;
        f[..head].copy_from_slice(&pkt[..head]);
        f[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        f[4..6].copy_from_slice(&(id as u16).to_be_bytes());
        let ff = (offset / 8) as u16 | if more { 0x2000 } else { 0 };
        f[6..8].copy_from_slice(&ff.to_be_bytes());
        f[10..12].copy_from_slice(&[0, 0]);
        let c = super::checksum::finish(super::checksum::sum_bytes(&f[..head]));
        f[10..12].copy_from_slice(&c.to_be_bytes());
        f[head..].copy_from_slice(data);
        Some((len, offset + n))
    } else {
        let next = pkt[6];
        if matches!(
            next,
            ipv6::ext::HOP_BY_HOP | ipv6::ext::ROUTING | ipv6::ext::DEST_OPTS | ipv6::ext::FRAGMENT
        ) {
            return None; // only packets without extension headers
        }
        let len = head + FRAG_HEADER_LEN + n;
        let f = out.get_mut(..len)?;
        f[..head].copy_from_slice(&pkt[..head]);
        f[4..6].copy_from_slice(&((FRAG_HEADER_LEN + n) as u16).to_be_bytes());
        f[6] = ipv6::ext::FRAGMENT;
        let ff = ((offset / 8) as u16) << 3 | u16::from(more);
        let h = &mut f[head..head + FRAG_HEADER_LEN];
        h[0] = next;
        h[1] = 0;
        h[2..4].copy_from_slice(&ff.to_be_bytes());
        h[4..8].copy_from_slice(&id.to_be_bytes());
        f[head + FRAG_HEADER_LEN..].copy_from_slice(data);
        Some((len, offset + n))
    }
}

/// Let routers fragment an IPv4 packet built with DF set and
/// identification 0 (an atomic datagram, RFC 6864 4.1, as
/// `udp::write_udp_headers` builds them): DF cleared, `id` as its
/// identification, the header checksum updated. A reply that fits the TUN
/// but not a smaller link between the TUN and the app (a gateway forwarding
/// a client on a 1500-byte link into a 9000-byte TUN) is then split by that
/// gateway instead of dropped. Nothing for IPv6 (routers never fragment
/// it) or a packet without a whole header.
pub fn allow_fragmenting(pkt: &mut [u8], id: u16) {
    if let Some(h) = pkt.get_mut(..ipv4::HEADER_LEN)
        && h[0] == 0x45
    {
        h[4..6].copy_from_slice(&id.to_be_bytes());
        h[6] &= !0x40;
        h[10..12].copy_from_slice(&[0, 0]);
        let c = super::checksum::finish(super::checksum::sum_bytes(h));
        h[10..12].copy_from_slice(&c.to_be_bytes());
    }
}

/// Length of the IPv6 Fragment header (RFC 8200 4.5).
const FRAG_HEADER_LEN: usize = 8;

/// Parse one fragment of either family.
fn parse(pkt: &[u8]) -> Result<Fragment<'_>, FragDrop> {
    match pkt.first().map(|b| b >> 4) {
        Some(4) => parse_v4(pkt),
        Some(6) => parse_v6(pkt),
        _ => Err(FragDrop::Malformed),
    }
}

fn parse_v4(pkt: &[u8]) -> Result<Fragment<'_>, FragDrop> {
    let bad = FragDrop::Malformed;
    let h = pkt.get(..ipv4::HEADER_LEN).ok_or(bad)?;
    let ihl = usize::from(h[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([h[2], h[3]]));
    if ihl < ipv4::HEADER_LEN || total < ihl || total > pkt.len() {
        return Err(bad);
    }
    let ff = u16::from_be_bytes([h[6], h[7]]);
    let more = ff & 0x2000 != 0;
    let offset = usize::from(ff & 0x1fff) * 8;
    let src = IpAddr::from([h[12], h[13], h[14], h[15]]);
    let dst = IpAddr::from([h[16], h[17], h[18], h[19]]);
    Ok(Fragment {
        key: Key {
            src,
            dst,
            id: u32::from(u16::from_be_bytes([h[4], h[5]])) | (u32::from(h[9]) << 16),
            v6: false,
        },
        offset,
        more,
        data: &pkt[ihl..total],
        head: (offset == 0).then(|| (&pkt[..ihl], 9)),
        proto: h[9],
    })
}

fn parse_v6(pkt: &[u8]) -> Result<Fragment<'_>, FragDrop> {
    let bad = FragDrop::Malformed;
    let h = pkt.get(..ipv6::HEADER_LEN).ok_or(bad)?;
    let end = ipv6::HEADER_LEN + usize::from(u16::from_be_bytes([h[4], h[5]]));
    if end > pkt.len() {
        return Err(bad);
    }
    let mut src = [0u8; 16];
    src.copy_from_slice(&h[8..24]);
    let mut dst = [0u8; 16];
    dst.copy_from_slice(&h[24..40]);
    // Walk the extension headers that may precede the Fragment header
    // (RFC 8200 4.1: Hop-by-Hop, Destination Options, Routing).
    let (mut next, mut nh_at, mut at) = (h[6], 6usize, ipv6::HEADER_LEN);
    loop {
        match next {
            ipv6::ext::HOP_BY_HOP | ipv6::ext::DEST_OPTS | ipv6::ext::ROUTING => {
                let e = pkt.get(at..at + 2).ok_or(bad)?;
                let len = (usize::from(e[1]) + 1) * 8;
                if at + len > end {
                    return Err(bad);
                }
                (next, nh_at, at) = (e[0], at, at + len);
            }
            ipv6::ext::FRAGMENT => break,
            _ => return Err(bad), // not a fragment
        }
    }
    let fh = pkt.get(at..at + 8).filter(|_| at + 8 <= end).ok_or(bad)?;
    let ff = u16::from_be_bytes([fh[2], fh[3]]);
    let offset = usize::from(ff >> 3) * 8;
    let more = ff & 1 != 0;
    let id = u32::from_be_bytes([fh[4], fh[5], fh[6], fh[7]]);
    Ok(Fragment {
        key: Key {
            src: IpAddr::from(src),
            dst: IpAddr::from(dst),
            id,
            v6: true,
        },
        offset,
        more,
        data: &pkt[at + 8..end],
        head: (offset == 0).then(|| (&pkt[..at], nh_at)),
        proto: fh[0],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::testutil::{ExtHdr, udp_v4, udp_v6};
    use crate::packet::{checksum, parse_ip, parse_udp};

    /// Split an unfragmented packet into fragments of at most `size`
    /// payload bytes (a multiple of 8), as a sending kernel does.
    fn fragments(pkt: &[u8], size: usize, id: u32) -> Vec<Vec<u8>> {
        let ip = parse_ip(pkt).expect("whole packet");
        let (head, payload) = pkt[..ip.len].split_at(ip.l4_offset);
        let mut out = Vec::new();
        let mut off = 0;
        while off < payload.len() {
            let n = size.min(payload.len() - off);
            let more = off + n < payload.len();
            let mut f = Vec::new();
            if ip.src.is_ipv4() {
                f.extend_from_slice(head);
                let ff = ((off / 8) as u16) | if more { 0x2000 } else { 0 };
                f[6..8].copy_from_slice(&ff.to_be_bytes());
                f[4..6].copy_from_slice(&(id as u16).to_be_bytes());
                f.extend_from_slice(&payload[off..off + n]);
                let len = f.len() as u16;
                f[2..4].copy_from_slice(&len.to_be_bytes());
                f[10..12].copy_from_slice(&[0, 0]);
                let c = checksum::finish(checksum::sum_bytes(&f[..20]));
                f[10..12].copy_from_slice(&c.to_be_bytes());
            } else {
                f.extend_from_slice(&head[..40]);
                f[6] = ExtHdr::Fragment.code();
                f.extend_from_slice(&[ip.protocol, 0]);
                let ff = ((off / 8) as u16) << 3 | u16::from(more);
                f.extend_from_slice(&ff.to_be_bytes());
                f.extend_from_slice(&id.to_be_bytes());
                f.extend_from_slice(&payload[off..off + n]);
                let plen = (f.len() - 40) as u16;
                f[4..6].copy_from_slice(&plen.to_be_bytes());
            }
            out.push(f);
            off += n;
        }
        out
    }

    fn big(v6: bool, len: usize) -> Vec<u8> {
        let payload: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        if v6 {
            udp_v6("[fd00:18::9]:5000", "[2001:db8::1]:53", &payload)
        } else {
            udp_v4("198.18.0.9:5000", "1.1.1.1:53", &payload)
        }
    }

    /// What reassembling `whole` sent as fragments with `id` yields: IPv4
    /// carries the fragments' identification and no flags (DF cannot go
    /// with fragments); IPv6 comes back unchanged.
    fn expected(whole: &[u8], id: u32) -> Vec<u8> {
        let mut want = whole.to_vec();
        if want[0] >> 4 == 4 {
            want[4..6].copy_from_slice(&(id as u16).to_be_bytes());
            want[6..8].copy_from_slice(&[0, 0]);
            want[10..12].copy_from_slice(&[0, 0]);
            let c = checksum::finish(checksum::sum_bytes(&want[..20]));
            want[10..12].copy_from_slice(&c.to_be_bytes());
        }
        want
    }

    fn reassemble(r: &mut Reassembler, frags: &[Vec<u8>]) -> (Vec<u8>, Vec<FragDrop>) {
        let now = Instant::now();
        let mut out = Vec::new();
        let mut drops = Vec::new();
        let mut done = Vec::new();
        for f in frags {
            match r.push(f, now, &mut out, |d| drops.push(d)) {
                Ok(Some(n)) => done = out[..n].to_vec(),
                Ok(None) => {}
                Err(e) => drops.push(e),
            }
        }
        (done, drops)
    }

    /// 8000-byte datagrams, both families, in order, reversed and
    /// shuffled, come back byte for byte as one valid packet.
    #[test]
    fn reassembles_in_any_order_both_families() {
        for v6 in [false, true] {
            let whole = big(v6, 8000);
            let frags = fragments(&whole, 1448, 77);
            assert!(frags.len() > 5);
            let mut orders = vec![frags.clone()];
            orders.push(frags.iter().rev().cloned().collect());
            let mut mixed = frags.clone();
            mixed.swap(0, 3);
            mixed.swap(1, 4);
            orders.push(mixed);
            for order in orders {
                let mut r = Reassembler::new(Limits::default());
                let (done, drops) = reassemble(&mut r, &order);
                assert!(drops.is_empty(), "{drops:?}");
                assert_eq!(done, expected(&whole, 77), "v6 {v6}");
                let longest = frags.iter().map(Vec::len).max();
                assert_eq!(Some(r.longest_fragment()), longest, "v6 {v6}");
                let ip = parse_ip(&done).expect("parses whole");
                let u = parse_udp(&done, &ip).expect("udp");
                assert_eq!(crate::packet::check_datagram(&done, &ip, &u), Ok(()));
                assert!(r.is_empty());
                assert_eq!(r.held_bytes(), 0);
            }
        }
    }

    /// The engine's own fragments of a large reply reassemble to the reply,
    /// both families, and each fits the MTU.
    #[test]
    fn fragment_at_round_trips_through_reassembly() {
        for v6 in [false, true] {
            for (len, mtu) in [(8000, 1500), (3000, 1280), (1473, 1500), (65_000, 9000)] {
                let whole = big(v6, len);
                let mut frags = Vec::new();
                let mut off = 0;
                let mut buf = vec![0u8; mtu];
                while let Some((n, next)) = fragment_at(&whole, mtu, 4242, off, &mut buf) {
                    assert!(n <= mtu);
                    frags.push(buf[..n].to_vec());
                    off = next;
                }
                assert!(frags.len() > 1, "{len} at {mtu}");
                let mut r = Reassembler::new(Limits {
                    total_bytes: 1 << 20,
                    per_source_bytes: 1 << 20,
                    ..Limits::default()
                });
                let (done, drops) = reassemble(&mut r, &frags);
                assert!(drops.is_empty(), "{drops:?}");
                assert_eq!(done, expected(&whole, 4242), "{len} at {mtu}, v6 {v6}");
            }
        }
    }

    /// A reply built as an atomic datagram (DF, id 0) becomes one a router
    /// may fragment: DF cleared, the id set, the header checksum valid, the
    /// rest unchanged; IPv6 is left alone.
    #[test]
    fn allow_fragmenting_clears_df_and_keeps_the_header_valid() {
        let mut buf = vec![0u8; 4000];
        let src: std::net::SocketAddr = "198.19.1.2:53".parse().expect("addr");
        let dst: std::net::SocketAddr = "10.233.1.2:5000".parse().expect("addr");
        let n = crate::packet::write_udp_headers(&mut buf, src, dst, 3000).expect("headers");
        let before = buf[..n].to_vec();
        assert_eq!(before[6] & 0x40, 0x40, "built with DF");
        allow_fragmenting(&mut buf[..n], 0xbeef);
        assert_eq!(&buf[4..6], &[0xbe, 0xef]);
        assert_eq!(buf[6] & 0x40, 0, "DF cleared");
        assert_eq!(
            checksum::finish(checksum::sum_bytes(&buf[..20])),
            0,
            "header checksum"
        );
        assert_eq!(buf[12..n], before[12..], "addresses and datagram unchanged");
        let ip = parse_ip(&buf[..n]).expect("still one whole packet");
        let u = parse_udp(&buf[..n], &ip).expect("udp");
        assert_eq!(crate::packet::check_datagram(&buf[..n], &ip, &u), Ok(()));
        let v6 = big(true, 3000);
        let mut same = v6.clone();
        allow_fragmenting(&mut same, 1);
        assert_eq!(same, v6);
    }

    #[test]
    fn overlap_discards_the_datagram_and_duplicates_are_ignored() {
        for v6 in [false, true] {
            let whole = big(v6, 4000);
            let frags = fragments(&whole, 1448, 9);
            let mut r = Reassembler::new(Limits::default());
            // An exact duplicate is harmless.
            let dup = vec![
                frags[0].clone(),
                frags[0].clone(),
                frags[1].clone(),
                frags[2].clone(),
            ];
            let (done, drops) = reassemble(&mut r, &dup);
            assert_eq!(done, expected(&whole, 9));
            assert_eq!(drops, [FragDrop::Duplicate]);
            // A fragment reaching into the first (1440..2880 after 0..1448).
            let mut over = fragments(&whole, 1448, 10);
            let shifted = fragments(&whole, 1440, 10)[1].clone();
            over.insert(1, shifted);
            let (done, drops) = reassemble(&mut r, &over);
            assert!(done.is_empty(), "an overlapping datagram never completes");
            assert!(drops.contains(&FragDrop::Overlap), "{drops:?}");
        }
    }

    #[test]
    fn malformed_and_tiny_fragments_are_refused() {
        let whole = big(false, 3000);
        let frags = fragments(&whole, 1448, 5);
        let mut r = Reassembler::new(Limits::default());
        let now = Instant::now();
        let mut out = Vec::new();
        // A non-last fragment whose length is not a multiple of 8.
        let odd = fragments(&whole, 1444, 6);
        assert_eq!(
            r.push(&odd[0], now, &mut out, |_| {}),
            Err(FragDrop::Malformed)
        );
        // A first fragment too small to hold the UDP header.
        let tiny = fragments(&whole, 8, 7);
        let mut t0 = tiny[0].clone();
        t0.truncate(20 + 4);
        t0[2..4].copy_from_slice(&24u16.to_be_bytes());
        t0[6..8].copy_from_slice(&0x2000u16.to_be_bytes());
        assert_eq!(r.push(&t0, now, &mut out, |_| {}), Err(FragDrop::Malformed));
        // Not UDP.
        let mut tcp = frags[0].clone();
        tcp[9] = protocol::TCP;
        assert_eq!(
            r.push(&tcp, now, &mut out, |_| {}),
            Err(FragDrop::Malformed)
        );
        assert!(r.is_empty());
    }

    #[test]
    fn memory_bounds_and_timeout_discard_and_report() {
        let limits = Limits {
            total_bytes: 20_000,
            per_source_bytes: 10_000,
            timeout: Duration::from_secs(5),
            max_datagrams: 256,
        };
        let mut r = Reassembler::new(limits);
        let now = Instant::now();
        let mut out = Vec::new();
        let mut drops = Vec::new();
        // Many incomplete datagrams from one source: only the first
        // fragments come, so none completes.
        for id in 0..20 {
            let frags = fragments(&big(false, 4000), 1448, id);
            let _ = r.push(&frags[0], now, &mut out, |d| drops.push(d));
            assert!(r.held_bytes() <= 20_000);
        }
        assert!(drops.iter().filter(|d| **d == FragDrop::NoRoom).count() > 0);
        assert!(r.len() < 20);
        // A datagram larger than the per-source bound never fits.
        let huge = fragments(&big(false, 12_000), 1448, 99);
        let last = huge.last().expect("fragments").clone();
        assert_eq!(r.push(&last, now, &mut out, |_| {}), Err(FragDrop::NoRoom));
        // Everything left times out.
        let held = r.len();
        let mut expired = 0;
        r.expire(now + Duration::from_secs(6), |d| {
            assert_eq!(d, FragDrop::Timeout);
            expired += 1;
        });
        assert_eq!(expired, held);
        assert!(r.is_empty());
        assert_eq!(r.held_bytes(), 0);
    }

    /// Random fragments of random packets never panic and never make the
    /// accounting go wrong.
    #[test]
    fn garbage_never_panics() {
        let mut rng = crate::packet::testutil::Rng::new(5722);
        let mut r = Reassembler::new(Limits {
            total_bytes: 50_000,
            per_source_bytes: 20_000,
            timeout: Duration::from_secs(5),
            max_datagrams: 64,
        });
        let now = Instant::now();
        let mut out = Vec::new();
        let seeds: Vec<Vec<u8>> = [false, true]
            .iter()
            .flat_map(|&v6| fragments(&big(v6, 5000), 1448, 3))
            .collect();
        let rounds = if cfg!(miri) { 200 } else { 20_000 };
        for _ in 0..rounds {
            let mut p = seeds[rng.below(seeds.len())].clone();
            for _ in 0..rng.below(4) {
                let i = rng.below(p.len());
                p[i] = rng.byte();
            }
            p.truncate(p.len() - rng.below(16).min(p.len()));
            if let Ok(Some(n)) = r.push(&p, now, &mut out, |_| {}) {
                assert!(n <= out.len());
            }
            assert!(r.held_bytes() <= 50_000 + 70_000);
        }
    }
}
