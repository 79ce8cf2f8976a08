//! The datagram path: each (client, server) pair gets a connected outbound
//! UDP socket, owned by the TUN driver's flow table (no locks on the uplink),
//! and a reply task that turns received datagrams back into IP packets.
//!
//! Bounds: at most `budget.udp_flows` flows, idle flows closed after
//! `timeouts.udp_idle_s`, and uplink datagrams are handed to the kernel with
//! a non-blocking send, so the socket's own send buffer is the only queue: a
//! full one is a counted drop, never unbounded memory. A flow that never
//! saw a reply closes sooner, after `timeouts.udp_unreplied_s` (as Linux
//! conntrack's unreplied UDP timeout, 30 s against 120-180 s), and past the
//! flow budget the oldest unreplied flow is evicted first (counted): a
//! one-way flood (a port scan, datagrams to dead peers) recycles its own
//! flows and never evicts a flow that was answered while an unanswered one
//! is left.
//!
//! Flows the rules send through a proxy (SOCKS5 UDP ASSOCIATE, Shadowsocks
//! UDP) need a handshake and framing before a datagram can leave, which the
//! driver must not wait for. They take a queued path: the driver copies the
//! payload into one of the flow's [`QUEUE_DEPTH`] recycled buffers and hands
//! it to the flow's task over a bounded channel; a full queue is a counted
//! drop. A flow's first buffer always exists; each further one is charged
//! one MTU against the proxied-queue byte budget (`budget.memory`), so all
//! flows together hold at most `udp_flows` x MTU plus that budget, and a
//! buffer the budget refuses is a counted drop too. The task opens the
//! association, frames and sends, and turns the proxy's replies back into
//! IP packets.
//!
//! DNS (when `[dns]` is on): a datagram to a hijacked address's port 53 opens
//! no flow. Its payload is copied to a task that asks the DNS service and
//! writes the answer to the TUN from the address the app asked; each query
//! is charged against the DNS in-flight byte budget while it is answered,
//! past that a query is a counted drop (the app's resolver retries), so the
//! driver never waits for DNS.
//! A flow to a fake-ip address is routed by the domain behind it: a proxy
//! gets the domain in its UDP header, a direct flow resolves it once (in the
//! flow's task, on the queued path) and sends to the real address; replies
//! always come from the fake address. A fake address no domain holds is a
//! counted drop.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::budget::{ByteBudget, Charge};
use crate::dispatch::Dispatcher;
use crate::dns::Dns;
use crate::lifecycle::{EngineTask, supervised};
use crate::outbound::{Address, OutboundError, ProxyUdp, Route, SocketFactory};
use crate::packet::{self, HEADROOM, IPV4_UDP_HEADERS, IPV6_UDP_HEADERS, IpInfo};
use crate::stats::{EngineDrop, LocalCounters, Stats};
use crate::tun::Tun;

type Key = (SocketAddr, SocketAddr);

/// Datagrams a proxied flow holds while its proxy is slow or still
/// handshaking. Each buffer is sized to the largest datagram it carried and
/// recycled, so a busy flow allocates at most this many; 16 x an iOS MTU of
/// 4064 bytes is 64 KiB per flow.
pub(crate) const QUEUE_DEPTH: usize = 16;

/// The driver's end of a proxied flow's queue.
#[derive(Debug)]
struct Queue {
    tx: mpsc::Sender<Vec<u8>>,
    /// Buffers the flow's task has sent and handed back.
    spare: mpsc::Receiver<Vec<u8>>,
    /// Buffers created so far (at most [`QUEUE_DEPTH`]).
    made: usize,
    /// Proxied-queue bytes; every buffer after the first is charged `unit`.
    budget: Arc<ByteBudget>,
    /// The most a buffer holds: the TUN's MTU (a datagram's payload is
    /// smaller, and buffers grow only to the payload they carry).
    unit: usize,
    /// Bytes charged for this flow's buffers, given back when it closes.
    charged: usize,
}

impl Queue {
    /// The driver's end, the flow task's receiver, and the task's way to
    /// hand buffers back.
    fn new(
        budget: Arc<ByteBudget>,
        mtu: u16,
    ) -> (Queue, mpsc::Receiver<Vec<u8>>, mpsc::Sender<Vec<u8>>) {
        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        let (spare_tx, spare) = mpsc::channel(QUEUE_DEPTH);
        let q = Queue {
            tx,
            spare,
            made: 0,
            budget,
            unit: usize::from(mtu),
            charged: 0,
        };
        (q, rx, spare_tx)
    }

    /// A buffer for the next datagram: one the task handed back, else a new
    /// one while the flow has fewer than [`QUEUE_DEPTH`] (the first always,
    /// later ones while the byte budget in force at `now` has room). `None`:
    /// the queue is full.
    fn buffer(&mut self, now: Instant) -> Option<Vec<u8>> {
        if let Ok(b) = self.spare.try_recv() {
            return Some(b);
        }
        if self.made >= QUEUE_DEPTH {
            return None;
        }
        if self.made > 0 {
            if !self.budget.take(self.unit, now) {
                return None;
            }
            self.charged += self.unit;
        }
        self.made += 1;
        Some(Vec::new())
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.budget.give_back(self.charged);
    }
}

#[derive(Debug)]
enum FlowIo {
    /// Direct: a connected socket, sent to synchronously.
    Direct(Arc<UdpSocket>),
    /// Through a proxy: queued to the flow's task.
    Queued(Queue),
}

#[derive(Debug)]
struct Flow {
    io: FlowIo,
    /// Whether this flow's uplink datagrams are gathered for one GSO send
    /// (direct flows where the kernel has `UDP_SEGMENT`, until their path
    /// refuses one).
    #[cfg(linux_like)]
    gso: bool,
    /// Last uplink datagram (driver-local, no atomics needed).
    last_up: Instant,
    /// Last downlink datagram, milliseconds since the table's epoch, at
    /// least 1; 0 while the flow never saw a reply ([`mark_reply`]).
    last_down: Arc<AtomicU64>,
    task: AbortHandle,
}

impl Flow {
    fn last_active(&self, epoch: Instant) -> Instant {
        let down = epoch + Duration::from_millis(self.last_down.load(Relaxed));
        self.last_up.max(down)
    }

