//! The smoltcp stack (DESIGN.md part 7): a userspace TCP behind the same
//! processing entry point, drivers, connect-first SYN handling, admission,
//! outbounds and statistics as the system stack. Only the way TCP segments
//! become streams differs: instead of rewriting them for the kernel, the
//! [`crate::system::Processor`] hands them to one smoltcp `Interface` in
//! any-IP mode, and each accepted connection is a smoltcp socket read and
//! written by a session task. UDP and ICMP never come here.
//!
//! One lock guards the interface and its sockets (smoltcp is single-owner);
//! it is per engine and held for one `poll` at a time, never across an await
//! or a blocking call (TUN writes are non-blocking; a full device queue drops
//! the segment, counted, and TCP retransmits it).
//!
//! Timers are driven from one place: the poller task sleeps until smoltcp's
//! `poll_at` (or until a session or the driver wakes it) and sleeps without a
//! deadline when no socket has a timer, so an idle tunnel never wakes up.

use crate::dispatch::{self, AppStream, Plan};
use std::collections::{HashMap, HashSet};
use std::future::poll_fn;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use parking_lot::Mutex;
use smoltcp::iface::{Config as IfaceConfig, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{Device, DeviceCapabilities, Medium, RxToken, TxToken};
use smoltcp::socket::tcp::{self, State};
use smoltcp::time::Instant as SmolInstant;
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr, IpListenEndpoint};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::budget::{OwnedPermit, Platform};
use crate::outbound::{OutboundStream, Route, reset_on_close};
use crate::packet;
use crate::relay::{self, Leg, LegMeter, Open, Relayed, Seal};
use crate::stats::{EngineDrop, Stats};
use crate::system::{DRAINING, STOPPED, Shared};
use crate::tun::{HEADROOM, Tun};

#[doc(hidden)]
pub mod fuzzing;
#[cfg(test)]
mod tests;

/// A flow as the app sees it: (client, server).
pub(crate) type Key = (SocketAddr, SocketAddr);

/// Transmit counters are published after this many packets (or by the poller).
const COMMIT_PACKETS: u64 = 64;

/// Per-connection socket buffer (each of receive and send) for a platform:
/// 64 KiB on iOS (64 sessions x 128 KiB fits the extension's budget), 128 KiB
/// on Android, 512 KiB on desktop (enough window for multi-Gbit/s on a
/// sub-millisecond path). Allocated zeroed by the allocator (`calloc`), so
/// large buffers are paged in only as the window fills.
pub(crate) fn socket_buffer(platform: Platform) -> usize {
    match platform {
        Platform::Ios => 64 * 1024,
        Platform::Android => 128 * 1024,
        Platform::Desktop => 512 * 1024,
    }
}

/// Where transmitted segments go: the TUN in the engine, a vector in tests.
pub(crate) trait Sink {
    /// Send the packet at `buf[HEADROOM..HEADROOM + len]`; false if dropped.
    fn send(&mut self, buf: &mut [u8], len: usize) -> bool;
}

/// The engine's sink: a non-blocking TUN write.
pub(crate) struct TunSink<'a>(pub &'a Tun);

impl Sink for TunSink<'_> {
    fn send(&mut self, buf: &mut [u8], len: usize) -> bool {
        self.0.try_send(buf, len).is_ok()
    }
}

#[derive(Debug, Default)]
struct TxCount {
    packets: u64,
    bytes: u64,
    dropped: u64,
}

impl TxCount {
    fn commit(&mut self, stats: &Stats) {
        if self.packets > 0 {
            stats.packets_down.fetch_add(self.packets, Relaxed);
            stats.tun_writes.fetch_add(self.packets, Relaxed);
            stats.bytes_down.fetch_add(self.bytes, Relaxed);
        }
        if self.dropped > 0 {
            stats.drops[EngineDrop::TunWrite as usize].fetch_add(self.dropped, Relaxed);
        }
        *self = TxCount::default();
    }
}

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
    inner: Mutex<Inner>,
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
}

impl std::fmt::Debug for SmolStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmolStack")
            .field("buffer", &self.buffer)
            .finish_non_exhaustive()
    }
}

