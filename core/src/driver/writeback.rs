//! What the per-packet reader writes back, and what waits for the end of
//! its drain.
//!
//! Two kinds of segment wait, per flow and direction ([`SegmentKey`]):
//! * **merges** (`tun.coalesce`): consecutive data segments of a flow toward
//!   the kernel listener are merged (`packet::coalesce`) into one packet of
//!   up to [`MERGE_MAX`] bytes, so the kernel's TCP receives one segment
//!   where it would have received many;
//! * **pure ACKs** (`tun.ack_thinning`): of the pure ACKs a drain writes for
//!   a flow, the newest says what the earlier ones did
//!   (`packet::ackthin`): only it is written, at the end of the drain.
//!
//! Up to [`MERGE_FLOWS`] merges and [`ACK_FLOWS`] ACKs wait at once, so
//! the flows a drain interleaves keep merging: a segment of one flow never
//! writes out what another flow holds. Any other segment first writes out
//! what its own flow holds, so a flow's segments keep their order (a flow
//! holds at most one of the two kinds at a time). A full table writes out
//! its oldest entry to make room. Everything held is written when the
//! drain ends ([`WriteBack::flush`]), before the reader sleeps.
//!
//! A merge keeps the headers its first segment had before the demux
//! translated it ([`Untranslated`]). The next segments of that flow that
//! carry the same headers but for sequence number, lengths and checksums
//! are merged as they were read ([`WriteBack::continues`]), without the
//! demux: within a drain their translation would give what the first one's
//! gave (the same flow entry; the window clamp, whose share only shrinks
//! within a drain and whose advertised edge does not move back, lowers an
//! equal window to the same value), and the merge takes those fields from
//! the head. They are counted as the demux counts them. A segment that
//! could change the flow's entry (SYN, FIN, RST, one the demux did not
//! write back) ends this for every held merge until the next one starts.
//! A merge reads the payload's sum from the checksum the app sent, with
//! the segment's own pseudo-header, so nothing is summed where the kernel
//! verifies (`Demux::defers_data_sums`); elsewhere the merge sums and
//! checks the payload, and a segment that fails takes the demux's path,
//! which counts and drops it.
//!
//! A merged packet the device refuses is cut back into the segments it was
//! (`coalesce::segment_at`) and those are written instead. A kernel before
//! 6.6 allocates a TUN write in one piece, so a large write can fail with
//! `ENOBUFS` (or `ENOMEM`) while memory is fragmented: that is transient
//! and merging goes on. Any other refusal says the device does not take
//! packets above its MTU, and merging stops for good.

use std::future::Future;
use std::io;

use crate::budget;
use crate::packet::ackthin::{self, ACK_MAX, PureAck, SegmentKey};
use crate::packet::tcp::{PlainTcp, flags, parse_plain_tcp};
use crate::packet::{HEADROOM, coalesce};
use crate::stats::{EngineDrop, LocalCounters};
use crate::tun::Tun;

/// Largest packet a merge produces: what an IP packet may carry. A
/// kernel that allocates the write in one piece may refuse it (`ENOBUFS`)
/// when its memory is fragmented; the packet is then written as the
/// segments it was made of, and merging goes on. A 32 KiB bound instead
/// cost 11-20 % of one stream's throughput at MTU 4064 and 9000 on the
/// phone profile (docs/notes.md, "Window clamping on the phone's TUN",
/// run 6).
pub(super) const MERGE_MAX: usize = coalesce::MAX_PACKET;

/// Merges in progress at once. Each takes a [`MERGE_MAX`] buffer, made on
/// the first merge of its slot (so 256 KiB once four flows merged in one
/// drain).
pub(super) const MERGE_FLOWS: usize = 4;

/// Pure ACKs held at once (each [`ACK_MAX`] bytes, in place).
pub(super) const ACK_FLOWS: usize = 16;

// What the write-back can hold is within its line of the memory budget's
// worst case (`budget::write_back_bytes`): the merge slots and the buffer
// for a refused merge's segments, each the larger of a packet and
// `MERGE_MAX`, and the held ACKs.
const _: () = {
    assert!(MERGE_FLOWS + 1 == budget::WRITE_BACK_MERGE_BUFFERS);
    assert!(HEADROOM + coalesce::MAX_PACKET <= budget::WRITE_BACK_MERGE_BUFFER);
    assert!(MERGE_MAX <= coalesce::MAX_PACKET);
    assert!(ACK_FLOWS * std::mem::size_of::<HeldAck>() <= budget::WRITE_BACK_HELD_ACKS);
};

/// Where packets are written: the TUN, or a recording device in tests.
pub(super) trait Sink {
    /// Write `buf[HEADROOM..][..len]` without waiting.
    fn try_send(&self, buf: &mut [u8], len: usize) -> io::Result<()>;
    /// Write it, waiting until the device takes it.
    fn send(&self, buf: &mut [u8], len: usize) -> impl Future<Output = io::Result<()>>;
}

