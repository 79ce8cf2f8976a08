//! Host names of proxy servers (`server = "ss.example.com:8388"`).
//!
//! A proxy's name is resolved with plain DNS queries (UDP, then TCP when the
//! reply is truncated) sent on sockets from the engine's [`SocketFactory`],
//! so they take the same loop avoidance as every other outbound socket
//! (interface, fwmark, the `protect(fd)` hook) and never enter the tunnel,
//! whatever the rules say about the resolver's address: resolving a proxy
//! through itself could never finish. Which resolvers are asked is decided
//! where the outbounds are built (docs/configuration.md, "Host names").
//!
//! Per name, [`NameCache`] (sans-I/O: the caller passes `now`) keeps the
//! answer for its TTL, the family that last connected, and a failure for
//! [`FAILURE_HOLD`]. A connect failure to every address marks the answer
//! stale, so the next connection asks again (a server that moved is
//! followed at once, not after its TTL); a refresh that fails falls back to
//! the stale addresses (RFC 8767 "serve stale"). TCP connects race the
//! addresses in the order [`NameCache::order`] gives, one every
//! [`ATTEMPT_DELAY`] (RFC 8305 happy eyeballs).

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use parking_lot::Mutex;
use tokio::net::{TcpStream, UdpSocket};
use tokio::task::JoinSet;

use super::SocketFactory;
use crate::dnswire::{Upstream, UpstreamProto, length_prefixed, msg, read_frame};

/// RFC 8305 section 8: "a recommended value of 250 milliseconds" between
/// connection attempts to successive addresses.
pub const ATTEMPT_DELAY: Duration = Duration::from_millis(250);
/// How long a failed lookup is answered from memory: a burst of app
/// connections (a browser opens dozens at once) then costs one lookup and
/// one timeout, not one each, and a fixed name is picked up within seconds.
pub const FAILURE_HOLD: Duration = Duration::from_secs(5);
/// Shortest time an answer is kept: a TTL of 0 would otherwise mean a query
/// per connection.
pub const MIN_TTL: Duration = Duration::from_secs(1);
/// Longest time an answer is kept without a connect failure (a proxy that
/// moves under a day-long TTL is followed within the hour anyway).
pub const MAX_TTL: Duration = Duration::from_secs(3_600);
/// Largest DNS message read over TCP or UDP.
const MAX_MESSAGE: usize = 65_535;

/// The resolvers asked for proxy host names, and the time one try may take.
#[derive(Debug, Clone, Default)]
pub struct Resolvers {
    /// From the configuration ([`Resolvers::pick`]).
    list: Vec<Upstream>,
    /// `list` is `[direct] bootstrap`: the network's servers never replace
    /// it.
    pinned: bool,
    /// The host reports the network's DNS servers (`Engine::network_changed`,
    /// Android): with nothing configured, proxy names wait for them
    /// instead of refusing the start ([`Resolvers::from_network`]).
    from_network: bool,
    /// The DNS servers of the network the host reported last
    /// ([`Resolvers::set_platform`]), shared by every clone; empty until
    /// it reports some.
    platform: Arc<Mutex<Arc<[Upstream]>>>,
    timeout: Duration,
}

impl Resolvers {
    /// The first non-empty of: `bootstrap` (`[direct] bootstrap`), the UDP
    /// and TCP entries of `upstreams` (`[dns] upstreams`; DNS over TLS is
    /// not spoken here), the system's resolvers ([`system_resolvers`]).
    /// Without a `bootstrap`, the network's own servers replace them once
    /// the host reports some ([`Resolvers::set_platform`]).
    pub fn pick(bootstrap: &[Upstream], upstreams: &[Upstream], timeout: Duration) -> Resolvers {
        let pinned = !bootstrap.is_empty();
        let list = if pinned {
            bootstrap.to_vec()
        } else {
            let plain: Vec<Upstream> = upstreams
                .iter()
                .filter(|u| !u.proto.over_tls())
                .cloned()
                .collect();
            if plain.is_empty() {
                system_resolvers()
            } else {
                plain
            }
        };
        Resolvers {
            list,
            pinned,
            timeout,
            ..Resolvers::default()
        }
    }

