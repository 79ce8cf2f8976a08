//! [`SmolStack`]: one smoltcp `Interface` in any-IP mode and its sockets,
//! behind one lock per engine (smoltcp is single-owner). The lock is held
//! for one poll at a time, never across an await or a blocking call (TUN
//! writes are non-blocking; a full device queue drops the segment, counted,
//! and TCP retransmits it).
//!
//! Every socket sits in a smoltcp `SocketSet` of its own, and a poll is
//! given one set: smoltcp walks every socket of the set it polls (to find
//! the one a segment is for, to collect output, for the next deadline), so
//! a packet costs the same with one or ten thousand sockets open. The
//! packet's flow picks the set (a hash map lookup); a packet of no flow is
//! polled with an empty set, and smoltcp answers it with an RST as before.
//!
//! Timers are driven from one place: the poller task sleeps until the
//! earliest socket deadline (an ordered index of each socket's smoltcp
//! `poll_at`, refiled after each of its polls), or until a session or the
//! driver wakes it, and then polls only the sockets whose deadline has come
//! and those a session queued output on, read from or closed (`dirty`). It
//! sleeps without a deadline when no socket has a timer, so an idle tunnel
//! never wakes up.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use parking_lot::Mutex;
use smoltcp::iface::{Config as IfaceConfig, Interface, SocketHandle, SocketSet};
use smoltcp::socket::tcp::{self, State};
use smoltcp::time::Instant as SmolInstant;
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr, IpListenEndpoint};
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use super::device::{Dev, Held, Sink, TunSink, TxCount};
use crate::budget::OwnedPermit;
use crate::lifecycle::{Lifecycle, Phase};
use crate::packet::HEADROOM;
use crate::stack::{HALF_OPEN_PER_SOURCE, HANDSHAKE_TIMEOUT};
use crate::stats::{EngineDrop, Stats};
use crate::tun::Tun;

/// A flow as the app sees it: (client, server).
pub(crate) type Key = (SocketAddr, SocketAddr);

/// Transmit counters are published after this many packets (or by the poller).
const COMMIT_PACKETS: u64 = 64;

/// What to do with a connection request (SYN without ACK).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Syn {
    /// A retransmit for a connection smoltcp already has: feed it.
    Known,
    /// A retransmit while the outbound connect is in flight: absorb it.
    Connecting,
    /// A new connection, now marked connecting: route it and connect.
    New,
    /// The socket budget is spent: refuse (RST), counted as `nat_table_full`.
    Full,
}

/// The stack of one engine.
pub(crate) struct SmolStack {
    pub(super) inner: Mutex<Inner>,
    /// Wakes the poller: a session moved data or closed, or the driver's poll
    /// brought the next timer forward.
    wake: Notify,
    /// smoltcp timestamps count from here.
    epoch: Instant,
    buffer: usize,
    /// A connection that heard nothing from the app for this long is
    /// aborted: `timeouts.tcp_idle_s`, the system stack's NAT idle timeout.
    idle: Duration,
    /// How long a socket whose session ended may take to finish closing (FIN
    /// exchange) before it is dropped regardless: `timeouts.tcp_linger_s`.
    linger: Duration,
    /// Sockets (open, closing) plus connects in flight: `budget.nat_entries`,
    /// the same bound the system stack puts on its NAT table.
    max_sockets: usize,
    /// Half-open connections (connect in flight, or socket still in
    /// SYN-RECEIVED) past which a new SYN evicts the oldest, as the system
    /// stack does (`stack::system`, "Half-open connections").
    max_half_open: usize,
}

impl std::fmt::Debug for SmolStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmolStack")
            .field("buffer", &self.buffer)
            .finish_non_exhaustive()
    }
}