impl Sink for Tun {
    fn try_send(&self, buf: &mut [u8], len: usize) -> io::Result<()> {
        Tun::try_send(self, buf, len)
    }

    fn send(&self, buf: &mut [u8], len: usize) -> impl Future<Output = io::Result<()>> {
        Tun::send(self, buf, len)
    }
}

/// What the per-packet reader does with what it writes (module docs).
pub(super) struct WriteBack {
    coalesce: bool,
    thin_acks: bool,
    merges: [Held; MERGE_FLOWS],
    acks: [HeldAck; ACK_FLOWS],
    /// The slot a full table writes out next (oldest first, round robin).
    next_merge: usize,
    next_ack: usize,
    /// One segment cut back from a refused merge (allocated on the first).
    scratch: Vec<u8>,
    /// Merged writes refused as transient (`ENOBUFS`, `ENOMEM`) so far.
    transient: u64,
    /// Whether merges take segments as read (the system stack's: its
    /// translation is what they skip).
    as_read: bool,
    /// Whether the kernel verifies the app's data segments
    /// (`Demux::defers_data_sums`): untranslated merges need not sum them.
    kernel_sums: bool,
    /// Whether a held merge may take untranslated segments (module docs).
    untranslated: bool,
}

/// Most header bytes kept of a merge's first segment: IPv6 and a TCP
/// header with 40 bytes of options.
const RAW_MAX: usize = 100;

/// A segment's headers as read, before the demux translated it in place,
/// and what its translation did: what a merge started from it keeps
/// (module docs).
#[derive(Clone, Copy)]
pub(super) struct Untranslated {
    bytes: [u8; RAW_MAX],
    /// Bytes copied (the packet's first `RAW_MAX` at most).
    len: usize,
    /// Toward the app (the listener's data), counted `packets_down`.
    down: bool,
    /// The translation lowered its window (`window_clamped`).
    clamped: bool,
}

impl Untranslated {
    /// The headers of `pkt`, a packet just read; `down` and `clamped` are
    /// set once the demux translated it ([`Untranslated::translated`]).
    #[inline]
    pub fn read(pkt: &[u8]) -> Self {
        let len = pkt.len().min(RAW_MAX);
        let mut bytes = [0; RAW_MAX];
        bytes[..len].copy_from_slice(&pkt[..len]);
        Untranslated {
            bytes,
            len,
            down: false,
            clamped: false,
        }
    }

    /// The demux's counters that tell what a translation did: packets
    /// toward the app, windows lowered.
    #[inline]
    pub fn counts(local: &LocalCounters) -> (u64, u64) {
        (local.packets_down, local.window_clamped)
    }

    /// Record what translating the packet did, from the demux's
    /// [`Untranslated::counts`] before it and its counters after.
    #[inline]
    pub fn translated(&mut self, before: (u64, u64), after: &LocalCounters) {
        let (down, clamped) = before;
        self.down = after.packets_down != down;
        self.clamped = after.window_clamped != clamped;
    }

    /// Whether the packet may be TCP: anything but a plain UDP datagram
    /// or ICMP message (an IPv6 packet with extension headers may carry
    /// TCP behind them).
    #[inline]
    pub fn maybe_tcp(&self) -> bool {
        let b = &self.bytes[..self.len];
        match b.first().map(|v| v >> 4) {
            Some(4) => !matches!(b.get(9), Some(&(1 | 17))),
            Some(6) => !matches!(b.get(6), Some(&(17 | 58))),
            _ => false,
        }
    }
}

impl WriteBack {
    pub fn new(coalesce: bool, thin_acks: bool) -> Self {
        WriteBack {
            coalesce,
            thin_acks,
            merges: Default::default(),
            acks: std::array::from_fn(|_| HeldAck::default()),
            next_merge: 0,
            next_ack: 0,
            scratch: Vec::new(),
            transient: 0,
            as_read: false,
            kernel_sums: false,
            untranslated: false,
        }
    }

    /// Let merges take their flows' next segments as read (module docs):
    /// for the system stack, whose translation that skips. `kernel_sums`:
    /// the kernel verifies the app's data segments
    /// (`Demux::defers_data_sums`).
    pub fn merging_as_read(mut self, kernel_sums: bool) -> Self {
        self.as_read = true;
        self.kernel_sums = kernel_sums;
        self
    }

    /// The headers of `pkt`, just read, if a merge it starts could take
    /// segments as read.
    #[inline]
    pub fn as_read(&self, pkt: &[u8]) -> Option<Untranslated> {
        (self.as_read && self.coalesce).then(|| Untranslated::read(pkt))
    }