struct Inner {
    iface: Interface,
    sockets: SocketSet<'static>,
    flows: HashMap<Key, SocketHandle>,
    connecting: HashSet<Key>,
    /// Sockets whose session ended, with when; removed once closed.
    detached: Vec<(Key, SocketHandle, Instant)>,
    /// Transmit scratch: HEADROOM + MTU.
    tx: Box<[u8]>,
    count: TxCount,
    /// When the poller will wake next (None: no deadline).
    armed: Option<Instant>,
}

/// The device smoltcp sees for one poll: at most one received packet
/// (borrowed from the driver's buffer, no copy), transmits into `sink`.
struct Dev<'a, S: Sink> {
    rx: Option<&'a [u8]>,
    tx: &'a mut [u8],
    sink: &'a mut S,
    count: &'a mut TxCount,
    mtu: usize,
}

struct Rx<'a>(&'a [u8]);

impl RxToken for Rx<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(self.0)
    }
}

struct Tx<'a, S: Sink> {
    buf: &'a mut [u8],
    sink: &'a mut S,
    count: &'a mut TxCount,
}

impl<S: Sink> TxToken for Tx<'_, S> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let end = HEADROOM + len;
        if end > self.buf.len() {
            // smoltcp honours the MTU it was given; should it not, the
            // segment is built and dropped (counted) rather than panicking.
            let mut tmp = vec![0u8; len];
            self.count.dropped += 1;
            return f(&mut tmp);
        }
        let r = f(&mut self.buf[HEADROOM..end]);
        shade_window(&mut self.buf[HEADROOM..end]);
        if self.sink.send(self.buf, len) {
            self.count.packets += 1;
            self.count.bytes += len as u64;
        } else {
            self.count.dropped += 1;
        }
        r
    }
}

impl<S: Sink> Device for Dev<'_, S> {
    type RxToken<'b>
        = Rx<'b>
    where
        Self: 'b;
    type TxToken<'b>
        = Tx<'b, S>
    where
        Self: 'b;

    fn receive(&mut self, _: SmolInstant) -> Option<(Rx<'_>, Tx<'_, S>)> {
        let pkt = self.rx.take()?;
        Some((
            Rx(pkt),
            Tx {
                buf: self.tx,
                sink: self.sink,
                count: self.count,
            },
        ))
    }

    fn transmit(&mut self, _: SmolInstant) -> Option<Tx<'_, S>> {
        Some(Tx {
            buf: self.tx,
            sink: self.sink,
            count: self.count,
        })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ip;
        caps.max_transmission_unit = self.mtu;
        caps
    }
}