    /// Whether a reply ever came back on this flow.
    fn replied(&self) -> bool {
        self.last_down.load(Relaxed) != 0
    }
}

/// Record a reply at the present moment: milliseconds since `epoch`, never
/// 0, which stands for "never replied".
fn mark_reply(last_down: &AtomicU64, epoch: Instant) {
    let ms = u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
    last_down.store(ms.max(1), Relaxed);
}

impl Drop for Flow {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the datagram path and its flow tasks need.
#[derive(Debug)]
pub(crate) struct UdpEnv {
    /// Rules, outbounds, DNS, statistics.
    pub d: Arc<Dispatcher>,
    /// Where replies are written.
    pub tun: Arc<Tun>,
    /// Direct flows' sockets (bound, marked or protected off the TUN).
    pub factory: SocketFactory,
    pub mtu: u16,
    /// `budget.udp_flows`: the least recently used flow is evicted past it.
    pub max_flows: usize,
    /// `timeouts.udp_idle_s`.
    pub idle: Duration,
    /// `timeouts.udp_unreplied_s`: the idle timeout of a flow that never
    /// saw a reply (at most `idle`).
    pub unreplied: Duration,
    /// Bytes the proxied flows' queues may hold beyond one buffer each.
    pub queues: Arc<ByteBudget>,
}

/// Flow table, owned by the TUN driver task.
#[derive(Debug)]
pub(crate) struct UdpTable {
    flows: HashMap<Key, Flow>,
    shared: Arc<UdpEnv>,
    epoch: Instant,
    /// Flows evicted since the driver last yielded: their reply tasks are
    /// aborted, and each one's socket closes only when the runtime drops
    /// that task ([`UdpTable::take_evicted`]).
    evicted: usize,
    /// Uplink datagrams of one direct flow waiting for one GSO send.
    #[cfg(linux_like)]
    gso: Gso,
}

impl UdpTable {
    pub fn new(shared: Arc<UdpEnv>, now: Instant) -> Self {
        Self {
            flows: HashMap::new(),
            shared,
            epoch: now,
            evicted: 0,
            #[cfg(linux_like)]
            gso: Gso::default(),
        }
    }

    /// Send what the uplink gathered (the driver calls this at the end of
    /// every drain, so a datagram waits at most one drain).
    pub fn flush(&mut self, local: &mut LocalCounters) {
        #[cfg(linux_like)]
        if let Some(refused) = self.gso.flush(local)
            && let Some(f) = self.flows.get_mut(&refused)
        {
            f.gso = false;
        }
        #[cfg(not(linux_like))]
        let _ = local;
    }

    pub fn len(&self) -> usize {
        self.flows.len()
    }

    /// Whether flows were evicted since the last call. Their sockets are
    /// still open until the runtime drops their aborted tasks, which it
    /// does only once the driver yields: a driver that reads on through a
    /// flood without yielding (the device stays readable, so its awaits
    /// return at once until tokio's cooperative budget runs out) would hold
    /// thousands of evicted sockets over a `udp_flows` of a few hundred.
    pub fn take_evicted(&mut self) -> bool {
        std::mem::take(&mut self.evicted) > 0
    }

    /// Send one uplink datagram (`buf` holds the whole IP packet).
    pub fn handle(&mut self, buf: &[u8], ip: &IpInfo, now: Instant, local: &mut LocalCounters) {
        let udp = match packet::parse_udp(buf, ip) {
            Ok(u) => u,
            Err(r) => return local.reject(r),
        };
        // A bad checksum opens no flow and reaches no outbound.
        if let Err(r) = packet::check_datagram(buf, ip, &udp) {
            return local.reject(r);
        }
        let key = (
            SocketAddr::new(ip.src, udp.src_port),
            SocketAddr::new(ip.dst, udp.dst_port),
        );
        let payload = &buf[udp.payload_offset..udp.payload_offset + udp.payload_len];
        if udp.dst_port == 53
            && let Some(dns) = &self.shared.d.dns
            && dns.hijacks(key.1)
        {
            return self.hijack(key, payload, now, local);
        }
        // One lookup per datagram; a second only when the flow is new.
        let flow = match self.flows.get_mut(&key) {
            Some(f) => f,
            None => {
                if !self.open(key, now, local) {
                    return;
                }
                let Some(f) = self.flows.get_mut(&key) else {
                    return;
                };
                f
            }
        };
        flow.last_up = now;
        match &mut flow.io {
            #[cfg(linux_like)]
            FlowIo::Direct(sock) if flow.gso => {
                let fits = udp_room(self.shared.mtu, key.1).1;
                if let Some(refused) = self.gso.push(key, sock, payload, fits, local)
                    && let Some(f) = self.flows.get_mut(&refused)
                {
                    f.gso = false;
                }
            }
            FlowIo::Direct(sock) => {
                send_one(sock, payload, local);
            }
            FlowIo::Queued(q) => {
                let Some(mut buf) = q.buffer(now) else {
                    return local.drop(EngineDrop::UdpQueueFull);
                };
                buf.clear();
                // Exact: a buffer never holds more than the largest payload
                // it carried (at most the MTU it is charged for).
                buf.reserve_exact(payload.len());
                buf.extend_from_slice(payload);
                match q.tx.try_send(buf) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => local.drop(EngineDrop::UdpQueueFull),
                    // The association failed or ended; the flow idles out.
                    Err(mpsc::error::TrySendError::Closed(_)) => {
                        local.drop(EngineDrop::UdpSendError)
                    }
                }
            }
        }
    }

    /// Hand a hijacked query to a task (one copy of the payload; the driver
    /// does not wait). The task is charged its state, the query and the
    /// reply (up to one MTU, held once as the answer and once as the packet
    /// written) against the DNS in-flight budget while it runs.
    fn hijack(&mut self, key: Key, payload: &[u8], now: Instant, local: &mut LocalCounters) {
        let Some(dns) = self.shared.d.dns.clone() else {
            return;
        };
        let charge = match dns.charge_udp_query(payload.len(), self.shared.mtu, now) {
            Ok(c) => c,
            Err(why) => return local.drop(why),
        };
        let answer = answer_hijacked(self.shared.clone(), dns, payload.to_vec(), key, charge);
        let life = self.shared.d.life.clone();
        tokio::spawn(supervised(life, EngineTask::Dns, answer));
    }