    /// Merge `pkt`, a packet just read and not translated, into the merge
    /// its flow holds, counted as the demux would count it; false when it
    /// does not continue one (module docs). The caller then hands it to
    /// the demux.
    #[inline]
    pub fn continues(&mut self, pkt: &[u8], local: &mut LocalCounters) -> bool {
        if !self.untranslated {
            return false;
        }
        let Some(n) = parse_plain_tcp(pkt).filter(coalesce::candidate_plain) else {
            return false;
        };
        for held in &mut self.merges {
            if !held.append_untranslated(pkt, &n, self.kernel_sums) {
                continue;
            }
            let len = n.ip.len as u64;
            if held.raw.down {
                local.packets_down += 1;
                local.bytes_down += len;
            } else {
                local.packets_up += 1;
                local.bytes_up += len;
            }
            local.window_clamped += u64::from(held.raw.clamped);
            return true;
        }
        false
    }

    /// No held merge takes untranslated segments any more: a packet the
    /// demux saw may have changed a flow's entry (module docs).
    pub fn forget_untranslated(&mut self) {
        if self.untranslated {
            self.untranslated = false;
            for h in &mut self.merges {
                h.raw.len = 0;
            }
        }
    }

    /// Whether segments toward the listener are still merged (the caller
    /// asks `Demux::to_listener` only then).
    pub fn merging(&self) -> bool {
        self.coalesce
    }

    /// Write the packet at `buf[HEADROOM..][..len]`, or hold it (module
    /// docs). `to_listener`: the demux's verdict that it goes to the kernel
    /// listener (`Demux::to_listener`); a data segment of those may merge.
    /// Its headers are parsed once, here, for all that follows. `raw`: its
    /// headers as read, before the demux translated it, which a merge it
    /// starts keeps (module docs).
    pub async fn put<S: Sink>(
        &mut self,
        sink: &S,
        local: &mut LocalCounters,
        buf: &mut [u8],
        len: usize,
        to_listener: bool,
        raw: Option<&Untranslated>,
    ) {
        let pkt = &buf[HEADROOM..HEADROOM + len];
        let Some(plain) = parse_plain_tcp(pkt) else {
            self.forget_untranslated();
            super::write_back(sink, local, buf, len).await;
            return;
        };
        let Some((key, ack)) = ackthin::classify_plain(pkt, &plain) else {
            self.forget_untranslated();
            super::write_back(sink, local, buf, len).await;
            return;
        };
        if plain.tcp.flags & (flags::SYN | flags::FIN | flags::RST) != 0 {
            self.forget_untranslated();
        }
        if to_listener && self.coalesce && coalesce::candidate_plain(&plain) {
            self.flush_ack(sink, local, &key).await;
            if !self.merge(sink, local, key, pkt, &plain, raw).await {
                // Merging stopped for good on the write that made room.
                super::write_back(sink, local, buf, len).await;
            }
            return;
        }
        if let Some(ack) = ack.filter(|_| self.thin_acks) {
            self.flush_merge(sink, local, &key).await;
            self.hold_ack(sink, local, key, ack, pkt).await;
            return;
        }
        self.flush_merge(sink, local, &key).await;
        self.flush_ack(sink, local, &key).await;
        super::write_back(sink, local, buf, len).await;
    }

    /// Write out everything held: the drain ended.
    pub async fn flush<S: Sink>(&mut self, sink: &S, local: &mut LocalCounters) {
        self.forget_untranslated();
        for i in 0..MERGE_FLOWS {
            self.write_merge(sink, local, i).await;
        }
        for i in 0..ACK_FLOWS {
            self.write_ack(sink, local, i).await;
        }
    }

    /// Merge `pkt` into its flow's held packet, or hold it in a slot of
    /// its own; false if merging stopped for good meanwhile (not held).
    async fn merge<S: Sink>(
        &mut self,
        sink: &S,
        local: &mut LocalCounters,
        key: SegmentKey,
        pkt: &[u8],
        plain: &PlainTcp,
        raw: Option<&Untranslated>,
    ) -> bool {
        let slot = match self.merges.iter().position(|h| h.key == Some(key)) {
            Some(i) if self.merges[i].append(pkt, plain) => return true,
            Some(i) => i,
            None => vacant_or_next(&self.merges, |h| h.key.is_none(), &mut self.next_merge),
        };
        self.write_merge(sink, local, slot).await;
        if self.coalesce {
            let held = &mut self.merges[slot];
            held.start(key, pkt, plain, raw);
            self.untranslated |= held.raw.len > 0;
        }
        self.coalesce
    }

    async fn hold_ack<S: Sink>(
        &mut self,
        sink: &S,
        local: &mut LocalCounters,
        key: SegmentKey,
        ack: PureAck,
        pkt: &[u8],
    ) {
        let slot = match self.acks.iter().position(|h| h.key == Some(key)) {
            Some(i) if ackthin::supersedes(ack, self.acks[i].ack) => {
                local.acks_thinned += 1;
                self.acks[i].set(key, ack, pkt);
                return;
            }
            Some(i) => i,
            None => vacant_or_next(&self.acks, |h| h.key.is_none(), &mut self.next_ack),
        };
        self.write_ack(sink, local, slot).await;
        self.acks[slot].set(key, ack, pkt);
    }

