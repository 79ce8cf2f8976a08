//! kerntun's DNS service: queries to port 53 of the hijacked addresses are
//! answered here (from the cache, the fake-ip pool, or an upstream reached
//! through the outbound the rules choose) instead of being relayed as
//! ordinary flows. docs/dns.md describes the configuration and behaviour.
//!
//! Every hijacked query gets an answer: a packet that is not a query at all
//! is dropped (counted as malformed), and so is a query that finds the
//! in-flight byte budget spent (counted as `dns_queue_full`; the client's
//! resolver retries) or is longer than `msg::MAX_QUERY` (4 KiB, counted
//! as `dns_query_too_long`); a query with more than one question and an
//! OPT gets FORMERR from its header (counted as `refused`); when every
//! upstream fails the client hears SERVFAIL within the sum of the per-try
//! timeouts.
//!
//! Memory: the cache is bounded in bytes ([`cache`]), and every query being
//! answered and every upstream exchange holds a charge against the
//! in-flight byte budget while it lasts, taken before the query's bytes
//! are copied or read: over UDP by the driver ([`Dns::charge_udp_query`]),
//! over TCP by [`Dns::serve_tcp`] once the length prefix is in, which also
//! charges each reply while it is written. So an asker that waits for
//! another's identical question (asked upstream once) is charged like any
//! other.

mod cache;
mod config;
mod fakeip;
/// The `dns` fuzz target's entry point (`cargo fuzz` builds with
/// `--cfg fuzzing`), not part of the API.
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing;
mod upstream;

use crate::dnswire::frame::{self, Frame};
use crate::dnswire::msg;
pub use crate::dnswire::{Upstream, UpstreamProto};
pub use config::{
    DnsConfig, DnsConfigError, DnsStrategy, PLATFORM_UPSTREAM, UpstreamEntry, default_resolver,
};

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, Query};
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::budget::{ByteBudget, Charge};
use crate::outbound::Outbounds;
use crate::relay::{self, Side};
use crate::stats::{EngineDrop, Stats};
use cache::Cache;
use fakeip::FakePool;
use msg::{BadReply, Incoming};
use upstream::ExchangeError;

/// TTL of fake-ip answers: short, so a client asks again (and refreshes the
/// domain's place in the pool) rather than holding an address that may have
/// gone to another domain.
const FAKE_TTL: u32 = 1;
/// A DNS-over-TCP client connection that sends nothing for this long is
/// closed (RFC 7766 section 6.2.3 recommends seconds, not minutes, for a
/// server under load).
const TCP_IDLE: Duration = Duration::from_secs(10);

/// What a hijacked query holds while it is answered, besides the query and
/// the reply (charged at their size): its task and the lookup's state
/// (decoded query and reply messages, a few hundred bytes to a few KiB).
pub(crate) const QUERY_STATE: usize = 4 * 1024;
/// What one upstream exchange over UDP holds while it waits: the socket,
/// the encoded query, the future's state. The receive buffer (the largest
/// datagram, 64 KiB) exists only for the one non-blocking receive after the
/// socket is readable, never across an await.
pub(crate) const UDP_EXCHANGE: usize = 4 * 1024;
/// What one exchange over TCP or TLS holds: the stream, the reply frame
/// being read (at most 65 535 bytes, the length prefix is 16 bits), and for
/// TLS the session's record buffers (two 16 KiB records).
pub(crate) const STREAM_EXCHANGE: usize = 4 * 1024 + 65_535 + 2 * 16 * 1024;

/// An upstream outcome shared with the askers that waited for it.
type Shared = Result<(Arc<Message>, Arc<[u8]>), DnsError>;

/// The DNS service of one engine.
pub struct Dns {
    outbounds: Arc<Outbounds>,
    upstreams: Vec<UpstreamEntry>,
    /// What a `"platform"` entry stands for: the usable DNS servers of the
    /// network the host reported last ([`Dns::set_platform`]), empty until
    /// it reports some. Read once per upstream round, never per packet.
    platform: Mutex<Arc<[Upstream]>>,
    /// Time allowed to one upstream try.
    timeout: Duration,
    hijack: Vec<IpAddr>,
    hijack_all: bool,
    /// `dns.reset_dot`.
    reset_dot: bool,
    /// The family A/AAAA queries are answered empty for (`Some(true)`:
    /// AAAA), from `dns.strategy` and the TUN's families.
    empty_family: Option<bool>,
    cache: Cache,
    /// Bytes the cache may hold (shrinks with memory pressure).
    cache_bytes: Arc<ByteBudget>,
    /// Bytes queries being answered and upstream exchanges may hold.
    in_flight: Arc<ByteBudget>,
    /// Bytes the fake-ip pool may hold (shrinks with memory pressure).
    fake_bytes: Arc<ByteBudget>,
    /// Questions being asked upstream: later askers wait on the channel.
    pending: Mutex<HashMap<cache::Key, watch::Receiver<Option<Shared>>>>,
    /// Shared with the service a reload replaces this one with, when the
    /// ranges stay ([`Dns::carry_over`]).
    fake: Option<Arc<FakePool>>,
    /// The pool's ranges and size, as configured.
    fake_shape: Option<(ipnet::Ipv4Net, Option<ipnet::Ipv6Net>, usize)>,
    /// Lower-case, without trailing dots.
    filter: Vec<Box<str>>,
    tls: Option<upstream::Tls>,
}

impl std::fmt::Debug for Dns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dns")
            .field("upstreams", &self.upstreams)
            .field("timeout", &self.timeout)
            .field("hijack", &self.hijack)
            .field("hijack_all", &self.hijack_all)
            .field("fake_ip", &self.fake.is_some())
            .finish_non_exhaustive()
    }
}

/// Why a domain could not be resolved.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum DnsError {
    /// Every upstream failed, timed out or was rejected by the rules.
    #[error("no upstream answered")]
    Upstream,
    /// The upstreams answered, without an address of the family asked for.
    #[error("no address in the answer")]
    NoAddress,
    /// Not a domain name.
    #[error("not a valid domain name")]
    BadName,
    /// The in-flight byte budget is spent (counted as `dns_queue_full`).
    #[error("too many DNS queries in flight")]
    Busy,
}

/// An answer found in the cache or fetched.
enum Found {
    Cached(Message, u32),
    /// The decoded reply and its wire form (ID still the upstream one).
    Fresh(Arc<Message>, Vec<u8>),
}

/// Whose turn it is to ask upstream.
enum Turn<'a> {
    /// Nobody asks this question yet: ask, then tell the waiters.
    Lead(Lead<'a>),
    /// Someone does: wait for the outcome.
    Follow(watch::Receiver<Option<Shared>>),
}