/// Advertise one window unit less than smoltcp does, so that the right
/// edge the app is told never passes an edge smoltcp will hold it to.
///
/// With window scaling smoltcp advertises its free space rounded down to the
/// scale unit (2^shift bytes, 16 with the desktop buffers) and trims every
/// segment at the edge of its *last* advertisement. Between two ACKs that
/// edge can move back by up to a unit minus one byte (the rounding remainder
/// grows as the buffer fills), so bytes the app sent inside the earlier edge
/// are dropped. If the buffer is then full, smoltcp takes no segment whose
/// sequence number is not exactly the next one it expects, ACK and window
/// field included (RFC 9293 3.10.7.4 asks to process them): every ACK the
/// app sends carries its SND.NXT, past the dropped bytes, so smoltcp never
/// learns that the app opened its window, and an echo-style session stalls
/// for good (issue 6). One unit less keeps the advertised edge at least a
/// unit behind every edge smoltcp can later enforce (those never fall more
/// than a unit below its buffer end, which only moves forward), so nothing
/// sent inside it is dropped and the app's SND.NXT is smoltcp's next
/// expected sequence number when the window closes. SYN segments (window
/// not scaled) and RSTs are left alone; a zero window stays zero.
///
/// In place on a segment smoltcp just built (complete IPv4/IPv6 header, no
/// extension headers, valid checksum), with an RFC 1624 checksum update.
fn shade_window(p: &mut [u8]) {
    use crate::packet::checksum;
    let l4 = match p.first().map(|b| b >> 4) {
        Some(4) if p.len() >= 20 && p[9] == 6 => usize::from(p[0] & 0x0f) * 4,
        Some(6) if p.len() >= 40 && p[6] == 6 => 40,
        _ => return,
    };
    let Some(t) = p.get_mut(l4..l4 + 20) else {
        return;
    };
    if t[13] & (packet::tcp_flags::SYN | packet::tcp_flags::RST) != 0 {
        return;
    }
    let old = [t[14], t[15]];
    let win = u16::from_be_bytes(old);
    if win == 0 {
        return;
    }
    let new = (win - 1).to_be_bytes();
    t[14..16].copy_from_slice(&new);
    let sum = u16::from_be_bytes([t[16], t[17]]);
    let sum = checksum::nonzero(checksum::update(sum, checksum::replaced(&old, &new)));
    t[16..18].copy_from_slice(&sum.to_be_bytes());
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
            ..
        } = self;
        detached.retain(|&(key, h, since)| {
            let state = sockets.get::<tcp::Socket>(h).state();
            let done = matches!(state, State::Closed | State::TimeWait)
                || now.saturating_duration_since(since) >= linger;
            if done {
                sockets.remove(h);
                if flows.get(&key) == Some(&h) {
                    flows.remove(&key);
                }
            }
            !done
        });
    }

    fn socket(&mut self, h: SocketHandle) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket>(h)
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
                connecting: HashSet::new(),
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
        }
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
            g.sockets.remove(h);
            g.flows.remove(&key);
        }
        if g.connecting.contains(&key) {
            return Syn::Connecting;
        }
        if g.flows.len() + g.connecting.len() >= self.max_sockets {
            return Syn::Full;
        }
        g.connecting.insert(key);
        Syn::New
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
        g.connecting.remove(&key);
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
    pub(crate) async fn run_poller(self: Arc<Self>, sh: Arc<Shared>) {
        let mut stop = sh.stop.subscribe();
        loop {
            let deadline = self.poll_once(&mut TunSink(&sh.tun), &sh.stats, Instant::now());
            let sleep = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s >= STOPPED) => return,
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
        g.poll(ts, None, sink);
        g.sweep(now, self.linger);
        g.count.commit(stats);
        let Inner { iface, sockets, .. } = &mut *g;
        let delay = iface.poll_delay(ts, sockets);
        let mut at = delay.map(|d| now + Duration::from_micros(d.total_micros()));
        if at.is_none() && !g.detached.is_empty() {
            // Lingering sockets with no smoltcp timer still need a sweep.
            at = Some(now + self.linger);
        }
        g.armed = at;
        at
    }

    fn poll_recv(
        &self,
        h: SocketHandle,
        cx: &mut Context<'_>,
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
        match s.state() {
            State::Closed => Poll::Ready(Err(io::ErrorKind::ConnectionReset.into())),
            State::Listen | State::SynReceived | State::SynSent => {
                s.register_recv_waker(cx.waker());
                Poll::Pending
            }
            _ if !s.may_recv() => Poll::Ready(Ok(0)),
            _ => {
                s.register_recv_waker(cx.waker());
                Poll::Pending
            }
        }
    }

    fn poll_send(
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

    fn with_socket(&self, h: SocketHandle, f: impl FnOnce(&mut tcp::Socket<'static>)) {
        f(self.inner.lock().socket(h));
        self.wake.notify_one();
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

/// The app's side of one connection: a smoltcp socket. Dropping it hands the
/// socket to the poller, which removes it once closed.
pub(crate) struct SmolStream {
    stack: Arc<SmolStack>,
    h: SocketHandle,
    key: Key,
}

impl SmolStream {
    pub(crate) fn new(stack: Arc<SmolStack>, h: SocketHandle, key: Key) -> Self {
        SmolStream { stack, h, key }
    }

    /// Read into `buf`; 0 at the app's FIN.
    pub(crate) async fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        poll_fn(|cx| self.stack.poll_recv(self.h, cx, buf)).await
    }

    /// Write all of `data`, waiting for window space (a slow app parks here).
    pub(crate) async fn send_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let n = poll_fn(|cx| self.stack.poll_send(self.h, cx, data)).await?;
            data = &data[n..];
        }
        Ok(())
    }

    /// Send a FIN after what was queued (half-close toward the app).
    pub(crate) fn close(&self) {
        self.stack.with_socket(self.h, |s| s.close());
    }

    /// Reset the connection toward the app.
    pub(crate) fn abort(&self) {
        self.stack.with_socket(self.h, |s| s.abort());
    }
}

