//! The system netstack: kerntun does not implement TCP. Each TCP packet read
//! from the TUN is rewritten in place (source NAT, `crate::translate`) and
//! written back, so the kernel's own TCP accepts it on a listener bound to
//! the gateway address; the accepted socket's peer port is the NAT port,
//! which the NAT table maps back to the app's original 5-tuple.
//!
//! Connect-first: a new connection's SYN is admitted, routed and held while
//! the outbound connects. Only when the outbound answers is the SYN rewritten
//! and handed to the kernel; if the outbound refuses or times out, the app
//! receives an RST answering its SYN. The app therefore sees what a real
//! network would show it (`ECONNREFUSED`, not a connection that opens and
//! then dies), which keeps happy-eyeballs and fallback logic in apps working.
//! A SYN retransmitted while the connect is pending is absorbed.
//!
//! Half-open connections (connect in flight, or SYN handed to the kernel
//! and not yet accepted) are bounded apart from established ones: at most
//! [`HALF_OPEN_MAX`] in total and never more than half the admission limit,
//! so they cannot take the permits answered connections need, and at most
//! [`HALF_OPEN_PER_SOURCE`] from one source address, which bounds the
//! outbound connects one app keeps in flight. A new SYN past either bound
//! evicts the oldest half-open connection (of that source, or of all), never
//! the newcomer, and one whose app does not complete the handshake within
//! [`HANDSHAKE_TIMEOUT`] is closed. A SYN flood from spoofed sources thus
//! holds a bounded number of outbound sockets and recycles its own slots,
//! and the next real connection is admitted at once.
//!
//! `listener.rs`: the kernel listeners and the accept loop.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::task::AbortHandle;

use super::{HALF_OPEN_MAX, HALF_OPEN_PER_SOURCE, HANDSHAKE_TIMEOUT, HeldSyn};
use crate::budget::OwnedPermit;
use crate::dispatch::{Dispatcher, Next, Plan};
use crate::nat::{FlowKey, NatTable};
use crate::packet::{self, Disposition, IpInfo, TcpInfo};
use crate::stats::{EngineDrop, LocalCounters, NatSnapshot, Stats};
use crate::translate::{self, Cause, FamilyAddrs, StackAddrs, TcpStep};
use crate::tun::Tun;

mod listener;

pub(crate) use listener::{accept_loop, bind_listener};

/// An admitted connection waiting for the kernel to accept the app's side.
#[derive(Debug)]
enum Pending {
    /// The outbound connect is in flight (task `task`, number `seq`); the
    /// app's SYN is held. The permit stays here, not in the task, so an
    /// eviction hands it back at once (an aborted task drops it later).
    Connecting {
        task: AbortHandle,
        seq: u64,
        permit: OwnedPermit,
        source: IpAddr,
        since: Instant,
    },
    /// The SYN went to the kernel; the accepted connection goes on to
    /// `next`. Expires if never accepted.
    Ready {
        next: Next,
        permit: OwnedPermit,
        source: IpAddr,
        since: Instant,
    },
}

impl Pending {
    /// The app's address and when the connection's SYN was admitted (for
    /// `Ready`: handed to the kernel).
    fn origin(&self) -> (IpAddr, Instant) {
        match self {
            Pending::Connecting { source, since, .. } | Pending::Ready { source, since, .. } => {
                (*source, *since)
            }
        }
    }
}

/// The system stack of one engine: its NAT table, its addresses, and the
/// connections between SYN and accept.
#[derive(Debug)]
pub(crate) struct SystemStack {
    d: Arc<Dispatcher>,
    tun: Arc<Tun>,
    nat: Arc<NatTable>,
    /// Gateway, NAT address and listener port per family.
    addrs: StackAddrs,
    pending: Mutex<HashMap<u16, Pending>>,
    /// Numbers connect tasks, so a task only ever completes its own entry
    /// (after an eviction the port may carry another connection).
    next_seq: AtomicU64,
    /// How long a SYN handed to the kernel may wait for its accept.
    half_open_timeout: Duration,
}

impl SystemStack {
    pub fn new(
        d: Arc<Dispatcher>,
        tun: Arc<Tun>,
        nat: NatTable,
        addrs: StackAddrs,
        half_open_timeout: Duration,
    ) -> Self {
        SystemStack {
            d,
            tun,
            nat: Arc::new(nat),
            addrs,
            pending: Mutex::new(HashMap::new()),
            next_seq: AtomicU64::new(0),
            half_open_timeout,
        }
    }