/// The asker of a question in flight; its entry leaves the pending map
/// when it is done or dropped (a cancelled lookup: the waiters then ask
/// themselves).
struct Lead<'a> {
    dns: &'a Dns,
    key: cache::Key,
    tx: watch::Sender<Option<Shared>>,
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        let mut pending = self.dns.pending.lock();
        if pending
            .get(&self.key)
            .is_some_and(|rx| rx.same_channel(&self.tx.subscribe()))
        {
            pending.remove(&self.key);
        }
    }
}

impl Found {
    fn msg(&self) -> &Message {
        match self {
            Found::Cached(m, _) => m,
            Found::Fresh(m, _) => m,
        }
    }
}

/// A random query ID for an upstream (RFC 5452: an unpredictable ID is half
/// of what keeps off-path spoofing out). hickory draws it from a seeded
/// RNG when it makes a query.
fn random_id() -> u16 {
    Message::query().metadata.id
}

impl Dns {
    /// The service, or `None` when `[dns]` is off. `c` has passed
    /// [`DnsConfig::validate`]; `tun_nets` are the TUN's prefixes (the
    /// default hijack addresses come from them).
    /// `cache_bytes`, `in_flight` and `fake_bytes` are the service's
    /// memory budgets.
    pub fn new(
        c: &DnsConfig,
        tun_nets: &[ipnet::IpNet],
        outbounds: Arc<Outbounds>,
        cache_bytes: Arc<ByteBudget>,
        in_flight: Arc<ByteBudget>,
        fake_bytes: Arc<ByteBudget>,
    ) -> Result<Option<Arc<Self>>, DnsConfigError> {
        if !c.enabled {
            return Ok(None);
        }
        let upstreams = c.upstream_entries()?;
        let hijack = if c.hijack.is_empty() {
            tun_nets
                .iter()
                .copied()
                .filter_map(config::default_resolver)
                .collect()
        } else {
            c.hijack.clone()
        };
        let fake_shape = c
            .fake_ip
            .then_some((c.fake_ip_pool, c.fake_ip_pool6, c.fake_ip_entries));
        let fake = fake_shape.map(|(v4, v6, n)| Arc::new(FakePool::new(v4, v6, n)));
        let filter = c
            .fake_ip_filter
            .iter()
            .map(|d| {
                d.trim_end_matches('.')
                    .to_ascii_lowercase()
                    .into_boxed_str()
            })
            .collect();
        let tls = if upstreams
            .iter()
            .any(|u| matches!(u, UpstreamEntry::Server(s) if s.proto.over_tls()))
        {
            Some(tls_connector(c)?)
        } else {
            None
        };
        let tun_v6 = tun_nets.iter().any(|n| matches!(n, ipnet::IpNet::V6(_)));
        Ok(Some(Arc::new(Dns {
            outbounds,
            upstreams,
            platform: Mutex::new(Arc::from([])),
            timeout: Duration::from_millis(c.timeout_ms.max(1)),
            hijack,
            hijack_all: c.hijack_all,
            reset_dot: c.reset_dot,
            empty_family: c.strategy.empty_family(tun_v6),
            cache: Cache::new(c.cache_entries),
            cache_bytes,
            in_flight,
            fake_bytes,
            pending: Mutex::new(HashMap::new()),
            fake,
            fake_shape,
            filter,
            tls,
        })))
    }

    /// Whether port-53 traffic to `dst` is answered here.
    #[inline]
    pub fn hijacks(&self, dst: SocketAddr) -> bool {
        dst.port() == 53 && (self.hijack_all || self.hijack.contains(&dst.ip()))
    }

    /// Whether a TCP connection to `dst` is DNS over TLS to a hijacked
    /// address, to be reset (`dns.reset_dot`). Only the hijacked addresses
    /// themselves, also with `hijack_all`: a resolver configured with a
    /// server of its own (Private DNS with a host name) does not fall back,
    /// so resetting it would only break it.
    #[inline]
    pub fn resets_dot(&self, dst: SocketAddr) -> bool {
        self.reset_dot && dst.port() == 853 && self.hijack.contains(&dst.ip())
    }

    /// The answer to one hijacked query; `None` for a packet that is not a
    /// DNS query (counted as malformed) or when the in-flight budget is
    /// spent (counted as `dns_queue_full`).
    pub async fn answer(&self, query: &[u8], stats: &Stats) -> Option<Vec<u8>> {
        self.answer_limited(query, stats).await.map(|(r, _)| r)
    }

    /// [`Dns::answer`] for a UDP client: a reply longer than the client can
    /// take (its EDNS size or 512 bytes, and `path_max`) is truncated with
    /// TC set, so the client asks again over TCP.
    pub async fn answer_udp(
        &self,
        query: &[u8],
        path_max: usize,
        stats: &Stats,
    ) -> Option<Vec<u8>> {
        let (r, limit) = self.answer_limited(query, stats).await?;
        if r.len() <= limit.min(path_max) {
            return Some(r);
        }
        msg::truncate(&r).filter(|t| t.len() <= path_max)
    }

    async fn answer_limited(&self, query: &[u8], stats: &Stats) -> Option<(Vec<u8>, usize)> {
        let d = &stats.dns;
        let Some(incoming) = msg::parse_query(query) else {
            d.malformed.fetch_add(1, Relaxed);
            return None;
        };
        d.queries.fetch_add(1, Relaxed);
        let q = match incoming {
            Incoming::Refuse(r) => {
                d.refused.fetch_add(1, Relaxed);
                return Some((r, msg::UDP_PLAIN_MAX));
            }
            Incoming::Query(q) => q,
        };
        let limit = msg::udp_limit(&q);
        let qq = msg::question(&q)?;
        // A family `dns.strategy` leaves out: no records, before fake-ip,
        // the cache or an upstream is asked.
        if let Some(v6) = msg::is_address_query(qq)
            && self.empty_family == Some(v6)
        {
            d.strategy_empty.fetch_add(1, Relaxed);
            return Some((msg::no_records(&q), limit));
        }
        if let (Some(pool), Some(v6)) = (&self.fake, msg::is_address_query(qq)) {
            let name = msg::key_name(&qq.name);
            let domain = name.trim_end_matches('.');
            if !domain.is_empty() && !self.filtered(domain) {
                let now = Instant::now();
                // No address free (every one held or in its grace period):
                // the real answer, as for a filtered domain.
                match pool.assign(domain, now, self.fake_bytes.limit(now), d) {
                    Some((a4, a6)) => {
                        d.fakeip_answers.fetch_add(1, Relaxed);
                        let addr = if v6 {
                            a6.map(IpAddr::V6)
                        } else {
                            Some(IpAddr::V4(a4))
                        };
                        return Some((msg::fake_answer(&q, addr, FAKE_TTL), limit));
                    }
                    None => {
                        d.fakeip_fallbacks.fetch_add(1, Relaxed);
                    }
                }
            }
        }
        let reply = match self.lookup(&q, qq, stats).await {
            Ok(Found::Cached(m, age)) => msg::from_cache(&m, &q, age),
            Ok(Found::Fresh(_, mut raw)) => {
                // The upstream saw our ID; the client gets its own back.
                raw[..2].copy_from_slice(&q.metadata.id.to_be_bytes());
                raw
            }
            Err(DnsError::Busy) => return None,
            Err(_) => {
                d.servfail.fetch_add(1, Relaxed);
                msg::servfail(&q)
            }
        };
        Some((reply, limit))
    }

