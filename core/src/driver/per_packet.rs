//! The per-packet reader: one packet per read system call, as Android's
//! VpnService descriptor and a Linux TUN without offload deliver them.
//!
//! With `coalesce`, the segments of one flow read in the same drain and
//! written back toward the kernel listener are merged (`packet::coalesce`)
//! into one packet of up to 64 KiB, held aside until a packet that does not
//! continue it, or the end of the drain: the kernel's TCP then receives one
//! segment where it would have received up to [`DRAIN_PER_EDGE`]. Any other
//! packet first writes out what is held, so a flow's packets keep their
//! order. If the device refuses a merged packet, merging stops for good.

use std::io;

use super::{DRAIN_PER_EDGE, Head, is_fatal, write_back};
use crate::demux::Demux;
use crate::packet::coalesce::{self, MAX_PACKET};
use crate::packet::{Disposition, HEADROOM};
use crate::stats::LocalCounters;
use crate::tun::Tun;

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
    /// `HEADROOM + MAX_PACKET` bytes once first used.
    buf: Vec<u8>,
    /// Length of the held packet (0: none).
    len: usize,
    /// Whether segments were merged into it (it may exceed the MTU).
    merged: bool,
}

impl Held {
    /// Hold `pkt` as the start of a possible merge.
    fn start(&mut self, pkt: &[u8]) {
        if self.buf.is_empty() {
            self.buf = vec![0u8; HEADROOM + MAX_PACKET];
        }
        self.buf[HEADROOM..HEADROOM + pkt.len()].copy_from_slice(pkt);
        self.len = pkt.len();
        self.merged = false;
    }

    /// Merge `pkt` into the held packet, if it continues it.
    fn append(&mut self, pkt: &[u8]) -> bool {
        if self.len == 0 {
            return false;
        }
        match coalesce::append(&mut self.buf[HEADROOM..], self.len, pkt) {
            Some(n) => {
                self.len = n;
                self.merged = true;
                true
            }
            None => false,
        }
    }

    /// Write the held packet out. False if the device refused a merged
    /// packet: the caller stops merging (the refused data is a counted
    /// drop, which TCP retransmits).
    async fn flush(&mut self, tun: &Tun, local: &mut LocalCounters) -> bool {
        if self.len == 0 {
            return true;
        }
        let (len, merged) = (self.len, self.merged);
        self.len = 0;
        let sent = write_back(tun, local, &mut self.buf, len).await;
        if !sent && merged {
            tracing::warn!(
                "the TUN refused a merged {len}-byte segment: writing segments back one by one from now on"
            );
            return false;
        }
        true
    }
}
