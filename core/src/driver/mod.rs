//! TUN I/O drivers. One task owns the device's read side. Its loop has one
//! head ([`Head`]): sleep until the device is readable, the engine stops, or
//! a cleanup tick is due; then the reader drains a bounded number of packets.
//! Every reader feeds packets to the same [`Processor::process`] and writes
//! back with the same [`Processor::write_back`], so batching is an I/O
//! concern and never a second processing path.
//!
//! The readers, one file each, picked by platform:
//!
//! * `per_packet` (Android, iOS without `recvmsg_x`, Linux without offload):
//!   drain up to [`DRAIN_PER_EDGE`] packets per readiness edge, each written
//!   back with a non-blocking send, awaiting the device only when its queue
//!   is full; on Linux/Android consecutive segments of a flow toward the
//!   kernel listener are merged first (`packet::coalesce`);
//! * `linux_gro` (Linux `virtio_net_hdr` offload): one read returns a TCP
//!   super-packet of up to 64 KiB that tun-rs splits into segments; the
//!   rewritten segments are written with `send_multiple`, which coalesces
//!   them again (GRO) before they reach the kernel;
//! * `darwin` (macOS, iOS): `recvmsg_x` batch reads behind a run-time probe,
//!   per-packet writes.

use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::lifecycle::{Lifecycle, Phase};
use crate::packet::frag::{Limits, Reassembler};
use crate::packet::{self, Disposition, HEADROOM, IpInfo, Reject, protocol};
use crate::stack::Stack;
use crate::stats::{EngineDrop, LocalCounters, Stats};
use crate::tun::Tun;
use crate::udp::UdpTable;

#[cfg(apple)]
mod darwin;
#[cfg(target_os = "linux")]
mod linux_gro;
mod per_packet;

/// Packets drained per readiness edge in per-packet mode. Bounds the time the
/// driver monopolises a worker (32 x ~1 us) while amortising the wake-up
/// over a burst, as sing-tun's drain loop does.
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

/// The per-packet processing every reader shares: the stack for TCP, the
/// flow table for UDP (owned here, so the uplink datagram path takes no
/// locks), echo replies for pings to the gateway.
#[derive(Debug)]
pub(crate) struct Processor {
    stack: Stack,
    udp: UdpTable,
    /// IP fragments from the app, until their datagram is whole.
    frags: Reassembler,
    /// Where a reassembled datagram is written (kept while small).
    frag_out: Vec<u8>,
    /// The TUN's own addresses (IPv4, IPv6): pings to them are answered.
    gateways: (Option<IpAddr>, Option<IpAddr>),
    tun: Arc<Tun>,
    stats: Arc<Stats>,
    pub local: LocalCounters,
    /// The clock reading for the current drain (one `Instant::now()` per edge).
    pub now: Instant,
}

impl Processor {
    pub fn new(
        stack: Stack,
        udp: UdpTable,
        gateways: (Option<IpAddr>, Option<IpAddr>),
        tun: Arc<Tun>,
        stats: Arc<Stats>,
    ) -> Self {
        let now = Instant::now();
        Self {
            stack,
            udp,
            frags: Reassembler::new(Limits::default()),
            frag_out: Vec::new(),
            gateways,
            tun,
            stats,
            local: LocalCounters::new(now),
            now,
        }
    }

    /// Process one packet in place: `WriteBack(n)` asks the driver to write
    /// `buf[..n]` to the TUN.
    #[inline]
    pub fn process(&mut self, buf: &mut [u8]) -> Disposition {
        let ip = match packet::parse_ip(buf) {
            Ok(ip) => ip,
            Err(Reject::Ipv4Fragment | Reject::Ipv6Fragment) => {
                self.fragment(buf);
                return Disposition::Done;
            }
            Err(r) => {
                self.local.reject(r);
                return Disposition::Done;
            }
        };
        match ip.protocol {
            protocol::TCP => self.stack.tcp(buf, &ip, self.now, &mut self.local),
            protocol::UDP => {
                self.udp.handle(buf, &ip, self.now, &mut self.local);
                Disposition::Done
            }
            protocol::ICMP | protocol::ICMPV6 => self.icmp(buf, &ip),
            _ => {
                self.local.reject(packet::Reject::UnsupportedProtocol);
                Disposition::Done
            }
        }
    }

