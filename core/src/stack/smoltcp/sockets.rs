//! [`Sockets`]: one smoltcp `Interface` in any-IP mode and its sockets,
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
//!
//! `half_open.rs` keeps the connections between a SYN and the end of its
//! handshake; `stream.rs` has what a session does to its socket;
//! `rings.rs` lends sockets full rings while data fills their small ones.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use parking_lot::Mutex;
use smoltcp::iface::{Config as IfaceConfig, Interface, SocketHandle, SocketSet};
use smoltcp::socket::tcp::{self, State};
use smoltcp::time::Instant as SmolInstant;
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr, IpListenEndpoint};
use tokio::sync::Notify;

use super::device::{Dev, Held, Sink, TunSink, TxCount};
use super::gate::is_unicast;
use super::half_open::Connecting;
use super::rings::{Loan, Loans, Ring};
use crate::budget::OwnedPermit;
use crate::lifecycle::{Lifecycle, Phase};
use crate::nat::FlowKey;
use crate::packet::HEADROOM;
use crate::stats::{EngineDrop, Stats};
use crate::tun::Tun;

/// Transmit counters are published after this many packets (or by the poller).
const COMMIT_PACKETS: u64 = 64;

/// The smoltcp interface of one engine and its sockets.
pub(crate) struct Sockets {
    pub(super) inner: Mutex<Inner>,
    /// Wakes the poller: a session moved data or closed, or the driver's poll
    /// brought the next timer forward.
    pub(super) wake: Notify,
    /// smoltcp timestamps count from here.
    epoch: Instant,
    /// Bytes of a full ring (a socket's rings on loan, `rings.rs`).
    buffer: usize,
    /// Bytes of the rings a socket starts on.
    small: usize,
    /// A connection that heard nothing from the app for this long is
    /// aborted: `timeouts.tcp_idle_s`, the system stack's NAT idle timeout.
    idle: Duration,
    /// How long a socket whose session ended may take to finish closing (FIN
    /// exchange) before it is dropped regardless: `timeouts.tcp_linger_s`.
    linger: Duration,
    /// Sockets (open, closing) plus connects in flight: `budget.tcp_flows`,
    /// the bound the system stack puts on its NAT table.
    pub(super) max_sockets: usize,
    /// Half-open connections (connect in flight, or socket still in
    /// SYN-RECEIVED) past which a new SYN evicts the oldest, as the system
    /// stack does (`stack::system`, "Half-open connections").
    pub(super) max_half_open: usize,
}

impl std::fmt::Debug for Sockets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sockets")
            .field("buffer", &self.buffer)
            .field("small", &self.small)
            .finish_non_exhaustive()
    }
}

