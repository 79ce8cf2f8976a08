//! TUN I/O drivers. One task owns the device's read side; every driver feeds
//! packets to the same [`Processor::process`] and acts only on the returned
//! [`Disposition`], so batching is an I/O concern and never a second
//! processing path.
//!
//! * Per-packet (iOS, Android, or Linux without offload): wait for readiness,
//!   then drain up to [`DRAIN_PER_EDGE`] packets, writing each back with a
//!   non-blocking `try_send` and falling back to an awaited send only when the
//!   device queue is full.
//! * Batch (Linux `virtio_net_hdr` offload): one read returns a TCP
//!   super-packet of up to 64 KiB that tun-rs splits into segments; the
//!   rewritten segments are written with `send_multiple`, which coalesces them
//!   again (GRO) before they reach the kernel. A read that yields a single
//!   packet is written back in place, without the copy into a GRO buffer.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::packet::Disposition;
use crate::stats::EngineDrop;
use crate::system::{Processor, STOPPED, Shared};
use crate::tun::HEADROOM;

/// Packets drained per readiness edge in per-packet mode. Bounds the time the
/// driver monopolises a worker (32 x ~1 us) while amortising the wake-up; the
/// number follows the seed's measurement and sing-tun's drain loop.
pub const DRAIN_PER_EDGE: usize = 32;

/// How often NAT entries, unaccepted outbounds and idle UDP flows are expired.
/// Only armed while there is something to expire, so an idle tunnel sleeps.
pub(crate) const CLEANUP_TICK: Duration = Duration::from_secs(1);

/// Which driver runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverKind {
    PerPacket,
    Batch,
}

impl DriverKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DriverKind::PerPacket => "per_packet",
            DriverKind::Batch => "batch",
        }
    }
}

/// Run the driver until the engine stops or the device fails.
pub(crate) async fn run(shared: Arc<Shared>, kind: DriverKind) {
    let mut proc = Processor::new(shared.clone());
    let result = match kind {
        DriverKind::PerPacket => per_packet(&mut proc).await,
        #[cfg(target_os = "linux")]
        DriverKind::Batch => batch::run(&mut proc).await,
        // Darwin: recvmsg_x batches behind a run-time probe (crate::utun).
        #[cfg(any(target_os = "macos", target_os = "ios"))]
        DriverKind::Batch => crate::utun::run_batch(&mut proc).await,
        #[cfg(not(any(target_os = "linux", target_os = "macos", target_os = "ios")))]
        DriverKind::Batch => per_packet(&mut proc).await,
    };
    proc.local.commit(&shared.stats, Instant::now());
    if let Err(e) = result {
        shared.fail(format!("TUN device failed: {e}"));
    }
}

/// Read errors that end the driver (device gone); the rest are retried.
pub(crate) fn is_fatal(e: &io::Error) -> bool {
    !matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    ) && e.raw_os_error().is_some()
}

async fn per_packet(proc: &mut Processor) -> io::Result<()> {
    let shared = proc.shared.clone();
    let tun = &shared.tun;
    let mut stop = shared.stop.subscribe();
    // One buffer for the device's largest packet plus the virtio headroom.
    let mut buf = vec![0u8; HEADROOM + usize::from(shared.mtu).max(1500) + 64].into_boxed_slice();
    let mut tick = tokio::time::interval(CLEANUP_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let armed = proc.has_state();
        tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s >= STOPPED) => return Ok(()),
            r = tun.dev.readable() => r?,
            _ = tick.tick(), if armed => {
                proc.cleanup(Instant::now());
                continue;
            }
        }
        proc.now = Instant::now();
        let mut n_read = 0u64;
        for _ in 0..DRAIN_PER_EDGE {
            let len = match tun.try_recv(&mut buf) {
                Ok(len) => len,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if is_fatal(&e) => return Err(e),
                Err(_) => break,
            };
            n_read += 1;
            let pkt = &mut buf[HEADROOM..HEADROOM + len];
            match proc.process(pkt) {
                Disposition::WriteBack(n) => {
                    proc.local.writes += 1;
                    match tun.try_send(&mut buf, n) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            if tun.send(&mut buf, n).await.is_err() {
                                proc.local.drop(EngineDrop::TunWrite);
                            }
                        }
                        Err(_) => proc.local.drop(EngineDrop::TunWrite),
                    }
                }
                Disposition::ForwardUdp => proc.forward_udp(pkt),
                Disposition::Done => {}
            }
        }
        if n_read > 0 {
            proc.local.read_done(n_read, &shared.stats, proc.now);
        }
        if (n_read as usize) < DRAIN_PER_EDGE {
            // About to sleep: publish what was counted.
            proc.local.commit(&shared.stats, proc.now);
        }
    }
}