    /// Whether `domain` (or a parent of it) is on the fake-ip filter list.
    fn filtered(&self, domain: &str) -> bool {
        self.filter.iter().any(|f| {
            domain == &**f
                || (domain.len() > f.len()
                    && domain.ends_with(&**f)
                    && domain.as_bytes()[domain.len() - f.len() - 1] == b'.')
        })
    }

    /// DNS over TCP (RFC 7766) on a hijacked connection: length-prefixed
    /// queries answered one after the other, until EOF, a malformed query,
    /// or [`TCP_IDLE`] without one.
    /// Generic over the app's side of the connection: a kernel socket
    /// (system stack) or a smoltcp socket.
    ///
    /// The framing is `frame::decode`'s, read exactly as far as it asks, so
    /// no byte past the current frame is read. A prefix announcing more
    /// than `msg::MAX_QUERY` closes the connection with the message unread
    /// (`dns_query_too_long`). Otherwise the query's state and length are
    /// charged to the in-flight budget before its buffer exists, and its
    /// reply while it is written; without room the connection closes
    /// (`dns_queue_full`). Between queries the connection holds no buffer.
    pub(crate) async fn serve_tcp<S: Side>(
        &self,
        stream: &S,
        stats: &Stats,
    ) -> std::io::Result<()> {
        let mut buf = Vec::new();
        let mut query: Option<Charge> = None;
        loop {
            let n = match frame::decode(&buf, msg::MAX_QUERY) {
                Frame::TooLong(_) => {
                    stats.drop(EngineDrop::DnsQueryTooLong);
                    return Ok(());
                }
                Frame::Need(n) => n,
                Frame::Message(len) => {
                    stats.dns.tcp_queries.fetch_add(1, Relaxed);
                    let answered = self
                        .answer(&buf[frame::PREFIX..frame::PREFIX + len], stats)
                        .await;
                    buf = Vec::new();
                    drop(query.take());
                    let Some(r) = answered else {
                        return Ok(());
                    };
                    let Some(reply) = crate::dnswire::length_prefixed(&r).ok().or_else(|| {
                        msg::truncate(&r).and_then(|t| crate::dnswire::length_prefixed(&t).ok())
                    }) else {
                        return Ok(());
                    };
                    drop(r);
                    let Some(_writing) = self.charge(reply.len(), stats) else {
                        return Ok(());
                    };
                    stream.write_all(&reply).await?;
                    continue;
                }
            };
            let at = buf.len();
            if at == frame::PREFIX {
                // The prefix is in: charge the message before reading it.
                query = self.charge(QUERY_STATE + frame::PREFIX + n, stats);
                if query.is_none() {
                    return Ok(());
                }
                buf.reserve_exact(n);
            }
            buf.resize(at + n, 0);
            match tokio::time::timeout(TCP_IDLE, relay::read_exact(stream, &mut buf[at..])).await {
                Err(_) => return Ok(()),
                // EOF between queries ends the connection cleanly; inside a
                // message it is the peer's error.
                Ok(Err(e))
                    if e.kind() == std::io::ErrorKind::UnexpectedEof && at < frame::PREFIX =>
                {
                    return Ok(());
                }
                Ok(r) => r.map(drop)?,
            }
        }
    }

    /// The in-flight charge of one hijacked UDP query of `len` bytes, taken
    /// by the driver before it copies the query into a task: its state, the
    /// query and the reply (up to one MTU of `mtu`, held once as the answer
    /// and once as the packet written). `Err` is the drop to count: a query
    /// longer than `msg::MAX_QUERY` (never copied), or no room.
    pub(crate) fn charge_udp_query(
        &self,
        len: usize,
        mtu: u16,
        now: Instant,
    ) -> Result<Charge, EngineDrop> {
        if len > msg::MAX_QUERY {
            return Err(EngineDrop::DnsQueryTooLong);
        }
        let cost = QUERY_STATE + len + 2 * usize::from(mtu);
        self.in_flight
            .try_charge(cost, now)
            .ok_or(EngineDrop::DnsQueueFull)
    }

    /// Whether `ip` lies in the fake-ip pool (held by a domain or not).
    pub fn is_fake(&self, ip: IpAddr) -> bool {
        self.fake.as_ref().is_some_and(|p| p.contains(ip))
    }

    /// The domain a fake address stands for (refreshing its place in the
    /// pool's recency order). A short lock, no await: cheap enough for the
    /// SYN path.
    pub fn fake_domain(&self, ip: IpAddr) -> Option<Arc<str>> {
        self.fake.as_ref()?.domain(ip, Instant::now())
    }

    /// Resolve a domain through the cache and the upstreams (never the fake
    /// pool): the first address of the family asked for.
    pub async fn resolve(&self, domain: &str, v6: bool, stats: &Stats) -> Result<IpAddr, DnsError> {
        let q = msg::build_query(domain, v6).ok_or(DnsError::BadName)?;
        let qq = msg::question(&q).ok_or(DnsError::BadName)?;
        let found = self.lookup(&q, qq, stats).await?;
        msg::addresses(found.msg(), v6)
            .next()
            .ok_or(DnsError::NoAddress)
    }