    /// As [`Resolvers::pick`], for a host that reports the network's DNS
    /// servers itself (Android, through `Engine::network_changed`):
    /// there is no system resolver file to read, and with no `bootstrap`
    /// or plain `upstreams` a proxy given by host name is accepted at start
    /// and resolved through the network's servers once the host reports
    /// them. Until then a connection through it fails, counted in the
    /// outbound's `resolve_failures`.
    pub fn from_network(
        bootstrap: &[Upstream],
        upstreams: &[Upstream],
        timeout: Duration,
    ) -> Resolvers {
        let pinned = !bootstrap.is_empty();
        let list = if pinned {
            bootstrap.to_vec()
        } else {
            upstreams
                .iter()
                .filter(|u| !u.proto.over_tls())
                .cloned()
                .collect()
        };
        Resolvers {
            list,
            pinned,
            from_network: true,
            timeout,
            ..Resolvers::default()
        }
    }

    /// Exactly these resolvers (the network's never replace them).
    pub fn new(list: Vec<Upstream>, timeout: Duration) -> Resolvers {
        Resolvers {
            list,
            pinned: true,
            timeout,
            ..Resolvers::default()
        }
    }

    /// Whether no resolver can ever answer for a proxy name: none
    /// configured, and the host does not report the network's servers.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty() && !self.from_network
    }

    /// The configured resolvers.
    pub fn list(&self) -> &[Upstream] {
        &self.list
    }

    /// The host reported a network whose DNS servers are `servers`
    /// (`Engine::network_changed`): each over UDP port 53, on sockets made
    /// like every other direct socket (bound to the new default interface).
    /// Loopback, unspecified and IPv6 link-local addresses are left out (a
    /// link-local address needs a zone a socket address here cannot
    /// carry). An empty list gives the configured resolvers back.
    pub fn set_platform(&self, servers: &[IpAddr]) {
        *self.platform.lock() = Self::platform_list(servers).into();
    }

    /// The network's DNS servers as [`Resolvers::set_platform`] asks them.
    pub fn platform_list(servers: &[IpAddr]) -> Vec<Upstream> {
        servers
            .iter()
            .filter(|ip| usable_platform_server(**ip))
            .map(|ip| Upstream {
                proto: UpstreamProto::Udp,
                addr: SocketAddr::new(*ip, 53),
                server_name: None,
                path: None,
            })
            .collect()
    }

    /// The time one question to a resolver may take.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The resolvers a lookup asks now ([`choose`]).
    pub fn current(&self) -> Vec<Upstream> {
        let platform = self.platform.lock().clone();
        choose(&self.list, self.pinned, &platform).to_vec()
    }
}

/// Who resolves a proxy's name: `configured` when it is `[direct]
/// bootstrap` (`pinned`) or while the network reported no DNS servers,
/// else the network's own (`platform`): on a phone they are the ones that
/// work on the network it is on (an IPv6-only network's resolver included),
/// where the configured upstreams are the system's file or what the DNS
/// service asks.
pub fn choose<'a>(
    configured: &'a [Upstream],
    pinned: bool,
    platform: &'a [Upstream],
) -> &'a [Upstream] {
    if pinned || platform.is_empty() {
        configured
    } else {
        platform
    }
}

/// Whether a DNS server the host reported can be asked from here.
pub(crate) fn usable_platform_server(ip: IpAddr) -> bool {
    let link_local_v6 = matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80);
    !ip.is_loopback() && !ip.is_unspecified() && !link_local_v6
}

/// The system's resolvers over UDP port 53: on Linux and macOS the
/// `nameserver` lines of systemd-resolved's list of real upstreams
/// (`/run/systemd/resolve/resolv.conf`) when it exists, else of
/// `/etc/resolv.conf`. Loopback entries are skipped: a local stub resolver
/// sends its own queries on sockets the engine's loop avoidance does not
/// cover, so with the host's traffic routed into the tunnel, resolving the
/// proxy would wait on the proxy. Android and iOS have no such file: set
/// `[direct] bootstrap` or `[dns] upstreams` there.
pub fn system_resolvers() -> Vec<Upstream> {
    for path in ["/run/systemd/resolve/resolv.conf", "/etc/resolv.conf"] {
        if let Ok(text) = std::fs::read_to_string(path) {
            let list: Vec<Upstream> = nameservers(&text)
                .into_iter()
                .map(|ip| Upstream {
                    proto: UpstreamProto::Udp,
                    addr: SocketAddr::new(ip, 53),
                    server_name: None,
                    path: None,
                })
                .collect();
            if !list.is_empty() {
                return list;
            }
        }
    }
    Vec::new()
}