pub(super) struct Inner {
    pub(super) iface: Interface,
    /// One slot per socket (open or closing), indexed by [`Id`]; `free`
    /// lists the empty ones.
    slots: Vec<Option<Slot>>,
    free: Vec<Id>,
    /// An empty socket set: the poll of a packet that belongs to no flow
    /// (smoltcp answers it with an RST, as it does when no socket takes it).
    none: SocketSet<'static>,
    pub(super) flows: HashMap<Key, Id>,
    /// Connects in flight, with when their SYN came and (once spawned) the
    /// task to abort if the connection is evicted and its admission permit
    /// (held here so an eviction hands it back at once).
    pub(super) connecting: HashMap<Key, Connecting>,
    /// Sockets given their SYN whose handshake the app has not completed,
    /// oldest first (entries past SYN-RECEIVED are dropped lazily).
    pub(super) handshaking: VecDeque<(Key, Id, Instant)>,
    /// Half-open connections evicted and handshakes timed out, not yet
    /// published to the statistics.
    pub(super) evicted: u64,
    pub(super) timed_out: u64,
    /// Sockets whose session ended, with when and the session's admission
    /// permit (released with the socket); removed once closed.
    pub(super) detached: Vec<(Key, Id, Instant, Option<OwnedPermit>)>,
    /// Every socket with a smoltcp deadline, by deadline: the poller polls
    /// only the sockets whose deadline has come.
    timers: BTreeSet<(SmolInstant, Id)>,
    /// Sockets a session queued output on, read from (a window update may be
    /// owed), closed or aborted: the poller polls only these.
    dirty: Vec<Id>,
    /// Scratch for the poller (kept to avoid allocating per wake-up).
    scratch: Vec<Id>,
    /// The pure ACKs held during the driver's drain, one entry per flow
    /// (kept to avoid allocating per drain).
    held: Vec<(Id, Held)>,
    /// Transmit scratch: HEADROOM + MTU.
    pub(super) tx: Box<[u8]>,
    pub(super) count: TxCount,
    /// When the poller will wake next (None: no deadline).
    pub(super) armed: Option<Instant>,
}

/// A socket's place in the stack: an index into `Inner::slots`.
pub(crate) type Id = u32;

/// One socket in a socket set of its own. smoltcp walks every socket of the
/// set it is given (to find the one a segment is for, to collect output, to
/// find the next deadline), so a poll of one flow's set costs the same
/// however many flows are open.
struct Slot {
    set: SocketSet<'static>,
    h: SocketHandle,
    /// Its entry in `Inner::timers`.
    timer: Option<SmolInstant>,
    /// Queued in `Inner::dirty`.
    dirty: bool,
    /// Its entry in `Inner::held` during a drain.
    held: Option<u32>,
}

/// A connect in flight.
#[derive(Debug)]
pub(super) struct Connecting {
    since: Instant,
    task: Option<AbortHandle>,
    permit: Option<OwnedPermit>,
}

/// Addresses smoltcp may answer from or to: unicast only (its routing
/// asserts on anything else, and no real flow uses them).
pub(crate) fn is_unicast(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(v) => !(v.is_unspecified() || v.is_multicast() || v.is_broadcast()),
        IpAddr::V6(v) => !(v.is_unspecified() || v.is_multicast()),
    }
}

impl Inner {
    fn now(epoch: Instant, now: Instant) -> SmolInstant {
        SmolInstant::from_micros(now.saturating_duration_since(epoch).as_micros() as i64)
    }

    /// One smoltcp poll of socket `id` alone (`None`: of no socket), with
    /// `pkt` (a whole IP packet) as the only input; then its deadline is
    /// filed. Work independent of the number of sockets (but for the
    /// logarithmic deadline index).
    ///
    /// With `hold`, the socket's pure ACKs are held (see [`Held`]) until
    /// [`Inner::flush_held`]; without, an ACK it holds goes out first.
    fn poll<S: Sink>(
        &mut self,
        id: Option<Id>,
        ts: SmolInstant,
        pkt: Option<&[u8]>,
        sink: &mut S,
        hold: bool,
    ) {
        let mtu = self.tx.len() - HEADROOM;
        let Inner {
            iface,
            slots,
            none,
            tx,
            count,
            timers,
            held,
            ..
        } = self;
        let slot = id.and_then(|i| slots.get_mut(i as usize)?.as_mut());
        let Some(slot) = slot else {
            let mut dev = Dev {
                rx: pkt,
                tx,
                sink,
                count,
                mtu,
                hold: None,
            };
            iface.poll(ts, &mut dev, none);
            return;
        };
        let id = id.unwrap_or_default();
        let mut h = match slot.held {
            Some(i) => held.get_mut(i as usize).map(|e| &mut e.1),
            None if hold => {
                slot.held = Some(held.len() as u32);
                held.push((id, Held::default()));
                held.last_mut().map(|e| &mut e.1)
            }
            None => None,
        };
        if !hold && let Some(h) = h.take() {
            h.flush(sink, count);
        }
        let mut dev = Dev {
            rx: pkt,
            tx,
            sink,
            count,
            mtu,
            hold: h,
        };
        iface.poll(ts, &mut dev, &mut slot.set);
        let at = iface.poll_at(ts, &slot.set);
        if at != slot.timer {
            if let Some(old) = slot.timer {
                timers.remove(&(old, id));
            }
            if let Some(at) = at {
                timers.insert((at, id));
            }
            slot.timer = at;
        }
    }

