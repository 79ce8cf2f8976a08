//! The Darwin reader: `recvmsg_x` batch reads, probed at run time (the
//! symbol must exist and the calls must succeed; on any error the reader
//! switches to per-packet reads for good and counts it as a failed batch
//! read). Writes stay per packet: a utun has no list send, so the private
//! `sendmsg_x` would still hand the kernel one packet at a time
//! (docs/notes.md, "Merging on a utun"), and its behaviour across macOS
//! versions is not tested here.

use std::io;
use std::os::fd::AsFd;

use super::{Head, handle, is_fatal};
use crate::demux::Demux;
use crate::stats::EngineDrop;
use crate::sys::utun::{MAX_BATCH, RecvBatch, SlotError};
use crate::tun::Tun;

/// Batches per readiness edge: with [`MAX_BATCH`] (32) at most 128 packets
/// per wake-up, which bounds the time the reader keeps a worker before the
/// other tasks run, as [`super::DRAIN_PER_EDGE`] does for per-packet reads
/// (fewer wake-ups per packet, since one call reads up to 32).
const BATCHES_PER_EDGE: usize = 4;

pub(super) async fn run(
    demux: &mut Demux,
    head: &mut Head,
    tun: &Tun,
    mtu: usize,
) -> io::Result<()> {
    let mut batch = RecvBatch::new(MAX_BATCH, mtu.max(1500) + 64);
    let mut batching = crate::sys::darwin::recvmsg_x_available();
    if !batching {
        tracing::warn!("recvmsg_x is not available: reading the utun one packet at a time");
        demux.local.drop(EngineDrop::TunReadBatch);
    }
    while head.readable(demux).await? {
        let mut empty = false;
        for _ in 0..BATCHES_PER_EDGE {
            if batching {
                match crate::sys::darwin::recvmsg_x(tun.dev.as_fd(), &mut batch) {
                    Ok(n) if n > 0 => {
                        for i in 0..n {
                            match batch.packet(i) {
                                Ok((buf, len)) => handle(demux, tun, buf, len).await,
                                Err(SlotError::Truncated) => {
                                    demux.local.drop(EngineDrop::TunReadBatch)
                                }
                                // Counted by the parser as an empty packet.
                                Err(SlotError::Short) => {
                                    let _ = demux.process(&mut []);
                                }
                            }
                        }
                        demux.read_done(n as u64);
                        continue;
                    }
                    // Nothing queued: the read below consumes the readiness
                    // edge (tun-rs clears it only on its own WouldBlock), so
                    // the driver sleeps instead of spinning.
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        tracing::warn!(
                            "recvmsg_x failed ({e}): reading the utun one packet at a time"
                        );
                        demux.local.drop(EngineDrop::TunReadBatch);
                        batching = false;
                        continue;
                    }
                }
            }
            let buf = batch.slot_mut(0);
            let len = match tun.try_recv(buf) {
                Ok(len) => len,
                Err(e) if is_fatal(&e) => return Err(e),
                Err(_) => {
                    empty = true;
                    break;
                }
            };
            handle(demux, tun, buf, len).await;
            demux.read_done(1);
        }
        demux.drained(empty);
    }
    Ok(())
}