/// The non-loopback `nameserver` addresses of a resolv.conf (an IPv6
/// address with a `%zone` is skipped: a socket address cannot carry it
/// here).
pub fn nameservers(resolv_conf: &str) -> Vec<IpAddr> {
    resolv_conf
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver")).then(|| w.next())?
        })
        .filter_map(|a| a.parse::<IpAddr>().ok())
        .filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
        .collect()
}

/// A proxy's host name, port and cache; one per configured outbound. The
/// lock is held across a lookup, so concurrent connections wait for one
/// lookup instead of each sending their own.
#[derive(Debug)]
pub struct Named {
    name: String,
    port: u16,
    cache: tokio::sync::Mutex<NameCache>,
    /// Set by [`Named::forget`]: the next lookup starts from an empty
    /// cache. A flag, not the cache's lock, so forgetting never waits for
    /// a lookup in flight (whose answer, from the old network, the flag
    /// then discards on the lookup after it).
    forgotten: std::sync::atomic::AtomicBool,
}

impl Named {
    pub fn new(name: &str, port: u16) -> Named {
        Named {
            name: name.to_owned(),
            port,
            cache: tokio::sync::Mutex::new(NameCache::default()),
            forgotten: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Forget what the cache learned (the network moved).
    pub fn forget(&self) {
        self.forgotten
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The addresses to try, in order (resolving first when the cache says so).
    pub async fn addresses(
        &self,
        factory: &SocketFactory,
        resolvers: &Resolvers,
    ) -> Result<Vec<SocketAddr>, ResolveError> {
        let mut c = self.cache.lock().await;
        if self
            .forgotten
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            *c = NameCache::default();
        }
        match c.lookup(Instant::now(), self.port) {
            Lookup::Use(a) => Ok(a),
            Lookup::Fail(e) => Err(e),
            Lookup::Resolve => {
                let list = resolvers.current();
                let r = resolve(factory, &list, &self.name, resolvers.timeout).await;
                if let Ok(a) = &r {
                    tracing::debug!("{} -> {:?} (ttl {:?})", self.name, a.addrs, a.ttl);
                }
                c.answer(Instant::now(), self.port, r)
            }
        }
    }

    pub async fn connected(&self, ip: IpAddr) {
        self.cache.lock().await.connected(ip);
    }

    pub async fn connect_failed(&self) {
        self.cache.lock().await.connect_failed();
    }
}

/// Why a proxy's name has no address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResolveError {
    /// The name does not exist (NXDOMAIN).
    #[error("no such name (NXDOMAIN)")]
    NxDomain,
    /// The name exists but has neither A nor AAAA records.
    #[error("no A or AAAA records")]
    NoAddresses,
    /// No resolver gave an answer (the last failure).
    #[error("no resolver answered: {0}")]
    NoAnswer(String),
    /// The name is not a valid DNS name.
    #[error("not a valid DNS name")]
    BadName,
}

/// One lookup's result: the addresses of both families and how long they
/// may be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub addrs: Vec<IpAddr>,
    pub ttl: Duration,
}

/// What a connection should do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Use these addresses, in this order.
    Use(Vec<SocketAddr>),
    /// Fail with the error remembered from the last lookup.
    Fail(ResolveError),
    /// Ask the resolvers, then call [`NameCache::answer`].
    Resolve,
}

/// The sans-I/O state of one proxy name.
#[derive(Debug, Default)]
pub struct NameCache {
    addrs: Vec<IpAddr>,
    /// `None`: never resolved, or stale after a connect failure.
    expires: Option<Instant>,
    /// The family (`true` = IPv6) of the last address that connected.
    prefer_v6: Option<bool>,
    failure: Option<(ResolveError, Instant)>,
}

impl NameCache {
    /// What to do at `now` for a connection to `port`.
    pub fn lookup(&self, now: Instant, port: u16) -> Lookup {
        if let Some((e, until)) = &self.failure
            && now < *until
        {
            return Lookup::Fail(e.clone());
        }
        match self.expires {
            Some(t) if now < t && !self.addrs.is_empty() => Lookup::Use(self.order(port)),
            _ => Lookup::Resolve,
        }
    }

