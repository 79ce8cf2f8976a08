//! TUN I/O drivers. One task owns the device's read side. Its loop has one
//! head ([`Head`]): sleep until the device is readable, the engine stops, or
//! a cleanup tick is due; then the reader drains a bounded number of packets.
//! Every reader feeds packets to the same [`Demux::process`]
//! (`core/src/demux.rs`) and writes back with the same [`write_back`], so
//! batching is an I/O concern and never a second processing path.
//!
//! The readers, one file each, picked by platform:
//!
//! * `per_packet` (Android, iOS without `recvmsg_x`, Linux without offload):
//!   drain up to [`DRAIN_PER_EDGE`] packets per readiness edge, each written
//!   back with a non-blocking send, awaiting the device only when its queue
//!   is full; on Linux/Android consecutive segments of a flow toward the
//!   kernel listener are merged first (`packet::coalesce`); on
//!   Linux/Android with `tun.read_ring` > 0 a thread of its own reads the
//!   device into a bounded ring (`read_ring`) and the driver drains the
//!   ring instead, up to `RING_DRAIN` packets at a time;
//! * `linux_gro` (Linux `virtio_net_hdr` offload): one read returns a TCP
//!   super-packet of up to 64 KiB that tun-rs splits into segments; the
//!   rewritten segments are written with `send_multiple`, which coalesces
//!   them again (GRO) before they reach the kernel;
//! * `darwin` (macOS, iOS): `recvmsg_x` batch reads behind a run-time probe,
//!   per-packet writes.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::demux::Demux;
use crate::lifecycle::{Lifecycle, Phase, Ticker};
use crate::network::Addresses;
use crate::packet::{Disposition, HEADROOM};
use crate::stats::{EngineDrop, LocalCounters};
use crate::tun::Tun;

#[cfg(apple)]
mod darwin;
#[cfg(target_os = "linux")]
mod linux_gro;
mod per_packet;
#[cfg(linux_like)]
mod read_ring;
mod writeback;

use writeback::Sink;

/// Packets drained per readiness edge in per-packet mode. Bounds the time the
/// driver keeps a worker before the other tasks run, while amortising the
/// wake-up over a burst and giving the merges and held ACKs a longer run
/// (`writeback.rs`). 64 against 32 on the phone profile at MTU 1500, 16
/// and 64 streams: 7-12 % less CPU per byte, 5-11 % more throughput, the
/// same drops; mixed at 9000 (docs/notes.md, "Drains of 64 packets").
pub const DRAIN_PER_EDGE: usize = 64;

/// Packets taken from the reader thread's ring per drain
/// (`tun.read_ring` > 0, `read_ring.rs`): the reader goes on reading while
/// the driver writes, so a drain finds more waiting than an edge of the
/// device would give.
#[cfg(linux_like)]
pub const RING_DRAIN: usize = 64;

/// How often NAT entries, unaccepted outbounds and idle UDP flows are expired.
/// Only armed while there is something to expire, so an idle tunnel sleeps;
/// no timer at all while the engine sleeps (`Engine::sleep`, [`Ticker`]),
/// and one tick at once on wake.
pub(crate) const CLEANUP_TICK: Duration = Duration::from_secs(1);

/// What the per-packet driver does with the segments it writes back
/// (`driver::writeback`; the batch drivers write each one as it comes).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteOptions {
    /// `tun.coalesce`: merge a flow's data segments toward the listener.
    pub coalesce: bool,
    /// `tun.ack_thinning`: of a flow's pure ACKs in one drain, write the newest.
    pub thin_acks: bool,
}

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

/// Process the packet at `buf[HEADROOM..][..len]` and write the result
/// back from the same buffer (the batch readers; the per-packet reader
/// may hold packets aside to merge them).
#[cfg_attr(not(any(target_os = "linux", apple)), allow(dead_code))]
async fn handle(demux: &mut Demux, tun: &Tun, buf: &mut [u8], len: usize) {
    if let Disposition::WriteBack(n) = demux.process(&mut buf[HEADROOM..HEADROOM + len]) {
        write_back(tun, &mut demux.local, buf, n).await;
    }
}

/// Write the packet at `buf[HEADROOM..][..len]` to the TUN: without
/// waiting first, awaiting the device only when its queue is full. A
/// failed write is a counted drop (TCP retransmits it); false then.
async fn write_back<S: Sink>(
    tun: &S,
    local: &mut LocalCounters,
    buf: &mut [u8],
    len: usize,
) -> bool {
    let sent = send(tun, local, buf, len).await;
    if sent.is_err() {
        local.drop(EngineDrop::TunWrite);
    }
    sent.is_ok()
}

/// [`write_back`] that leaves a failure to the caller, uncounted.
async fn send<S: Sink>(
    tun: &S,
    local: &mut LocalCounters,
    buf: &mut [u8],
    len: usize,
) -> io::Result<()> {
    local.writes += 1;
    match tun.try_send(buf, len) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => tun.send(buf, len).await,
        Err(e) => Err(e),
    }
}