impl Drop for SmolStream {
    fn drop(&mut self) {
        let mut g = self.stack.inner.lock();
        let s = g.socket(self.h);
        if !matches!(s.state(), State::Closed | State::TimeWait) {
            s.close();
        }
        g.detached.push((self.key, self.h, Instant::now()));
        drop(g);
        self.stack.wake.notify_one();
    }
}

/// Connect the outbound for a held SYN (connect-first, as in the system
/// stack), then open the smoltcp socket and run the session; on failure the
/// app gets an RST answering its SYN.
pub(crate) async fn connect_then_accept(
    sh: Arc<Shared>,
    stack: Arc<SmolStack>,
    key: Key,
    mut syn: Box<[u8]>,
    permit: OwnedPermit,
    plan: Plan,
) {
    let (client, server) = key;
    let len = syn.len() - HEADROOM;
    let (route, dst) = match plan {
        Plan::Connect { route, dst } => (route, dst),
        Plan::Dns | Plan::Sniff | Plan::Refuse(_) => {
            // Nothing to connect first (a refusal never gets here).
            if matches!(plan, Plan::Refuse(_)) || *sh.stop.borrow() >= DRAINING {
                stack.connect_failed(&key);
                send_rst(&sh, &mut syn, len).await;
                return;
            }
            let accepted =
                stack.accept(key, &syn[HEADROOM..], Instant::now(), &mut TunSink(&sh.tun));
            let Some(h) = accepted else {
                send_rst(&sh, &mut syn, len).await;
                return;
            };
            drop(syn);
            let app = SmolStream::new(stack, h, key);
            if matches!(plan, Plan::Dns) {
                dns_session(sh, app, permit).await;
            } else {
                sniff_session(sh, app, server, permit).await;
            }
            return;
        }
    };
    let result = dispatch::connect(&sh, route, &dst, server.is_ipv6()).await;
    let out = match result {
        Ok(out) => out,
        Err(e) => {
            stack.connect_failed(&key);
            sh.stats.tcp_connect_failed.fetch_add(1, Relaxed);
            tracing::debug!(
                "connect {client} -> {dst} via {}: {e}",
                sh.outbounds.name(route)
            );
            drop(permit);
            send_rst(&sh, &mut syn, len).await;
            return;
        }
    };
    if *sh.stop.borrow() >= DRAINING {
        stack.connect_failed(&key);
        send_rst(&sh, &mut syn, len).await;
        return;
    }
    let accepted = stack.accept(key, &syn[HEADROOM..], Instant::now(), &mut TunSink(&sh.tun));
    let Some(h) = accepted else {
        reset_on_close(&out.stream);
        send_rst(&sh, &mut syn, len).await;
        return;
    };
    let app = SmolStream::new(stack, h, key);
    session(sh, app, out, permit).await;
}

impl AppStream for &SmolStream {
    async fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        SmolStream::recv(self, buf).await
    }
    async fn send_all(&mut self, data: &[u8]) -> io::Result<()> {
        SmolStream::send_all(self, data).await
    }
}

/// DNS over TCP to a hijacked address, answered here.
async fn dns_session(sh: Arc<Shared>, app: SmolStream, permit: OwnedPermit) {
    let mut phase = sh.stop.subscribe();
    if let Some(dns) = sh.dns.clone() {
        let mut stream = &app;
        let r = tokio::select! {
            r = dns.serve_tcp(&mut stream, &sh.stats) => r,
            _ = phase.wait_for(|p| *p >= DRAINING) => Err(io::Error::other("engine stopping")),
        };
        if let Err(e) = r {
            tracing::debug!("dns over tcp ended with {e}");
            app.abort();
        }
    }
    drop(app);
    drop(permit);
}