    fn open(&mut self, key: Key, now: Instant, local: &mut LocalCounters) -> bool {
        // What is gathered goes out before the table changes (an eviction
        // below may close the flow it belongs to).
        self.flush(local);
        let (client, server) = key;
        let shared = self.shared.clone();
        let outbounds = &shared.d.outbounds;
        // A fake address stands for a domain: route by it, and carry it on.
        let fake = match &shared.d.dns {
            Some(dns) if dns.is_fake(server.ip()) => match dns.fake_domain(server.ip()) {
                Some(d) => Some((dns.clone(), d)),
                None => {
                    local.drop(EngineDrop::FakeIpUnknown);
                    return false;
                }
            },
            _ => None,
        };
        let route = outbounds.route(&match &fake {
            Some((_, d)) => crate::rules::Target::fake_ip(server, d),
            None => crate::rules::Target::ip(server),
        });
        if route == Route::Reject {
            local.drop(EngineDrop::UdpRejected);
            return false;
        }
        if self.flows.len() >= self.shared.max_flows {
            self.evict_oldest();
        }
        let last_down = Arc::new(AtomicU64::new(0));
        let (io, task) = match route {
            Route::Proxy(i) if outbounds.udp_proxied(route) => {
                let (queue, rx, spare_tx) = Queue::new(shared.queues.clone(), shared.mtu);
                let target = match &fake {
                    Some((_, d)) => Address::Domain(d.to_string(), server.port()),
                    None => Address::Ip(server),
                };
                let task = tokio::spawn(proxy_flow(
                    self.shared.clone(),
                    i,
                    client,
                    server,
                    target,
                    rx,
                    spare_tx,
                    last_down.clone(),
                    self.epoch,
                ))
                .abort_handle();
                (FlowIo::Queued(queue), task)
            }
            // Direct to a domain: resolved in the flow's task, so the flow
            // takes the queued path while that happens.
            _ if fake.is_some() => {
                let Some((dns, domain)) = fake else {
                    return false;
                };
                let (queue, rx, spare_tx) = Queue::new(shared.queues.clone(), shared.mtu);
                let task = tokio::spawn(resolved_flow(
                    self.shared.clone(),
                    dns,
                    domain,
                    client,
                    server,
                    rx,
                    spare_tx,
                    last_down.clone(),
                    self.epoch,
                ))
                .abort_handle();
                (FlowIo::Queued(queue), task)
            }
            // Direct, or a proxy configured without UDP.
            _ => {
                let sock = match shared.factory.udp_connected(server) {
                    Ok(s) => Arc::new(s),
                    Err(e) => {
                        local.drop(EngineDrop::UdpOpenFailed);
                        self.shared
                            .d
                            .warn
                            .warn(format_args!("udp flow to {server}: {e}"));
                        return false;
                    }
                };
                let task = tokio::spawn(reply_loop(
                    sock.clone(),
                    self.shared.clone(),
                    client,
                    server,
                    last_down.clone(),
                    self.epoch,
                ))
                .abort_handle();
                (FlowIo::Direct(sock), task)
            }
        };
        self.flows.insert(
            key,
            Flow {
                #[cfg(linux_like)]
                gso: matches!(io, FlowIo::Direct(_)) && crate::sys::udp::gso_supported(),
                io,
                last_up: now,
                last_down,
                task,
            },
        );
        self.shared.d.stats.udp_flows_total.fetch_add(1, Relaxed);
        self.shared.d.stats.udp_flows_active.fetch_add(1, Relaxed);
        true
    }

    /// Eviction when the flow budget is reached: the least recently used
    /// flow that never saw a reply, or, when every flow was answered, the
    /// least recently used of all. O(n) over a bounded table, and only when
    /// a new flow arrives at the limit.
    fn evict_oldest(&mut self) {
        let epoch = self.epoch;
        if let Some(key) = self
            .flows
            .iter()
            .min_by_key(|(_, f)| (f.replied(), f.last_active(epoch)))
            .map(|(k, _)| *k)
        {
            self.flows.remove(&key);
            self.evicted += 1;
            self.shared.d.stats.udp_flows_evicted.fetch_add(1, Relaxed);
            self.shared.d.stats.udp_flows_active.fetch_sub(1, Relaxed);
        }
    }

    /// Close flows idle for longer than their timeout: `unreplied` for a
    /// flow that never saw a reply, `idle` for one that did.
    pub fn sweep(&mut self, now: Instant) {
        let (idle, unreplied) = (self.shared.idle, self.shared.unreplied);
        let epoch = self.epoch;
        let before = self.flows.len();
        self.flows.retain(|_, f| {
            let limit = if f.replied() { idle } else { unreplied };
            now.saturating_duration_since(f.last_active(epoch)) < limit
        });
        let removed = (before - self.flows.len()) as u64;
        if removed > 0 {
            self.shared
                .d
                .stats
                .udp_flows_active
                .fetch_sub(removed, Relaxed);
        }
    }
}

/// One non-blocking `send(2)` of a direct flow's datagram, counted. True
/// if the socket's send buffer was full (the datagram is a counted drop).
fn send_one(sock: &UdpSocket, payload: &[u8], local: &mut LocalCounters) -> bool {
    // A direct non-blocking send(2): tokio's `try_send` consults its cached
    // readiness first and answers WouldBlock on a socket epoll has not yet
    // reported writable, which would drop every flow's first datagram.
    match socket2::SockRef::from(sock).send(payload) {
        Ok(_) => {
            local.udp_packets_up += 1;
            local.udp_bytes_up += payload.len() as u64;
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
            local.drop(EngineDrop::UdpSendFull);
            return true;
        }
        Err(_) => local.drop(EngineDrop::UdpSendError),
    }
    false
}