/// Run the driver until the engine stops or the device fails (then the
/// engine fails with the reason).
pub(crate) async fn run(
    mut demux: Demux,
    tun: Arc<Tun>,
    kind: DriverKind,
    life: Arc<Lifecycle>,
    mtu: u16,
    writes: WriteOptions,
    read_ring: usize,
) {
    let mtu = usize::from(mtu);
    // Merged packets exceed the MTU: only where the kernel is known to take
    // them on a TUN without offload (Linux; utun is not checked).
    let coalesce = writes.coalesce && cfg!(linux_like);
    let thin_acks = writes.thin_acks;
    let mut head = Head::new(tun.clone(), &life);
    head.held_answered = demux.held_answered();
    let d = &mut demux;
    let h = &mut head;
    let result = match kind {
        DriverKind::PerPacket => {
            per_packet::run(d, h, &tun, mtu, coalesce, thin_acks, read_ring).await
        }
        #[cfg(target_os = "linux")]
        DriverKind::Batch => linux_gro::run(d, h, &tun, mtu).await,
        #[cfg(apple)]
        DriverKind::Batch => darwin::run(d, h, &tun, mtu).await,
        #[cfg(not(any(target_os = "linux", apple)))]
        DriverKind::Batch => per_packet::run(d, h, &tun, mtu, coalesce, thin_acks, read_ring).await,
    };
    demux.commit(Instant::now());
    if let Err(e) = result {
        life.fail(format!("TUN device failed: {e}"));
    }
}

/// The head of every reader's loop: sleep until the device is readable, the
/// engine stops, or a cleanup tick is due (armed only while there is state
/// to expire, so an idle tunnel sleeps; never while the engine sleeps).
pub(crate) struct Head {
    input: Input,
    phase: watch::Receiver<Phase>,
    tick: Ticker,
    /// The host's network changes (`network.rs`): the flow table closes
    /// the flows a change stranded.
    network: watch::Receiver<Option<Arc<Addresses>>>,
    /// A held UDP flow's owner lookup answered (`udp/sniff.rs`): it is
    /// routed at once, not at its next datagram or the next tick.
    held_answered: Arc<tokio::sync::Notify>,
}

impl Head {
    pub fn new(tun: Arc<Tun>, life: &Arc<Lifecycle>) -> Self {
        Head {
            input: Input {
                tun,
                #[cfg(linux_like)]
                ring: None,
            },
            phase: life.subscribe(),
            tick: Ticker::new(CLEANUP_TICK, life),
            network: life.network().subscribe(),
            held_answered: Default::default(),
        }
    }

    /// Wait on the reader thread's ring instead of the device from now on.
    #[cfg(linux_like)]
    fn read_from(&mut self, ring: Arc<read_ring::Ring>) {
        self.input.ring = Some(ring);
    }

    /// Wait until the device is readable (true; `demux.now` is set for the
    /// drain) or the engine stops (false). Due cleanups run here.
    pub async fn readable(&mut self, demux: &mut Demux) -> io::Result<bool> {
        // Let the runtime drop the tasks the last drain aborted, so a flood
        // that evicts flows closes their sockets as it goes: at most one
        // drain's evictions stay open beyond the flow budget.
        if demux.owes_yield() {
            tokio::task::yield_now().await;
        }
        loop {
            // Also armed while counts wait to be published: a drain that
            // ended without finding the device empty (its last read took a
            // packet) did not commit them, and the next packet may never
            // come.
            let armed = demux.has_state() || demux.local.is_dirty();
            tokio::select! {
                biased;
                _ = self.phase.wait_for(|p| *p >= Phase::Stopped) => return Ok(false),
                r = self.input.ready() => {
                    r?;
                    demux.now = Instant::now();
                    return Ok(true);
                }
                Ok(()) = self.network.changed() => {
                    let addrs = self.network.borrow_and_update().clone();
                    if let Some(a) = addrs {
                        demux.network_changed(&a);
                        demux.commit(Instant::now());
                    }
                }
                () = self.held_answered.notified() => {
                    let now = Instant::now();
                    demux.settle_held(now);
                    demux.commit(now);
                }
                // ACKs wait for window grants: a drain, even an empty one,
                // hands out those that came free (`Demux::drained`).
                () = tokio::time::sleep(std::time::Duration::from_millis(
                    crate::nat::GRANT_MS,
                )), if demux.has_parked() => {
                    demux.now = Instant::now();
                    return Ok(true);
                }
                () = self.tick.tick(armed) => {
                    let now = Instant::now();
                    demux.cleanup(now);
                    demux.commit(now);
                }
            }
        }
    }
}

/// Where the driver's packets come from: the device, or the reader
/// thread's ring (`tun.read_ring` > 0 on Linux/Android).
struct Input {
    tun: Arc<Tun>,
    #[cfg(linux_like)]
    ring: Option<Arc<read_ring::Ring>>,
}

impl Input {
    /// The device is readable, or the ring holds packets.
    async fn ready(&self) -> io::Result<()> {
        #[cfg(linux_like)]
        if let Some(ring) = &self.ring {
            ring.readable().await;
            return Ok(());
        }
        self.tun.dev.readable().await
    }
}

/// Read errors that end the driver (device gone); the rest are retried.
pub(crate) fn is_fatal(e: &io::Error) -> bool {
    !matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    ) && e.raw_os_error().is_some()
}