pub(super) struct Inner {
    pub(super) iface: Interface,
    /// One slot per socket (open or closing), indexed by [`Id`]; `free`
    /// lists the empty ones.
    pub(super) slots: Vec<Option<Slot>>,
    free: Vec<Id>,
    /// An empty socket set: the poll of a packet that belongs to no flow
    /// (smoltcp answers it with an RST, as it does when no socket takes it).
    none: SocketSet<'static>,
    pub(super) flows: HashMap<FlowKey, Id>,
    /// Connects in flight, with when their SYN came and (once spawned) the
    /// task to abort if the connection is evicted and its admission permit
    /// (held here so an eviction hands it back at once).
    pub(super) connecting: HashMap<FlowKey, Connecting>,
    /// Sockets given their SYN whose handshake the app has not completed,
    /// oldest first (entries past SYN-RECEIVED are dropped lazily).
    pub(super) handshaking: VecDeque<(FlowKey, Id, Instant)>,
    /// Half-open connections evicted and handshakes timed out, not yet
    /// published to the statistics.
    pub(super) evicted: u64,
    pub(super) timed_out: u64,
    /// Sockets whose session ended, with when and the session's admission
    /// permit (released with the socket); removed once closed.
    pub(super) detached: Vec<(FlowKey, Id, Instant, Option<OwnedPermit>)>,
    /// Every socket with a smoltcp deadline, by deadline: the poller polls
    /// only the sockets whose deadline has come.
    timers: BTreeSet<(SmolInstant, Id)>,
    /// Sockets a session queued output on, read from (a window update may be
    /// owed), closed or aborted: the poller polls only these.
    pub(super) dirty: Vec<Id>,
    /// Scratch for the poller (kept to avoid allocating per wake-up).
    scratch: Vec<Id>,
    /// The full rings sockets borrow while data fills their small ones.
    pub(super) loans: Loans,
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
pub(super) struct Slot {
    pub(super) set: SocketSet<'static>,
    pub(super) h: SocketHandle,
    /// Its entry in `Inner::timers`.
    timer: Option<SmolInstant>,
    /// Queued in `Inner::dirty`.
    dirty: bool,
    /// Its entry in `Inner::held` during a drain.
    held: Option<u32>,
    /// The full rings it borrowed, if any.
    pub(super) loan: Loan,
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
        let mut slot = id.and_then(|i| slots.get_mut(i as usize)?.as_mut());
        let id = id.unwrap_or_default();
        // The socket's held ACKs: none for a packet of no socket.
        let mut h = match slot.as_deref_mut() {
            Some(Slot { held: Some(i), .. }) => held.get_mut(*i as usize).map(|e| &mut e.1),
            Some(slot) if hold => {
                slot.held = Some(held.len() as u32);
                held.push((id, Held::default()));
                held.last_mut().map(|e| &mut e.1)
            }
            _ => None,
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
        let Some(slot) = slot else {
            iface.poll(ts, &mut dev, none);
            return;
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
            loan: Loan::default(),
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
    pub(super) fn remove(&mut self, id: Id) {
        if let Some(mut slot) = self.slots.get_mut(id as usize).and_then(Option::take) {
            if let Some(t) = slot.timer {
                self.timers.remove(&(t, id));
            }
            if let Some(e) = slot.held.and_then(|i| self.held.get_mut(i as usize)) {
                e.1.clear();
            }
            if slot.loan.any() {
                #[allow(irrefutable_let_patterns)] // Only TCP sockets are enabled.
                if let smoltcp::socket::Socket::Tcp(sock) = slot.set.remove(slot.h) {
                    self.end_loan(sock, &slot.loan);
                }
            }
            self.free.push(id);
        }
    }

    /// Queue socket `id` for the poller.
    pub(super) fn mark(&mut self, id: Id) {
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

    pub(super) fn socket_ref(&self, id: Id) -> &tcp::Socket<'static> {
        let slot = self.slots[id as usize]
            .as_ref()
            .expect("a socket id held by the stack or a stream refers to a socket");
        slot.set.get::<tcp::Socket>(slot.h)
    }
}

impl Sockets {
    /// An interface answering for every address (any-IP), with the TUN's
    /// own addresses as gateways.
    pub(crate) fn new(
        nets: &[IpNet],
        mtu: u16,
        buffer: usize,
        idle: Duration,
        linger: Duration,
        max_sockets: usize,
    ) -> Sockets {
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
        Sockets {
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
                loans: Loans::new(buffer, buffer, 0, None),
                held: Vec::new(),
                tx,
                count,
                armed: None,
            }),
            wake: Notify::new(),
            epoch,
            buffer,
            small: buffer,
            idle,
            linger,
            max_sockets,
            max_half_open: max_sockets,
        }
    }

    /// Start sockets on rings of `small` bytes and lend up to `rings` full
    /// rings at once (a half or a quarter of them under `pressure`) to the
    /// sockets whose small ones data fills (`rings.rs`). Without it
    /// sockets start on full rings.
    pub(crate) fn with_loans(
        mut self,
        small: usize,
        rings: usize,
        pressure: Option<Arc<crate::budget::Pressure>>,
    ) -> Self {
        let mut loans = Loans::new(small, self.buffer, rings, pressure);
        loans.window_budget = self.inner.get_mut().loans.window_budget;
        self.small = loans.small;
        self.inner.get_mut().loans = loans;
        self
    }

    /// Share `bytes` of window among the sockets on a full receive ring:
    /// each offers at most `bytes` over their number (within its small and
    /// full ring's sizes), so that many uploads at once invite no more of
    /// the app's packets than the TUN's queue holds (`rings.rs`).
    pub(crate) fn with_window_budget(mut self, bytes: usize) -> Self {
        self.inner.get_mut().loans.window_budget = bytes;
        self
    }