    /// A new socket, in a set of its own.
    fn add(&mut self, sock: tcp::Socket<'static>) -> Id {
        // Room for exactly one: a set that grows from empty reserves four.
        let mut set = SocketSet::new(Vec::with_capacity(1));
        let h = set.add(sock);
        let slot = Slot {
            set,
            h,
            timer: None,
            dirty: false,
            held: None,
        };
        match self.free.pop() {
            Some(id) => {
                self.slots[id as usize] = Some(slot);
                id
            }
            None => {
                self.slots.push(Some(slot));
                (self.slots.len() - 1) as Id
            }
        }
    }

    /// Remove socket `id` and its deadline (a stale `dirty` entry is
    /// harmless: at worst one extra poll of whichever socket reuses `id`).
    fn remove(&mut self, id: Id) {
        if let Some(slot) = self.slots.get_mut(id as usize).and_then(Option::take) {
            if let Some(t) = slot.timer {
                self.timers.remove(&(t, id));
            }
            if let Some(e) = slot.held.and_then(|i| self.held.get_mut(i as usize)) {
                e.1.clear();
            }
            self.free.push(id);
        }
    }

    /// Queue socket `id` for the poller.
    fn mark(&mut self, id: Id) {
        if let Some(slot) = self.slots.get_mut(id as usize).and_then(Option::as_mut)
            && !slot.dirty
        {
            slot.dirty = true;
            self.dirty.push(id);
        }
    }

    /// Sockets in the stack (open or closing).
    #[cfg(any(test, fuzzing))]
    pub(super) fn socket_count(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Poll the queued sockets, then those whose deadline has come.
    fn poll_due<S: Sink>(&mut self, ts: SmolInstant, sink: &mut S) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.append(&mut self.dirty);
        for &id in &ids {
            if let Some(slot) = self.slots.get_mut(id as usize).and_then(Option::as_mut) {
                slot.dirty = false;
            }
        }
        // Each due socket once: its next deadline is filed anew by its poll.
        while let Some(&(at, id)) = self.timers.first()
            && at <= ts
        {
            self.timers.pop_first();
            if let Some(slot) = self.slots.get_mut(id as usize).and_then(Option::as_mut) {
                slot.timer = None;
            }
            ids.push(id);
        }
        for &id in &ids {
            self.poll(Some(id), ts, None, sink, false);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// Write out the ACKs held in this drain.
    fn flush_held<S: Sink>(&mut self, sink: &mut S) {
        let Inner {
            held, slots, count, ..
        } = self;
        for (id, h) in held.iter_mut() {
            if let Some(slot) = slots.get_mut(*id as usize).and_then(Option::as_mut) {
                slot.held = None;
            }
            h.flush(sink, count);
        }
        held.clear();
    }

    /// The poller's next smoltcp deadline.
    fn next_timer(&self, epoch: Instant) -> Option<Instant> {
        let &(at, _) = self.timers.first()?;
        Some(epoch + Duration::from_micros(at.total_micros().max(0) as u64))
    }

    /// Drop the sockets of ended sessions once they are closed (or linger
    /// expired). Runs right after a poll, so an abort's RST went out.
    fn sweep(&mut self, now: Instant, linger: Duration) {
        let mut i = 0;
        while i < self.detached.len() {
            let (key, id, since, _) = self.detached[i];
            let state = self.socket(id).state();
            let done = matches!(state, State::Closed | State::TimeWait)
                || now.saturating_duration_since(since) >= linger;
            if !done {
                i += 1;
                continue;
            }
            self.detached.swap_remove(i);
            self.handshaking.retain(|e| e.1 != id);
            self.remove(id);
            if self.flows.get(&key) == Some(&id) {
                self.flows.remove(&key);
            }
        }
    }

    pub(super) fn socket(&mut self, id: Id) -> &mut tcp::Socket<'static> {
        let slot = self.slots[id as usize]
            .as_mut()
            .expect("a socket id held by the stack or a stream refers to a socket");
        slot.set.get_mut::<tcp::Socket>(slot.h)
    }

    fn socket_ref(&self, id: Id) -> &tcp::Socket<'static> {
        let slot = self.slots[id as usize]
            .as_ref()
            .expect("a socket id held by the stack or a stream refers to a socket");
        slot.set.get::<tcp::Socket>(slot.h)
    }