    /// Take a lookup's result; the addresses to use, or the error. A failed
    /// refresh keeps serving the stale addresses (and asks again after
    /// [`FAILURE_HOLD`]).
    pub fn answer(
        &mut self,
        now: Instant,
        port: u16,
        r: Result<Answer, ResolveError>,
    ) -> Result<Vec<SocketAddr>, ResolveError> {
        match r {
            Ok(a) if !a.addrs.is_empty() => {
                self.addrs = a.addrs;
                self.expires = Some(now + a.ttl.clamp(MIN_TTL, MAX_TTL));
                self.failure = None;
                Ok(self.order(port))
            }
            Ok(_) => self.answer(now, port, Err(ResolveError::NoAddresses)),
            Err(e) if !self.addrs.is_empty() => {
                tracing::warn!("refresh failed ({e}); using the previous addresses");
                self.expires = Some(now + FAILURE_HOLD);
                Ok(self.order(port))
            }
            Err(e) => {
                self.failure = Some((e.clone(), now + FAILURE_HOLD));
                Err(e)
            }
        }
    }

    /// A connection to `ip` succeeded: its family goes first from now on.
    pub fn connected(&mut self, ip: IpAddr) {
        self.prefer_v6 = Some(ip.is_ipv6());
    }

    /// No address connected: the next connection asks the resolvers again.
    pub fn connect_failed(&mut self) {
        self.expires = None;
    }

    /// The addresses with the families interleaved (RFC 8305 section 4),
    /// starting with the family that last connected, else IPv6.
    pub fn order(&self, port: u16) -> Vec<SocketAddr> {
        let first_v6 = self.prefer_v6.unwrap_or(true);
        let (mut a, mut b): (Vec<IpAddr>, Vec<IpAddr>) =
            self.addrs.iter().partition(|ip| ip.is_ipv6() == first_v6);
        let mut out = Vec::with_capacity(self.addrs.len());
        let (mut a, mut b) = (a.drain(..), b.drain(..));
        loop {
            match (a.next(), b.next()) {
                (None, None) => break,
                (x, y) => out.extend(x.into_iter().chain(y).map(|ip| SocketAddr::new(ip, port))),
            }
        }
        out
    }
}

/// Turn the A and AAAA replies of one resolver into an answer: the union of
/// their addresses with the smaller TTL, else NXDOMAIN or no records.
/// `Err` from both: this resolver gave nothing (try the next one).
pub fn combine(
    a: Result<Message, String>,
    aaaa: Result<Message, String>,
) -> Result<Answer, ResolveError> {
    let mut addrs = Vec::new();
    let mut ttl: Option<u32> = None;
    let mut nx = false;
    let mut last_err = None;
    let mut answered = false;
    for (r, v6) in [(a, false), (aaaa, true)] {
        match r {
            Ok(m) => {
                answered = true;
                let before = addrs.len();
                addrs.extend(msg::addresses(&m, v6));
                if addrs.len() > before {
                    let t = m.answers.iter().map(|r| r.ttl).min().unwrap_or(0);
                    ttl = Some(ttl.map_or(t, |x| x.min(t)));
                }
                nx |= m.metadata.response_code == ResponseCode::NXDomain;
            }
            Err(e) => last_err = Some(e),
        }
    }
    if !addrs.is_empty() {
        return Ok(Answer {
            addrs,
            ttl: Duration::from_secs(u64::from(ttl.unwrap_or(0))),
        });
    }
    if nx {
        Err(ResolveError::NxDomain)
    } else if answered {
        Err(ResolveError::NoAddresses)
    } else {
        Err(ResolveError::NoAnswer(last_err.unwrap_or_default()))
    }
}

/// Resolve `name` (A and AAAA at once) with the first resolver that
/// answers, each try bounded by `timeout`.
pub async fn resolve(
    factory: &SocketFactory,
    resolvers: &[Upstream],
    name: &str,
    timeout: Duration,
) -> Result<Answer, ResolveError> {
    let mut last = ResolveError::NoAnswer(
        "no resolver is known: none configured (direct.bootstrap, dns.upstreams) and the network's DNS servers not reported yet (network_changed)".into(),
    );
    for up in resolvers {
        let (a, aaaa) = tokio::join!(
            query(factory, up, name, false, timeout),
            query(factory, up, name, true, timeout)
        );
        match combine(a, aaaa) {
            Err(ResolveError::NoAnswer(e)) => {
                tracing::debug!("resolver {} for {name}: {e}", up.addr);
                last = ResolveError::NoAnswer(format!("{}: {e}", up.addr));
            }
            r => return r,
        }
    }
    Err(last)
}

