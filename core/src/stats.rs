//! Engine statistics: relaxed atomic counters shared by every task, and a
//! plain snapshot for the CLI and the FFI.
//!
//! The TUN driver does not touch these atomics per packet: it counts into a
//! [`LocalCounters`] and commits every 64 packets, or when 100 ms have passed,
//! or before it goes back to sleep, so an idle tunnel never wakes up to
//! publish zeros.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::packet::Reject;

pub use kerntun_proto::drops::EngineDrop;

/// Shared counters. All relaxed: they are statistics, not synchronisation.
#[derive(Debug, Default)]
pub struct Stats {
    pub packets_up: AtomicU64,
    pub bytes_up: AtomicU64,
    pub packets_down: AtomicU64,
    pub bytes_down: AtomicU64,
    pub icmp_echo_replies: AtomicU64,
    pub tcp_sessions_active: AtomicU64,
    pub tcp_sessions_total: AtomicU64,
    pub tcp_bytes_up: AtomicU64,
    pub tcp_bytes_down: AtomicU64,
    pub tcp_rejected_by_rule: AtomicU64,
    pub tcp_connect_failed: AtomicU64,
    pub admission_refused: AtomicU64,
    pub accept_errors: AtomicU64,
    pub accept_foreign_peer: AtomicU64,
    pub accept_syn_unverified: AtomicU64,
    pub accept_unknown_port: AtomicU64,
    pub udp_flows_active: AtomicU64,
    pub udp_flows_total: AtomicU64,
    pub udp_flows_evicted: AtomicU64,
    pub udp_packets_up: AtomicU64,
    pub udp_bytes_up: AtomicU64,
    pub udp_packets_down: AtomicU64,
    pub udp_bytes_down: AtomicU64,
    pub tun_reads: AtomicU64,
    pub tun_read_packets: AtomicU64,
    pub tun_read_max_batch: AtomicU64,
    pub tun_writes: AtomicU64,
    /// Times the TUN reader thread found its ring full (`tun.read_ring`)
    /// and left packets in the kernel's queue until the driver freed slots.
    pub tun_ring_full: AtomicU64,
    /// System-stack TCP segments whose advertised window the translation
    /// lowered (`tun.window_clamp`).
    pub tcp_window_clamped: AtomicU64,
    /// Pure ACKs the per-packet driver did not write because a newer one
    /// of the same flow, in the same drain, said the same (`tun.ack_thinning`).
    pub tcp_acks_thinned: AtomicU64,
    /// Full smoltcp rings lent to sockets now (`stack/smoltcp/rings.rs`).
    pub smoltcp_ring_loans: AtomicU64,
    /// Times a smoltcp socket asked for a full ring while the pool had lent
    /// every one: it went on with its small ring.
    pub smoltcp_ring_loans_refused: AtomicU64,
    pub rejects: [AtomicU64; Reject::COUNT],
    pub drops: DropCounts,
    /// TCP payload bytes (both directions) moved with splice(2), never in userspace.
    pub tcp_bytes_spliced: AtomicU64,
    /// TCP payload bytes (both directions) moved through a userspace buffer.
    pub tcp_bytes_copied: AtomicU64,
    /// Relay directions that could have spliced but copied (fallback errno,
    /// no pipe, SIGPIPE at its default action).
    pub splice_fallbacks: AtomicU64,
    /// Network changes the host reported that changed something
    /// (`Engine::network_changed`; the same network twice counts once).
    pub network_changes: AtomicU64,
    /// TCP sessions reset because a network change left their outbound
    /// socket's address (or interface) behind.
    pub sessions_reset_on_network_change: AtomicU64,
    /// Direct UDP flows closed for the same reason.
    pub udp_flows_dropped_on_network_change: AtomicU64,
    /// Connections the host closed (`Engine::close_connection`).
    pub connections_closed_by_host: AtomicU64,
    /// Connections closed by a reload because their outbound is not in
    /// the new configuration (`Engine::reload`).
    pub reload_closed: AtomicU64,
    /// Owner lookups asked of the host (`owner.rs`).
    pub owner_lookups: AtomicU64,
    /// Of those, answered "no owner known".
    pub owner_unknown: AtomicU64,
    /// Of those, failed: an error or a panic of the hook, no answer within
    /// `owner::TIMEOUT`, or the lookup queue full.
    pub owner_failed: AtomicU64,
    /// Per proxy outbound of the current configuration, in the order of
    /// [`crate::outbound::Outbounds::names`]. The counters themselves
    /// belong to the configuration's `Outbounds` (a flow counts into those
    /// of the generation that routed it); a reload replaces this list,
    /// keeping the counters of every outbound whose name stays. Read by a
    /// snapshot and written by a reload, never per packet.
    pub outbounds: parking_lot::RwLock<Box<[Arc<OutboundCounters>]>>,
    /// DNS hijack, cache, fake-ip and sniffing.
    pub dns: DnsCounters,
}