    /// Abort the sockets whose app has not completed the handshake within
    /// [`HANDSHAKE_TIMEOUT`] (their sessions end and close the outbound),
    /// and forget those that moved on. The next deadline, if any.
    fn expire_handshakes(&mut self, now: Instant) -> Option<Instant> {
        while let Some(&(_, id, since)) = self.handshaking.front() {
            let s = self.socket(id);
            if s.state() != State::SynReceived {
                self.handshaking.pop_front();
                continue;
            }
            if now.saturating_duration_since(since) < HANDSHAKE_TIMEOUT {
                return Some(since + HANDSHAKE_TIMEOUT);
            }
            s.abort();
            self.mark(id);
            self.timed_out += 1;
            self.handshaking.pop_front();
        }
        None
    }

    /// Half-open connections (connects in flight, sockets in SYN-RECEIVED).
    fn half_open(&self) -> usize {
        self.connecting.len() + self.handshaking.len()
    }

    /// Evict the oldest half-open connection (of `source` only, if given):
    /// abort its connect, or reset its socket (its session then ends).
    fn evict_oldest(&mut self, source: Option<IpAddr>) {
        let mine = |k: &Key| source.is_none_or(|s| k.0.ip() == s);
        let connecting = self
            .connecting
            .iter()
            .filter(|(k, _)| mine(k))
            .min_by_key(|(_, c)| c.since)
            .map(|(k, c)| (*k, c.since));
        let handshaking = self
            .handshaking
            .iter()
            .enumerate()
            .find(|(_, (k, id, _))| mine(k) && self.socket_ref(*id).state() == State::SynReceived)
            .map(|(i, (_, _, since))| (i, *since));
        match (connecting, handshaking) {
            (Some((k, a)), Some((_, b))) if a <= b => self.evict_connecting(&k),
            (Some((k, _)), None) => self.evict_connecting(&k),
            (_, Some((i, _))) => {
                if let Some((_, id, _)) = self.handshaking.remove(i) {
                    self.socket(id).abort();
                    self.mark(id);
                    self.evicted += 1;
                }
            }
            (None, None) => {}
        }
    }

    fn evict_connecting(&mut self, key: &Key) {
        if let Some(c) = self.connecting.remove(key) {
            if let Some(t) = c.task {
                t.abort();
            }
            self.evicted += 1;
        }
    }
}

impl SmolStack {
    /// An interface answering for every address (any-IP), with the TUN's
    /// own addresses as gateways.
    pub(crate) fn new(
        nets: &[IpNet],
        mtu: u16,
        buffer: usize,
        idle: Duration,
        linger: Duration,
        max_sockets: usize,
    ) -> SmolStack {
        let mtu = usize::from(mtu).max(1280);
        let mut tx = vec![0u8; HEADROOM + mtu].into_boxed_slice();
        let mut count = TxCount::default();
        struct Nowhere;
        impl Sink for Nowhere {
            fn send(&mut self, _: &mut [u8], _: usize) -> bool {
                false
            }
        }
        let mut cfg = IfaceConfig::new(HardwareAddress::Ip);
        // Initial sequence numbers: smoltcp mixes this seed with the tuple.
        cfg.random_seed = seed();
        let epoch = Instant::now();
        let mut iface = {
            let mut dev = Dev {
                rx: None,
                tx: &mut tx,
                sink: &mut Nowhere,
                count: &mut count,
                mtu,
                hold: None,
            };
            Interface::new(cfg, &mut dev, SmolInstant::from_micros(0))
        };
        iface.set_any_ip(true);
        iface.update_ip_addrs(|addrs| {
            for net in nets {
                if is_unicast(net.addr()) {
                    let _ = addrs.push(IpCidr::new(IpAddress::from(net.addr()), net.prefix_len()));
                }
            }
        });
        for net in nets {
            // any-IP needs a route to the destination via one of our own
            // addresses: a default route per family through the gateway.
            let _ = match net.addr() {
                IpAddr::V4(a) => iface.routes_mut().add_default_ipv4_route(a).map(|_| ()),
                IpAddr::V6(a) => iface.routes_mut().add_default_ipv6_route(a).map(|_| ()),
            };
        }
        SmolStack {
            inner: Mutex::new(Inner {
                iface,
                slots: Vec::new(),
                free: Vec::new(),
                none: SocketSet::new(Vec::new()),
                flows: HashMap::new(),
                connecting: HashMap::new(),
                handshaking: VecDeque::new(),
                evicted: 0,
                timed_out: 0,
                detached: Vec::new(),
                timers: BTreeSet::new(),
                dirty: Vec::new(),
                scratch: Vec::new(),
                held: Vec::new(),
                tx,
                count,
                armed: None,
            }),
            wake: Notify::new(),
            epoch,
            buffer,
            idle,
            linger,
            max_sockets,
            max_half_open: max_sockets,
        }
    }