/// Accepted before routing: read the first bytes (a smoltcp socket cannot
/// be peeked, so they are kept and sent to the outbound first), route by the
/// domain they name, connect, relay. A refusal or failed connect resets the
/// app.
async fn sniff_session(sh: Arc<Shared>, app: SmolStream, server: SocketAddr, permit: OwnedPermit) {
    let timeout = Duration::from_millis(sh.sniff.timeout_ms);
    let mut phase = sh.stop.subscribe();
    let mut first = Vec::new();
    let connected = async {
        let domain = sniff_read(&app, &mut first, timeout).await;
        dispatch::count_sniff(&sh.stats, domain.is_some());
        let route = dispatch::route_sniffed(&sh, server, domain.as_deref());
        if route == Route::Reject {
            sh.stats.tcp_rejected_by_rule.fetch_add(1, Relaxed);
            return None;
        }
        let dst = crate::outbound::Address::Ip(server);
        let mut out = match dispatch::connect(&sh, route, &dst, server.is_ipv6()).await {
            Ok(out) => out,
            Err(e) => {
                sh.stats.tcp_connect_failed.fetch_add(1, Relaxed);
                tracing::debug!("connect {server} via {}: {e}", sh.outbounds.name(route));
                return None;
            }
        };
        // The bytes read while sniffing go out first, framed like the rest.
        if !first.is_empty() {
            let sent = match out.codec.as_mut() {
                Some(c) => {
                    let mut wire = Vec::new();
                    c.0.seal(&first, &mut wire);
                    relay::write_all(&out.stream, &wire).await
                }
                None => relay::write_all(&out.stream, &first).await,
            };
            if sent.is_err() {
                reset_on_close(&out.stream);
                return None;
            }
            let n = first.len() as u64;
            sh.stats.tcp_bytes_up.fetch_add(n, Relaxed);
            sh.stats.tcp_bytes_copied.fetch_add(n, Relaxed);
        }
        Some(out)
    };
    let out = tokio::select! {
        out = connected => out,
        _ = phase.wait_for(|p| *p >= DRAINING) => None,
    };
    match out {
        Some(out) => Box::pin(session(sh, app, out, permit)).await,
        None => {
            app.abort();
            drop(app);
            drop(permit);
        }
    }
}

/// Read the app's first bytes into `first` until they name a domain, name
/// none, reach [`crate::sniff::MAX_SNIFF`], or `timeout` passes.
async fn sniff_read(app: &SmolStream, first: &mut Vec<u8>, timeout: Duration) -> Option<String> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut chunk = vec![0u8; 4096];
    loop {
        let n = match tokio::time::timeout_at(deadline, app.recv(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return None,
        };
        let take = n.min(crate::sniff::MAX_SNIFF - first.len());
        first.extend_from_slice(&chunk[..take]);
        match crate::sniff::sniff(first) {
            crate::sniff::Sniffed::Domain { name, .. } => return Some(name.to_owned()),
            crate::sniff::Sniffed::NoDomain => return None,
            crate::sniff::Sniffed::NeedMore if first.len() >= crate::sniff::MAX_SNIFF => {
                return None;
            }
            crate::sniff::Sniffed::NeedMore => {}
        }
    }
}

/// Answer the held SYN in `syn[HEADROOM..HEADROOM + len]` with an RST.
async fn send_rst(sh: &Shared, syn: &mut [u8], len: usize) {
    let pkt = &mut syn[HEADROOM..HEADROOM + len];
    let Ok(ip) = packet::parse_ip(pkt) else {
        return;
    };
    let Ok(tcp) = packet::parse_tcp(pkt, &ip) else {
        return;
    };
    let n = packet::tcp_rst_reply(pkt, &ip, &tcp);
    if sh.tun.send(syn, n).await.is_err() {
        sh.stats.drop(EngineDrop::TunWrite);
    }
}

/// Counts a session as active for as long as it lives (also when aborted).
struct Active<'a>(&'a Stats);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.tcp_sessions_active.fetch_sub(1, Relaxed);
    }
}