/// Consecutive uplink datagrams of one direct flow, read in the same TUN
/// drain, gathered back to back for one GSO send (`UDP_SEGMENT`): every
/// datagram but the last has the first one's size, the last may be
/// shorter, at most [`GSO_MAX_SEGMENTS`] and [`GSO_MAX_BYTES`] in all. A
/// datagram of another flow, a longer one, or a full batch sends what is
/// gathered first, so each flow's datagrams keep their order. The kernel
/// then builds one packet for the batch instead of one per datagram, and
/// splits it at the device or in software.
#[cfg(linux_like)]
#[derive(Debug, Default)]
struct Gso {
    /// The payloads (allocated once, at the first batch).
    buf: Vec<u8>,
    key: Option<Key>,
    sock: Option<Arc<UdpSocket>>,
    /// Size of every segment but the last.
    seg: usize,
    count: usize,
    /// A shorter datagram ended the batch.
    closed: bool,
}

#[cfg(linux_like)]
use crate::sys::udp::{GSO_MAX_BYTES, GSO_MAX_SEGMENTS};

#[cfg(linux_like)]
impl Gso {
    /// Gather one datagram of flow `key`; only one whose packet fit the
    /// TUN (`fits`: its payload room) is gathered, a longer one (the app
    /// sent it as fragments) would exceed the path's MTU as a segment.
    /// Returns a flow whose path refused a GSO send while making room (it
    /// sends one by one from then on).
    fn push(
        &mut self,
        key: Key,
        sock: &Arc<UdpSocket>,
        payload: &[u8],
        fits: usize,
        local: &mut LocalCounters,
    ) -> Option<Key> {
        let len = payload.len();
        // Nothing to segment: an empty datagram, or one GSO cannot carry.
        let alone = len == 0 || len > fits.min(GSO_MAX_BYTES);
        let mut refused = None;
        if self.count > 0
            && (alone
                || self.key != Some(key)
                || self.closed
                || len > self.seg
                || self.count == GSO_MAX_SEGMENTS
                || self.buf.len() + len > GSO_MAX_BYTES)
        {
            refused = self.flush(local);
        }
        if alone || refused == Some(key) {
            // Nothing to segment (or this flow just lost GSO): as before.
            send_one(sock, payload, local);
            return refused;
        }
        if self.count == 0 {
            if self.buf.capacity() == 0 {
                self.buf.reserve_exact(GSO_MAX_BYTES);
            }
            self.key = Some(key);
            self.sock = Some(sock.clone());
            self.seg = len;
            self.closed = false;
        } else if len < self.seg {
            self.closed = true;
        }
        self.buf.extend_from_slice(payload);
        self.count += 1;
        refused
    }

    /// Send what is gathered: one datagram plainly, more with one GSO send.
    /// A batch the kernel refuses goes out one datagram at a time, each
    /// counted on its own, so an error loses nothing silently (a send
    /// buffer too full for the whole batch may still take some; once it
    /// takes none, the rest are counted `udp_send_full` without trying).
    /// If the refusal says the path cannot segment (`EIO`: no checksum
    /// offload or IPsec on the route; `EINVAL`: a segment above the path
    /// MTU), the flow is returned to stop gathering.
    fn flush(&mut self, local: &mut LocalCounters) -> Option<Key> {
        let (Some(sock), Some(key)) = (self.sock.take(), self.key.take()) else {
            return None;
        };
        let (count, seg) = (self.count, self.seg);
        self.count = 0;
        let mut refused = None;
        if count == 1 {
            send_one(&sock, &self.buf, local);
        } else {
            match crate::sys::udp::send_gso(sock.as_fd(), &self.buf, seg as u16) {
                Ok(_) => {
                    local.udp_packets_up += count as u64;
                    local.udp_bytes_up += self.buf.len() as u64;
                }
                Err(e) => {
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EIO | libc::EINVAL | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
                    ) {
                        refused = Some(key);
                    }
                    let mut full = false;
                    for d in self.buf.chunks(seg) {
                        if full {
                            local.drop(EngineDrop::UdpSendFull);
                        } else {
                            full = send_one(&sock, d, local);
                        }
                    }
                }
            }
        }
        self.buf.clear();
        refused
    }
}

impl Drop for UdpTable {
    fn drop(&mut self) {
        let n = self.flows.len() as u64;
        self.shared.d.stats.udp_flows_active.fetch_sub(n, Relaxed);
    }
}

/// Reply datagrams up to this size are sent to the app as IP fragments
/// when they do not fit one TUN packet (`packet::frag::fragment_at`; the
/// app's stack reassembles them), larger ones are dropped and counted
/// (`udp_reply_too_big`), never truncated. 16 KiB covers large DNS answers
/// over EDNS0 (4096 is the common buffer size), games, VoIP and tunnels at
/// jumbo sizes, and bounds what one receive takes: a direct flow's buffer
/// while replies arrive (freed when they stop), or on Linux/Android a reply
/// slot with its spill area ([`reply_loop`]).
pub(crate) const FRAGMENTED_REPLY_MAX: usize = 16 * 1024;

/// Identification of the reply datagrams the engine fragments (RFC 6864:
/// unique per source, destination and protocol while fragments may live).
static FRAG_ID: AtomicU32 = AtomicU32::new(1);

/// IP + UDP header bytes for datagrams from `server`, and the payload that
/// still fits one TUN packet of the device MTU (a larger DNS answer is
/// truncated with TC set; a larger reply datagram is fragmented).
fn udp_room(mtu: u16, server: SocketAddr) -> (usize, usize) {
    let hdr = if server.is_ipv6() {
        IPV6_UDP_HEADERS
    } else {
        IPV4_UDP_HEADERS
    };
    (hdr, usize::from(mtu).saturating_sub(hdr))
}

/// Answer one hijacked query and write the answer to the TUN as a datagram
/// from the address the app asked (`key.1`) to the app (`key.0`).
async fn answer_hijacked(
    shared: Arc<UdpEnv>,
    dns: Arc<Dns>,
    query: Vec<u8>,
    (client, server): Key,
    _charge: Charge,
) {
    let (hdr, max_payload) = udp_room(shared.mtu, server);
    let stats: &Stats = &shared.d.stats;
    let Some(reply) = dns.answer_udp(&query, max_payload, stats).await else {
        return;
    };
    let mut b = vec![0u8; HEADROOM + hdr + reply.len()];
    b[HEADROOM + hdr..].copy_from_slice(&reply);
    match packet::write_udp_headers(&mut b[HEADROOM..], server, client, reply.len()) {
        Ok(len) => {
            if shared.tun.send(&mut b, len).await.is_err() {
                stats.drop(EngineDrop::TunWrite);
            }
        }
        Err(r) => {
            stats.rejects[r.index()].fetch_add(1, Relaxed);
        }
    }
}