    async fn flush_merge<S: Sink>(
        &mut self,
        sink: &S,
        local: &mut LocalCounters,
        key: &SegmentKey,
    ) {
        if let Some(i) = self.merges.iter().position(|h| h.key.as_ref() == Some(key)) {
            self.write_merge(sink, local, i).await;
        }
    }

    async fn flush_ack<S: Sink>(&mut self, sink: &S, local: &mut LocalCounters, key: &SegmentKey) {
        if let Some(i) = self.acks.iter().position(|h| h.key.as_ref() == Some(key)) {
            self.write_ack(sink, local, i).await;
        }
    }

    async fn write_ack<S: Sink>(&mut self, sink: &S, local: &mut LocalCounters, i: usize) {
        let held = &mut self.acks[i];
        if held.key.take().is_some() {
            super::write_back(sink, local, &mut held.buf, held.len).await;
        }
    }

    /// Write out merge slot `i`. A refused merged packet is written as the
    /// segments it was instead (module docs); merging stops for good if the
    /// refusal was not transient.
    async fn write_merge<S: Sink>(&mut self, sink: &S, local: &mut LocalCounters, i: usize) {
        let held = &mut self.merges[i];
        if held.key.take().is_none() {
            return;
        }
        let (len, merged) = (held.len, held.merged);
        let Err(e) = super::send(sink, local, &mut held.buf, len).await else {
            return;
        };
        if !merged {
            local.drop(EngineDrop::TunWrite);
            return;
        }
        self.write_cut(sink, local, i, len).await;
        if is_transient(&e) {
            self.transient += 1;
            if self.transient == 1 {
                tracing::info!(
                    "the TUN refused a merged {len}-byte segment ({e}): written as its segments; merging goes on"
                );
            }
        } else {
            tracing::warn!(
                "the TUN refused a merged {len}-byte segment ({e}): writing segments back one by one from now on"
            );
            self.coalesce = false;
        }
    }

    /// Write merge slot `i`'s packet of `len` bytes as the segments it was
    /// merged from; each failure is a counted drop (TCP retransmits it).
    async fn write_cut<S: Sink>(
        &mut self,
        sink: &S,
        local: &mut LocalCounters,
        i: usize,
        len: usize,
    ) {
        let held = &self.merges[i];
        let merged = &held.buf[HEADROOM..HEADROOM + len];
        let need = HEADROOM + len.min(held.first_payload + (len - payload_len(merged)));
        if self.scratch.len() < need {
            self.scratch = vec![0u8; need];
        }
        for n in 0.. {
            let held = &self.merges[i];
            let merged = &held.buf[HEADROOM..HEADROOM + len];
            let Some(seg) =
                coalesce::segment_at(merged, held.first_payload, n, &mut self.scratch[HEADROOM..])
            else {
                break;
            };
            super::write_back(sink, local, &mut self.scratch, seg).await;
        }
    }
}

/// A data segment held aside to merge the next segments of its flow into.
struct Held {
    /// The flow, while a packet is held.
    key: Option<SegmentKey>,
    /// `HEADROOM` plus [`MERGE_MAX`] or the first held packet's length,
    /// whichever is larger, once first used.
    buf: Vec<u8>,
    /// Length of the held packet.
    len: usize,
    /// Its headers, while a packet is held (`len` is `ip.len`).
    plain: Option<PlainTcp>,
    /// The held packet's own payload length before anything was merged
    /// into it: where a refused merge is cut back.
    first_payload: usize,
    /// Whether segments were merged into it (it may exceed the MTU).
    merged: bool,
    /// The held packet's headers as read, `len` the header length (0: it
    /// takes no untranslated segment).
    raw: Untranslated,
}

impl Default for Held {
    fn default() -> Self {
        Held {
            key: None,
            buf: Vec::new(),
            len: 0,
            plain: None,
            first_payload: 0,
            merged: false,
            raw: Untranslated {
                bytes: [0; RAW_MAX],
                len: 0,
                down: false,
                clamped: false,
            },
        }
    }
}