    /// The in-flight byte budget.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> &Arc<ByteBudget> {
        &self.in_flight
    }

    /// Evict cached answers and fake-ip domains down to the byte limits in
    /// force at `now` (the host raised the memory pressure).
    pub fn trim(&self, now: Instant, stats: &Stats) {
        self.cache.trim(self.cache_bytes.limit(now));
        if let Some(pool) = &self.fake {
            pool.trim(self.fake_bytes.limit(now), now, &stats.dns);
        }
    }

    /// Forget every cached answer (the network moved: answers learned on
    /// the old one, a captive portal's or a local resolver's, may not hold
    /// on the new one). The fake-ip pool stays: apps hold its addresses.
    pub fn forget_answers(&self) {
        self.cache.trim(0);
    }

    /// A reload replaces `old` with this service (just built, not yet
    /// shared): the fake-ip pool is `old`'s when its ranges and size are
    /// unchanged, so the fake addresses apps cached keep their domains
    /// (true then); the network's DNS servers the host reported carry over
    /// too. The answer cache starts empty (the upstreams may differ).
    pub(crate) fn carry_over(this: &mut Arc<Dns>, old: &Dns) -> bool {
        let Some(new) = Arc::get_mut(this) else {
            return false;
        };
        *new.platform.lock() = old.platform.lock().clone();
        let same = new.fake_shape.is_some() && new.fake_shape == old.fake_shape;
        if same {
            new.fake = old.fake.clone();
        }
        same
    }

    /// The host reported a network whose DNS servers are `servers`
    /// (`Engine::network_changed`): a `"platform"` upstream asks them from
    /// now on, each over UDP port 53, in the order given. Those no socket
    /// here can reach are left out, as for proxy names
    /// (`outbound::resolve::usable_platform_server`); with none left the
    /// entry yields nothing until the next report.
    pub fn set_platform(&self, servers: &[IpAddr]) {
        let list: Arc<[Upstream]> = servers
            .iter()
            .filter(|ip| crate::outbound::resolve::usable_platform_server(**ip))
            .map(|ip| Upstream {
                proto: UpstreamProto::Udp,
                addr: SocketAddr::new(*ip, 53),
                server_name: None,
                path: None,
            })
            .collect();
        *self.platform.lock() = list;
    }

    /// The cache, else the upstreams. A question already being asked
    /// upstream is not asked again: this lookup waits for that one's
    /// outcome (and asks itself only if that lookup was cancelled).
    async fn lookup(&self, q: &Message, qq: &Query, stats: &Stats) -> Result<Found, DnsError> {
        let key: cache::Key = (
            msg::key_name(&qq.name).into_boxed_str(),
            u16::from(qq.query_type),
            u16::from(qq.query_class),
        );
        // Twice at most: a leader cancelled under us hands the turn over once.
        for _ in 0..2 {
            if let Some((wire, age)) = self.cache.get(&key, Instant::now())
                && let Ok(m) = Message::from_vec(&wire)
            {
                stats.dns.cache_hits.fetch_add(1, Relaxed);
                return Ok(Found::Cached(m, age));
            }
            match self.turn(&key) {
                Turn::Follow(mut rx) => {
                    let Ok(outcome) = rx.wait_for(Option::is_some).await else {
                        continue;
                    };
                    let shared = outcome.clone().unwrap_or(Err(DnsError::Upstream));
                    drop(outcome);
                    return shared.map(|(m, raw)| Found::Fresh(m, raw.to_vec()));
                }
                Turn::Lead(lead) => {
                    let r = self.ask_upstreams(q, qq, key, stats).await;
                    let shared = match &r {
                        Ok((m, raw)) => Ok((m.clone(), Arc::from(raw.as_slice()))),
                        Err(e) => Err(e.clone()),
                    };
                    lead.tx.send_replace(Some(shared));
                    return r.map(|(m, raw)| Found::Fresh(m, raw));
                }
            }
        }
        Err(DnsError::Upstream)
    }

    /// Join the question in flight for `key`, or become its asker.
    fn turn(&self, key: &cache::Key) -> Turn<'_> {
        let mut pending = self.pending.lock();
        if let Some(rx) = pending.get(key)
            && rx.has_changed().is_ok()
        {
            return Turn::Follow(rx.clone());
        }
        let (tx, rx) = watch::channel(None);
        pending.insert(key.clone(), rx);
        Turn::Lead(Lead {
            dns: self,
            key: key.clone(),
            tx,
        })
    }

    /// The upstreams in order (each try bounded by the timeout and charged
    /// against the in-flight budget); a cacheable reply is stored. A
    /// `"platform"` entry is each of the network's servers in turn, or,
    /// before the host reported any, nothing (counted
    /// `platform_unavailable`): the next entry is asked.
    async fn ask_upstreams(
        &self,
        q: &Message,
        qq: &Query,
        key: cache::Key,
        stats: &Stats,
    ) -> Result<(Arc<Message>, Vec<u8>), DnsError> {
        let mut up_q = q.clone();
        for entry in &self.upstreams {
            let platform: Arc<[Upstream]>;
            let (ups, direct): (&[Upstream], bool) = match entry {
                UpstreamEntry::Server(up) => (std::slice::from_ref(up), false),
                UpstreamEntry::Platform => {
                    platform = self.platform.lock().clone();
                    if platform.is_empty() {
                        stats.dns.platform_unavailable.fetch_add(1, Relaxed);
                        tracing::debug!("dns upstream \"platform\": no server reported");
                    }
                    (&platform, true)
                }
            };
            for up in ups {
                let id = random_id();
                up_q.metadata.id = id;
                let Ok(wire) = up_q.to_vec() else {
                    return Err(DnsError::BadName);
                };
                let cost = match up.proto {
                    UpstreamProto::Udp => UDP_EXCHANGE,
                    UpstreamProto::Tcp | UpstreamProto::Tls | UpstreamProto::Https => {
                        STREAM_EXCHANGE
                    }
                };
                let Some(charge) = self.charge(cost + wire.len(), stats) else {
                    return Err(DnsError::Busy);
                };
                let asked = self.ask(up, direct, &wire, id, qq, stats, charge);
                match tokio::time::timeout(self.timeout, asked).await {
                    Ok(Ok((m, raw))) => {
                        let m = Arc::new(m);
                        if let Some(ttl) = msg::cache_ttl(&m) {
                            let now = Instant::now();
                            let limit = self.cache_bytes.limit(now);
                            self.cache.insert(key, &raw, ttl, now, limit);
                        }
                        return Ok((m, raw));
                    }
                    Ok(Err(ExchangeError::Busy)) => return Err(DnsError::Busy),
                    Ok(Err(ExchangeError::Rejected)) => {}
                    Ok(Err(e)) => {
                        stats.dns.upstream_failures.fetch_add(1, Relaxed);
                        tracing::debug!("dns upstream {}: {e}", up.addr);
                    }
                    Err(_) => {
                        stats.dns.upstream_failures.fetch_add(1, Relaxed);
                        tracing::debug!("dns upstream {}: timed out", up.addr);
                    }
                }
            }
        }
        Err(DnsError::Upstream)
    }

    /// `bytes` of the in-flight budget, or `None` (counted) when it is spent.
    fn charge(&self, bytes: usize, stats: &Stats) -> Option<Charge> {
        let c = self.in_flight.try_charge(bytes, Instant::now());
        if c.is_none() {
            stats.drop(EngineDrop::DnsQueueFull);
        }
        c
    }

    /// One try: exchange, check the reply; a truncated UDP reply is asked
    /// again over TCP (same address, same outbound, same time budget, the
    /// charge raised to a stream exchange's). `direct`: sent direct
    /// whatever the rules say (a `"platform"` server).
    #[allow(clippy::too_many_arguments)]
    async fn ask(
        &self,
        up: &Upstream,
        direct: bool,
        wire: &[u8],
        id: u16,
        qq: &Query,
        stats: &Stats,
        _charge: Charge,
    ) -> Result<(Message, Vec<u8>), ExchangeError> {
        let tls = self.tls.as_ref();
        let raw = upstream::exchange(&self.outbounds, up, direct, tls, wire, id, stats).await?;
        match msg::check_reply(&raw, id, qq) {
            Ok(m) => Ok((m, raw)),
            Err(BadReply::Truncated) if up.proto == UpstreamProto::Udp => {
                let _more = self
                    .charge(STREAM_EXCHANGE - UDP_EXCHANGE, stats)
                    .ok_or(ExchangeError::Busy)?;
                let tcp = Upstream {
                    proto: UpstreamProto::Tcp,
                    ..up.clone()
                };
                let raw =
                    upstream::exchange(&self.outbounds, &tcp, direct, tls, wire, id, stats).await?;
                msg::check_reply(&raw, id, qq)
                    .map(|m| (m, raw))
                    .map_err(ExchangeError::Reply)
            }
            Err(e) => Err(ExchangeError::Reply(e)),
        }
    }
}