/// One counter per [`EngineDrop`], indexed by it (an array type of its own
/// because the standard library derives `Default` for arrays of at most 32).
#[derive(Debug)]
pub struct DropCounts(pub [AtomicU64; EngineDrop::COUNT]);

impl Default for DropCounts {
    fn default() -> Self {
        Self(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl std::ops::Deref for DropCounts {
    type Target = [AtomicU64; EngineDrop::COUNT];
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

/// Counters of kerntun's DNS service and of domain sniffing.
#[derive(Debug, Default)]
pub struct DnsCounters {
    /// Hijacked queries received (UDP and TCP).
    pub queries: AtomicU64,
    /// Of those, queries that arrived over TCP.
    pub tcp_queries: AtomicU64,
    /// Answered from the cache.
    pub cache_hits: AtomicU64,
    /// Upstream exchanges that failed or timed out (each try counts).
    pub upstream_failures: AtomicU64,
    /// Queries that found a `"platform"` upstream without a server (the
    /// host reported none yet, or none usable): the next upstream was
    /// asked, or the query failed if there was none.
    pub platform_unavailable: AtomicU64,
    /// Queries answered SERVFAIL because every upstream failed.
    pub servfail: AtomicU64,
    /// Hijacked packets that were not a DNS query (counted, dropped).
    pub malformed: AtomicU64,
    /// Queries answered FORMERR or NOTIMP from their header alone.
    pub refused: AtomicU64,
    /// A/AAAA answers given from the fake-ip pool.
    pub fakeip_answers: AtomicU64,
    /// Domains holding a fake address right now.
    pub fakeip_active: AtomicU64,
    /// Fake addresses taken back from the least recently used domain.
    pub fakeip_evictions: AtomicU64,
    /// A/AAAA answered with the real address: no fake one was free.
    pub fakeip_fallbacks: AtomicU64,
    /// A/AAAA queries answered NOERROR without records because
    /// `dns.strategy` leaves their family out (AAAA on a TUN without IPv6
    /// by default).
    pub strategy_empty: AtomicU64,
    /// Connections whose domain was read from a TLS ClientHello or HTTP Host.
    pub sniffed: AtomicU64,
    /// Sniffing gave up (timeout, or the first bytes named no domain).
    pub sniff_misses: AtomicU64,
    /// Of those, sniffs that needed more than a session's own 8 KiB and
    /// found no room in the relay pool for 16 KiB (routed by address).
    pub sniff_unbudgeted: AtomicU64,
}

/// `$to` with each listed field loaded (`Relaxed`) from the counter of the
/// same name in `$from`, then the fields after `with` as written.
macro_rules! loaded {
    ($from:expr => $to:ident { $($counter:ident),* $(,)? } $(with { $($rest:tt)* })?) => {
        $to { $($counter: $from.$counter.load(Relaxed),)* $($($rest)*)? }
    };
}

impl DnsCounters {
    fn snapshot(&self) -> DnsSnapshot {
        loaded!(self => DnsSnapshot {
            queries,
            tcp_queries,
            cache_hits,
            upstream_failures,
            platform_unavailable,
            servfail,
            malformed,
            refused,
            fakeip_answers,
            fakeip_active,
            fakeip_evictions,
            fakeip_fallbacks,
            strategy_empty,
            sniffed,
            sniff_misses,
            sniff_unbudgeted,
        })
    }
}

/// A copy of [`DnsCounters`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DnsSnapshot {
    pub queries: u64,
    pub tcp_queries: u64,
    pub cache_hits: u64,
    pub upstream_failures: u64,
    pub platform_unavailable: u64,
    pub servfail: u64,
    pub malformed: u64,
    pub refused: u64,
    pub fakeip_answers: u64,
    pub fakeip_active: u64,
    pub fakeip_evictions: u64,
    pub fakeip_fallbacks: u64,
    pub strategy_empty: u64,
    pub sniffed: u64,
    pub sniff_misses: u64,
    pub sniff_unbudgeted: u64,
}

/// Counters of one proxy outbound.
#[derive(Debug, Default)]
pub struct OutboundCounters {
    pub name: String,
    /// TCP connections opened through it (handshake done).
    pub tcp_connects: AtomicU64,
    /// TCP connects that failed on the network (refused, unreachable, timeout).
    pub tcp_failures: AtomicU64,
    /// Handshakes or frames the proxy got wrong (bad reply, refusal code,
    /// failed decryption), TCP and UDP.
    pub protocol_errors: AtomicU64,
    /// UDP flows opened through it.
    pub udp_flows: AtomicU64,
    /// UDP associations that could not be opened.
    pub udp_failures: AtomicU64,
    /// TCP connections and UDP flows that failed because the server's host
    /// name did not resolve (NXDOMAIN, no records, no resolver answered).
    pub resolve_failures: AtomicU64,
}

/// A snapshot of one proxy outbound's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct OutboundSnapshot {
    pub name: String,
    pub tcp_connects: u64,
    pub tcp_failures: u64,
    pub protocol_errors: u64,
    pub udp_flows: u64,
    pub udp_failures: u64,
    pub resolve_failures: u64,
}

impl Stats {
    /// Counters listing these per-outbound counters
    /// ([`crate::outbound::Outbounds::counters`]).
    pub fn with_outbounds(counters: &[Arc<OutboundCounters>]) -> Self {
        let s = Stats::default();
        s.set_outbounds(counters);
        s
    }

    /// List these per-outbound counters from now on (a reload).
    pub fn set_outbounds(&self, counters: &[Arc<OutboundCounters>]) {
        *self.outbounds.write() = counters.into();
    }

    pub fn drop(&self, why: EngineDrop) {
        self.drops[why as usize].fetch_add(1, Relaxed);
    }
}

/// Per-driver counts, committed to [`Stats`] in batches.
#[derive(Debug)]
pub struct LocalCounters {
    pub packets_up: u64,
    pub bytes_up: u64,
    pub packets_down: u64,
    pub bytes_down: u64,
    pub icmp_echo_replies: u64,
    pub udp_packets_up: u64,
    pub udp_bytes_up: u64,
    pub reads: u64,
    pub read_packets: u64,
    pub max_batch: u64,
    pub writes: u64,
    pub window_clamped: u64,
    /// Pure ACKs not written: a newer one of the same flow said the same
    /// (`driver::writeback`).
    pub acks_thinned: u64,
    /// Set by the system stack when the TCP packet it just translated was
    /// a pure ACK held at its edge for want of a window grant; taken at
    /// once by `Demux::process`, which keeps the packet.
    pub parked: Option<crate::translate::Parked>,
    pub rejects: [u64; Reject::COUNT],
    pub drops: [u64; EngineDrop::COUNT],
    pending: u64,
    last_commit: Instant,
}

/// Commit after this many packets (live statistics without an atomic
/// add per packet)...
const COMMIT_PACKETS: u64 = 64;
/// ...or after this long, whichever comes first.
const COMMIT_INTERVAL: Duration = Duration::from_millis(100);

impl LocalCounters {
    pub fn new(now: Instant) -> Self {
        Self {
            packets_up: 0,
            bytes_up: 0,
            packets_down: 0,
            bytes_down: 0,
            icmp_echo_replies: 0,
            udp_packets_up: 0,
            udp_bytes_up: 0,
            reads: 0,
            read_packets: 0,
            max_batch: 0,
            writes: 0,
            window_clamped: 0,
            acks_thinned: 0,
            parked: None,
            rejects: [0; Reject::COUNT],
            drops: [0; EngineDrop::COUNT],
            pending: 0,
            last_commit: now,
        }
    }

    #[inline]
    pub fn reject(&mut self, why: Reject) {
        self.rejects[why.index()] += 1;
    }

    #[inline]
    pub fn drop(&mut self, why: EngineDrop) {
        self.drops[why as usize] += 1;
    }

    /// Record one read of `packets` packets; commits when a threshold is met.
    #[inline]
    pub fn read_done(&mut self, packets: u64, stats: &Stats, now: Instant) {
        self.reads += 1;
        self.read_packets += packets;
        self.max_batch = self.max_batch.max(packets);
        self.pending += packets;
        if self.pending >= COMMIT_PACKETS || now.duration_since(self.last_commit) >= COMMIT_INTERVAL
        {
            self.commit(stats, now);
        }
    }

    /// Publish and reset. Called by the thresholds and before the driver sleeps.
    pub fn commit(&mut self, stats: &Stats, now: Instant) {
        if self.pending == 0 && self.reads == 0 {
            return;
        }
        let add = |c: &AtomicU64, v: &mut u64| {
            if *v != 0 {
                c.fetch_add(*v, Relaxed);
                *v = 0;
            }
        };
        add(&stats.packets_up, &mut self.packets_up);
        add(&stats.bytes_up, &mut self.bytes_up);
        add(&stats.packets_down, &mut self.packets_down);
        add(&stats.bytes_down, &mut self.bytes_down);
        add(&stats.icmp_echo_replies, &mut self.icmp_echo_replies);
        add(&stats.udp_packets_up, &mut self.udp_packets_up);
        add(&stats.udp_bytes_up, &mut self.udp_bytes_up);
        add(&stats.tun_reads, &mut self.reads);
        add(&stats.tun_read_packets, &mut self.read_packets);
        add(&stats.tun_writes, &mut self.writes);
        add(&stats.tcp_window_clamped, &mut self.window_clamped);
        add(&stats.tcp_acks_thinned, &mut self.acks_thinned);
        stats.tun_read_max_batch.fetch_max(self.max_batch, Relaxed);
        for (c, v) in stats.rejects.iter().zip(self.rejects.iter_mut()) {
            add(c, v);
        }
        for (c, v) in stats.drops.iter().zip(self.drops.iter_mut()) {
            add(c, v);
        }
        self.pending = 0;
        self.last_commit = now;
    }

    /// Whether anything is waiting to be committed.
    pub fn is_dirty(&self) -> bool {
        self.pending != 0 || self.reads != 0
    }
}

/// The TCP flows the running stack tracks, by state: the system stack's
/// NAT entries, or smoltcp's connects and sockets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TcpFlowsSnapshot {
    /// System: NAT entries between SYN and accept. smoltcp: connects in flight.
    pub half_open: u64,
    /// System: accepted entries. smoltcp: sockets, open or closing.
    pub active: u64,
    /// System: entries lingering after their session ended. smoltcp: 0
    /// (its closing sockets count as active).
    pub closing: u64,
}

/// A point-in-time copy of everything the engine counts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StatsSnapshot {
    pub stack: &'static str,
    pub driver: &'static str,
    pub memory_pressure: &'static str,
    pub uptime_ms: u64,
    pub packets_up: u64,
    pub bytes_up: u64,
    pub packets_down: u64,
    pub bytes_down: u64,
    pub icmp_echo_replies: u64,
    pub tcp_sessions_active: u64,
    pub tcp_sessions_total: u64,
    pub tcp_bytes_up: u64,
    pub tcp_bytes_down: u64,
    pub tcp_rejected_by_rule: u64,
    pub tcp_connect_failed: u64,
    pub admission_limit: u64,
    pub admission_refused: u64,
    pub accept_errors: u64,
    pub accept_foreign_peer: u64,
    pub accept_syn_unverified: u64,
    pub accept_unknown_port: u64,
    pub udp_flows_active: u64,
    pub udp_flows_total: u64,
    pub udp_flows_evicted: u64,
    pub udp_packets_up: u64,
    pub udp_bytes_up: u64,
    pub udp_packets_down: u64,
    pub udp_bytes_down: u64,
    /// TCP flows by state (`budget.tcp_flows` bounds their sum).
    pub tcp_flows: TcpFlowsSnapshot,
    pub tun_reads: u64,
    pub tun_read_packets: u64,
    pub tun_read_max_batch: u64,
    pub tun_writes: u64,
    /// Times the TUN reader thread found its ring full (`tun.read_ring`).
    pub tun_ring_full: u64,
    /// TCP segments whose advertised window was clamped (`tun.window_clamp`).
    pub tcp_window_clamped: u64,
    /// Pure ACKs not written: a newer one of the flow said the same (`tun.ack_thinning`).
    pub tcp_acks_thinned: u64,
    /// Full smoltcp rings lent to sockets now.
    pub smoltcp_ring_loans: u64,
    /// Times a smoltcp socket was refused a full ring (every one was lent).
    pub smoltcp_ring_loans_refused: u64,
    /// Non-zero drop counters, by reason name (parse rejections and engine drops).
    pub drops: Vec<(&'static str, u64)>,
    /// TCP payload bytes moved with splice(2) (both directions).
    pub tcp_bytes_spliced: u64,
    /// TCP payload bytes moved through userspace buffers (both directions).
    pub tcp_bytes_copied: u64,
    /// Relay directions that fell back from splice to a userspace copy.
    pub splice_fallbacks: u64,
    /// Network changes that changed something (`Engine::network_changed`).
    pub network_changes: u64,
    /// TCP sessions reset because a network change stranded their outbound.
    pub sessions_reset_on_network_change: u64,
    /// Direct UDP flows closed because a network change stranded their socket.
    pub udp_flows_dropped_on_network_change: u64,
    /// Connections the host closed (`Engine::close_connection`).
    pub connections_closed_by_host: u64,
    /// Connections a reload closed: their outbound is gone from the new
    /// configuration (`Engine::reload`).
    pub reload_closed: u64,
    /// Owner lookups asked of the host (`owner.rs`).
    pub owner_lookups: u64,
    /// Of those, answered "no owner known".
    pub owner_unknown: u64,
    /// Of those, failed (the hook's error or panic, a timeout, a full queue).
    pub owner_failed: u64,
    /// The NAT64 prefix of the IPv6-only network the host is on, as
    /// `64:ff9b::/96`; `None` on a network with IPv4 or without NAT64
    /// (`outbound/nat64.rs`).
    pub nat64_prefix: Option<String>,
    /// Outbound connects to IPv4 sent inside the NAT64 prefix.
    pub nat64_synthesized: u64,
    /// Prefix discoveries on an IPv6-only network that found none.
    pub nat64_discovery_failed: u64,
    /// Ticks of the engine's periodic timers (the driver's cleanup, the
    /// heap trim); they stand still while the engine sleeps
    /// (`Engine::sleep`).
    pub timer_ticks: u64,
    /// Per proxy outbound.
    pub outbounds: Vec<OutboundSnapshot>,
    /// DNS service and sniffing.
    pub dns: DnsSnapshot,
}

impl StatsSnapshot {
    /// Total of all drop reasons.
    pub fn total_drops(&self) -> u64 {
        self.drops.iter().map(|(_, n)| n).sum()
    }