    /// Bound half-open connections at `n` (see `max_half_open`).
    pub(crate) fn with_half_open(mut self, n: usize) -> Self {
        self.max_half_open = n.max(1);
        self
    }

    /// Process one TCP packet from the app: smoltcp sees the socket of the
    /// packet's flow alone (none if it has no flow: smoltcp then answers
    /// with an RST), so the work does not grow with the number of open
    /// sockets. Every segment goes out at once: the tests', the fuzz
    /// target's and the bench's way in (the driver holds ACKs,
    /// [`Sockets::input_held`]).
    #[cfg(any(test, fuzzing, feature = "bench-internals"))]
    pub(crate) fn input<S: Sink>(&self, pkt: &[u8], now: Instant, sink: &mut S, stats: &Stats) {
        self.input_inner(pkt, now, sink, stats, false);
    }

    /// `Self::input` for the driver: the flow's pure ACKs are held
    /// (one per flow, the newest) until [`Sockets::drain_done`].
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
        // The app's data fills the small receive ring: a full one, if the
        // pool has one, and a poll that tells the app of the wider window
        // at once (smoltcp's ACK of this segment offered the small ring's
        // rest).
        if let Some(id) = id
            && g.wants_loan(id, 0) == Some(Ring::Rx)
            && g.lend(id, Ring::Rx, now)
        {
            g.poll(Some(id), ts, None, sink, hold);
        }
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
        key: FlowKey,
        syn: &[u8],
        now: Instant,
        sink: &mut S,
    ) -> Option<Id> {
        let FlowKey { client, server } = key;
        // Allocated outside the lock.
        let (rx, tx) = start_rings(self.small);
        let mut sock = tcp::Socket::new(rx, tx);
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
        // The window scale of the full rings it may borrow.
        sock.set_window_shift_for(self.buffer);
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
             poller, {} full rings lent, poller armed {:?}, unpublished tx {:?}",
            g.flows.len(),
            g.connecting.len(),
            g.detached.len(),
            g.timers.len(),
            g.dirty.len(),
            g.loans.lent,
            g.armed.map(|a| a.saturating_duration_since(now)),
            g.count,
        )];
        for (key, &id) in &g.flows {
            let s = g.socket_ref(id);
            lines.push(format!(
                "{} -> {}: {} send_queue {} recv_queue {} can_send {} can_recv {} {}",
                key.client,
                key.server,
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
        let quiet = g.return_quiet(now);
        let inner = &mut *g;
        stats.smoltcp_ring_loans.store(
            inner.loans.lent as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        if inner.loans.refused > 0 {
            stats
                .smoltcp_ring_loans_refused
                .fetch_add(inner.loans.refused, std::sync::atomic::Ordering::Relaxed);
            inner.loans.refused = 0;
        }
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
        // A handshake's deadline wakes the poller too, and quiet rings.
        for h in [handshake, quiet].into_iter().flatten() {
            at = Some(at.map_or(h, |a| a.min(h)));
        }
        g.armed = at;
        at
    }
}

/// A new socket's rings (receive, send) of `n` bytes each. `calloc` clears
/// a chunk it reuses (in a runtime thread's arena, every chunk), which
/// would make a ring resident in full at once: its whole pages are handed
/// back, to become resident again only as far as data fills them.
fn start_rings(n: usize) -> (tcp::SocketBuffer<'static>, tcp::SocketBuffer<'static>) {
    let ring = || {
        let mut v = vec![0u8; n];
        crate::sys::pages::discard(&mut v);
        tcp::SocketBuffer::new(v)
    };
    (ring(), ring())
}

/// The flow of a TCP packet from the app: (client, server). `None` if it
/// does not parse (smoltcp then drops it, or answers it with an RST).
fn flow_of(pkt: &[u8]) -> Option<FlowKey> {
    let ip = crate::packet::parse_ip(pkt).ok()?;
    let tcp = crate::packet::parse_tcp(pkt, &ip).ok()?;
    Some(FlowKey::new(
        SocketAddr::new(ip.src, tcp.src_port),
        SocketAddr::new(ip.dst, tcp.dst_port),
    ))
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