    /// Bound half-open connections at `n` (see `max_half_open`).
    pub(crate) fn with_half_open(mut self, n: usize) -> Self {
        self.max_half_open = n.max(1);
        self
    }

    /// Classify a SYN (without ACK); a new one is marked connecting.
    pub(crate) fn syn(&self, key: Key) -> Syn {
        let mut g = self.inner.lock();
        if let Some(&id) = g.flows.get(&key) {
            if !g.detached.iter().any(|d| d.1 == id) {
                return Syn::Known;
            }
            // The app reuses a port whose previous connection is still
            // closing here: drop the old socket, this is a new connection.
            g.detached.retain(|d| d.1 != id);
            g.handshaking.retain(|d| d.1 != id);
            g.remove(id);
            g.flows.remove(&key);
        }
        if g.connecting.contains_key(&key) {
            return Syn::Connecting;
        }
        if g.flows.len() + g.connecting.len() >= self.max_sockets {
            return Syn::Full;
        }
        // The half-open bounds: evict the oldest, never refuse the newcomer.
        let per_source = HALF_OPEN_PER_SOURCE.min(self.max_half_open);
        let source = key.0.ip();
        if g.half_open() >= per_source {
            // Count only sockets still in SYN-RECEIVED.
            let Inner {
                slots, handshaking, ..
            } = &mut *g;
            handshaking.retain(|e| {
                slots[e.1 as usize]
                    .as_ref()
                    .is_some_and(|s| s.set.get::<tcp::Socket>(s.h).state() == State::SynReceived)
            });
        }
        if g.half_open() >= per_source {
            let from_source = g.connecting.keys().filter(|k| k.0.ip() == source).count()
                + g.handshaking
                    .iter()
                    .filter(|e| e.0.0.ip() == source)
                    .count();
            if from_source >= per_source {
                g.evict_oldest(Some(source));
            } else if g.half_open() >= self.max_half_open {
                g.evict_oldest(None);
            }
        }
        // An evicted socket's RST goes out from the poller.
        let wake = !g.dirty.is_empty();
        let connecting = Connecting {
            since: Instant::now(),
            task: None,
            permit: None,
        };
        g.connecting.insert(key, connecting);
        drop(g);
        if wake {
            self.wake.notify_one();
        }
        Syn::New
    }

    /// The connect task and admission permit of a connection marked
    /// connecting: the task is aborted and the permit dropped if the
    /// connection is evicted (at once, if it already was).
    pub(crate) fn connecting_task(&self, key: &Key, task: AbortHandle, permit: OwnedPermit) {
        match self.inner.lock().connecting.get_mut(key) {
            Some(c) => {
                c.task = Some(task);
                c.permit = Some(permit);
            }
            None => task.abort(),
        }
    }

    /// The admission permit of a connection still connecting (`None` if it
    /// was evicted).
    pub(crate) fn take_permit(&self, key: &Key) -> Option<OwnedPermit> {
        self.inner
            .lock()
            .connecting
            .get_mut(key)
            .and_then(|c| c.permit.take())
    }

    /// A new connection was refused before connecting (rule, admission).
    pub(crate) fn unmark(&self, key: &Key) {
        self.inner.lock().connecting.remove(key);
    }