impl Held {
    /// Hold `pkt`, whose headers `plain` are, as the start of a possible
    /// merge.
    /// `raw`: its headers as read, if untranslated segments may follow.
    fn start(&mut self, key: SegmentKey, pkt: &[u8], plain: &PlainTcp, raw: Option<&Untranslated>) {
        if self.buf.len() < HEADROOM + pkt.len().max(MERGE_MAX) {
            self.buf = vec![0u8; HEADROOM + pkt.len().max(MERGE_MAX)];
        }
        self.buf[HEADROOM..HEADROOM + pkt.len()].copy_from_slice(pkt);
        self.key = Some(key);
        self.len = pkt.len();
        self.plain = Some(*plain).filter(|p| p.ip.len == pkt.len());
        self.first_payload = plain.tcp.payload_len;
        self.merged = false;
        // The headers of the packet as read span what the translated ones
        // do (a translation changes no length).
        let header_len = plain.ip.l4_offset + plain.tcp.header_len;
        match raw {
            Some(r) if header_len <= r.len => {
                self.raw = *r;
                self.raw.len = header_len;
            }
            _ => self.raw.len = 0,
        }
    }

    /// Merge `pkt` (headers `n`), not translated, into the held packet if
    /// it continues it as read (module docs). `kernel_sums`: the kernel
    /// verifies the app's segments; the listener's are its own.
    #[inline]
    fn append_untranslated(&mut self, pkt: &[u8], n: &PlainTcp, kernel_sums: bool) -> bool {
        if self.raw.len == 0 || self.key.is_none() {
            return false;
        }
        let Some(head) = self.plain.as_mut() else {
            return false;
        };
        let room = &mut self.buf[HEADROOM..HEADROOM + MERGE_MAX.max(self.len)];
        let raw_head = &self.raw.bytes[..self.raw.len];
        let verified = kernel_sums || self.raw.down;
        if !coalesce::append_untranslated(room, head, raw_head, pkt, n, verified) {
            return false;
        }
        self.len = head.ip.len;
        self.merged = true;
        true
    }

    /// Merge `pkt` (headers `plain`) into the held packet, if it continues
    /// it and the result stays within [`MERGE_MAX`].
    fn append(&mut self, pkt: &[u8], plain: &PlainTcp) -> bool {
        let Some(head) = self.plain.as_mut() else {
            return false;
        };
        let room = &mut self.buf[HEADROOM..HEADROOM + MERGE_MAX.max(self.len)];
        // What the write-back merges was checked on arrival (the uplink)
        // or built by the kernel listener's TCP (`Demux::to_listener`).
        if !coalesce::append_verified_plain(room, head, pkt, plain) {
            return false;
        }
        self.len = head.ip.len;
        self.merged = true;
        true
    }
}

/// A pure ACK held until the drain ends or its flow writes something else.
struct HeldAck {
    key: Option<SegmentKey>,
    ack: PureAck,
    len: usize,
    buf: [u8; HEADROOM + ACK_MAX],
}

impl Default for HeldAck {
    fn default() -> Self {
        HeldAck {
            key: None,
            ack: PureAck {
                seq: 0,
                ack: 0,
                window: 0,
            },
            len: 0,
            buf: [0; HEADROOM + ACK_MAX],
        }
    }
}

impl HeldAck {
    fn set(&mut self, key: SegmentKey, ack: PureAck, pkt: &[u8]) {
        self.buf[HEADROOM..HEADROOM + pkt.len()].copy_from_slice(pkt);
        self.key = Some(key);
        self.ack = ack;
        self.len = pkt.len();
    }
}

/// The slot of `table` for a new flow: the first `vacant` one, else the one
/// `next` names, which then moves on (oldest first, round robin).
#[inline]
fn vacant_or_next<T, const N: usize>(
    table: &[T; N],
    vacant: impl Fn(&T) -> bool,
    next: &mut usize,
) -> usize {
    table.iter().position(vacant).unwrap_or_else(|| {
        let i = *next;
        *next = (i + 1) % N;
        i
    })
}

/// TCP payload length of a packet the merge took (0 for anything else).
fn payload_len(pkt: &[u8]) -> usize {
    crate::packet::parse_ip(pkt)
        .ok()
        .and_then(|ip| crate::packet::parse_tcp(pkt, &ip).ok())
        .map_or(0, |t| t.payload_len)
}