/// One question to one resolver, bounded by `timeout`.
pub(crate) async fn query(
    factory: &SocketFactory,
    up: &Upstream,
    name: &str,
    v6: bool,
    timeout: Duration,
) -> Result<Message, String> {
    let q = msg::build_query(name, v6).ok_or("not a valid DNS name")?;
    let question = q.queries.first().ok_or("no question")?.clone();
    let id = q.metadata.id;
    let wire = msg::encode(&q);
    let exchange = async {
        if up.proto == UpstreamProto::Udp {
            let sock = factory.udp_connected(up.addr).map_err(|e| e.to_string())?;
            match udp_exchange(&sock, &wire, id, &question).await {
                Err(msg::BadReply::Truncated) => {}
                r => return r.map_err(|e| format!("{e:?}")),
            }
        }
        // TCP: asked for, or the UDP reply was truncated (RFC 7766).
        let mut s = factory
            .connect_tcp(up.addr)
            .await
            .map_err(|e| e.to_string())?;
        use tokio::io::AsyncWriteExt;
        let frame = length_prefixed(&wire).map_err(|e| e.to_string())?;
        s.write_all(&frame).await.map_err(|e| e.to_string())?;
        let reply = read_frame(&mut s).await.map_err(|e| e.to_string())?;
        msg::check_reply(&reply, id, &question).map_err(|e| format!("{e:?}"))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(format!("timed out after {timeout:?}")),
    }
}

async fn udp_exchange(
    sock: &UdpSocket,
    wire: &[u8],
    id: u16,
    question: &hickory_proto::op::Query,
) -> Result<Message, msg::BadReply> {
    sock.send(wire).await.map_err(|_| msg::BadReply::Failed)?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let n = sock
            .recv(&mut buf)
            .await
            .map_err(|_| msg::BadReply::Failed)?;
        // Anything that is not the reply (a late answer to another try, a
        // guess at the ID) is dropped and the wait goes on.
        match msg::check_reply(buf.get(..n).unwrap_or_default(), id, question) {
            Err(msg::BadReply::Mismatch) => continue,
            r => return r,
        }
    }
}

/// Connect to the first of `addrs` that answers: a new attempt starts every
/// [`ATTEMPT_DELAY`] or as soon as the previous one fails, and the first
/// to connect wins (the others are dropped). The error is the last
/// attempt's.
pub async fn connect_happy(
    factory: &SocketFactory,
    addrs: &[SocketAddr],
) -> io::Result<(TcpStream, SocketAddr)> {
    let mut set = JoinSet::new();
    let mut pending = addrs.iter().copied();
    let mut last_err = io::Error::new(io::ErrorKind::NotFound, "no address to connect to");
    loop {
        // Each turn follows a failure or the timer: start the next address.
        if let Some(a) = pending.next() {
            let f = factory.clone();
            set.spawn(async move { (a, f.connect_tcp(a).await) });
        }
        if set.is_empty() {
            return Err(last_err);
        }
        let more = pending.len() > 0;
        tokio::select! {
            r = set.join_next() => match r {
                Some(Ok((a, Ok(s)))) => return Ok((s, a)),
                Some(Ok((a, Err(e)))) => {
                    tracing::debug!("connect to {a}: {e}");
                    last_err = e;
                }
                Some(Err(e)) => last_err = io::Error::other(e),
                None => {}
            },
            () = tokio::time::sleep(ATTEMPT_DELAY), if more => {}
        }
    }
}