    /// The count for one drop reason name (0 when absent).
    pub fn drop_count(&self, name: &str) -> u64 {
        self.drops
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, v)| *v)
    }
}

impl Stats {
    /// Copy the counters (the caller fills stack, driver, pressure, TCP flows and uptime).
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |c: &AtomicU64| c.load(Relaxed);
        let mut drops = Vec::new();
        for r in Reject::ALL {
            let n = g(&self.rejects[r.index()]);
            if n != 0 {
                drops.push((r.as_str(), n));
            }
        }
        for d in EngineDrop::ALL {
            let n = g(&self.drops[d as usize]);
            if n != 0 {
                drops.push((d.as_str(), n));
            }
        }
        loaded!(self => StatsSnapshot {
            packets_up,
            bytes_up,
            packets_down,
            bytes_down,
            icmp_echo_replies,
            tcp_sessions_active,
            tcp_sessions_total,
            tcp_bytes_up,
            tcp_bytes_down,
            tcp_rejected_by_rule,
            tcp_connect_failed,
            admission_refused,
            accept_errors,
            accept_foreign_peer,
            accept_syn_unverified,
            accept_unknown_port,
            udp_flows_active,
            udp_flows_total,
            udp_flows_evicted,
            udp_packets_up,
            udp_bytes_up,
            udp_packets_down,
            udp_bytes_down,
            tun_reads,
            tun_read_packets,
            tun_read_max_batch,
            tun_writes,
            tun_ring_full,
            tcp_window_clamped,
            tcp_acks_thinned,
            smoltcp_ring_loans,
            smoltcp_ring_loans_refused,
            tcp_bytes_spliced,
            tcp_bytes_copied,
            splice_fallbacks,
            network_changes,
            sessions_reset_on_network_change,
            udp_flows_dropped_on_network_change,
            connections_closed_by_host,
            reload_closed,
            owner_lookups,
            owner_unknown,
            owner_failed,
        } with {
            drops,
            // Filled by the engine from the socket factory's NAT64 state.
            nat64_prefix: None,
            nat64_synthesized: 0,
            nat64_discovery_failed: 0,
            dns: self.dns.snapshot(),
            outbounds: self
                .outbounds
                .read()
                .iter()
                .map(|o| loaded!(o => OutboundSnapshot {
                    tcp_connects,
                    tcp_failures,
                    protocol_errors,
                    udp_flows,
                    udp_failures,
                    resolve_failures,
                } with {
                    name: o.name.clone(),
                }))
                .collect(),
            ..Default::default()
        })
    }
}