/// A refusal that says the kernel lacked memory for this write, not that
/// it never takes such a packet.
pub(super) fn is_transient(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::ENOMEM))
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::time::Instant;

    use super::*;
    use crate::packet::tcp_flags as flags;
    use crate::packet::testutil::tcp_v4;
    use crate::packet::{parse_ip, parse_tcp};

    const S: &str = "198.18.0.1:8000";

    /// Records what is written; refuses packets above `limit` with `errno`.
    struct Recorder {
        written: RefCell<Vec<Vec<u8>>>,
        limit: usize,
        errno: i32,
    }

    impl Recorder {
        fn new() -> Self {
            Self::refusing(usize::MAX, 0)
        }

        fn refusing(limit: usize, errno: i32) -> Self {
            Recorder {
                written: RefCell::new(Vec::new()),
                limit,
                errno,
            }
        }

        fn take(&self) -> Vec<Vec<u8>> {
            std::mem::take(&mut self.written.borrow_mut())
        }
    }

    impl Sink for Recorder {
        fn try_send(&self, buf: &mut [u8], len: usize) -> io::Result<()> {
            if len > self.limit {
                return Err(io::Error::from_raw_os_error(self.errno));
            }
            self.written
                .borrow_mut()
                .push(buf[HEADROOM..HEADROOM + len].to_vec());
            Ok(())
        }

        async fn send(&self, buf: &mut [u8], len: usize) -> io::Result<()> {
            self.try_send(buf, len)
        }
    }

    /// (seq, ack, payload) of a written TCP packet.
    fn seg(pkt: &[u8]) -> (u32, u32, Vec<u8>, u8) {
        let ip = parse_ip(pkt).expect("ip");
        let t = parse_tcp(pkt, &ip).expect("tcp");
        let start = ip.l4_offset + t.header_len;
        (
            t.seq,
            t.ack,
            pkt[start..start + t.payload_len].to_vec(),
            t.flags,
        )
    }

    fn data(src: &str, seq: u32, payload: &[u8]) -> Vec<u8> {
        tcp_v4(src, S, seq, 7, flags::ACK, &[], payload)
    }

    fn ack(src: &str, ack: u32) -> Vec<u8> {
        tcp_v4(src, S, 1, ack, flags::ACK, &[], b"")
    }

    struct Drain {
        out: WriteBack,
        local: LocalCounters,
        buf: Vec<u8>,
    }

    impl Drain {
        fn new(coalesce: bool, thin_acks: bool) -> Self {
            Drain {
                out: WriteBack::new(coalesce, thin_acks).merging_as_read(true),
                local: LocalCounters::new(Instant::now()),
                buf: vec![0; HEADROOM + 2048],
            }
        }

        /// Put `pkt` as the reader would, after the demux said whether it
        /// goes to the listener (here: every segment; the write-back itself
        /// tells data segments, which merge, from the rest).
        async fn put(&mut self, sink: &Recorder, pkt: &[u8]) {
            self.put_read(sink, pkt, None).await;
        }

        /// [`Drain::put`] of a packet whose headers as read were `raw`.
        async fn put_read(&mut self, sink: &Recorder, pkt: &[u8], raw: Option<&Untranslated>) {
            self.buf[HEADROOM..HEADROOM + pkt.len()].copy_from_slice(pkt);
            let to_listener = self.out.merging();
            let (local, buf) = (&mut self.local, &mut self.buf);
            self.out
                .put(sink, local, buf, pkt.len(), to_listener, raw)
                .await;
        }

        async fn flush(&mut self, sink: &Recorder) {
            self.out.flush(sink, &mut self.local).await;
        }

        /// What the reader does with `raw`, a packet as read, whose
        /// translation is `translated`: the write-back takes it as read if
        /// it continues a merge (true), else the demux translates it,
        /// counting it up (or down), and it is put.
        async fn read(
            &mut self,
            sink: &Recorder,
            raw: &[u8],
            translated: &[u8],
            down: bool,
            clamped: bool,
        ) -> bool {
            if self.out.continues(raw, &mut self.local) {
                return true;
            }
            let mut r = self.out.as_read(raw).expect("merging as read");
            let before = Untranslated::counts(&self.local);
            if down {
                self.local.packets_down += 1;
            } else {
                self.local.packets_up += 1;
            }
            self.local.window_clamped += u64::from(clamped);
            r.translated(before, &self.local);
            self.put_read(sink, translated, Some(&r)).await;
            false
        }
    }

    impl Drain {
        /// [`Drain::read`] of the app's 100-byte segment at `seq`, filled
        /// with `fill`, toward the listener and not clamped.
        async fn read_app(&mut self, sink: &Recorder, seq: u32, fill: u8) -> bool {
            let (raw, tr) = app_data(seq, &[fill; 100]);
            self.read(sink, &raw, &tr, false, false).await
        }
    }

    /// An app's segment as read (`raw`) and as the demux translates it.
    fn app_data(seq: u32, payload: &[u8]) -> (Vec<u8>, Vec<u8>) {
        (
            tcp_v4(
                "10.0.0.9:3000",
                "1.1.1.1:443",
                seq,
                7,
                flags::ACK,
                &[],
                payload,
            ),
            data("198.18.0.7:40000", seq, payload),
        )
    }

    /// The segments of a flow's merge that follow its first are merged as
    /// they were read, without the demux, and counted as it counts them;
    /// the merge written is the one the translated segments make.
    #[tokio::test]
    async fn a_merge_takes_its_flows_next_segments_as_read() {
        let sink = Recorder::new();
        let mut d = Drain::new(true, true);
        let mut plain = Drain::new(true, true);
        for i in 0..4u32 {
            let (raw, translated) = app_data(1000 + i * 100, &[b'a' + i as u8; 100]);
            let as_read = d.read(&sink, &raw, &translated, false, false).await;
            assert_eq!(as_read, i > 0, "segment {i}");
            plain.put(&sink, &translated).await;
        }
        assert_eq!(d.local.packets_up, 4, "each counted once");
        assert_eq!(d.local.bytes_up, 3 * 140, "those merged as read by length");
        d.flush(&sink).await;
        let merged = sink.take();
        plain.flush(&sink).await;
        assert_eq!(
            merged,
            sink.take(),
            "the same merge as from translated segments"
        );
        assert_eq!(merged.len(), 1);
    }

    /// A segment as read that does not continue the merge as read is the
    /// demux's; a control segment of any flow, and the drain's end, stop
    /// merges from taking segments as read.
    #[tokio::test]
    async fn merges_as_read_stop_where_the_demux_must_see_a_segment() {
        let sink = Recorder::new();
        let mut d = Drain::new(true, true);
        assert!(!d.read_app(&sink, 1000, 1).await);
        // Another window as read: the demux's, though its translation
        // would merge.
        let (mut raw, tr) = app_data(1100, &[2; 100]);
        raw[20 + 15] ^= 1;
        assert!(!d.read(&sink, &raw, &tr, false, false).await);
        assert!(
            d.read_app(&sink, 1200, 3).await,
            "the head's own headers again"
        );

        // An RST of another flow: its entry may have gone, so nothing
        // merges as read until a merge starts again.
        let rst = tcp_v4(
            "198.18.0.7:40001",
            S,
            1,
            1,
            flags::RST | flags::ACK,
            &[],
            b"",
        );
        d.put(&sink, &rst).await;
        assert!(!d.read_app(&sink, 1300, 4).await, "after an RST");
        d.flush(&sink).await;
        assert!(!d.read_app(&sink, 1400, 5).await, "a new drain: a new head");
        assert!(d.read_app(&sink, 1500, 6).await, "continuing it");
        d.flush(&sink).await;
        assert!(!d.read_app(&sink, 1600, 7).await, "after the drain ended");
        sink.take();

        // A segment toward the app is counted down, and a clamped window
        // counted for each segment merged as read.
        let mut d = Drain::new(true, true);
        let (raw, tr) = app_data(1000, &[1; 100]);
        assert!(!d.read(&sink, &raw, &tr, true, true).await);
        for i in 1..3u32 {
            let (raw, tr) = app_data(1000 + i * 100, &[2; 100]);
            assert!(d.read(&sink, &raw, &tr, true, true).await);
        }
        assert_eq!((d.local.packets_down, d.local.packets_up), (3, 0));
        assert_eq!((d.local.bytes_down, d.local.window_clamped), (2 * 140, 3));
    }

    #[tokio::test]
    async fn interleaved_flows_each_merge() {
        let (a, b) = ("198.18.0.7:40000", "198.18.0.7:40001");
        let sink = Recorder::new();
        let mut d = Drain::new(true, true);
        for i in 0..3u32 {
            d.put(&sink, &data(a, 1000 + i * 100, &[b'a' + i as u8; 100]))
                .await;
            d.put(&sink, &data(b, 5000 + i * 100, &[b'x' + i as u8; 100]))
                .await;
        }
        assert!(
            sink.take().is_empty(),
            "nothing written before the drain ends"
        );
        d.flush(&sink).await;
        let mut w: Vec<_> = sink.take().iter().map(|p| seg(p)).collect();
        w.sort_by_key(|s| s.0);
        assert_eq!(w.len(), 2, "one merged segment per flow");
        let want_a: Vec<u8> = [[b'a'; 100], [b'b'; 100], [b'c'; 100]].concat();
        let want_b: Vec<u8> = [[b'x'; 100], [b'y'; 100], [b'z'; 100]].concat();
        assert_eq!((w[0].0, &w[0].2), (1000, &want_a));
        assert_eq!((w[1].0, &w[1].2), (5000, &want_b));
    }

    #[tokio::test]
    async fn a_flows_other_segment_writes_what_it_holds_first() {
        let (a, b) = ("198.18.0.7:40000", "198.18.0.7:40001");
        let sink = Recorder::new();
        let mut d = Drain::new(true, true);
        d.put(&sink, &data(a, 1000, &[1; 100])).await;
        d.put(&sink, &data(b, 5000, &[2; 100])).await;
        d.put(&sink, &data(a, 1100, &[3; 100])).await;
        d.put(&sink, &ack(a, 9)).await;
        // The FIN of flow a: its merge goes first; flow b keeps its own.
        d.put(
            &sink,
            &tcp_v4(a, S, 1200, 9, flags::ACK | flags::FIN, &[], b""),
        )
        .await;
        let w: Vec<_> = sink.take().iter().map(|p| seg(p)).collect();
        assert_eq!(w.len(), 3, "{w:?}");
        assert_eq!((w[0].0, w[0].2.len()), (1000, 200), "the merge of a first");
        assert_eq!((w[1].1, w[1].2.len()), (9, 0), "then a's ACK");
        assert_ne!(w[2].3 & flags::FIN, 0, "then a's FIN");
        d.flush(&sink).await;
        let w: Vec<_> = sink.take().iter().map(|p| seg(p)).collect();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].0, 5000, "b's segment waited for the drain's end");
    }

    #[tokio::test]
    async fn a_held_ack_is_released_at_drain_end() {
        let c = "198.18.0.7:40000";
        let sink = Recorder::new();
        let mut d = Drain::new(true, true);
        for n in [100, 200, 300] {
            d.put(&sink, &ack(c, n)).await;
        }
        assert!(sink.take().is_empty(), "ACKs wait for the drain's end");
        d.flush(&sink).await;
        let w: Vec<_> = sink.take().iter().map(|p| seg(p)).collect();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].1, 300, "the newest ACK is written");
        assert_eq!(d.local.acks_thinned, 2);
        d.flush(&sink).await;
        assert!(sink.take().is_empty(), "written once");
    }

    #[tokio::test]
    async fn duplicate_acks_are_all_written_in_order() {
        let c = "198.18.0.7:40000";
        let sink = Recorder::new();
        let mut d = Drain::new(true, true);
        for n in [300, 300, 300, 250] {
            d.put(&sink, &ack(c, n)).await;
        }
        d.flush(&sink).await;
        let acks: Vec<u32> = sink.take().iter().map(|p| seg(p).1).collect();
        assert_eq!(acks, [300, 300, 300, 250]);
        assert_eq!(d.local.acks_thinned, 0);
    }

    #[tokio::test]
    async fn without_thinning_every_ack_is_written_at_once() {
        let c = "198.18.0.7:40000";
        let sink = Recorder::new();
        let mut d = Drain::new(true, false);
        for n in [100, 200] {
            d.put(&sink, &ack(c, n)).await;
        }
        assert_eq!(sink.take().len(), 2);
    }

    #[tokio::test]
    async fn a_full_table_writes_its_oldest_merge() {
        let sink = Recorder::new();
        let mut d = Drain::new(true, true);
        for f in 0..=MERGE_FLOWS as u16 {
            d.put(
                &sink,
                &data(&format!("198.18.0.7:{}", 40000 + f), 1, &[9; 10]),
            )
            .await;
        }
        let w: Vec<_> = sink.take();
        assert_eq!(w.len(), 1, "one merge made room");
        let ip = parse_ip(&w[0]).expect("ip");
        assert_eq!(parse_tcp(&w[0], &ip).expect("tcp").src_port, 40000);
        d.flush(&sink).await;
        assert_eq!(sink.take().len(), MERGE_FLOWS);
    }

    /// The client of the refused-merge tests.
    const C: &str = "198.18.0.7:40000";

    /// Three 1000-byte segments from `C`, merged into one write that the
    /// sink refuses with `errno`.
    async fn merge_refused(errno: i32) -> (Recorder, Drain) {
        let sink = Recorder::refusing(1500, errno);
        let mut d = Drain::new(true, true);
        for i in 0..3u32 {
            d.put(&sink, &data(C, 1000 + i * 1000, &[i as u8; 1000]))
                .await;
        }
        d.flush(&sink).await;
        (sink, d)
    }

    #[tokio::test]
    async fn an_enobufs_merge_is_written_as_its_segments_and_merging_goes_on() {
        let (sink, mut d) = merge_refused(libc::ENOBUFS).await;
        let w: Vec<_> = sink.take().iter().map(|p| seg(p)).collect();
        let got: Vec<(u32, usize)> = w.iter().map(|s| (s.0, s.2.len())).collect();
        assert_eq!(got, [(1000, 1000), (2000, 1000), (3000, 1000)]);
        assert!(
            w.iter()
                .enumerate()
                .all(|(i, s)| s.2.iter().all(|&b| b == i as u8))
        );
        assert!(d.out.merging(), "ENOBUFS is transient");
        assert_eq!(d.local.drops[EngineDrop::TunWrite as usize], 0);
        // The next drain merges again.
        d.put(&sink, &data(C, 4000, &[7; 100])).await;
        d.put(&sink, &data(C, 4100, &[8; 100])).await;
        d.flush(&sink).await;
        let w = sink.take();
        assert_eq!(w.len(), 1);
        assert_eq!(seg(&w[0]).2.len(), 200);
    }

    #[tokio::test]
    async fn a_merge_refused_for_its_size_stops_merging() {
        let (sink, mut d) = merge_refused(libc::EINVAL).await;
        assert_eq!(sink.take().len(), 3, "written as its segments");
        assert!(!d.out.merging());
        d.put(&sink, &data(C, 4000, &[7; 100])).await;
        assert_eq!(sink.take().len(), 1, "written at once from now on");
    }
}