    /// One TCP packet from the TUN, translated in place.
    #[inline]
    pub fn tcp(
        self: &Arc<Self>,
        buf: &mut [u8],
        ip: &IpInfo,
        now: Instant,
        local: &mut LocalCounters,
    ) -> Disposition {
        let held = |port| {
            matches!(
                self.pending.lock().get(&port),
                Some(Pending::Connecting { .. })
            )
        };
        match translate::translate_tcp(buf, ip, &self.nat, &self.addrs, now, held) {
            TcpStep::Uplink(n) => {
                local.packets_up += 1;
                local.bytes_up += n as u64;
                Disposition::WriteBack(n)
            }
            TcpStep::Downlink(n) => {
                local.packets_down += 1;
                local.bytes_down += n as u64;
                Disposition::WriteBack(n)
            }
            TcpStep::NewFlow {
                key,
                port,
                tcp,
                evicted,
            } => {
                if evicted {
                    local.drop(EngineDrop::HalfOpenEvicted);
                }
                self.new_flow(buf, ip, &tcp, (key, port), now, local)
            }
            TcpStep::Reset { len, cause } => {
                if matches!(cause, EngineDrop::NatTableFull | EngineDrop::NatNoFreePort) {
                    self.d.warn.warn(format_args!(
                        "NAT table refused a new flow ({})",
                        cause.as_str()
                    ));
                }
                local.drop(cause);
                Disposition::WriteBack(len)
            }
            TcpStep::Drop(Cause::Reject(r)) => {
                local.reject(r);
                Disposition::Done
            }
            TcpStep::Drop(Cause::Engine(d)) => {
                local.drop(d);
                Disposition::Done
            }
        }
    }

    /// A SYN that created NAT entry `port`: admit it, then hold it while the
    /// outbound connects, or (DNS, sniffing) hand it to the kernel at once.
    fn new_flow(
        self: &Arc<Self>,
        buf: &mut [u8],
        ip: &IpInfo,
        tcp: &TcpInfo,
        (key, port): (FlowKey, u16),
        now: Instant,
        local: &mut LocalCounters,
    ) -> Disposition {
        let source = key.client.ip();
        // Room first: an evicted connection's permit is back before admit.
        self.make_room(source, now, local);
        let Some((plan, permit)) = self.d.admit(key.server, now) else {
            self.nat.abort_half_open(port, now);
            return Disposition::WriteBack(packet::tcp_rst_reply(buf, ip, tcp));
        };
        let Some(fam) = self.addrs.family(key.server.ip()) else {
            // translate_tcp only reports new flows of an enabled family.
            self.nat.abort_half_open(port, now);
            return Disposition::Done;
        };
        let next = match plan {
            Plan::Connect { .. } => {
                let syn = HeldSyn::new(&buf[..ip.len]);
                // Spawned under the lock, so the task finds its entry.
                let seq = self.next_seq.fetch_add(1, Relaxed);
                let mut pending = self.pending.lock();
                let task = tokio::spawn(self.clone().connect(key, (port, seq), fam, syn, plan));
                let connecting = Pending::Connecting {
                    task: task.abort_handle(),
                    seq,
                    permit,
                    source,
                    since: now,
                };
                if let Some(old) = pending.insert(port, connecting) {
                    // A stale entry on a reused port: close it, never let
                    // its task complete the new connection.
                    drop(pending);
                    self.close_half_open(port, old, now, false);
                }
                return Disposition::Done;
            }
            // Nothing to connect first: the kernel accepts now and the
            // session does the rest.
            Plan::Dns => Next::Dns,
            Plan::Sniff => Next::Sniff,
        };
        let ready = Pending::Ready {
            next,
            permit,
            source,
            since: now,
        };
        let old = self.pending.lock().insert(port, ready);
        if let Some(old) = old {
            self.close_half_open(port, old, now, false);
        }
        match rewrite_to_listener(buf, ip, fam, port) {
            Ok(()) => Disposition::WriteBack(ip.len),
            Err(r) => {
                self.pending.lock().remove(&port);
                self.nat.abort_half_open(port, now);
                local.reject(r);
                Disposition::Done
            }
        }
    }

    /// The outbound of `port` connected: the kernel's accept goes on to
    /// `next`. False (and `next` is dropped) if the connection was evicted
    /// meanwhile.
    fn ready(&self, (port, seq): (u16, u64), next: Next, now: Instant) -> bool {
        let mut pending = self.pending.lock();
        match pending.remove(&port) {
            Some(Pending::Connecting {
                permit,
                source,
                seq: s,
                ..
            }) if s == seq => {
                let ready = Pending::Ready {
                    next,
                    permit,
                    source,
                    since: now,
                };
                pending.insert(port, ready);
                true
            }
            Some(other) => {
                pending.insert(port, other);
                false
            }
            None => false,
        }
    }