async fn session(sh: Arc<Shared>, app: SmolStream, out: OutboundStream, permit: OwnedPermit) {
    sh.stats.tcp_sessions_total.fetch_add(1, Relaxed);
    sh.stats.tcp_sessions_active.fetch_add(1, Relaxed);
    let active = Active(&sh.stats);
    let mut phase = sh.stop.subscribe();
    let OutboundStream {
        stream: out,
        codec,
        route,
    } = out;
    let meter = relay::Meter {
        up: &sh.stats.tcp_bytes_up,
        down: &sh.stats.tcp_bytes_down,
        spliced: &sh.stats.tcp_bytes_spliced,
        copied: &sh.stats.tcp_bytes_copied,
    };
    let buf = sh.outbounds.relay.buffer;
    let relayed = async {
        match codec {
            None => relay_smol(&app, &out, None, None, buf, &meter).await,
            Some(codec) => {
                let (mut seal, mut open) = *codec;
                relay_smol(&app, &out, Some(&mut seal), Some(&mut open), buf, &meter).await
            }
        }
    };
    let r = tokio::select! {
        r = relayed => r,
        _ = phase.wait_for(|p| *p >= DRAINING) => Err(io::Error::other("engine stopping")),
    };
    if let Err(e) = r {
        if e.kind() == io::ErrorKind::InvalidData
            && let Route::Proxy(i) = route
            && let Some(c) = sh.stats.outbounds.get(i)
        {
            c.protocol_errors.fetch_add(1, Relaxed);
        }
        tracing::debug!("relay via {} ended with {e}", sh.outbounds.name(route));
        app.abort();
        reset_on_close(&out);
    }
    drop(app);
    drop(active);
    drop(permit);
}

/// `copy_bidirectional` between a smoltcp socket and an outbound kernel
/// socket, with the outbound's framing when it has one. No splice here: one
/// side lives in userspace.
async fn relay_smol(
    app: &SmolStream,
    out: &TcpStream,
    seal: Option<&mut (dyn Seal + '_)>,
    open: Option<&mut (dyn Open + '_)>,
    buf_size: usize,
    meter: &relay::Meter<'_>,
) -> io::Result<Relayed> {
    let (up, down) = tokio::try_join!(
        up_leg(app, out, seal, buf_size, meter.up_leg()),
        down_leg(out, app, open, buf_size, meter.down_leg()),
    )?;
    Ok(Relayed { up, down })
}

async fn up_leg(
    app: &SmolStream,
    out: &TcpStream,
    mut seal: Option<&mut (dyn Seal + '_)>,
    buf_size: usize,
    meter: LegMeter<'_>,
) -> io::Result<Leg> {
    let mut leg = Leg::default();
    let mut buf: Option<Box<[u8]>> = None;
    let mut wire = Vec::new();
    loop {
        let b = buf.get_or_insert_with(|| vec![0u8; buf_size.max(1)].into_boxed_slice());
        let n = app.recv(b).await?;
        if n == 0 {
            relay::shutdown_write(out)?;
            return Ok(leg);
        }
        match seal.as_deref_mut() {
            Some(s) => {
                wire.clear();
                s.seal(&b[..n], &mut wire);
                relay::write_all(out, &wire).await?;
            }
            None => relay::write_all(out, &b[..n]).await?,
        }
        meter.add_copied(&mut leg, n);
        if n < b.len() {
            // The socket's buffer was drained: release ours until more comes.
            buf = None;
            wire = Vec::new();
        }
    }
}

async fn down_leg(
    out: &TcpStream,
    app: &SmolStream,
    mut open: Option<&mut (dyn Open + '_)>,
    buf_size: usize,
    meter: LegMeter<'_>,
) -> io::Result<Leg> {
    let mut leg = Leg::default();
    let mut buf: Option<Box<[u8]>> = None;
    let mut plain = Vec::new();
    loop {
        out.readable().await?;
        let b = buf.get_or_insert_with(|| vec![0u8; buf_size.max(1)].into_boxed_slice());
        match out.try_read(b) {
            Ok(0) => {
                if let Some(o) = open.as_deref_mut() {
                    o.finish()?;
                }
                app.close();
                return Ok(leg);
            }
            Ok(n) => {
                let sent = match open.as_deref_mut() {
                    Some(o) => {
                        plain.clear();
                        o.open(&b[..n], &mut plain)?;
                        app.send_all(&plain).await?;
                        plain.len()
                    }
                    None => {
                        app.send_all(&b[..n]).await?;
                        n
                    }
                };
                meter.add_copied(&mut leg, sent);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                buf = None;
                plain = Vec::new();
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}