/// Write the reply of `len` bytes at `b[HEADROOM + header..]` to the app as a
/// datagram from the flow's server to its client, headers written in place.
async fn send_reply(env: &UdpEnv, b: &mut [u8], key: Key, len: usize) {
    if write_reply(env, b, key, len).await {
        let stats: &Stats = &env.d.stats;
        stats.udp_packets_down.fetch_add(1, Relaxed);
        stats.udp_bytes_down.fetch_add(len as u64, Relaxed);
    }
}

/// [`send_reply`] without counting what was delivered: true if it was
/// (every failure is counted here).
async fn write_reply(env: &UdpEnv, b: &mut [u8], (client, server): Key, len: usize) -> bool {
    let stats: &Stats = &env.d.stats;
    let mtu = usize::from(env.mtu);
    match packet::write_udp_headers(&mut b[HEADROOM..], server, client, len) {
        Ok(total) if total <= mtu => {
            // Without waiting first: the device's queue is rarely full.
            let sent = match env.tun.try_send(b, total) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => env.tun.send(b, total).await,
                r => r,
            };
            if sent.is_err() {
                stats.drop(EngineDrop::TunWrite);
            }
            sent.is_ok()
        }
        Ok(total) => {
            // Larger than one TUN packet: as fragments, which the app's
            // stack puts back together. One buffer per such reply.
            let id = FRAG_ID.fetch_add(1, Relaxed);
            let pkt = &b[HEADROOM..HEADROOM + total];
            let mut frag = vec![0u8; HEADROOM + mtu];
            let mut off = 0;
            while let Some((n, next)) =
                packet::frag::fragment_at(pkt, mtu, id, off, &mut frag[HEADROOM..])
            {
                if env.tun.send(&mut frag, n).await.is_err() {
                    stats.drop(EngineDrop::TunWrite);
                    return false;
                }
                off = next;
            }
            if off == 0 {
                // The MTU leaves no room for a fragment (never below 1280).
                stats.drop(EngineDrop::UdpReplyTooBig);
                return false;
            }
            true
        }
        Err(r) => {
            stats.rejects[r.index()].fetch_add(1, Relaxed);
            false
        }
    }
}

/// A direct flow to a fake address: resolve its domain through the DNS
/// service (never the fake pool), connect to the real address, then relay
/// what the driver queues; replies reach the app from the fake address.
#[allow(clippy::too_many_arguments)]
async fn resolved_flow(
    shared: Arc<UdpEnv>,
    dns: Arc<Dns>,
    domain: Arc<str>,
    client: SocketAddr,
    server: SocketAddr,
    mut rx: mpsc::Receiver<Vec<u8>>,
    spare: mpsc::Sender<Vec<u8>>,
    last_down: Arc<AtomicU64>,
    epoch: Instant,
) {
    let stats: &Stats = &shared.d.stats;
    let ip = match dns.resolve(&domain, server.is_ipv6(), stats).await {
        Ok(ip) => ip,
        Err(e) => {
            shared
                .d
                .warn
                .warn(format_args!("udp flow to {domain} ({server}): {e}"));
            return;
        }
    };
    let real = SocketAddr::new(ip, server.port());
    let sock = match shared.factory.udp_connected(real) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            stats.drop(EngineDrop::UdpOpenFailed);
            shared
                .d
                .warn
                .warn(format_args!("udp flow to {domain} ({real}): {e}"));
            return;
        }
    };
    let down = reply_loop(
        sock.clone(),
        shared.clone(),
        client,
        server,
        last_down,
        epoch,
    );
    let up = async {
        while let Some(buf) = rx.recv().await {
            match sock.send(&buf).await {
                Ok(_) => {
                    stats.udp_packets_up.fetch_add(1, Relaxed);
                    stats.udp_bytes_up.fetch_add(buf.len() as u64, Relaxed);
                }
                Err(_) => stats.drop(EngineDrop::UdpSendError),
            }
            let _ = spare.try_send(buf);
        }
    };
    tokio::select! {
        () = down => {}
        () = up => {}
    }
}