    /// Process one TCP packet from the app: smoltcp sees the socket of the
    /// packet's flow alone (none if it has no flow: smoltcp then answers
    /// with an RST), so the work does not grow with the number of open
    /// sockets. Every segment goes out at once: the tests', the fuzz
    /// target's and the bench's way in (the driver holds ACKs,
    /// [`SmolStack::input_held`]).
    #[cfg(any(test, fuzzing, feature = "bench-internals"))]
    pub(crate) fn input<S: Sink>(&self, pkt: &[u8], now: Instant, sink: &mut S, stats: &Stats) {
        self.input_inner(pkt, now, sink, stats, false);
    }

    /// [`SmolStack::input`] for the driver: the flow's pure ACKs are held
    /// (one per flow, the newest) until [`SmolStack::drain_done`].
    pub(crate) fn input_held<S: Sink>(
        &self,
        pkt: &[u8],
        now: Instant,
        sink: &mut S,
        stats: &Stats,
    ) {
        self.input_inner(pkt, now, sink, stats, true);
    }

    /// The driver's drain ended: write out the ACKs held in it.
    pub(crate) fn drain_done<S: Sink>(&self, sink: &mut S, stats: &Stats) {
        let mut g = self.inner.lock();
        if g.held.is_empty() {
            return;
        }
        g.flush_held(sink);
        if g.count.packets >= COMMIT_PACKETS || g.count.dropped > 0 {
            g.count.commit(stats);
        }
    }

    fn input_inner<S: Sink>(
        &self,
        pkt: &[u8],
        now: Instant,
        sink: &mut S,
        stats: &Stats,
        hold: bool,
    ) {
        let ts = Inner::now(self.epoch, now);
        let key = flow_of(pkt);
        let mut g = self.inner.lock();
        let id = key.and_then(|k| g.flows.get(&k).copied());
        g.poll(id, ts, Some(pkt), sink, hold);
        if g.count.packets >= COMMIT_PACKETS || g.count.dropped > 0 {
            g.count.commit(stats);
        }
        // A new timer earlier than the poller's deadline: wake it to re-arm.
        let at = id
            .and_then(|id| g.slots[id as usize].as_ref()?.timer)
            .map(|at| self.epoch + Duration::from_micros(at.total_micros().max(0) as u64));
        if let Some(at) = at
            && g.armed.is_none_or(|a| at < a)
        {
            g.armed = Some(at);
            drop(g);
            self.wake.notify_one();
        }
    }