/// The TLS client for `tls://` and `https://` upstreams: the Mozilla roots (webpki-roots)
/// plus the PEM certificates of `tls_ca_file`.
#[cfg(feature = "dot")]
fn tls_connector(c: &DnsConfig) -> Result<upstream::Tls, DnsConfigError> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    use tokio_rustls::rustls;
    let bad = |reason: String| DnsConfigError {
        field: "tls_ca_file",
        reason,
    };
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = &c.tls_ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| bad(format!("{}: {e}", path.display())))?;
        let mut n = 0;
        for cert in certs {
            let cert = cert.map_err(|e| bad(format!("{}: {e}", path.display())))?;
            roots
                .add(cert)
                .map_err(|e| bad(format!("{}: {e}", path.display())))?;
            n += 1;
        }
        if n == 0 {
            return Err(bad(format!("{}: no certificate in it", path.display())));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| DnsConfigError {
            field: "upstreams",
            reason: format!("TLS: {e}"),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(upstream::Tls::new(Arc::new(cfg)))
}

#[cfg(not(feature = "dot"))]
fn tls_connector(_: &DnsConfig) -> Result<upstream::Tls, DnsConfigError> {
    Err(config::dot_missing())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Pressure;
    use crate::config::Config;
    use crate::outbound::SocketFactory;
    use crate::testutil::runtime;
    use hickory_proto::op::ResponseCode;
    use hickory_proto::rr::RecordType;
    use kerntun_testkit::tokio_servers::tcp_pair;

    fn service(tweak: impl FnOnce(&mut Config)) -> Arc<Dns> {
        service_with(tweak, 1 << 20)
    }

    /// The service with `in_flight` bytes for queries and exchanges.
    fn service_with(tweak: impl FnOnce(&mut Config), in_flight: usize) -> Arc<Dns> {
        service_under(tweak, in_flight, 1 << 20, Arc::new(Pressure::default()))
    }

    /// The service with `in_flight` and `cache` bytes under `pressure`.
    fn service_under(
        tweak: impl FnOnce(&mut Config),
        in_flight: usize,
        cache: usize,
        pressure: Arc<Pressure>,
    ) -> Arc<Dns> {
        let mut c = Config::default();
        c.tun.ipv4 = Some("198.18.0.1/16".parse().expect("net"));
        c.dns.enabled = true;
        // Nothing listens there: every forward fails (refused) at once.
        c.dns.upstreams = vec!["udp://127.0.0.1:9".into()];
        c.dns.timeout_ms = 300;
        tweak(&mut c);
        c.validate().expect("valid");
        let ob = Outbounds::new(
            &c.outbounds,
            &std::collections::BTreeMap::new(),
            &c.rules,
            &c.relay,
            SocketFactory::new(&c.direct, None),
            4096,
            crate::outbound::resolve::Resolvers::default(),
        )
        .expect("outbounds");
        let cache = Arc::new(ByteBudget::new(cache, pressure.clone()));
        let in_flight = Arc::new(ByteBudget::new(in_flight, pressure.clone()));
        let fake = Arc::new(ByteBudget::new(1 << 20, pressure));
        Dns::new(&c.dns, &c.tun.nets(), Arc::new(ob), cache, in_flight, fake)
            .expect("dns")
            .expect("enabled")
    }

    #[test]
    fn hijack_defaults_to_gateway_plus_two() {
        let d = service(|_| {});
        assert!(d.hijacks("198.18.0.3:53".parse().expect("sa")));
        assert!(!d.hijacks("198.18.0.3:54".parse().expect("sa")));
        assert!(
            !d.hijacks("198.18.0.1:53".parse().expect("sa")),
            "the TUN's own address"
        );
        assert!(!d.hijacks("8.8.8.8:53".parse().expect("sa")));
        let all = service(|c| c.dns.hijack_all = true);
        assert!(all.hijacks("8.8.8.8:53".parse().expect("sa")));
    }

    /// A reload's new service keeps the old fake-ip pool when its ranges
    /// and size are the same: an address handed out before still stands
    /// for its domain, and the same domain gets the same address. Another
    /// range (or no fake-ip before) starts a new pool.
    #[test]
    fn reload_keeps_the_fake_pool_when_its_range_stays() {
        let stats = Stats::default();
        let rt = runtime();
        let fake_a = |d: &Dns, name: &str| {
            let q = msg::testutil::query(name, RecordType::A, 7);
            let r = Message::from_vec(&rt.block_on(d.answer(&q, &stats)).expect("answer"))
                .expect("decode");
            let hickory_proto::rr::RData::A(a) = &r.answers[0].data else {
                panic!("an A record")
            };
            IpAddr::V4(a.0)
        };
        let old = service(|c| c.dns.fake_ip = true);
        let ip = fake_a(&old, "kept.test.");
        // Other upstreams and hijack settings, the same pool.
        let mut new = service(|c| {
            c.dns.fake_ip = true;
            c.dns.upstreams = vec!["udp://127.0.0.1:10".into()];
            c.dns.hijack_all = true;
        });
        assert_eq!(new.fake_domain(ip), None, "a fresh pool knows nothing");
        assert!(Dns::carry_over(&mut new, &old), "same range: kept");
        assert_eq!(new.fake_domain(ip).as_deref(), Some("kept.test"));
        assert_eq!(fake_a(&new, "kept.test."), ip, "the same address again");
        let other = fake_a(&new, "new.test.");
        assert_eq!(
            old.fake_domain(other).as_deref(),
            Some("new.test"),
            "one pool"
        );

        let mut moved = service(|c| {
            c.dns.fake_ip = true;
            c.dns.fake_ip_pool = "198.18.64.0/18".parse().expect("net");
        });
        assert!(!Dns::carry_over(&mut moved, &old), "another range: new");
        assert_eq!(moved.fake_domain(ip), None);
        let mut off = service(|_| {});
        assert!(
            !Dns::carry_over(&mut off, &old),
            "fake-ip off: nothing kept"
        );
    }

    #[test]
    fn fake_ip_filter_and_servfail() {
        let d = service(|c| {
            c.dns.fake_ip = true;
            c.dns.fake_ip_filter = vec!["Real.Test.".into()];
            // The fake-ip pool's own empty AAAA (not the strategy's).
            c.dns.strategy = DnsStrategy::DualStack;
        });
        let stats = Stats::default();
        let rt = runtime();
        let q = msg::testutil::query("www.example.com.", RecordType::A, 3);
        let r =
            Message::from_vec(&rt.block_on(d.answer(&q, &stats)).expect("answer")).expect("decode");
        let hickory_proto::rr::RData::A(a) = &r.answers[0].data else {
            panic!("an A record")
        };
        assert!(d.is_fake(IpAddr::V4(a.0)));
        assert_eq!(
            d.fake_domain(IpAddr::V4(a.0)).as_deref(),
            Some("www.example.com")
        );
        // AAAA without a v6 pool: empty NOERROR.
        let q6 = msg::testutil::query("www.example.com.", RecordType::AAAA, 4);
        let r6 = Message::from_vec(&rt.block_on(d.answer(&q6, &stats)).expect("answer"))
            .expect("decode");
        assert!(r6.answers.is_empty());
        assert_eq!(r6.metadata.response_code, ResponseCode::NoError);
        // Filtered (a subdomain of the filter): forwarded, and the dead
        // upstream makes it a SERVFAIL with the query's ID.
        let qf = msg::testutil::query("x.real.test.", RecordType::A, 5);
        let t0 = Instant::now();
        let rf = Message::from_vec(&rt.block_on(d.answer(&qf, &stats)).expect("answer"))
            .expect("decode");
        assert!(t0.elapsed() < Duration::from_millis(1_000));
        assert_eq!(rf.metadata.id, 5);
        assert_eq!(rf.metadata.response_code, ResponseCode::ServFail);
        assert!(!d.filtered("notreal.test"));
        let g = |c: &std::sync::atomic::AtomicU64| c.load(Relaxed);
        let s = &stats.dns;
        assert_eq!(
            (g(&s.queries), g(&s.fakeip_answers), g(&s.servfail)),
            (3, 2, 1),
            "queries, fake answers, servfail"
        );
        assert_eq!(rt.block_on(d.answer(b"\x00\x01junk", &stats)), None);
        assert_eq!(stats.dns.malformed.load(Relaxed), 1);
    }

    /// A service (in-flight budget `in_flight`, 2 s timeout) whose one
    /// upstream is a [`slow_upstream`] answering after `delay`; that
    /// upstream's query count, and fresh stats.
    async fn slow_service(
        delay: Duration,
        in_flight: usize,
    ) -> (Arc<Dns>, Arc<std::sync::atomic::AtomicUsize>, Arc<Stats>) {
        let (up, asked) = slow_upstream(delay).await;
        let tweak = |c: &mut Config| {
            c.dns.upstreams = vec![format!("udp://{up}")];
            c.dns.timeout_ms = 2_000;
        };
        (
            service_with(tweak, in_flight),
            asked,
            Arc::new(Stats::default()),
        )
    }

    /// A UDP upstream on 127.0.0.1 that answers every A query with
    /// 192.0.2.1 after `delay`, and counts the queries it got.
    async fn slow_upstream(delay: Duration) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let sock = Arc::new(
            tokio::net::UdpSocket::bind("127.0.0.1:0")
                .await
                .expect("bind"),
        );
        let addr = sock.local_addr().expect("addr");
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = asked.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            while let Ok((n, from)) = sock.recv_from(&mut buf).await {
                counter.fetch_add(1, Relaxed);
                let reply = msg::testutil::answer_a(&buf[..n], [192, 0, 2, 1], 60)
                    .to_vec()
                    .expect("encode");
                let sock = sock.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _ = sock.send_to(&reply, from).await;
                });
            }
        });
        (addr, asked)
    }

    /// The answer to `name`/`t` as a message.
    async fn ask(d: &Dns, name: &str, t: RecordType, stats: &Stats) -> Message {
        let q = msg::testutil::query(name, t, 9);
        Message::from_vec(&d.answer(&q, stats).await.expect("answered")).expect("decode")
    }

    /// `dns.strategy`: the family it leaves out is answered NOERROR with
    /// no records, counted, for fake-ip and forwarded answers alike, and
    /// without asking the upstream; the other family is answered as
    /// before. `auto` leaves AAAA out exactly when the TUN has no IPv6.
    #[test]
    fn strategy_answers_the_family_left_out_empty() {
        use hickory_proto::rr::RData;
        // A service set up by `base`, then leaving out what `strategy`
        // says, with an IPv6 TUN address when `tun6`.
        let strategy_service = |base: &dyn Fn(&mut Config), strategy, tun6: bool| {
            service(|c| {
                base(c);
                c.dns.strategy = strategy;
                if tun6 {
                    c.tun.ipv6 = Some("fd00:18::1/64".parse().expect("net"));
                }
            })
        };
        let empty = |r: &Message| {
            assert_eq!(r.metadata.response_code, ResponseCode::NoError, "{r:?}");
            assert!(r.answers.is_empty(), "{r:?}");
            assert_eq!(r.metadata.id, 9);
        };
        runtime().block_on(async {
            // Fake-ip with both pools.
            let fake = |strategy, tun6| {
                strategy_service(
                    &|c| {
                        c.dns.fake_ip = true;
                        c.dns.fake_ip_pool6 = Some("fc00:18::/96".parse().expect("pool6"));
                    },
                    strategy,
                    tun6,
                )
            };
            let stats = Stats::default();
            let d = fake(DnsStrategy::Ipv4Only, true);
            empty(&ask(&d, "v6.example.", RecordType::AAAA, &stats).await);
            let r = ask(&d, "v6.example.", RecordType::A, &stats).await;
            assert!(matches!(r.answers[0].data, RData::A(_)), "{r:?}");
            assert_eq!(stats.dns.strategy_empty.load(Relaxed), 1);
            assert_eq!(stats.dns.fakeip_answers.load(Relaxed), 1, "only the A");
            let d = fake(DnsStrategy::Auto, true);
            let r = ask(&d, "v6.example.", RecordType::AAAA, &stats).await;
            assert!(matches!(r.answers[0].data, RData::AAAA(_)), "{r:?}");
            let d = fake(DnsStrategy::Auto, false);
            empty(&ask(&d, "v6.example.", RecordType::AAAA, &stats).await);
            let d = fake(DnsStrategy::Ipv6Only, true);
            empty(&ask(&d, "v6.example.", RecordType::A, &stats).await);
            let r = ask(&d, "v6.example.", RecordType::AAAA, &stats).await;
            assert!(matches!(r.answers[0].data, RData::AAAA(_)), "{r:?}");
            assert_eq!(stats.dns.strategy_empty.load(Relaxed), 3);

            // Forwarded: the upstream answers whatever it is asked.
            let (up, asked) = slow_upstream(Duration::ZERO).await;
            let fwd = |strategy, tun6| {
                strategy_service(
                    &|c| c.dns.upstreams = vec![format!("udp://{up}")],
                    strategy,
                    tun6,
                )
            };
            let stats = Stats::default();
            let d = fwd(DnsStrategy::Ipv4Only, true);
            empty(&ask(&d, "a.test.", RecordType::AAAA, &stats).await);
            assert_eq!(asked.load(Relaxed), 0, "not asked upstream");
            assert_eq!(
                ask(&d, "a.test.", RecordType::A, &stats)
                    .await
                    .answers
                    .len(),
                1
            );
            assert_eq!(asked.load(Relaxed), 1);
            let d = fwd(DnsStrategy::Auto, false);
            empty(&ask(&d, "b.test.", RecordType::AAAA, &stats).await);
            assert_eq!(asked.load(Relaxed), 1, "not asked upstream");
            // Other types pass whatever the strategy.
            let r = ask(&d, "b.test.", RecordType::TXT, &stats).await;
            assert_eq!(r.answers.len(), 1, "{r:?}");
            assert_eq!(asked.load(Relaxed), 2);
            assert_eq!(stats.dns.strategy_empty.load(Relaxed), 2);
            // `auto` with IPv6 in the TUN, and `dual_stack` without: asked.
            for d in [
                fwd(DnsStrategy::Auto, true),
                fwd(DnsStrategy::DualStack, false),
            ] {
                let before = asked.load(Relaxed);
                let r = ask(&d, "c.test.", RecordType::AAAA, &stats).await;
                assert_eq!(r.answers.len(), 1, "{r:?}");
                assert_eq!(asked.load(Relaxed), before + 1);
            }
            assert_eq!(stats.dns.strategy_empty.load(Relaxed), 2);
        });
    }

    /// Twenty hijacked queries for one name while the upstream is slow: it
    /// is asked once, and all twenty clients get the answer with their own
    /// ID. (Each used to open its own upstream socket with its own 64 KiB
    /// buffer.)
    #[test]
    fn identical_questions_in_flight_are_asked_upstream_once() {
        runtime().block_on(async {
            let (d, asked, stats) = slow_service(Duration::from_millis(200), 1 << 20).await;
            let mut set = tokio::task::JoinSet::new();
            for id in 0..20u16 {
                let (d, stats) = (d.clone(), stats.clone());
                set.spawn(async move {
                    let q = msg::testutil::query("same.test.", RecordType::A, 1000 + id);
                    let r = d.answer(&q, &stats).await.expect("answered");
                    (id, Message::from_vec(&r).expect("decode"))
                });
            }
            while let Some(done) = set.join_next().await {
                let (id, r) = done.expect("task");
                assert_eq!(r.metadata.id, 1000 + id, "the client's own ID");
                assert_eq!(r.metadata.response_code, ResponseCode::NoError);
                assert_eq!(msg::addresses(&r, false).count(), 1, "{r:?}");
            }
            assert_eq!(asked.load(Relaxed), 1, "one upstream query for 20 askers");
            assert!(d.pending.lock().is_empty(), "nothing left in flight");
            // Later askers are answered from the cache.
            let q = msg::testutil::query("same.test.", RecordType::A, 7);
            assert!(d.answer(&q, &stats).await.is_some());
            assert_eq!(asked.load(Relaxed), 1);
            assert_eq!(stats.dns.cache_hits.load(Relaxed), 1);
        });
    }

    /// An in-flight budget with room for one exchange: a second question
    /// asked meanwhile is dropped and counted (the client retries), the
    /// first is answered, and the budget is whole again afterwards.
    #[test]
    fn exchanges_past_the_in_flight_budget_are_dropped_and_counted() {
        runtime().block_on(async {
            let (d, asked, stats) =
                slow_service(Duration::from_millis(200), UDP_EXCHANGE + 100).await;
            let first = {
                let (d, stats) = (d.clone(), stats.clone());
                tokio::spawn(async move {
                    let q = msg::testutil::query("one.test.", RecordType::A, 1);
                    d.answer(&q, &stats).await
                })
            };
            tokio::time::sleep(Duration::from_millis(50)).await;
            let q = msg::testutil::query("two.test.", RecordType::A, 2);
            assert_eq!(d.answer(&q, &stats).await, None, "no room: dropped");
            assert_eq!(stats.snapshot().drop_count("dns_queue_full"), 1);
            assert!(
                first.await.expect("task").is_some(),
                "the first is answered"
            );
            assert_eq!(asked.load(Relaxed), 1);
            assert_eq!(d.in_flight().used(), 0, "charges released");
            let q = msg::testutil::query("two.test.", RecordType::A, 3);
            assert!(d.answer(&q, &stats).await.is_some(), "room again");
        });
    }

    /// Raised memory pressure shrinks the cache's byte limit: `trim` (the
    /// engine calls it when the host reports) evicts down to it at once, and
    /// later answers keep to it.
    #[test]
    fn cache_shrinks_with_memory_pressure() {
        use crate::budget::MemoryPressure;
        runtime().block_on(async {
            let (up, _) = slow_upstream(Duration::ZERO).await;
            let pressure = Arc::new(Pressure::default());
            let tweak = |c: &mut Config| c.dns.upstreams = vec![format!("udp://{up}")];
            let d = service_under(tweak, 1 << 20, 8 * 1024, pressure.clone());
            let stats = Stats::default();
            let ask = |i: u16| {
                let (d, stats) = (&d, &stats);
                async move {
                    let q = msg::testutil::query(&format!("n{i}.test."), RecordType::A, i);
                    assert!(d.answer(&q, stats).await.is_some(), "answer {i}");
                }
            };
            for i in 0..40 {
                ask(i).await;
            }
            let full = d.cache.bytes();
            assert!(full <= 8 * 1024 && full > 6 * 1024, "{full} bytes");
            pressure.report(MemoryPressure::Critical, Instant::now());
            d.trim(Instant::now(), &stats);
            assert!(d.cache.bytes() <= 2 * 1024, "{} bytes", d.cache.bytes());
            for i in 40..60 {
                ask(i).await;
            }
            assert!(d.cache.bytes() <= 2 * 1024, "{} bytes", d.cache.bytes());
            assert!(d.cache.len() > 0, "still caching");
        });
    }

    #[test]
    fn serve_tcp_answers_frames_until_eof() {
        use tokio::io::AsyncWriteExt;
        let d = service(|c| c.dns.fake_ip = true);
        let stats = Stats::default();
        runtime().block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = l.local_addr().expect("addr");
            let client = tokio::spawn(async move {
                let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
                let mut ids = Vec::new();
                let mut wire = Vec::new();
                for id in [11u16, 12] {
                    let q = msg::testutil::query("t.test.", RecordType::A, id);
                    wire.extend_from_slice(&crate::dnswire::length_prefixed(&q).expect("frame"));
                }
                // Both queries in one write: the server must split frames.
                s.write_all(&wire).await.expect("write");
                for _ in 0..2 {
                    let r = crate::dnswire::read_frame(&mut s).await.expect("reply");
                    ids.push(Message::from_vec(&r).expect("decode").metadata.id);
                }
                s.shutdown().await.expect("shutdown");
                ids
            });
            let (s, _) = l.accept().await.expect("accept");
            d.serve_tcp(&s, &stats).await.expect("served");
            assert_eq!(client.await.expect("client"), vec![11, 12]);
        });
        assert_eq!(stats.dns.tcp_queries.load(Relaxed), 2);
        assert_eq!(stats.dns.queries.load(Relaxed), 2);
    }

    /// A prefix announcing more than MAX_QUERY closes the connection at
    /// once, nothing of the message read and nothing charged.
    #[test]
    fn tcp_query_announced_past_the_cap_closes_unread() {
        use tokio::io::AsyncReadExt;
        let d = service(|_| {});
        let stats = Stats::default();
        runtime().block_on(async {
            let (mut app, s) = tcp_pair().await;
            let mut w = 65_535u16.to_be_bytes().to_vec();
            w.extend_from_slice(&[0u8; 1000]);
            app.write_all(&w).await.expect("write");
            let served =
                tokio::time::timeout(Duration::from_secs(2), d.serve_tcp(&s, &stats)).await;
            assert!(matches!(served, Ok(Ok(()))), "closed at once: {served:?}");
            assert_eq!(d.in_flight().used(), 0);
            drop(s);
            let mut rest = Vec::new();
            let _ = app.read_to_end(&mut rest).await;
            assert!(rest.is_empty(), "no answer");
        });
        let snap = stats.snapshot();
        assert_eq!(snap.drop_count("dns_query_too_long"), 1);
        assert_eq!(snap.dns.tcp_queries, 0);
        // At the cap it is read (and, as garbage, dropped as malformed).
        let stats = Stats::default();
        runtime().block_on(async {
            let (app, s) = tcp_pair().await;
            let mut w = (msg::MAX_QUERY as u16).to_be_bytes().to_vec();
            w.resize(2 + msg::MAX_QUERY, 0xff);
            app.write_all(&w).await.expect("write");
            d.serve_tcp(&s, &stats).await.expect("served");
        });
        assert_eq!(stats.snapshot().drop_count("dns_query_too_long"), 0);
        assert_eq!(stats.dns.tcp_queries.load(Relaxed), 1);
        assert_eq!(stats.dns.malformed.load(Relaxed), 1);
    }

    /// The query is charged once its prefix is in, before its bytes are
    /// read, and the charge is held while they trickle in; without room
    /// for it the connection closes, counted.
    #[test]
    fn tcp_query_is_charged_before_it_is_read() {
        let d = service(|_| {});
        let stats = Arc::new(Stats::default());
        runtime().block_on(async {
            let (app, s) = tcp_pair().await;
            let serving = {
                let (d, stats) = (d.clone(), stats.clone());
                tokio::spawn(async move { d.serve_tcp(&s, &stats).await })
            };
            app.write_all(&1000u16.to_be_bytes()).await.expect("prefix");
            app.write_all(&[0u8; 500]).await.expect("half");
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert_eq!(d.in_flight().used(), QUERY_STATE + 2 + 1000);
            drop(app);
            let _ = serving.await.expect("task");
            assert_eq!(d.in_flight().used(), 0, "given back");
        });
        // No room for the query's state: closed unread.
        let small = service_with(|_| {}, QUERY_STATE);
        let stats = Stats::default();
        runtime().block_on(async {
            let (app, s) = tcp_pair().await;
            let q = msg::testutil::query("t.test.", RecordType::A, 1);
            let framed = crate::dnswire::length_prefixed(&q).expect("frame");
            app.write_all(&framed).await.expect("write");
            let served =
                tokio::time::timeout(Duration::from_secs(2), small.serve_tcp(&s, &stats)).await;
            assert!(matches!(served, Ok(Ok(()))), "{served:?}");
        });
        assert_eq!(stats.snapshot().drop_count("dns_queue_full"), 1);
        assert_eq!(stats.dns.tcp_queries.load(Relaxed), 0);
    }

    /// Twenty TCP clients ask the same slow question: one upstream
    /// exchange, and every asker, the nineteen that wait for the first one
    /// too, holds its query's charge while it waits.
    #[test]
    fn tcp_askers_waiting_for_an_identical_question_are_charged() {
        runtime().block_on(async {
            let (d, asked, stats) = slow_service(Duration::from_millis(300), 1 << 20).await;
            let q = msg::testutil::query("same.test.", RecordType::A, 5);
            let framed = crate::dnswire::length_prefixed(&q).expect("frame");
            let mut apps = Vec::new();
            let mut set = tokio::task::JoinSet::new();
            for _ in 0..20 {
                let (app, s) = tcp_pair().await;
                app.write_all(&framed).await.expect("write");
                apps.push(app);
                let (d, stats) = (d.clone(), stats.clone());
                set.spawn(async move { d.serve_tcp(&s, &stats).await });
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
            let used = d.in_flight().used();
            assert!(
                used >= 20 * (QUERY_STATE + 2 + q.len()) + UDP_EXCHANGE,
                "{used} bytes charged while 20 wait"
            );
            for mut app in apps {
                let r = crate::dnswire::read_frame(&mut app).await.expect("reply");
                assert_eq!(Message::from_vec(&r).expect("decode").metadata.id, 5);
            }
            assert_eq!(asked.load(Relaxed), 1, "asked upstream once");
            drop(set);
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(d.in_flight().used(), 0, "given back");
        });
    }

    /// Over UDP the driver takes the charge before copying the query; a
    /// query past the cap is refused without one.
    #[test]
    fn udp_query_past_the_cap_is_refused_before_it_is_copied() {
        let d = service(|_| {});
        let now = Instant::now();
        assert_eq!(
            d.charge_udp_query(msg::MAX_QUERY + 1, 1500, now).err(),
            Some(EngineDrop::DnsQueryTooLong)
        );
        assert_eq!(d.in_flight().used(), 0);
        let c = d.charge_udp_query(msg::MAX_QUERY, 1500, now).expect("room");
        assert_eq!(d.in_flight().used(), QUERY_STATE + msg::MAX_QUERY + 3000);
        drop(c);
        let small = service_with(|_| {}, QUERY_STATE);
        assert_eq!(
            small.charge_udp_query(100, 1500, now).err(),
            Some(EngineDrop::DnsQueueFull)
        );
    }

    /// Records beyond a question and an OPT: FORMERR, counted as refused.
    #[test]
    fn refusals_are_counted() {
        let d = service(|_| {});
        let stats = Stats::default();
        let mut q = msg::testutil::query("a.test.", RecordType::A, 3);
        q[7] = 1;
        q.extend_from_slice(&[0xff; 16]);
        let r = runtime().block_on(d.answer(&q, &stats)).expect("answered");
        let m = Message::from_vec(&r).expect("decode");
        assert_eq!(m.metadata.response_code, ResponseCode::FormErr);
        assert_eq!(stats.dns.refused.load(Relaxed), 1);
        assert_eq!(stats.dns.malformed.load(Relaxed), 0);
    }
}