/// A UDP socket connected to the first of `addrs` the host has a route to
/// (a family without one fails at `connect` at once).
pub fn udp_first(factory: &SocketFactory, addrs: &[SocketAddr]) -> io::Result<UdpSocket> {
    let mut last_err = io::Error::new(io::ErrorKind::NotFound, "no address to send to");
    for &a in addrs {
        match factory.udp_connected(a) {
            Ok(s) => return Ok(s),
            Err(e) => last_err = e,
        }
    }
    Err(last_err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{MessageType, OpCode};
    use hickory_proto::rr::rdata::{A, AAAA};
    use hickory_proto::rr::{Name, RData, Record};

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    fn answer(addrs: &[&str], ttl: u64) -> Result<Answer, ResolveError> {
        Ok(Answer {
            addrs: addrs.iter().map(|a| ip(a)).collect(),
            ttl: Duration::from_secs(ttl),
        })
    }

    fn reply(code: ResponseCode, addrs: &[(&str, u32)]) -> Message {
        let mut m = Message::new(1, MessageType::Response, OpCode::Query);
        m.metadata.response_code = code;
        let name = Name::from_ascii("ss.test.").expect("name");
        for (a, ttl) in addrs {
            let data = match ip(a) {
                IpAddr::V4(v4) => RData::A(A(v4)),
                IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
            };
            m.answers.push(Record::from_rdata(name.clone(), *ttl, data));
        }
        m
    }

    #[test]
    fn cache_follows_the_ttl_and_connect_failures() {
        let t0 = Instant::now();
        let mut c = NameCache::default();
        assert_eq!(c.lookup(t0, 8388), Lookup::Resolve, "nothing known yet");
        let got = c.answer(t0, 8388, answer(&["198.51.100.1"], 30));
        assert_eq!(got, Ok(vec![sa("198.51.100.1:8388")]));
        assert_eq!(
            c.lookup(t0 + Duration::from_secs(29), 8388),
            Lookup::Use(vec![sa("198.51.100.1:8388")])
        );
        assert_eq!(
            c.lookup(t0 + Duration::from_secs(30), 8388),
            Lookup::Resolve
        );
        // A connect failure makes the answer stale at once.
        c.connect_failed();
        assert_eq!(c.lookup(t0, 8388), Lookup::Resolve);
        // The server moved: the new answer replaces the old one.
        let got = c.answer(t0, 8388, answer(&["198.51.100.2"], 30));
        assert_eq!(got, Ok(vec![sa("198.51.100.2:8388")]));
        // TTLs are clamped.
        c.answer(t0, 1, answer(&["198.51.100.2"], 0))
            .expect("ttl 0");
        assert_eq!(c.lookup(t0 + MIN_TTL, 1), Lookup::Resolve);
        c.answer(t0, 1, answer(&["198.51.100.2"], 86_400))
            .expect("a day");
        assert_eq!(c.lookup(t0 + MAX_TTL, 1), Lookup::Resolve);
    }

    #[test]
    fn failures_are_held_and_stale_answers_served() {
        let t0 = Instant::now();
        let mut c = NameCache::default();
        assert_eq!(
            c.answer(t0, 1, Err(ResolveError::NxDomain)),
            Err(ResolveError::NxDomain)
        );
        assert_eq!(c.lookup(t0, 1), Lookup::Fail(ResolveError::NxDomain));
        assert_eq!(c.lookup(t0 + FAILURE_HOLD, 1), Lookup::Resolve);
        assert_eq!(
            c.answer(t0, 1, answer(&[], 30)),
            Err(ResolveError::NoAddresses),
            "an empty answer is a failure"
        );
        c.answer(t0, 1, answer(&["192.0.2.1"], 30)).expect("fixed");
        assert_eq!(c.lookup(t0, 1), Lookup::Use(vec![sa("192.0.2.1:1")]));
        // A failed refresh keeps the old address for a while.
        c.connect_failed();
        let r = c.answer(t0, 1, Err(ResolveError::NoAnswer("timed out".into())));
        assert_eq!(r, Ok(vec![sa("192.0.2.1:1")]));
        assert_eq!(c.lookup(t0, 1), Lookup::Use(vec![sa("192.0.2.1:1")]));
        assert_eq!(c.lookup(t0 + FAILURE_HOLD, 1), Lookup::Resolve);
    }

    #[test]
    fn order_interleaves_and_prefers_what_worked() {
        let mut c = NameCache::default();
        c.answer(
            Instant::now(),
            443,
            answer(
                &["192.0.2.1", "192.0.2.2", "2001:db8::1", "2001:db8::2"],
                60,
            ),
        )
        .expect("answer");
        let v6_first = vec![
            sa("[2001:db8::1]:443"),
            sa("192.0.2.1:443"),
            sa("[2001:db8::2]:443"),
            sa("192.0.2.2:443"),
        ];
        assert_eq!(c.order(443), v6_first, "IPv6 first when nothing is known");
        c.connected(ip("192.0.2.2"));
        assert_eq!(
            c.order(443),
            vec![
                sa("192.0.2.1:443"),
                sa("[2001:db8::1]:443"),
                sa("192.0.2.2:443"),
                sa("[2001:db8::2]:443"),
            ],
            "the family that connected goes first"
        );
        c.connected(ip("2001:db8::2"));
        assert_eq!(c.order(443), v6_first);
    }

    /// A phone's engine (the host reports the network's DNS servers)
    /// reads no resolver file and accepts a proxy given by host name with
    /// nothing configured; an engine that can never learn a resolver
    /// refuses it, naming the proxy.
    #[test]
    fn a_phone_accepts_a_proxy_name_before_it_knows_a_resolver() {
        use std::collections::BTreeMap;

        use crate::config::{OutboundConfig, OutboundUdp, Socks5Config};
        use crate::outbound::config::DirectConfig;
        use crate::outbound::{Address, Outbounds, SocketFactory};
        use crate::relay::RelayConfig;

        let mut outs = BTreeMap::new();
        outs.insert(
            "proxy".to_string(),
            OutboundConfig::Socks5(Socks5Config {
                server: Address::Domain("proxy.test".into(), 1080),
                username: None,
                password: None,
                udp: OutboundUdp::Relay,
            }),
        );
        let build = |r: Resolvers| {
            let factory = SocketFactory::new(&DirectConfig::default(), None);
            Outbounds::new(
                &outs,
                &BTreeMap::new(),
                &[],
                &RelayConfig::default(),
                factory,
                64 * 1024,
                r,
            )
        };
        let t = Duration::from_secs(1);
        let phone = Resolvers::from_network(&[], &[], t);
        assert!(phone.list().is_empty(), "a phone has no resolver file");
        assert!(!phone.is_empty(), "it waits for the network's servers");
        assert!(build(phone).is_ok());
        let Err(e) = build(Resolvers::new(Vec::new(), t)) else {
            panic!("nothing could ever resolve proxy.test")
        };
        let e = e.to_string();
        assert!(
            e.contains("proxy") && e.contains("no resolver is known"),
            "{e}"
        );
        // What is configured still comes first on a phone.
        let dns: Vec<Upstream> = vec!["udp://192.0.2.53:53".parse().expect("upstream")];
        assert_eq!(Resolvers::from_network(&[], &dns, t).list(), &dns);
    }

    #[test]
    fn combine_replies() {
        let a = reply(
            ResponseCode::NoError,
            &[("192.0.2.1", 300), ("192.0.2.2", 60)],
        );
        let aaaa = reply(ResponseCode::NoError, &[("2001:db8::1", 120)]);
        let got = combine(Ok(a.clone()), Ok(aaaa)).expect("both");
        assert_eq!(got.addrs.len(), 3);
        assert_eq!(got.ttl, Duration::from_secs(60), "the smallest TTL");
        // IPv6 only: an empty A reply does not shorten the TTL.
        let empty = reply(ResponseCode::NoError, &[]);
        let v6 = reply(ResponseCode::NoError, &[("2001:db8::1", 120)]);
        let got = combine(Ok(empty.clone()), Ok(v6)).expect("v6 only");
        assert_eq!(got.addrs, vec![ip("2001:db8::1")]);
        assert_eq!(got.ttl, Duration::from_secs(120));
        // One family lost: the other still answers.
        let got = combine(Ok(a), Err("timed out".into())).expect("a only");
        assert_eq!(got.addrs.len(), 2);
        let nx = reply(ResponseCode::NXDomain, &[]);
        assert_eq!(combine(Ok(nx.clone()), Ok(nx)), Err(ResolveError::NxDomain));
        assert_eq!(
            combine(Ok(empty.clone()), Ok(empty)),
            Err(ResolveError::NoAddresses)
        );
        assert_eq!(
            combine(Err("x".into()), Err("timed out".into())),
            Err(ResolveError::NoAnswer("timed out".into()))
        );
    }

    #[test]
    fn resolv_conf_nameservers() {
        let text = "# generated\nsearch lan\nnameserver 127.0.0.53\nnameserver 192.0.2.53\n\
                    nameserver   2001:db8::53 \nnameserver fe80::1%eth0\nnameserver ::1\noptions edns0\n";
        assert_eq!(
            nameservers(text),
            vec![ip("192.0.2.53"), ip("2001:db8::53")]
        );
        assert!(nameservers("nameserver\n").is_empty());
        let up = |s: &str| s.parse::<Upstream>().expect("upstream");
        let t = Duration::from_secs(1);
        let boot = [up("udp://192.0.2.1:53")];
        let dns = [
            up("tls://192.0.2.2:853#dns.example"),
            up("tcp://192.0.2.3:53"),
        ];
        assert_eq!(Resolvers::pick(&boot, &dns, t).list(), &boot);
        assert_eq!(
            Resolvers::pick(&[], &dns, t).list(),
            &dns[1..],
            "not DNS over TLS"
        );
    }

    /// The network's DNS servers replace the configured upstreams (or the
    /// system's) once the host reports some, never `bootstrap`; an empty
    /// report gives the configured ones back.
    #[test]
    fn the_networks_servers_serve_unless_bootstrap_is_set() {
        let up = |s: &str| s.parse::<Upstream>().expect("upstream");
        let t = Duration::from_secs(1);
        let boot = [up("udp://192.0.2.1:53")];
        let dns = [up("tcp://192.0.2.3:53")];
        let phone = [up("udp://100.64.0.1:53"), up("udp://[2001:db8::1]:53")];
        // The pure choice.
        assert_eq!(choose(&dns, false, &[]), &dns, "nothing reported yet");
        assert_eq!(choose(&dns, false, &phone), &phone);
        assert_eq!(choose(&boot, true, &phone), &boot, "bootstrap pins");
        assert_eq!(choose(&[], false, &phone), &phone, "no configured one");
        // Through `Resolvers`, clones share what the host reported.
        let picked = Resolvers::pick(&[], &dns, t);
        let clone = picked.clone();
        assert_eq!(picked.current(), dns, "before any network change");
        clone.set_platform(&[
            ip("100.64.0.1"),
            ip("127.0.0.1"),
            ip("fe80::1"),
            ip("::"),
            ip("2001:db8::1"),
        ]);
        assert_eq!(
            picked.current(),
            phone,
            "port 53 over UDP, without loopback, link-local or unspecified"
        );
        picked.set_platform(&[ip("fe80::1")]);
        assert_eq!(picked.current(), dns, "nothing usable reported");
        let pinned = Resolvers::pick(&boot, &dns, t);
        pinned.set_platform(&[ip("100.64.0.1")]);
        assert_eq!(pinned.current(), boot);
    }

    fn factory() -> SocketFactory {
        SocketFactory::new(&crate::config::DirectConfig::default(), None)
    }

    /// A listener whose accept queue is full: further SYNs are dropped and
    /// a connect to it hangs, like one to an unreachable address.
    fn black_hole() -> (socket2::Socket, Vec<std::net::TcpStream>, SocketAddr) {
        use socket2::{Domain, Socket, Type};
        let l = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
        l.bind(&sa("127.0.0.1:0").into()).expect("bind");
        l.listen(0).expect("listen");
        let addr = l
            .local_addr()
            .expect("addr")
            .as_socket()
            .expect("inet address");
        // Fill the queue (a backlog of 0 still takes one or two).
        let mut fill = Vec::new();
        for _ in 0..4 {
            let s = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
            s.set_nonblocking(true).expect("nonblocking");
            let _ = s.connect(&addr.into());
            fill.push(std::net::TcpStream::from(s));
        }
        std::thread::sleep(Duration::from_millis(50));
        (l, fill, addr)
    }

    #[tokio::test]
    async fn happy_eyeballs_staggers_and_skips_failures() {
        let good = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("listener");
        let good_addr = good.local_addr().expect("addr");
        // A refused address fails at once: the next starts without waiting.
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr")
        };
        let t = Instant::now();
        let (_s, a) = connect_happy(&factory(), &[closed, good_addr])
            .await
            .expect("second address");
        assert_eq!(a, good_addr);
        assert!(t.elapsed() < ATTEMPT_DELAY, "{:?}", t.elapsed());
        // A hanging address: the next starts after the attempt delay, long
        // before the hanging connect would time out.
        let (_l, _fill, hole) = black_hole();
        let t = Instant::now();
        let (_s, a) = connect_happy(&factory(), &[hole, good_addr])
            .await
            .expect("raced past the hang");
        assert_eq!(a, good_addr);
        let took = t.elapsed();
        assert!(
            took >= ATTEMPT_DELAY && took < 4 * ATTEMPT_DELAY,
            "{took:?}"
        );
        // Nothing works: the last error.
        let e = connect_happy(&factory(), &[closed])
            .await
            .expect_err("refused");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
        let e = connect_happy(&factory(), &[]).await.expect_err("empty");
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