#[cfg(target_os = "linux")]
mod batch {
    use super::*;
    use tun_rs::{GROTable, IDEAL_BATCH_SIZE};

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

    pub(super) async fn run(proc: &mut Processor) -> io::Result<()> {
        let shared = proc.shared.clone();
        let tun = &shared.tun;
        let mut stop = shared.stop.subscribe();
        let seg_len = HEADROOM + usize::from(shared.mtu);
        let mut original = vec![0u8; SUPER_PACKET].into_boxed_slice();
        // One lazily-populated arena for all segment buffers: pages are only
        // resident once a segment was written there.
        let mut arena = vec![0u8; SEGMENTS * seg_len].into_boxed_slice();
        let mut segs: Vec<&mut [u8]> = arena.chunks_exact_mut(seg_len).collect();
        let mut sizes = vec![0usize; SEGMENTS];
        // Write buffers need room to coalesce a whole super-packet: a buffer
        // sized HEADROOM + MTU never coalesces (DESIGN.md field notes).
        let mut out: Vec<Vec<u8>> = (0..IDEAL_BATCH_SIZE)
            .map(|_| Vec::with_capacity(2 * HEADROOM + 65_535))
            .collect();
        let mut gro = GROTable::default();
        let mut tick = tokio::time::interval(CLEANUP_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let armed = proc.has_state();
            tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s >= STOPPED) => return Ok(()),
                r = tun.dev.readable() => r?,
                _ = tick.tick(), if armed => {
                    proc.cleanup(Instant::now());
                    continue;
                }
            }
            proc.now = Instant::now();
            let mut drained = false;
            for _ in 0..READS_PER_EDGE {
                let n =
                    match tun
                        .dev
                        .try_recv_multiple(&mut original, &mut segs, &mut sizes, HEADROOM)
                    {
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            drained = true;
                            break;
                        }
                        Err(e) if is_fatal(&e) => return Err(e),
                        Err(_) => {
                            // Malformed virtio header or too many segments: this read
                            // is lost as a whole, counted; TCP retransmits it.
                            proc.local.drop(EngineDrop::TunReadBatch);
                            continue;
                        }
                    };
                if n == 1 {
                    // One packet, nothing to coalesce it with (the common
                    // read at a 64 KiB MTU, and every ACK): write it back
                    // from where it was read, with a "no offload" header,
                    // instead of copying it into a write buffer for GRO
                    // (5-9 % of engine CPU in the splice/copy profiles).
                    let buf = &mut *segs[0];
                    match proc.process(&mut buf[HEADROOM..HEADROOM + sizes[0]]) {
                        Disposition::WriteBack(len) => write_one(proc, buf, len).await,
                        Disposition::ForwardUdp => {
                            proc.forward_udp(&buf[HEADROOM..HEADROOM + sizes[0]]);
                        }
                        Disposition::Done => {}
                    }
                    proc.local.read_done(1, &shared.stats, proc.now);
                    continue;
                }
                let mut pending = 0usize;
                for i in 0..n {
                    let seg = &mut segs[i][HEADROOM..HEADROOM + sizes[i]];
                    match proc.process(seg) {
                        Disposition::WriteBack(len) => {
                            let o = &mut out[pending];
                            o.clear();
                            o.resize(HEADROOM, 0);
                            o.extend_from_slice(&seg[..len]);
                            pending += 1;
                            if pending == out.len() {
                                flush(proc, &mut gro, &mut out[..pending]).await;
                                pending = 0;
                            }
                        }
                        Disposition::ForwardUdp => proc.forward_udp(seg),
                        Disposition::Done => {}
                    }
                }
                if pending > 0 {
                    flush(proc, &mut gro, &mut out[..pending]).await;
                }
                proc.local.read_done(n as u64, &shared.stats, proc.now);
            }
            if drained {
                // About to sleep: publish what was counted.
                proc.local.commit(&shared.stats, proc.now);
            }
        }
    }

    /// Write one packet in place: non-blocking first, awaiting the device
    /// only when its queue is full.
    async fn write_one(proc: &mut Processor, buf: &mut [u8], len: usize) {
        proc.local.writes += 1;
        let tun = &proc.shared.tun;
        match tun.try_send(buf, len) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if tun.send(buf, len).await.is_err() {
                    proc.local.drop(EngineDrop::TunWrite);
                }
            }
            Err(_) => proc.local.drop(EngineDrop::TunWrite),
        }
    }

    async fn flush(proc: &mut Processor, gro: &mut GROTable, bufs: &mut [Vec<u8>]) {
        proc.local.writes += bufs.len() as u64;
        if proc
            .shared
            .tun
            .dev
            .send_multiple(gro, bufs, HEADROOM)
            .await
            .is_err()
        {
            proc.local.drop(EngineDrop::TunWrite);
        }
    }
}