/// At most one warning per interval (the engine uses 5 s), with a
/// count of what was suppressed in between. Lock-free.
#[derive(Debug)]
pub struct WarnLimiter {
    epoch: Instant,
    interval_ms: u64,
    /// Milliseconds since `epoch` of the last emitted warning, plus one (0 = never).
    last: AtomicU64,
    suppressed: AtomicU64,
}

impl WarnLimiter {
    pub fn new(interval: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            interval_ms: interval.as_millis() as u64,
            last: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Emit `msg` unless a warning went out less than the interval ago.
    /// Returns whether it was emitted.
    pub fn warn(&self, msg: std::fmt::Arguments<'_>) -> bool {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        let last = self.last.load(Relaxed);
        if last != 0 && now.saturating_sub(last) < self.interval_ms {
            self.suppressed.fetch_add(1, Relaxed);
            return false;
        }
        if self
            .last
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_err()
        {
            self.suppressed.fetch_add(1, Relaxed);
            return false;
        }
        let suppressed = self.suppressed.swap(0, Relaxed);
        tracing::warn!("{msg} ({suppressed} similar warnings suppressed)");
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_counters_commit_in_batches() {
        let stats = Stats::default();
        let t0 = Instant::now();
        let mut local = LocalCounters::new(t0);
        for _ in 0..63 {
            local.packets_up += 1;
            local.read_done(1, &stats, t0);
        }
        assert_eq!(
            stats.packets_up.load(Relaxed),
            0,
            "below 64 packets and 100 ms"
        );
        local.packets_up += 1;
        local.read_done(1, &stats, t0);
        assert_eq!(stats.packets_up.load(Relaxed), 64);
        local.packets_up += 1;
        local.read_done(1, &stats, t0 + Duration::from_millis(100));
        assert_eq!(stats.packets_up.load(Relaxed), 65, "100 ms elapsed");
        assert!(!local.is_dirty());
    }

    #[test]
    fn warnings_are_rate_limited() {
        let w = WarnLimiter::new(Duration::from_secs(5));
        assert!(w.warn(format_args!("first")));
        assert!(!w.warn(format_args!("second")));
        assert!(!w.warn(format_args!("third")));
        assert_eq!(w.suppressed.load(Relaxed), 2);
    }

    #[test]
    fn drop_names_are_unique() {
        let mut names: Vec<_> = EngineDrop::ALL.iter().map(|d| d.as_str()).collect();
        names.extend(Reject::ALL.iter().map(|r| r.as_str()));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
        for (i, d) in EngineDrop::ALL.iter().enumerate() {
            assert_eq!(*d as usize, i);
        }
    }
}
