//! [`SmolStack`]: one smoltcp `Interface` in any-IP mode and its sockets,
//! behind one lock per engine (smoltcp is single-owner). The lock is held
//! for one poll at a time, never across an await or a blocking call (TUN
//! writes are non-blocking; a full device queue drops the segment, counted,
//! and TCP retransmits it).
//!
//! Timers are driven from one place: the poller task sleeps until smoltcp's
//! `poll_at` (or until a session or the driver wakes it) and sleeps without a
//! deadline when no socket has a timer, so an idle tunnel never wakes up.

use std::collections::{HashMap, VecDeque};
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

use super::device::{Dev, Sink, TunSink, TxCount};
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
    pub(super) sockets: SocketSet<'static>,
    pub(super) flows: HashMap<Key, SocketHandle>,
    /// Connects in flight, with when their SYN came and (once spawned) the
    /// task to abort if the connection is evicted and its admission permit
    /// (held here so an eviction hands it back at once).
    pub(super) connecting: HashMap<Key, Connecting>,
    /// Sockets given their SYN whose handshake the app has not completed,
    /// oldest first (entries past SYN-RECEIVED are dropped lazily).
    pub(super) handshaking: VecDeque<(Key, SocketHandle, Instant)>,
    /// Half-open connections evicted and handshakes timed out, not yet
    /// published to the statistics.
    pub(super) evicted: u64,
    pub(super) timed_out: u64,
    /// Sockets whose session ended, with when and the session's admission
    /// permit (released with the socket); removed once closed.
    pub(super) detached: Vec<(Key, SocketHandle, Instant, Option<OwnedPermit>)>,
    /// Transmit scratch: HEADROOM + MTU.
    pub(super) tx: Box<[u8]>,
    pub(super) count: TxCount,
    /// When the poller will wake next (None: no deadline).
    pub(super) armed: Option<Instant>,
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

    /// One smoltcp poll, with `pkt` (a whole IP packet) as the only input.
    fn poll<S: Sink>(&mut self, ts: SmolInstant, pkt: Option<&[u8]>, sink: &mut S) {
        let mtu = self.tx.len() - HEADROOM;
        let mut dev = Dev {
            rx: pkt,
            tx: &mut self.tx,
            sink,
            count: &mut self.count,
            mtu,
        };
        self.iface.poll(ts, &mut dev, &mut self.sockets);
    }

    /// Drop the sockets of ended sessions once they are closed (or linger
    /// expired). Runs right after a poll, so an abort's RST went out.
    fn sweep(&mut self, now: Instant, linger: Duration) {
        let Inner {
            sockets,
            flows,
            detached,
            handshaking,
            ..
        } = self;
        detached.retain(|&(key, h, since, _)| {
            let state = sockets.get::<tcp::Socket>(h).state();
            let done = matches!(state, State::Closed | State::TimeWait)
                || now.saturating_duration_since(since) >= linger;
            if done {
                handshaking.retain(|e| e.1 != h);
                sockets.remove(h);
                if flows.get(&key) == Some(&h) {
                    flows.remove(&key);
                }
            }
            !done
        });
    }

    pub(super) fn socket(&mut self, h: SocketHandle) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket>(h)
    }

    /// Abort the sockets whose app has not completed the handshake within
    /// [`HANDSHAKE_TIMEOUT`] (their sessions end and close the outbound),
    /// and forget those that moved on. The next deadline, if any.
    fn expire_handshakes(&mut self, now: Instant) -> Option<Instant> {
        while let Some(&(_, h, since)) = self.handshaking.front() {
            let s = self.sockets.get_mut::<tcp::Socket>(h);
            if s.state() != State::SynReceived {
                self.handshaking.pop_front();
                continue;
            }
            if now.saturating_duration_since(since) < HANDSHAKE_TIMEOUT {
                return Some(since + HANDSHAKE_TIMEOUT);
            }
            s.abort();
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
            .find(|(_, (k, h, _))| {
                mine(k) && self.sockets.get::<tcp::Socket>(*h).state() == State::SynReceived
            })
            .map(|(i, (_, _, since))| (i, *since));
        match (connecting, handshaking) {
            (Some((k, a)), Some((_, b))) if a <= b => self.evict_connecting(&k),
            (Some((k, _)), None) => self.evict_connecting(&k),
            (_, Some((i, _))) => {
                if let Some((_, h, _)) = self.handshaking.remove(i) {
                    self.sockets.get_mut::<tcp::Socket>(h).abort();
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
                sockets: SocketSet::new(Vec::new()),
                flows: HashMap::new(),
                connecting: HashMap::new(),
                handshaking: VecDeque::new(),
                evicted: 0,
                timed_out: 0,
                detached: Vec::new(),
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
        if let Some(&h) = g.flows.get(&key) {
            if !g.detached.iter().any(|d| d.1 == h) {
                return Syn::Known;
            }
            // The app reuses a port whose previous connection is still
            // closing here: drop the old socket, this is a new connection.
            g.detached.retain(|d| d.1 != h);
            g.handshaking.retain(|d| d.1 != h);
            g.sockets.remove(h);
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
                sockets,
                handshaking,
                ..
            } = &mut *g;
            handshaking.retain(|e| sockets.get::<tcp::Socket>(e.1).state() == State::SynReceived);
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
        let connecting = Connecting {
            since: Instant::now(),
            task: None,
            permit: None,
        };
        g.connecting.insert(key, connecting);
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

    /// Process one TCP packet from the app (the driver's path).
    pub(crate) fn input<S: Sink>(&self, pkt: &[u8], now: Instant, sink: &mut S, stats: &Stats) {
        let ts = Inner::now(self.epoch, now);
        let mut g = self.inner.lock();
        g.poll(ts, Some(pkt), sink);
        if g.count.packets >= COMMIT_PACKETS || g.count.dropped > 0 {
            g.count.commit(stats);
        }
        // A new timer earlier than the poller's deadline: wake it to re-arm.
        let Inner {
            iface,
            sockets,
            armed,
            ..
        } = &mut *g;
        if let Some(at) = iface.poll_at(ts, sockets) {
            let at = self.epoch + Duration::from_micros(at.total_micros().max(0) as u64);
            if armed.is_none_or(|a| at < a) {
                *armed = Some(at);
                drop(g);
                self.wake.notify_one();
            }
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
    ) -> Option<SocketHandle> {
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
        let h = g.sockets.add(sock);
        // The socket listens on the server's address only for the duration
        // of this poll: it takes this SYN (from `client`) and no other.
        g.poll(ts, Some(syn), sink);
        let s = g.socket(h);
        let ok = s.state() == State::SynReceived
            && s.remote_endpoint()
                .is_some_and(|r| IpAddr::from(r.addr) == client.ip() && r.port == client.port());
        if !ok {
            g.sockets.remove(h);
            return None;
        }
        g.flows.insert(key, h);
        g.handshaking.push_back((key, h, now));
        drop(g);
        self.wake.notify_one();
        Some(h)
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
            "smoltcp: {} flows, {} connecting, {} detached, poller armed {:?}, unpublished tx {:?}",
            g.flows.len(),
            g.connecting.len(),
            g.detached.len(),
            g.armed.map(|a| a.saturating_duration_since(now)),
            g.count,
        )];
        for (key, &h) in &g.flows {
            let s = g.sockets.get::<tcp::Socket>(h);
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
        g.poll(ts, None, sink);
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
        let Inner { iface, sockets, .. } = &mut *g;
        let delay = iface.poll_delay(ts, sockets);
        let mut at = delay.map(|d| now + Duration::from_micros(d.total_micros()));
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
        h: SocketHandle,
        cx: Option<&mut Context<'_>>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let mut g = self.inner.lock();
        let s = g.socket(h);
        if s.can_recv() {
            return match s.recv_slice(buf) {
                Ok(n) => {
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
    pub(super) fn poll_readable(
        &self,
        h: SocketHandle,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        let mut g = self.inner.lock();
        let s = g.socket(h);
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
        h: SocketHandle,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut g = self.inner.lock();
        let s = g.socket(h);
        if s.can_send() {
            return match s.send_slice(data) {
                Ok(n) => {
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
    pub(super) fn detach(&self, h: SocketHandle, key: Key, permit: Option<OwnedPermit>) {
        let mut g = self.inner.lock();
        let s = g.socket(h);
        if !matches!(s.state(), State::Closed | State::TimeWait) {
            s.close();
        }
        g.detached.push((key, h, Instant::now(), permit));
        drop(g);
        self.wake.notify_one();
    }

    pub(super) fn with_socket(&self, h: SocketHandle, f: impl FnOnce(&mut tcp::Socket<'static>)) {
        f(self.inner.lock().socket(h));
        self.wake.notify_one();
    }
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