    /// The outbound connected: open a socket for `key` and give it the held
    /// SYN. `None` (the caller answers with an RST) if smoltcp did not take
    /// the SYN (bad checksum, port 0, ...).
    pub(crate) fn accept<S: Sink>(
        &self,
        key: Key,
        syn: &[u8],
        now: Instant,
        sink: &mut S,
    ) -> Option<Id> {
        let (client, server) = key;
        // Allocated outside the lock; zeroed pages come from calloc lazily.
        let mut sock = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0u8; self.buffer]),
            tcp::SocketBuffer::new(vec![0u8; self.buffer]),
        );
        sock.set_nagle_enabled(false);
        sock.set_timeout(Some(smoltcp::time::Duration::from_millis(
            // Capped at a year: smoltcp counts in u64 microseconds.
            self.idle.as_millis().min(31_536_000_000) as u64,
        )));
        let ep = IpListenEndpoint {
            addr: Some(IpAddress::from(server.ip())),
            port: server.port(),
        };
        let ts = Inner::now(self.epoch, now);
        let mut g = self.inner.lock();
        // Not connecting any more: evicted meanwhile.
        g.connecting.remove(&key)?;
        if sock.listen(ep).is_err() {
            return None;
        }
        let id = g.add(sock);
        // The socket listens on the server's address only for the duration
        // of this poll: it takes this SYN (from `client`) and no other.
        g.poll(Some(id), ts, Some(syn), sink, false);
        let s = g.socket(id);
        let ok = s.state() == State::SynReceived
            && s.remote_endpoint()
                .is_some_and(|r| IpAddr::from(r.addr) == client.ip() && r.port == client.port());
        if !ok {
            g.remove(id);
            return None;
        }
        g.flows.insert(key, id);
        g.handshaking.push_back((key, id, now));
        drop(g);
        // The poller re-arms for the SYN-ACK's retransmission.
        self.wake.notify_one();
        Some(id)
    }

    /// Drop a connecting mark after a failed connect.
    pub(crate) fn connect_failed(&self, key: &Key) {
        self.unmark(key);
    }

    /// Number of connections (open or closing) and of connects in flight.
    pub(crate) fn counts(&self) -> (usize, usize) {
        let g = self.inner.lock();
        (g.flows.len(), g.connecting.len())
    }

    /// A diagnostic dump of every socket (flow, state, queues and smoltcp's
    /// own view: windows, sequence numbers, timers) plus the poller's
    /// deadline. For failure reports (`kerntun demo`), not for hot paths: it
    /// formats each socket with smoltcp's `Debug` and strips the buffers.
    pub(crate) fn debug_sockets(&self) -> Vec<String> {
        let g = self.inner.lock();
        let now = Instant::now();
        let mut lines = vec![format!(
            "smoltcp: {} flows, {} connecting, {} detached, {} deadlines, {} queued for the \
             poller, poller armed {:?}, unpublished tx {:?}",
            g.flows.len(),
            g.connecting.len(),
            g.detached.len(),
            g.timers.len(),
            g.dirty.len(),
            g.armed.map(|a| a.saturating_duration_since(now)),
            g.count,
        )];
        for (key, &id) in &g.flows {
            let s = g.socket_ref(id);
            lines.push(format!(
                "{} -> {}: {} send_queue {} recv_queue {} can_send {} can_recv {} {}",
                key.0,
                key.1,
                s.state(),
                s.send_queue(),
                s.recv_queue(),
                s.can_send(),
                s.can_recv(),
                strip_storage(&format!("{s:?}")),
            ));
        }
        lines
    }

    /// The poller: the one place smoltcp's timers and the sessions' output
    /// are driven from. Returns when the engine stops.
    pub(crate) async fn run_poller(
        self: Arc<Self>,
        tun: Arc<Tun>,
        stats: Arc<Stats>,
        life: Arc<Lifecycle>,
    ) {
        loop {
            let deadline = self.poll_once(&mut TunSink(&tun), &stats, Instant::now());
            let sleep = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = life.reached(Phase::Stopped) => return,
                _ = self.wake.notified() => {}
                _ = sleep => {}
            }
        }
    }

    /// Poll, sweep, publish counters; the next deadline (None: idle).
    pub(crate) fn poll_once<S: Sink>(
        &self,
        sink: &mut S,
        stats: &Stats,
        now: Instant,
    ) -> Option<Instant> {
        let ts = Inner::now(self.epoch, now);
        let mut g = self.inner.lock();
        let handshake = g.expire_handshakes(now);
        g.poll_due(ts, sink);
        g.sweep(now, self.linger);
        g.count.commit(stats);
        let inner = &mut *g;
        for (n, why) in [
            (&mut inner.evicted, EngineDrop::HalfOpenEvicted),
            (&mut inner.timed_out, EngineDrop::HandshakeTimeout),
        ] {
            if *n > 0 {
                stats.drops[why as usize].fetch_add(*n, std::sync::atomic::Ordering::Relaxed);
                *n = 0;
            }
        }
        // A deadline already passed (a socket with output the poll could
        // not send) wakes the poller at once, as smoltcp's `poll_delay` 0.
        let mut at = g.next_timer(self.epoch).map(|t| t.max(now));
        if at.is_none() && !g.detached.is_empty() {
            // Lingering sockets with no smoltcp timer still need a sweep.
            at = Some(now + self.linger);
        }
        // A handshake's deadline wakes the poller too.
        if let Some(h) = handshake {
            at = Some(at.map_or(h, |a| a.min(h)));
        }
        g.armed = at;
        at
    }

    /// Read what the socket holds into `buf`: `Ok(0)` after the app's FIN.
    /// With nothing to read, register `cx` and pend, or (no `cx`) answer
    /// `WouldBlock`.
    pub(super) fn poll_recv(
        &self,
        id: Id,
        cx: Option<&mut Context<'_>>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let mut g = self.inner.lock();
        let s = g.socket(id);
        if s.can_recv() {
            return match s.recv_slice(buf) {
                Ok(n) => {
                    g.mark(id);
                    drop(g);
                    // The window opened: the poller may owe the app an update.
                    self.wake.notify_one();
                    Poll::Ready(Ok(n))
                }
                Err(tcp::RecvError::Finished) => Poll::Ready(Ok(0)),
                Err(tcp::RecvError::InvalidState) => {
                    Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()))
                }
            };
        }
        match recv_readiness(s) {
            Some(Ok(())) => Poll::Ready(Ok(0)),
            Some(Err(e)) => Poll::Ready(Err(e)),
            None => match cx {
                Some(cx) => {
                    s.register_recv_waker(cx.waker());
                    Poll::Pending
                }
                None => Poll::Ready(Err(io::ErrorKind::WouldBlock.into())),
            },
        }
    }

    /// Ready once a read would not pend: data, the app's FIN, or a reset.
    /// Takes no buffer, so a waiting relay direction holds none.
    pub(super) fn poll_readable(&self, id: Id, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut g = self.inner.lock();
        let s = g.socket(id);
        if s.can_recv() {
            return Poll::Ready(Ok(()));
        }
        match recv_readiness(s) {
            Some(_) => Poll::Ready(Ok(())),
            None => {
                s.register_recv_waker(cx.waker());
                Poll::Pending
            }
        }
    }

    pub(super) fn poll_send(
        &self,
        id: Id,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut g = self.inner.lock();
        let s = g.socket(id);
        if s.can_send() {
            return match s.send_slice(data) {
                Ok(n) => {
                    g.mark(id);
                    drop(g);
                    self.wake.notify_one();
                    Poll::Ready(Ok(n))
                }
                Err(_) => Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
            };
        }
        match s.state() {
            State::Listen | State::SynReceived | State::SynSent => {
                s.register_send_waker(cx.waker());
                Poll::Pending
            }
            State::Closed => Poll::Ready(Err(io::ErrorKind::ConnectionReset.into())),
            _ if !s.may_send() => Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
            _ => {
                s.register_send_waker(cx.waker());
                Poll::Pending
            }
        }
    }

    /// The session of `h` ended: close the socket gracefully (unless it is
    /// already closed) and hand it to the poller, which removes it (and
    /// releases `permit`) once the FIN exchange is over or the linger time
    /// has passed.
    pub(super) fn detach(&self, id: Id, key: Key, permit: Option<OwnedPermit>) {
        let mut g = self.inner.lock();
        let s = g.socket(id);
        if !matches!(s.state(), State::Closed | State::TimeWait) {
            s.close();
        }
        g.mark(id);
        g.detached.push((key, id, Instant::now(), permit));
        drop(g);
        self.wake.notify_one();
    }

    pub(super) fn with_socket(&self, id: Id, f: impl FnOnce(&mut tcp::Socket<'static>)) {
        let mut g = self.inner.lock();
        f(g.socket(id));
        g.mark(id);
        drop(g);
        self.wake.notify_one();
    }
}