/// Receive replies for one flow and write them to the TUN as IP packets from
/// `server` to `client`, up to `sys::udp::RECV_BATCH` (16) datagrams per
/// `recvmmsg(2)`, so one wake-up takes what queued up meanwhile.
///
/// Datagram `i` of a batch lands in slot `i` of the flow's buffer, room for
/// a reply that fits one TUN packet (at most [`SLOT_ROOM_MAX`]) behind space
/// for its headers, written in place. A longer one continues in the
/// thread's spill area ([`SPILL`], [`FRAGMENTED_REPLY_MAX`] per slot with
/// the slot's room), is copied out whole before the next await and goes as
/// fragments; a datagram longer than that is dropped and counted
/// (`MSG_TRUNC`), never passed on cut short. The buffer (16 slots, about
/// 24 KiB at MTU 1500) exists only while replies are arriving.
#[cfg(linux_like)]
async fn reply_loop(
    sock: Arc<UdpSocket>,
    shared: Arc<UdpEnv>,
    client: SocketAddr,
    server: SocketAddr,
    last_down: Arc<AtomicU64>,
    epoch: Instant,
) {
    use crate::sys::udp::{RECV_BATCH, Slots, recv_batch};
    let (hdr, max_payload) = udp_room(shared.mtu, server);
    let room = max_payload.clamp(1, SLOT_ROOM_MAX);
    let stride = HEADROOM + hdr + room;
    let spill_stride = FRAGMENTED_REPLY_MAX - room;
    let stats: &Stats = &shared.d.stats;
    let mut buf: Option<Box<[u8]>> = None;
    let mut got = [(0usize, false); RECV_BATCH];
    loop {
        if sock.readable().await.is_err() {
            return;
        }
        let dense = buf.get_or_insert_with(|| vec![0u8; RECV_BATCH * stride].into_boxed_slice());
        // Receive, and copy out what spilled, within one borrow of the
        // thread's spill area (no await in between).
        let mut spilled: Vec<(usize, Box<[u8]>)> = Vec::new();
        let r = SPILL.with_borrow_mut(|spill| {
            let spill = spill
                .get_or_insert_with(|| vec![0u8; RECV_BATCH * SPILL_STRIDE_MAX].into_boxed_slice());
            let mut slots = Slots {
                dense: &mut dense[..],
                stride,
                start: HEADROOM + hdr,
                room,
                spill: &mut spill[..],
                spill_stride,
            };
            let n = sock.try_io(tokio::io::Interest::READABLE, || {
                recv_batch(sock.as_fd(), &mut slots, &mut got)
            })?;
            for (i, &(len, trunc)) in got.iter().enumerate().take(n) {
                if len > room && !trunc {
                    let mut whole = vec![0u8; HEADROOM + hdr + len].into_boxed_slice();
                    let at = HEADROOM + hdr;
                    whole[at..at + room].copy_from_slice(&dense[i * stride + at..][..room]);
                    whole[at + room..].copy_from_slice(&spill[i * spill_stride..][..len - room]);
                    spilled.push((i, whole));
                }
            }
            Ok::<usize, io::Error>(n)
        });
        match r {
            Ok(n) => {
                mark_reply(&last_down, epoch);
                let (mut packets, mut bytes) = (0u64, 0u64);
                let mut spilled = spilled.into_iter().peekable();
                for (i, &(len, trunc)) in got.iter().enumerate().take(n) {
                    let delivered = if trunc {
                        stats.drop(EngineDrop::UdpReplyTooBig);
                        false
                    } else if len <= room {
                        let b = &mut dense[i * stride..(i + 1) * stride];
                        write_reply(&shared, b, (client, server), len).await
                    } else {
                        match spilled.next_if(|(j, _)| *j == i) {
                            Some((_, mut whole)) => {
                                write_reply(&shared, &mut whole, (client, server), len).await
                            }
                            None => false,
                        }
                    };
                    if delivered {
                        packets += 1;
                        bytes += len as u64;
                    }
                }
                if packets > 0 {
                    stats.udp_packets_down.fetch_add(packets, Relaxed);
                    stats.udp_bytes_down.fetch_add(bytes, Relaxed);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => buf = None,
            // ICMP errors (port unreachable) surface as errors on a connected
            // UDP socket; the flow stays usable.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
}

/// The most room a reply slot of [`reply_loop`] gives a datagram: QUIC's
/// and most UDP traffic's datagrams fit (at MTU 1500 the slot holds what
/// fits one TUN packet); longer ones continue in the spill area.
#[cfg(linux_like)]
const SLOT_ROOM_MAX: usize = 2048;

/// Spill bytes per slot at most: a slot's room and its spill hold
/// [`FRAGMENTED_REPLY_MAX`] together.
#[cfg(linux_like)]
const SPILL_STRIDE_MAX: usize = FRAGMENTED_REPLY_MAX;

#[cfg(linux_like)]
thread_local! {
    /// Where the datagrams of a [`reply_loop`] batch that are longer than
    /// their slot continue: one area per worker thread, used only inside
    /// one synchronous receive (256 KiB, allocated zeroed on first use, so
    /// its pages become resident only once long datagrams arrive).
    static SPILL: std::cell::RefCell<Option<Box<[u8]>>> = const { std::cell::RefCell::new(None) };
}

/// Receive replies for one flow and write them to the TUN as IP packets from
/// `server` to `client`. The buffer exists only while replies are arriving.
#[cfg(not(linux_like))]
async fn reply_loop(
    sock: Arc<UdpSocket>,
    shared: Arc<UdpEnv>,
    client: SocketAddr,
    server: SocketAddr,
    last_down: Arc<AtomicU64>,
    epoch: Instant,
) {
    let (hdr, max_payload) = udp_room(shared.mtu, server);
    let room = max_payload.max(FRAGMENTED_REPLY_MAX);
    let mut buf: Option<Box<[u8]>> = None;
    loop {
        if sock.readable().await.is_err() {
            return;
        }
        let b = buf.get_or_insert_with(|| vec![0u8; HEADROOM + hdr + room].into_boxed_slice());
        // recvmsg, not recv: a datagram longer than the room is dropped and
        // counted, never passed on cut to the room's size.
        let room = &mut b[HEADROOM + hdr..];
        let got = sock.try_io(tokio::io::Interest::READABLE, || {
            crate::sys::recv_datagram(sock.as_fd(), room)
        });
        match got {
            Ok((_, true)) => {
                mark_reply(&last_down, epoch);
                Stats::drop(&shared.d.stats, EngineDrop::UdpReplyTooBig);
            }
            Ok((n, false)) => {
                mark_reply(&last_down, epoch);
                send_reply(&shared, b, (client, server), n).await;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => buf = None,
            // ICMP errors (port unreachable) surface as errors on a connected
            // UDP socket; the flow stays usable.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
}

/// A proxied flow: open the association, then send what the driver queues
/// and turn the proxy's replies into IP packets, until the flow is dropped
/// (the driver aborts the task), the queue closes, or the association ends.
#[allow(clippy::too_many_arguments)]
async fn proxy_flow(
    shared: Arc<UdpEnv>,
    idx: usize,
    client: SocketAddr,
    server: SocketAddr,
    target: Address,
    mut rx: mpsc::Receiver<Vec<u8>>,
    spare: mpsc::Sender<Vec<u8>>,
    last_down: Arc<AtomicU64>,
    epoch: Instant,
) {
    let stats: &Stats = &shared.d.stats;
    let counters = stats.outbounds.get(idx);
    let assoc = match shared.d.outbounds.udp(idx).await {
        Ok(a) => {
            if let Some(c) = counters {
                c.udp_flows.fetch_add(1, Relaxed);
            }
            a
        }
        Err(e) => {
            if let Some(c) = counters {
                if e.is_protocol() {
                    c.protocol_errors.fetch_add(1, Relaxed);
                } else if matches!(e, OutboundError::Resolve { .. }) {
                    c.resolve_failures.fetch_add(1, Relaxed);
                } else {
                    c.udp_failures.fetch_add(1, Relaxed);
                }
            }
            shared.d.warn.warn(format_args!(
                "udp flow to {server} via {}: {e}",
                shared.d.outbounds.name(Route::Proxy(idx))
            ));
            return;
        }
    };
    let ProxyUdp {
        sock,
        control,
        mut codec,
    } = assoc;
    // A domain target is resolved by the proxy: its replies name whatever
    // address that was, so only an IP target pins the source.
    let pinned = match &target {
        Address::Ip(_) => Some(canonical(server)),
        Address::Domain(..) => None,
    };
    let (hdr, max_payload) = udp_room(shared.mtu, server);
    let max_payload = max_payload.max(FRAGMENTED_REPLY_MAX);
    const MAX_DATAGRAM: usize = 65_535;
    // Framing around a reply's payload: at most a SIP022 header with 900
    // bytes of padding, session ids, a domain address (up to 259 bytes) and
    // the AEAD tag, under 2 KiB.
    const MAX_FRAMING: usize = 2 * 1024;
    // Every reply whose payload fits one TUN packet fits here with its
    // framing; a datagram that fills the room was longer, and its payload
    // could not be delivered anyway. So a flow holds about one MTU while
    // replies arrive, not 64 KiB.
    let recv_room = max_payload + MAX_FRAMING + 1;
    let mut wire: Vec<u8> = Vec::new();
    let mut rbuf: Option<Box<[u8]>> = None;
    let control_closed = async {
        let Some(c) = &control else {
            return std::future::pending::<()>().await;
        };
        let mut b = [0u8; 64];
        loop {
            if c.readable().await.is_err() {
                return;
            }
            match c.try_read(&mut b) {
                Ok(0) => return,
                Ok(_) => {} // nothing is expected on it; ignore
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
    };
    tokio::pin!(control_closed);
    loop {
        tokio::select! {
            d = rx.recv() => {
                let Some(buf) = d else { return };
                match codec.encode(&target, &buf, &mut wire) {
                    Ok(()) => match sock.send(&wire).await {
                        Ok(_) => {
                            stats.udp_packets_up.fetch_add(1, Relaxed);
                            stats.udp_bytes_up.fetch_add(buf.len() as u64, Relaxed);
                        }
                        Err(_) => stats.drop(EngineDrop::UdpSendError),
                    },
                    Err(_) => stats.drop(EngineDrop::UdpSendError),
                }
                // Hand the buffer back for the next datagram (the driver
                // allocates only while fewer than QUEUE_DEPTH exist).
                let _ = spare.try_send(buf);
                if wire.capacity() > MAX_DATAGRAM * 2 {
                    wire = Vec::new();
                }
            }
            r = sock.readable() => {
                if r.is_err() {
                    return;
                }
                let b = rbuf.get_or_insert_with(|| vec![0u8; HEADROOM + hdr + recv_room].into_boxed_slice());
                let start = HEADROOM + hdr;
                match sock.try_recv(&mut b[start..]) {
                    Ok(n) if n == recv_room => {
                        last_down.store(epoch.elapsed().as_millis() as u64, Relaxed);
                        stats.drop(EngineDrop::UdpProxyReply);
                    }
                    Ok(n) => {
                        let (from, range) = match codec.decode(&mut b[start..start + n]) {
                            Ok(v) => v,
                            Err(e) => {
                                if e.is_protocol() && let Some(c) = counters {
                                    c.protocol_errors.fetch_add(1, Relaxed);
                                }
                                stats.drop(EngineDrop::UdpProxyReply);
                                continue;
                            }
                        };
                        // Like a connected socket: only the flow's server answers.
                        if let Some(p) = pinned
                            && from.canonical_ip().is_some_and(|a| a != p)
                        {
                            stats.drop(EngineDrop::UdpProxyReply);
                            continue;
                        }
                        mark_reply(&last_down, epoch);
                        let len = range.len();
                        if len > max_payload {
                            stats.drop(EngineDrop::UdpReplyTooBig);
                            continue;
                        }
                        b.copy_within(start + range.start..start + range.end, start);
                        send_reply(&shared, b, (client, server), len).await;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => rbuf = None,
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::ConnectionRefused | io::ErrorKind::Interrupted
                        ) => {}
                    Err(_) => return,
                }
            }
            _ = &mut control_closed => return,
        }
    }
}

fn canonical(a: SocketAddr) -> SocketAddr {
    Address::Ip(a).canonical_ip().unwrap_or(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{MemoryPressure, Pressure};

    /// A receiving socket on loopback and a connected tokio socket to it.
    #[cfg(linux_like)]
    fn pair(v6: bool) -> (Arc<UdpSocket>, std::net::UdpSocket) {
        let any = if v6 { "[::1]:0" } else { "127.0.0.1:0" };
        let rx = std::net::UdpSocket::bind(any).expect("bind");
        rx.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        let tx = std::net::UdpSocket::bind(any).expect("bind");
        tx.connect(rx.local_addr().expect("addr")).expect("connect");
        tx.set_nonblocking(true).expect("nonblocking");
        (Arc::new(UdpSocket::from_std(tx).expect("tokio")), rx)
    }

    #[cfg(linux_like)]
    fn datagram(i: usize, len: usize) -> Vec<u8> {
        (0..len)
            .map(|k| (i * 131 + k * 3 + k / 253) as u8)
            .collect()
    }

    #[cfg(linux_like)]
    fn key(v6: bool, port: u16) -> Key {
        let ip: std::net::IpAddr = if v6 {
            "fd00::9".parse()
        } else {
            "10.0.0.9".parse()
        }
        .expect("static");
        (SocketAddr::new(ip, port), SocketAddr::new(ip, 53))
    }

    /// Gathered uplink datagrams of two flows, interleaved, with runs of
    /// equal sizes, a short last segment, a longer one (ends a batch), an
    /// empty one and more than one batch holds (64): each flow's receiver
    /// gets every datagram whole and in order, v4 and v6, all counted sent.
    #[cfg(linux_like)]
    #[tokio::test]
    async fn gathered_datagrams_leave_whole_in_order_and_counted() {
        for v6 in [false, true] {
            let (a, rx_a) = pair(v6);
            let (b, rx_b) = pair(v6);
            let (ka, kb) = (key(v6, 1000), key(v6, 2000));
            let mut plan: Vec<(bool, usize)> = Vec::new();
            plan.extend(std::iter::repeat_n((true, 1200), 5));
            plan.extend([(true, 600), (true, 1200), (false, 1200), (false, 1200)]);
            plan.extend([(true, 1200), (true, 0), (true, 1)]);
            plan.extend(std::iter::repeat_n((true, 1000), 70));
            plan.extend([(true, 1300), (true, 1300), (false, 7)]);
            // Longer than one TUN packet: sent alone, in its place.
            plan.extend([(true, 1200), (true, 3000), (true, 1200), (true, 1200)]);
            let mut local = LocalCounters::new(Instant::now());
            let mut g = Gso::default();
            let mut sent = (Vec::new(), Vec::new());
            for (i, &(to_a, len)) in plan.iter().enumerate() {
                let d = datagram(i, len);
                let (k, s) = if to_a { (ka, &a) } else { (kb, &b) };
                assert_eq!(g.push(k, s, &d, 1472, &mut local), None);
                if to_a { &mut sent.0 } else { &mut sent.1 }.push(d);
            }
            assert_eq!(g.flush(&mut local), None);
            let mut buf = vec![0u8; 65536];
            for (rx, want) in [(&rx_a, &sent.0), (&rx_b, &sent.1)] {
                for (i, w) in want.iter().enumerate() {
                    let n = rx.recv(&mut buf).expect("datagram");
                    assert_eq!(&buf[..n], &w[..], "v6 {v6}: datagram {i}");
                }
            }
            assert_eq!(local.udp_packets_up, plan.len() as u64);
            let bytes: usize = plan.iter().map(|p| p.1).sum();
            assert_eq!(local.udp_bytes_up, bytes as u64);
            assert!(local.drops.iter().all(|&d| d == 0), "{:?}", local.drops);
            // A run of one flow left as one packet: a receiver with UDP_GRO
            // gets it whole, with the segment size, in one read.
            let (c, rx_c) = pair(v6);
            crate::sys::udp::testing::set_gro(rx_c.as_fd()).expect("UDP_GRO");
            let run: Vec<Vec<u8>> = (0..11)
                .map(|i| datagram(i, if i < 10 { 1200 } else { 500 }))
                .collect();
            for d in &run {
                assert_eq!(g.push(key(v6, 3000), &c, d, 1472, &mut local), None);
            }
            g.flush(&mut local);
            let (n, seg) =
                crate::sys::udp::testing::recv_gro(rx_c.as_fd(), &mut buf).expect("batch");
            assert_eq!((n, seg), (12_500, Some(1200)), "v6 {v6}");
            assert_eq!(&buf[..n], &run.concat()[..]);
        }
    }

    /// A batch the kernel refuses (here: a socket without UDP checksums,
    /// which GSO needs) goes out one datagram at a time, nothing lost and
    /// each counted, and the flow is named so it stops gathering. A send
    /// buffer too small for the whole batch takes it one by one too.
    #[cfg(linux_like)]
    #[tokio::test]
    async fn a_refused_batch_goes_one_by_one_counted() {
        let sizes: Vec<usize> = std::iter::repeat_n(1200, 8).chain([100]).collect();
        let k = key(false, 1000);
        let mut buf = vec![0u8; 65536];
        for small_buffer in [false, true] {
            let (s, rx) = pair(false);
            if small_buffer {
                // The kernel's minimum (about 4.5 KiB): 9 datagrams do not fit at once.
                socket2::SockRef::from(&*s)
                    .set_send_buffer_size(1)
                    .expect("sndbuf");
            } else {
                crate::sys::udp::testing::set_no_check(s.as_fd()).expect("SO_NO_CHECK");
            }
            let mut local = LocalCounters::new(Instant::now());
            let mut g = Gso::default();
            for (i, &l) in sizes.iter().enumerate() {
                assert_eq!(g.push(k, &s, &datagram(i, l), 1472, &mut local), None);
            }
            let refused = g.flush(&mut local);
            assert_eq!(
                refused,
                (!small_buffer).then_some(k),
                "small {small_buffer}"
            );
            for (i, &l) in sizes.iter().enumerate() {
                let n = rx.recv(&mut buf).expect("datagram");
                assert_eq!(&buf[..n], &datagram(i, l)[..], "small {small_buffer}: {i}");
            }
            assert_eq!(local.udp_packets_up, sizes.len() as u64);
            assert!(local.drops.iter().all(|&d| d == 0), "{:?}", local.drops);
        }
    }

    /// Proxied flows that never drain: each gets its first buffer, the
    /// buffers past it come out of the byte budget, and a closed flow gives
    /// its bytes back. Raised pressure shrinks what new buffers may take.
    /// (Each flow used to fill all 16 buffers, whatever the flow count.)
    #[test]
    fn proxied_queues_stay_within_their_byte_budget() {
        const MTU: u16 = 1500;
        let unit = usize::from(MTU);
        let now = Instant::now();
        let pressure = Arc::new(Pressure::default());
        let budget = Arc::new(ByteBudget::new(10 * unit, pressure.clone()));
        let mut flows: Vec<_> = (0..4).map(|_| Queue::new(budget.clone(), MTU)).collect();
        let mut made = Vec::new();
        for (q, _, _) in &mut flows {
            let mut n = 0;
            while let Some(b) = q.buffer(now) {
                n += 1;
                assert!(n <= QUEUE_DEPTH);
                drop(b);
            }
            made.push(n);
        }
        assert_eq!(made, [11, 1, 1, 1], "one each, ten from the budget");
        assert_eq!(budget.used(), 10 * unit);
        // A buffer the task hands back is reused without a charge.
        let (q, _, spare) = &mut flows[1];
        spare.try_send(Vec::with_capacity(unit)).expect("room");
        assert!(q.buffer(now).is_some());
        assert!(q.buffer(now).is_none());
        // Critical pressure: a quarter of the budget for new buffers.
        pressure.report(MemoryPressure::Critical, now);
        drop(flows.remove(0));
        assert_eq!(budget.used(), 0, "a closed flow gives its bytes back");
        let (q, _, _) = &mut flows[0];
        let mut n = 0;
        while q.buffer(now).is_some() {
            n += 1;
        }
        assert_eq!(n, 10 * unit / 4 / unit, "a quarter of the budget");
        assert!(budget.used() <= 10 * unit / 4);
    }
}
