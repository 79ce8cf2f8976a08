//! The Linux offload reader: the device carries a `virtio_net_hdr`, so one
//! read may return a TCP super-packet of up to 64 KiB, which tun-rs splits
//! into segments (GSO); the rewritten segments are written back with
//! `send_multiple`, which coalesces them again (GRO) before the kernel sees
//! them. A read that yields a single packet is written back in place.

use std::io;

use tun_rs::{GROTable, IDEAL_BATCH_SIZE};

use super::{Head, handle, is_fatal};
use crate::demux::Demux;
use crate::packet::{Disposition, HEADROOM};
use crate::stats::EngineDrop;
use crate::tun::Tun;

/// The smallest TCP MSS a peer may advertise (RFC 9293 permits tiny ones;
/// 48 is the floor Linux enforces via `tcp_min_snd_mss`). A 64 KiB
/// super-packet split at that MSS needs 65535 / 48 + 1 = 1366 segment
/// buffers; fewer would make tun-rs refuse the read ("too many segments").
const MIN_MSS: usize = 48;
const SEGMENTS: usize = 65_535 / MIN_MSS + 1;
/// Super-packet reads per readiness edge, bounding the time the driver
/// holds a worker (8 x 64 KiB) before other tasks run.
const READS_PER_EDGE: usize = 8;
/// Maximum IP packet, plus the virtio header.
const SUPER_PACKET: usize = HEADROOM + 65_535;

pub(super) async fn run(
    demux: &mut Demux,
    head: &mut Head,
    tun: &Tun,
    mtu: usize,
) -> io::Result<()> {
    let mut original = vec![0u8; SUPER_PACKET].into_boxed_slice();
    // One lazily-populated arena for all segment buffers: pages are only
    // resident once a segment was written there.
    let seg_len = HEADROOM + mtu;
    let mut arena = vec![0u8; SEGMENTS * seg_len].into_boxed_slice();
    let mut segs: Vec<&mut [u8]> = arena.chunks_exact_mut(seg_len).collect();
    let mut sizes = vec![0usize; SEGMENTS];
    // Write buffers need room to coalesce a whole super-packet: a buffer
    // sized HEADROOM + MTU never coalesces (tun-rs coalesces only into spare
    // capacity of at least twice the header plus the merged length).
    let mut out: Vec<Vec<u8>> = (0..IDEAL_BATCH_SIZE)
        .map(|_| Vec::with_capacity(2 * HEADROOM + 65_535))
        .collect();
    let mut gro = GROTable::default();
    while head.readable(demux).await? {
        let mut empty = false;
        for _ in 0..READS_PER_EDGE {
            let n = match tun
                .dev
                .try_recv_multiple(&mut original, &mut segs, &mut sizes, HEADROOM)
            {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    empty = true;
                    break;
                }
                Err(e) if is_fatal(&e) => return Err(e),
                Err(_) => {
                    // Malformed virtio header or too many segments: this read
                    // is lost as a whole, counted; TCP retransmits it.
                    demux.local.drop(EngineDrop::TunReadBatch);
                    continue;
                }
            };
            if n == 1 {
                // One packet, nothing to coalesce it with (the common read at
                // a 64 KiB MTU, and every ACK): write it back from where it
                // was read instead of copying it into a write buffer for GRO.
                handle(demux, tun, segs[0], sizes[0]).await;
                demux.read_done(1);
                continue;
            }
            let mut pending = 0usize;
            for i in 0..n {
                let seg = &mut segs[i][HEADROOM..HEADROOM + sizes[i]];
                if let Disposition::WriteBack(len) = demux.process(seg) {
                    let o = &mut out[pending];
                    o.clear();
                    o.resize(HEADROOM, 0);
                    o.extend_from_slice(&seg[..len]);
                    pending += 1;
                    if pending == out.len() {
                        flush(demux, tun, &mut gro, &mut out[..pending]).await;
                        pending = 0;
                    }
                }
            }
            if pending > 0 {
                flush(demux, tun, &mut gro, &mut out[..pending]).await;
            }
            demux.read_done(n as u64);
        }
        demux.drained(empty);
    }
    Ok(())
}

async fn flush(demux: &mut Demux, tun: &Tun, gro: &mut GROTable, bufs: &mut [Vec<u8>]) {
    demux.local.writes += bufs.len() as u64;
    if tun.dev.send_multiple(gro, bufs, HEADROOM).await.is_err() {
        demux.local.drop(EngineDrop::TunWrite);
    }
}