/// The flow of a TCP packet from the app: (client, server). `None` if it
/// does not parse (smoltcp then drops it, or answers it with an RST).
fn flow_of(pkt: &[u8]) -> Option<Key> {
    let ip = crate::packet::parse_ip(pkt).ok()?;
    let tcp = crate::packet::parse_tcp(pkt, &ip).ok()?;
    Some((
        SocketAddr::new(ip.src, tcp.src_port),
        SocketAddr::new(ip.dst, tcp.dst_port),
    ))
}

/// What a read of a socket with an empty receive buffer finds: the app's
/// FIN (`Ok`), a reset (`Err`), or nothing yet (`None`: wait).
fn recv_readiness(s: &tcp::Socket<'_>) -> Option<io::Result<()>> {
    match s.state() {
        State::Closed => Some(Err(io::ErrorKind::ConnectionReset.into())),
        State::Listen | State::SynReceived | State::SynSent => None,
        _ if !s.may_recv() => Some(Ok(())),
        _ => None,
    }
}

/// `s` without the contents of `storage: ...` fields (socket buffers).
fn strip_storage(s: &str) -> String {
    let mut out = String::with_capacity(1024);
    let mut rest = s;
    while let Some(i) = rest.find("storage: ") {
        out.push_str(&rest[..i]);
        out.push_str("storage: ..");
        rest = &rest[i..];
        // Skip to the end of the bracketed value that follows.
        let mut depth = 0usize;
        let mut end = rest.len();
        for (j, c) in rest.char_indices() {
            match c {
                '(' | '[' => depth += 1,
                ')' | ']' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = j + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

fn seed() -> u64 {
    // Not cryptographic: ISNs only need to differ between engine starts.
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let x = t ^ (std::process::id() as u64).rotate_left(32) ^ (&t as *const u64 as u64);
    // splitmix64 finaliser
    let x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
