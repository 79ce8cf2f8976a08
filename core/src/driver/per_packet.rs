//! The per-packet reader: one packet per read system call, as Android's
//! VpnService descriptor and a Linux TUN without offload deliver them.
//!
//! What it writes back goes through [`WriteBack`]
//! (`core/src/driver/writeback.rs`): with `coalesce`, a flow's data
//! segments toward the kernel listener read in one drain are merged; with
//! `thin_acks`, of a flow's pure ACKs in one drain only the newest is
//! written. Both wait at most until the drain ends.
//!
//! On Linux/Android with `tun.read_ring` > 0 the device is read by a thread
//! of its own into a bounded ring (`core/src/driver/read_ring.rs`) and the
//! drains take packets from the ring; otherwise this task reads the
//! device itself. Either way each packet is processed and written back
//! the same way ([`one`]).

use std::io;
use std::sync::Arc;

#[cfg(linux_like)]
use super::RING_DRAIN;
use super::writeback::{Untranslated, WriteBack};
use super::{DRAIN_PER_EDGE, Head, is_fatal};
use crate::demux::Demux;
use crate::packet::{Disposition, HEADROOM};
use crate::tun::Tun;

pub(super) async fn run(
    demux: &mut Demux,
    head: &mut Head,
    tun: &Arc<Tun>,
    mtu: usize,
    coalesce: bool,
    thin_acks: bool,
    read_ring: usize,
) -> io::Result<()> {
    let mut out = WriteBack::new(coalesce, thin_acks);
    if demux.system_stack() {
        out = out.merging_as_read(demux.defers_data_sums());
    }
    #[cfg(linux_like)]
    if read_ring > 0 {
        let stats = demux.stats().clone();
        match super::read_ring::Reader::start(tun.clone(), read_ring, mtu, stats) {
            // The reader thread is stopped and joined when `reader` drops,
            // however this driver ends.
            Ok(reader) => {
                head.read_from(reader.ring().clone());
                return run_ring(demux, head, tun, reader.ring(), &mut out).await;
            }
            Err(e) => tracing::warn!("no TUN reader thread ({e}): reading on the driver task"),
        }
    }
    #[cfg(not(linux_like))]
    let _ = read_ring;
    run_in_task(demux, head, tun, mtu, &mut out).await
}

/// Read on the driver task: up to [`DRAIN_PER_EDGE`] packets per
/// readiness edge of the device.
async fn run_in_task(
    demux: &mut Demux,
    head: &mut Head,
    tun: &Tun,
    mtu: usize,
    out: &mut WriteBack,
) -> io::Result<()> {
    // One buffer for the device's largest packet plus the headroom.
    let mut buf = vec![0u8; HEADROOM + mtu.max(1500) + 64].into_boxed_slice();
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
            one(demux, tun, out, &mut buf, len).await;
        }
        out.flush(tun, &mut demux.local).await;
        if n_read > 0 {
            demux.read_done(n_read);
        }
        demux.drained((n_read as usize) < DRAIN_PER_EDGE);
    }
    Ok(())
}

/// Take packets from the reader thread's ring (`read_ring.rs`): up to
/// [`RING_DRAIN`] per drain, processed and written back exactly as
/// [`run_in_task`] does, their slots then given back to the reader.
#[cfg(linux_like)]
async fn run_ring(
    demux: &mut Demux,
    head: &mut Head,
    tun: &Tun,
    ring: &super::read_ring::Ring,
    out: &mut WriteBack,
) -> io::Result<()> {
    let mut popped = Vec::with_capacity(RING_DRAIN);
    while head.readable(demux).await? {
        ring.pop(&mut popped, RING_DRAIN)?;
        let n_read = popped.len();
        for slot in popped.iter_mut() {
            let len = slot.packet_len();
            one(demux, tun, out, slot.buf_mut(), len).await;
        }
        out.flush(tun, &mut demux.local).await;
        ring.recycle(&mut popped);
        if n_read > 0 {
            demux.read_done(n_read as u64);
        }
        demux.drained(n_read < RING_DRAIN);
    }
    Ok(())
}

/// Process the packet at `buf[HEADROOM..][..len]` and hand what comes of
/// it to the write-back. A segment that continues a merge the write-back
/// holds, as it was read, goes there untranslated
/// (`core/src/driver/writeback.rs`).
async fn one(demux: &mut Demux, tun: &Tun, out: &mut WriteBack, buf: &mut [u8], len: usize) {
    let pkt = &buf[HEADROOM..HEADROOM + len];
    if out.continues(pkt, &mut demux.local) {
        return;
    }
    let mut raw = out.as_read(pkt);
    let before = Untranslated::counts(&demux.local);
    let Disposition::WriteBack(n) = demux.process(&mut buf[HEADROOM..HEADROOM + len]) else {
        if raw.is_some_and(|r| r.maybe_tcp()) {
            out.forget_untranslated();
        }
        return;
    };
    if let Some(r) = raw.as_mut() {
        r.translated(before, &demux.local);
    }
    let to_listener = out.merging() && demux.to_listener(&buf[HEADROOM..HEADROOM + n]);
    out.put(tun, &mut demux.local, buf, n, to_listener, raw.as_ref())
        .await;
}