    /// The half-open bound for a new SYN from `source`: past the per-source
    /// or the total bound, the oldest half-open connection (of `source`, or
    /// of all) is evicted. One pass over the pending map, which the bound
    /// keeps small.
    fn make_room(&self, source: IpAddr, now: Instant, local: &mut LocalCounters) {
        let cap = HALF_OPEN_MAX.min(self.d.admission.limit(now) / 2).max(1);
        let per_source = HALF_OPEN_PER_SOURCE.min(cap);
        let mut pending = self.pending.lock();
        if pending.len() < per_source {
            return;
        }
        let (mut mine, mut oldest_mine, mut oldest) = (0usize, None, None);
        for (&port, p) in pending.iter() {
            let (src, since) = p.origin();
            let older = |o: &Option<(u16, Instant)>| o.is_none_or(|(_, t)| since < t);
            if src == source {
                mine += 1;
                if older(&oldest_mine) {
                    oldest_mine = Some((port, since));
                }
            }
            if older(&oldest) {
                oldest = Some((port, since));
            }
        }
        let victim = if mine >= per_source {
            oldest_mine
        } else if pending.len() >= cap {
            oldest
        } else {
            None
        };
        let Some((port, _)) = victim else { return };
        let evicted = pending.remove(&port);
        drop(pending);
        if let Some(p) = evicted {
            self.close_half_open(port, p, now, true);
            local.drop(EngineDrop::HalfOpenEvicted);
        }
    }

    /// Close a half-open connection taken out of the pending map: stop its
    /// connect (the outbound socket closes with the task) or drop its
    /// outbound and permit, and (`nat`) end its NAT entry.
    fn close_half_open(&self, port: u16, p: Pending, now: Instant, nat: bool) {
        match p {
            Pending::Connecting { task, .. } => task.abort(),
            Pending::Ready { next, .. } => {
                if let Next::Relay(out) = &next {
                    crate::outbound::reset_on_close(&out.stream);
                }
            }
        }
        if nat {
            self.nat.abort_half_open(port, now);
        }
    }

    /// Connect the outbound for a held SYN along its plan, then release the
    /// SYN to the kernel (success) or answer the app with an RST (failure).
    async fn connect(
        self: Arc<Self>,
        key: FlowKey,
        (port, seq): (u16, u64),
        fam: FamilyAddrs,
        mut syn: HeldSyn,
        plan: Plan,
    ) {
        let Some(next) = self.d.prepare(plan, key.server).await else {
            {
                let mut pending = self.pending.lock();
                match pending.get(&port) {
                    Some(Pending::Connecting { seq: s, .. }) if *s == seq => {
                        pending.remove(&port);
                    }
                    _ => return, // evicted meanwhile: nothing of ours is left
                }
            }
            self.nat.abort_half_open(port, Instant::now());
            syn.refuse(&self.tun, &self.d.stats).await;
            return;
        };
        let Ok(ip) = packet::parse_ip(syn.packet()) else {
            return; // parsed once already; cannot happen
        };
        if rewrite_to_listener(syn.packet_mut(), &ip, fam, port).is_err() {
            return;
        }
        if !self.ready((port, seq), next, Instant::now()) {
            return; // evicted meanwhile
        }
        syn.send(&self.tun, &self.d.stats).await;
    }

    /// Whether there is state a cleanup tick could expire.
    pub fn has_state(&self) -> bool {
        !self.nat.is_empty() || !self.pending.lock().is_empty()
    }

    /// Expire NAT entries, and close outbounds whose SYN the app never
    /// completed within the handshake timeout.
    pub fn cleanup(&self, now: Instant) {
        self.nat.cleanup(now);
        let timeout = self.half_open_timeout.min(HANDSHAKE_TIMEOUT);
        let expired: Vec<(u16, Pending)> = {
            let mut pending = self.pending.lock();
            let ports: Vec<u16> = pending
                .iter()
                .filter(|(_, p)| {
                    matches!(p, Pending::Ready { since, .. }
                        if now.saturating_duration_since(*since) >= timeout)
                })
                .map(|(&port, _)| port)
                .collect();
            ports
                .into_iter()
                .filter_map(|port| pending.remove(&port).map(|p| (port, p)))
                .collect()
        };
        for (port, p) in expired {
            self.close_half_open(port, p, now, true);
            Stats::drop(&self.d.stats, EngineDrop::HandshakeTimeout);
        }
    }

    /// NAT entries by state.
    pub fn counts(&self) -> NatSnapshot {
        let c = self.nat.counts();
        NatSnapshot {
            half_open: c.half_open as u64,
            active: c.active as u64,
            closing: c.closing as u64,
        }
    }

    /// The listeners' addresses (gateway and port per family).
    pub fn listen_addrs(&self) -> Vec<SocketAddr> {
        [self.addrs.v4, self.addrs.v6]
            .into_iter()
            .flatten()
            .map(|f| SocketAddr::new(f.gateway, f.listen_port))
            .collect()
    }
}

/// Rewrite the app's SYN at `buf` from its own tuple to NAT address:`port`
/// -> the family's listener.
fn rewrite_to_listener(
    buf: &mut [u8],
    ip: &IpInfo,
    fam: FamilyAddrs,
    port: u16,
) -> Result<(), packet::Reject> {
    let nat_src = SocketAddr::new(fam.nat, port);
    let listener = SocketAddr::new(fam.gateway, fam.listen_port);
    packet::rewrite_tcp(buf, ip, nat_src, listener)
}