    /// One IP fragment: held until its datagram is whole, which then takes
    /// the UDP path like any datagram (only UDP is reassembled; TCP never
    /// needs it). Every discard is counted.
    #[cold]
    fn fragment(&mut self, buf: &[u8]) {
        let mut out = std::mem::take(&mut self.frag_out);
        let local = &mut self.local;
        let pushed = self.frags.push(buf, self.now, &mut out, |d| {
            local.drop(EngineDrop::of_frag(d));
        });
        match pushed {
            Ok(Some(n)) => match packet::parse_ip(&out[..n]) {
                Ok(ip) if ip.protocol == protocol::UDP => {
                    self.udp.handle(&out[..n], &ip, self.now, &mut self.local);
                }
                _ => self.local.drop(EngineDrop::FragMalformed),
            },
            Ok(None) => {}
            Err(d) => self.local.drop(EngineDrop::of_frag(d)),
        }
        // A buffer that held a large datagram is not kept.
        if out.capacity() <= 16 * 1024 {
            self.frag_out = out;
        }
    }

    fn icmp(&mut self, buf: &mut [u8], ip: &IpInfo) -> Disposition {
        let gateway = match ip.dst {
            IpAddr::V4(_) => self.gateways.0,
            IpAddr::V6(_) => self.gateways.1,
        };
        if gateway == Some(ip.dst)
            && let Ok(n) = packet::echo_reply_in_place(buf, ip)
        {
            self.local.icmp_echo_replies += 1;
            return Disposition::WriteBack(n);
        }
        self.local.drop(EngineDrop::IcmpUnhandled);
        Disposition::Done
    }

    /// Process the packet at `buf[HEADROOM..][..len]` and write the result
    /// back from the same buffer (the batch readers; the per-packet reader
    /// may hold packets aside to merge them).
    #[cfg_attr(not(any(target_os = "linux", apple)), allow(dead_code))]
    pub async fn handle(&mut self, buf: &mut [u8], len: usize) {
        if let Disposition::WriteBack(n) = self.process(&mut buf[HEADROOM..HEADROOM + len]) {
            self.write_back(buf, n).await;
        }
    }

    /// Write the packet at `buf[HEADROOM..][..len]` to the TUN: without
    /// waiting first, awaiting the device only when its queue is full. A
    /// failed write is a counted drop (TCP retransmits it); false then.
    pub async fn write_back(&mut self, buf: &mut [u8], len: usize) -> bool {
        self.local.writes += 1;
        let sent = match self.tun.try_send(buf, len) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.tun.send(buf, len).await,
            Err(e) => Err(e),
        };
        if sent.is_err() {
            self.local.drop(EngineDrop::TunWrite);
        }
        sent.is_ok()
    }

    /// Whether a packet to be written back may be merged with its flow's
    /// neighbours: a plain TCP data segment toward the TUN's own address
    /// (the system stack's uplink to its kernel listener, always delivered
    /// locally, so a packet above the MTU never has to leave the host).
    pub fn coalescible(&self, pkt: &[u8]) -> bool {
        let to_gateway = match pkt.first().map(|b| b >> 4) {
            Some(4) => pkt.get(16..20).is_some_and(|d| {
                self.gateways.0 == Some(IpAddr::from(<[u8; 4]>::try_from(d).unwrap_or_default()))
            }),
            Some(6) => pkt.get(24..40).is_some_and(|d| {
                self.gateways.1 == Some(IpAddr::from(<[u8; 16]>::try_from(d).unwrap_or_default()))
            }),
            _ => false,
        };
        to_gateway && packet::coalesce::candidate(pkt)
    }

    /// Count `n` packets read in this drain, which ended: what the stack
    /// held back during it goes out.
    pub fn read_done(&mut self, n: u64) {
        self.stack.drain_done();
        self.local.read_done(n, &self.stats, self.now);
    }

    /// Whether the last drain aborted tasks whose resources are freed only
    /// when the runtime drops them (evicted UDP flows and their sockets).
    fn owes_yield(&mut self) -> bool {
        self.udp.take_evicted()
    }

    /// Whether there is state a cleanup tick could expire.
    fn has_state(&self) -> bool {
        self.stack.has_state() || self.udp.len() > 0 || !self.frags.is_empty()
    }

    /// The periodic cleanup: NAT entries, unaccepted outbounds, idle UDP
    /// flows, datagrams whose fragments stopped coming.
    fn cleanup(&mut self, now: Instant) {
        self.stack.cleanup(now);
        self.udp.sweep(now);
        let stats = &self.stats;
        self.frags
            .expire(now, |d| Stats::drop(stats, EngineDrop::of_frag(d)));
    }
}

