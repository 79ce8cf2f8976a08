//! The per-packet reader: one packet per read system call, as Android's
//! VpnService descriptor and a Linux TUN without offload deliver them.
//!
//! With `coalesce`, the segments of one flow read in the same drain and
//! written back toward the kernel listener are merged (`packet::coalesce`)
//! into one packet of up to [`MERGE_MAX`] bytes, held aside until a packet
//! that does not continue it, or the end of the drain: the kernel's TCP
//! then receives one segment where it would have received up to
//! [`DRAIN_PER_EDGE`]. Any other packet first writes out what is held, so a
//! flow's packets keep their order.
//!
//! A merged packet the device refuses is cut back into the segments it was
//! (`coalesce::segment_at`) and those are written instead. A kernel before
//! 6.6 allocates a TUN write in one piece, so a large write can fail with
//! `ENOBUFS` (or `ENOMEM`) while memory is fragmented: that is transient
//! and merging goes on. Any other refusal says the device does not take
//! packets above its MTU, and merging stops for good.

use std::io;

use super::{DRAIN_PER_EDGE, Head, is_fatal, send, write_back};
use crate::demux::Demux;
use crate::packet::coalesce;
use crate::packet::{Disposition, HEADROOM};
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

pub(super) async fn run(
    demux: &mut Demux,
    head: &mut Head,
    tun: &Tun,
    mtu: usize,
    mut coalesce: bool,
) -> io::Result<()> {
    // One buffer for the device's largest packet plus the headroom.
    let mut buf = vec![0u8; HEADROOM + mtu.max(1500) + 64].into_boxed_slice();
    // The merge in progress (allocated, and its pages touched, only once a
    // merge happens).
    let mut held = Held::default();
    while head.readable(demux).await? {
        let mut n_read = 0u64;
        for _ in 0..DRAIN_PER_EDGE {
            let len = match tun.try_recv(&mut buf) {
                Ok(len) => len,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if is_fatal(&e) => return Err(e),
                Err(_) => break,
            };
            n_read += 1;
            let Disposition::WriteBack(n) = demux.process(&mut buf[HEADROOM..HEADROOM + len])
            else {
                continue;
            };
            let out = &buf[HEADROOM..HEADROOM + n];
            if coalesce && demux.coalescible(out) {
                if held.append(out) {
                    continue;
                }
                coalesce &= held.flush(tun, &mut demux.local).await;
                held.start(out);
                continue;
            }
            coalesce &= held.flush(tun, &mut demux.local).await;
            write_back(tun, &mut demux.local, &mut buf, n).await;
        }
        coalesce &= held.flush(tun, &mut demux.local).await;
        if n_read > 0 {
            demux.read_done(n_read);
        }
        demux.drained((n_read as usize) < DRAIN_PER_EDGE);
    }
    Ok(())
}

/// A packet held aside to merge the next segments of its flow into.
#[derive(Default)]
struct Held {
    /// `HEADROOM` plus [`MERGE_MAX`] or the first held packet's length,
    /// whichever is larger, once first used.
    buf: Vec<u8>,
    /// Length of the held packet (0: none).
    len: usize,
    /// The held packet's own payload length before anything was merged
    /// into it: where a refused merge is cut back.
    first_payload: usize,
    /// Whether segments were merged into it (it may exceed the MTU).
    merged: bool,
    /// One segment cut back from a refused merge (allocated on the first).
    scratch: Vec<u8>,
    /// Merged writes refused as transient (`ENOBUFS`, `ENOMEM`) so far.
    transient: u64,
}

impl Held {
    /// Hold `pkt` as the start of a possible merge.
    fn start(&mut self, pkt: &[u8]) {
        if self.buf.len() < HEADROOM + pkt.len().max(MERGE_MAX) {
            self.buf = vec![0u8; HEADROOM + pkt.len().max(MERGE_MAX)];
        }
        self.buf[HEADROOM..HEADROOM + pkt.len()].copy_from_slice(pkt);
        self.len = pkt.len();
        self.first_payload = payload_len(pkt);
        self.merged = false;
    }

    /// Merge `pkt` into the held packet, if it continues it and the result
    /// stays within [`MERGE_MAX`].
    fn append(&mut self, pkt: &[u8]) -> bool {
        if self.len == 0 {
            return false;
        }
        let room = &mut self.buf[HEADROOM..HEADROOM + MERGE_MAX.max(self.len)];
        match coalesce::append(room, self.len, pkt) {
            Some(n) => {
                self.len = n;
                self.merged = true;
                true
            }
            None => false,
        }
    }

    /// Write the held packet out. A refused merged packet is written as
    /// the segments it was instead (module docs); false if the refusal
    /// was not transient, and the caller stops merging.
    async fn flush(&mut self, tun: &Tun, local: &mut LocalCounters) -> bool {
        if self.len == 0 {
            return true;
        }
        let (len, merged) = (self.len, self.merged);
        self.len = 0;
        let Err(e) = send(tun, local, &mut self.buf, len).await else {
            return true;
        };
        if !merged {
            local.drop(EngineDrop::TunWrite);
            return true;
        }
        self.write_cut(tun, local, len).await;
        let transient = is_transient(&e);
        if transient {
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
        }
        transient
    }

    /// Write the held merged packet of `len` bytes as the segments it was
    /// merged from; each failure is a counted drop (TCP retransmits it).
    async fn write_cut(&mut self, tun: &Tun, local: &mut LocalCounters, len: usize) {
        let merged = &self.buf[HEADROOM..HEADROOM + len];
        let need = HEADROOM + len.min(self.first_payload + (len - payload_len(merged)));
        if self.scratch.len() < need {
            self.scratch = vec![0u8; need];
        }
        for i in 0.. {
            let merged = &self.buf[HEADROOM..HEADROOM + len];
            let Some(n) =
                coalesce::segment_at(merged, self.first_payload, i, &mut self.scratch[HEADROOM..])
            else {
                break;
            };
            write_back(tun, local, &mut self.scratch, n).await;
        }
    }
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