/// Run the driver until the engine stops or the device fails (then the
/// engine fails with the reason).
pub(crate) async fn run(
    mut proc: Processor,
    kind: DriverKind,
    life: Arc<Lifecycle>,
    mtu: u16,
    coalesce: bool,
) {
    let mtu = usize::from(mtu);
    // Merged packets exceed the MTU: only where the kernel is known to take
    // them on a TUN without offload (Linux; utun is not checked).
    let coalesce = coalesce && cfg!(linux_like);
    let result = match kind {
        DriverKind::PerPacket => per_packet::run(&mut proc, &life, mtu, coalesce).await,
        #[cfg(target_os = "linux")]
        DriverKind::Batch => linux_gro::run(&mut proc, &life, mtu).await,
        #[cfg(apple)]
        DriverKind::Batch => darwin::run(&mut proc, &life, mtu).await,
        #[cfg(not(any(target_os = "linux", apple)))]
        DriverKind::Batch => per_packet::run(&mut proc, &life, mtu, coalesce).await,
    };
    let stats = proc.stats.clone();
    proc.local.commit(&stats, Instant::now());
    if let Err(e) = result {
        life.fail(format!("TUN device failed: {e}"));
    }
}

/// The head of every reader's loop: sleep until the device is readable, the
/// engine stops, or a cleanup tick is due (armed only while there is state
/// to expire, so an idle tunnel sleeps).
pub(crate) struct Head {
    tun: Arc<Tun>,
    stats: Arc<Stats>,
    phase: watch::Receiver<Phase>,
    tick: tokio::time::Interval,
}

impl Head {
    pub fn new(proc: &Processor, life: &Lifecycle) -> Self {
        let mut tick = tokio::time::interval(CLEANUP_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Head {
            tun: proc.tun.clone(),
            stats: proc.stats.clone(),
            phase: life.subscribe(),
            tick,
        }
    }

    /// Wait until the device is readable (true; `proc.now` is set for the
    /// drain) or the engine stops (false). Due cleanups run here.
    pub async fn readable(&mut self, proc: &mut Processor) -> io::Result<bool> {
        // Let the runtime drop the tasks the last drain aborted, so a flood
        // that evicts flows closes their sockets as it goes: at most one
        // drain's evictions stay open beyond the flow budget.
        if proc.owes_yield() {
            tokio::task::yield_now().await;
        }
        loop {
            // Also armed while counts wait to be published: a drain that
            // ended without finding the device empty (its last read took a
            // packet) did not commit them, and the next packet may never
            // come.
            let armed = proc.has_state() || proc.local.is_dirty();
            tokio::select! {
                biased;
                _ = self.phase.wait_for(|p| *p >= Phase::Stopped) => return Ok(false),
                r = self.tun.dev.readable() => {
                    r?;
                    proc.now = Instant::now();
                    return Ok(true);
                }
                _ = self.tick.tick(), if armed => {
                    let now = Instant::now();
                    proc.cleanup(now);
                    proc.local.commit(&self.stats, now);
                }
            }
        }
    }

    /// After a drain: a reader that found the device empty is about to
    /// sleep, so what it counted is published now.
    pub fn drained(&self, proc: &mut Processor, empty: bool) {
        // Uplink datagrams gathered in this drain leave now (one GSO send
        // per flow's run of datagrams, `udp::UdpTable::flush`).
        proc.udp.flush(&mut proc.local);
        if empty {
            proc.local.commit(&self.stats, proc.now);
        }
    }
}

/// Read errors that end the driver (device gone); the rest are retried.
pub(crate) fn is_fatal(e: &io::Error) -> bool {
    !matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    ) && e.raw_os_error().is_some()
}
