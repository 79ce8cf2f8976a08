//! Outbounds: direct, SOCKS5 and Shadowsocks, and the rules that pick one
//! per connection (at SYN time) and per UDP flow.
//!
//! Every socket the engine opens toward the network, to a destination or to
//! a proxy, goes through [`SocketFactory`], which applies the loop-avoidance
//! the host chose (bind to an interface, an fwmark, or the app's
//! `protect(fd)` hook) before the first packet leaves, so nothing the engine
//! sends loops back into the TUN.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use socket2::{Domain, Protocol, SockRef, Socket, Type};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream, UdpSocket};

use crate::framing::Framing;
use crate::relay::{RelayConfig, RelayOptions};
use crate::rules::{Action, Rule, RuleError, RuleSet, Target};
use crate::stats::{OutboundCounters, Stats};

pub mod addr;
pub mod config;
pub mod group;
pub mod link;
pub mod nat64;
pub mod resolve;
pub mod shadowsocks;
pub mod socks5;

pub use addr::Address;
use config::{BadOutbound, DirectConfig, OutboundConfig, OutboundUdp};
use group::{BadGroup, GroupConfig, Groups, Pick};
use shadowsocks::{Key, ShadowsocksError, UdpSession};
use socks5::{Credentials, HandshakeError, Socks5Error};

/// The host's hook to exempt a socket from the VPN (Android
/// `VpnService.protect(fd)`). Called once per outbound socket, before connect.
pub trait Protect: Send + Sync + fmt::Debug {
    /// Return an error to abort the connection (it is counted and the app sees a reset).
    fn protect(&self, fd: i32) -> Result<(), String>;
}

/// Creates outbound sockets with the configured loop avoidance applied.
#[derive(Debug, Clone)]
pub struct SocketFactory {
    interface: Option<String>,
    fwmark: Option<u32>,
    protect: Option<Arc<dyn Protect>>,
    connect_timeout: Duration,
    /// The default interface the host reported last
    /// (`Engine::network_changed`), shared by every clone: once the host
    /// reported one, new sockets bind to it instead of `direct.interface`.
    /// Read once per new socket, never per packet.
    uplink: Arc<parking_lot::RwLock<Uplink>>,
    /// The network's NAT64 prefix, shared by every clone: connects to IPv4
    /// go inside it while the network has no IPv4 (`nat64.rs`).
    nat64: Arc<nat64::Nat64>,
}

/// Where new direct sockets are bound ([`SocketFactory::rebind`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
enum Uplink {
    /// The host never reported a network: `direct.interface`, if set.
    #[default]
    Configured,
    /// The host's default interface (`None`: no network, nothing to bind to).
    Host(Option<crate::network::DefaultInterface>),
}

impl SocketFactory {
    pub fn new(cfg: &DirectConfig, protect: Option<Arc<dyn Protect>>) -> Self {
        Self {
            interface: cfg.interface.clone(),
            fwmark: cfg.fwmark,
            protect,
            connect_timeout: Duration::from_millis(cfg.connect_timeout_ms.max(1)),
            uplink: Arc::default(),
            nat64: Arc::default(),
        }
    }

    /// The NAT64 prefix its connects use (`nat64.rs`).
    pub fn nat64(&self) -> &Arc<nat64::Nat64> {
        &self.nat64
    }

    /// Bind the sockets made from now on (by this factory and its clones)
    /// to the host's new default interface: by name with SO_BINDTODEVICE
    /// (Linux/Android), by index with IP_BOUND_IF (Darwin). Sockets made
    /// before keep their binding.
    pub fn rebind(&self, to: Option<crate::network::DefaultInterface>) {
        *self.uplink.write() = Uplink::Host(to);
    }

    fn prepare(&self, sock: &Socket, v6: bool) -> io::Result<()> {
        sock.set_nonblocking(true)?;
        let uplink = self.uplink.read().clone();
        #[cfg(linux_like)]
        {
            match &uplink {
                Uplink::Configured => {
                    if let Some(ifname) = &self.interface {
                        sock.bind_device(Some(ifname.as_bytes()))?;
                    }
                }
                Uplink::Host(Some(i)) if !i.name.is_empty() => bind_host_name(sock, &i.name)?,
                Uplink::Host(_) => {}
            }
            if let Some(mark) = self.fwmark {
                sock.set_mark(mark)?;
            }
        }
        #[cfg(not(linux_like))]
        {
            if self.interface.is_some() || self.fwmark.is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "direct.interface / direct.fwmark are Linux-only; use the protect hook",
                ));
            }
        }
        #[cfg(apple)]
        if let Uplink::Host(Some(i)) = &uplink
            && let Some(idx) = std::num::NonZeroU32::new(i.index)
        {
            if v6 {
                sock.bind_device_by_index_v6(Some(idx))?;
            } else {
                sock.bind_device_by_index_v4(Some(idx))?;
            }
        }
        #[cfg(not(apple))]
        let _ = v6; // only Darwin binds per family
        if let Some(p) = &self.protect {
            p.protect(sock.as_raw_fd())
                .map_err(|e| io::Error::other(format!("protect(fd) refused: {e}")))?;
        }
        Ok(())
    }

    /// The configured connect timeout (also bounds proxy handshakes).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Connect a direct TCP socket, bounded by the configured timeout (to
    /// IPv4 through the network's NAT64 prefix while it has one).
    pub async fn connect_tcp(&self, dst: SocketAddr) -> io::Result<TcpStream> {
        let dst = self.nat64.synthesize(dst);
        let sock = Socket::new(Domain::for_address(dst), Type::STREAM, Some(Protocol::TCP))?;
        self.prepare(&sock, dst.is_ipv6())?;
        // Best effort: a connection without keepalive still works.
        let _ = set_keepalive(SockRef::from(&sock));
        let sock = TcpSocket::from_std_stream(std::net::TcpStream::from(sock));
        match tokio::time::timeout(self.connect_timeout, sock.connect(dst)).await {
            Ok(r) => {
                let s = r?;
                s.set_nodelay(true)?;
                Ok(s)
            }
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connect to {dst} timed out"),
            )),
        }
    }

    /// A connected direct UDP socket for one flow (to IPv4 through the
    /// network's NAT64 prefix while it has one).
    pub fn udp_connected(&self, dst: SocketAddr) -> io::Result<UdpSocket> {
        let dst = self.nat64.synthesize(dst);
        let sock = Socket::new(Domain::for_address(dst), Type::DGRAM, Some(Protocol::UDP))?;
        self.prepare(&sock, dst.is_ipv6())?;
        sock.connect(&dst.into())?;
        UdpSocket::from_std(std::net::UdpSocket::from(sock))
    }

    /// An unconnected direct UDP socket of one family, bound to a port of
    /// its own: an endpoint-independent mapping, sent from to any
    /// destination (`udp/flow.rs`, `Mapping`).
    pub fn udp_unconnected(&self, v6: bool) -> io::Result<UdpSocket> {
        let any: SocketAddr = if v6 {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        };
        let sock = Socket::new(Domain::for_address(any), Type::DGRAM, Some(Protocol::UDP))?;
        self.prepare(&sock, v6)?;
        if v6 {
            sock.set_only_v6(true)?;
        }
        sock.bind(&any.into())?;
        UdpSocket::from_std(std::net::UdpSocket::from(sock))
    }
}

/// SO_BINDTODEVICE to the host's default interface. Kernels before 5.7
/// refuse it without CAP_NET_RAW, which an Android app does not hold: the
/// socket then stays unbound (warned once per process), and the protect
/// hook and the routes keep it off the TUN as they did before any network
/// change, as quinn-udp falls back when an option is refused.
#[cfg(linux_like)]
fn bind_host_name(sock: &Socket, name: &str) -> io::Result<()> {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    match sock.bind_device(Some(name.as_bytes())) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            if !WARNED.swap(true, Relaxed) {
                tracing::warn!(
                    "binding outbound sockets to {name}: {e}; they stay unbound (the routes pick the interface)"
                );
            }
            Ok(())
        }
        other => other,
    }
}

/// TCP keepalive on both legs of a relayed connection (the outbound socket
/// and, on the system stack, the app's accepted socket): a peer that
/// vanished without a FIN or an RST (a server whose host died, a path that
/// went dark) is found after [`KEEPALIVE_IDLE`] of silence plus
/// [`KEEPALIVE_PROBES`] unanswered probes [`KEEPALIVE_INTERVAL`] apart, 7
/// minutes in all, instead of never (the kernel's default is off, and 2 h
/// plus 9 x 75 s when on). The relay then fails and the session frees its
/// task, its two descriptors and its admission permit.
///
/// Why 5 minutes: probes go out only on a connection idle that long, so a
/// connection moving data costs nothing, and an idle one costs one small
/// packet per 5 minutes (applications that keep connections open longer,
/// such as push channels, ping more often than that themselves). Four
/// probes 30 s apart ride out a short loss of coverage.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(300);
/// See [`KEEPALIVE_IDLE`].
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// See [`KEEPALIVE_IDLE`].
pub const KEEPALIVE_PROBES: u32 = 4;

/// Turn on TCP keepalive with the engine's values ([`KEEPALIVE_IDLE`]).
pub fn set_keepalive(s: SockRef<'_>) -> io::Result<()> {
    let ka = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    s.set_tcp_keepalive(&ka)
}

/// Close a TCP socket with an RST instead of a FIN (SO_LINGER 0), so the
/// peer learns at once that the connection failed.
pub fn reset_on_close(s: &TcpStream) {
    let _ = SockRef::from(s).set_linger(Some(Duration::ZERO));
}

/// Where a flow goes, decided once (SYN time for TCP, first datagram for UDP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Direct,
    Reject,
    /// Index into the configured outbounds (sorted by name).
    Proxy(usize),
}

/// A configured proxy, with its key material derived once at start.
#[derive(Debug)]
enum Proxy {
    Socks5 {
        server: Server,
        creds: Option<Credentials>,
        udp: OutboundUdp,
    },
    Shadowsocks {
        server: Server,
        key: Key,
        udp: OutboundUdp,
    },
}

/// Where a proxy is: an address, or a host name resolved when needed.
#[derive(Debug)]
enum Server {
    Ip(SocketAddr),
    Name(Box<resolve::Named>),
}

impl Server {
    fn new(a: &Address) -> Server {
        match a {
            Address::Ip(a) => Server::Ip(*a),
            Address::Domain(name, port) => Server::Name(Box::new(resolve::Named::new(name, *port))),
        }
    }
}

/// Why an outbound could not be opened. Counted (per outbound for proxies);
/// the app sees a reset, or the datagram is dropped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboundError {
    /// Connecting or talking to the destination or the proxy failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The proxy did not finish its handshake in time.
    #[error("proxy handshake timed out after {0:?}")]
    Timeout(Duration),
    /// The SOCKS5 proxy refused or misbehaved.
    #[error("socks5: {0}")]
    Socks5(#[from] Socks5Error),
    /// A Shadowsocks frame could not be built or read.
    #[error("shadowsocks: {0}")]
    Shadowsocks(#[from] ShadowsocksError),
    /// The route is `reject`, or the outbound does not relay UDP.
    #[error("refused by the rules")]
    Rejected,
    /// A direct connection was asked for a domain that was not resolved.
    #[error("direct connection to unresolved {0}")]
    Unresolved(String),
    /// The host name of a proxy server did not resolve.
    #[error("outbound {outbound}: cannot resolve {name}: {reason}")]
    Resolve {
        outbound: String,
        name: String,
        reason: resolve::ResolveError,
    },
}

impl From<HandshakeError> for OutboundError {
    fn from(e: HandshakeError) -> Self {
        match e {
            HandshakeError::Io(e) => OutboundError::Io(e),
            HandshakeError::Protocol(e) => OutboundError::Socks5(e),
            HandshakeError::Timeout(t) => OutboundError::Timeout(t),
        }
    }
}

impl OutboundError {
    /// A proxy that answered wrongly (rather than a network failure).
    pub fn is_protocol(&self) -> bool {
        matches!(
            self,
            OutboundError::Socks5(_) | OutboundError::Shadowsocks(_)
        )
    }
}

/// A connected TCP outbound, handshake done, ready for the relay.
#[derive(Debug)]
pub struct OutboundStream {
    pub stream: TcpStream,
    /// The framing the outbound speaks over the socket (Shadowsocks AEAD);
    /// `None` means the socket carries the app's bytes unchanged (direct,
    /// SOCKS5, `none`) and can be spliced. Boxed: cipher state is large and
    /// most streams have none.
    pub framing: Option<Box<dyn Framing>>,
    /// Which outbound this is, in the generation of the configuration
    /// that connected it.
    pub route: Route,
    /// That outbound's counters (`None`: direct), which also name it: the
    /// stream keeps them across a reload, where `route` alone could name
    /// another outbound of the new configuration.
    pub counters: Option<Arc<OutboundCounters>>,
    /// The names of the rule and groups that chose it, when any did (for
    /// the connection list; set by the dispatcher, which knows them).
    pub why: Option<Box<Explained>>,
}

impl OutboundStream {
    /// The outbound's name: `direct`, or the proxy's.
    pub fn outbound_name(&self) -> &str {
        self.counters.as_ref().map_or("direct", |c| c.name.as_str())
    }
}

/// Groups a connection record names on its way to an outbound, at most.
pub const MAX_CHAIN: usize = 4;

/// Why a flow took its route: the rule that matched (`None`: no rule did,
/// the default route) and the groups it went through, outermost first.
/// Eight bytes and `Copy`, so deciding a flow stays free of allocation;
/// [`Outbounds::explain`] names them in the configuration that decided (a
/// reload replaces the rules and groups these index). A rule past the
/// 65,535th, or a group past the 255th, is not named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Why {
    rule: u16,
    groups: [u8; MAX_CHAIN],
    depth: u8,
}

impl Default for Why {
    fn default() -> Self {
        Why {
            rule: u16::MAX,
            groups: [0; MAX_CHAIN],
            depth: 0,
        }
    }
}

impl Why {
    /// The index of the rule that matched, if one did.
    pub fn rule(&self) -> Option<usize> {
        (self.rule != u16::MAX).then_some(usize::from(self.rule))
    }

    fn push_group(&mut self, g: usize) {
        if let (Some(slot), Ok(g)) = (
            self.groups.get_mut(usize::from(self.depth)),
            u8::try_from(g),
        ) {
            *slot = g;
            self.depth += 1;
        }
    }

    fn groups(&self) -> impl Iterator<Item = usize> + '_ {
        self.groups[..usize::from(self.depth)]
            .iter()
            .map(|&g| usize::from(g))
    }
}

/// The names behind a [`Why`]: what a connection record keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explained {
    /// The rule's label ([`Rule::label`]); `None`: no rule matched.
    pub rule: Option<Arc<str>>,
    /// The groups, outermost first.
    pub chain: Box<[Box<str>]>,
}

/// Why the outbounds and rules of a configuration cannot be set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    #[error(transparent)]
    Outbound(#[from] BadOutbound),
    #[error(transparent)]
    Rule(#[from] RuleError),
    #[error(transparent)]
    Group(#[from] BadGroup),
}

/// The outbounds and rules of one engine.
#[derive(Debug)]
pub struct Outbounds {
    factory: SocketFactory,
    /// Who resolves proxy host names.
    resolvers: resolve::Resolvers,
    names: Vec<String>,
    /// Per proxy, in the order of `names`; a reload carries them over by
    /// name ([`Outbounds::carry_counters`]).
    counters: Box<[Arc<OutboundCounters>]>,
    proxies: Vec<Proxy>,
    /// The groups (`[groups]`), each with its current member.
    groups: Groups,
    /// The configured rules, compiled, each with its route or group.
    rules: RuleSet<Pick>,
    /// What the connection list calls each rule ([`Rule::label`]).
    rule_labels: Vec<Arc<str>>,
    /// TCP relay options (`[relay]`).
    pub relay: RelayOptions,
}

impl Outbounds {
    /// Resolve `rules` against the configured outbounds and derive keys.
    pub fn new(
        outbounds: &BTreeMap<String, OutboundConfig>,
        rules: &[Rule],
        relay: &RelayConfig,
        factory: SocketFactory,
        relay_buffer: usize,
        resolvers: resolve::Resolvers,
    ) -> Result<Self, SetupError> {
        let none = BTreeMap::new();
        Self::with_groups(
            outbounds,
            &none,
            rules,
            relay,
            factory,
            relay_buffer,
            resolvers,
        )
    }

    /// [`Outbounds::new`] with groups (`[groups]`) rules may name too.
    pub fn with_groups(
        outbounds: &BTreeMap<String, OutboundConfig>,
        groups: &BTreeMap<String, GroupConfig>,
        rules: &[Rule],
        relay: &RelayConfig,
        factory: SocketFactory,
        relay_buffer: usize,
        resolvers: resolve::Resolvers,
    ) -> Result<Self, SetupError> {
        let mut names = Vec::new();
        let mut proxies = Vec::new();
        for (name, o) in outbounds {
            let bad = |reason: String| BadOutbound {
                name: name.clone(),
                reason,
            };
            if let Address::Domain(host, _) = o.server()
                && resolvers.is_empty()
            {
                return Err(bad(format!(
                    "server {host} is a host name and no resolver is known: set direct.bootstrap (or dns.upstreams)"
                ))
                .into());
            }
            proxies.push(match o {
                OutboundConfig::Socks5(c) => Proxy::Socks5 {
                    server: Server::new(&c.server),
                    creds: match (&c.username, &c.password) {
                        (Some(u), Some(p)) => Some(Credentials {
                            username: u.clone(),
                            password: p.clone(),
                        }),
                        _ => None,
                    },
                    udp: c.udp,
                },
                OutboundConfig::Shadowsocks(c) => Proxy::Shadowsocks {
                    server: Server::new(&c.server),
                    key: Key::new(c.method, &c.password).map_err(|e| bad(e.to_string()))?,
                    udp: c.udp,
                },
            });
            names.push(name.clone());
        }
        let groups = Groups::new(groups, |n| names.iter().position(|x| x == n))?;
        let rule_labels = rules
            .iter()
            .enumerate()
            .map(|(i, r)| Arc::from(r.label(i)))
            .collect();
        let rules = RuleSet::compile(rules, |i, r| {
            Ok(match &r.action {
                Action::Direct => Pick::Route(Route::Direct),
                Action::Reject => Pick::Route(Route::Reject),
                Action::Outbound(n) => match names.iter().position(|x| **x == **n) {
                    Some(idx) => Pick::Route(Route::Proxy(idx)),
                    None => match groups.index(n) {
                        Some(g) => Pick::Group(g),
                        None => {
                            return Err(RuleError::UnknownOutbound {
                                rule: i,
                                name: n.to_string(),
                            });
                        }
                    },
                },
            })
        })?;
        let counters = names
            .iter()
            .map(|n| {
                Arc::new(OutboundCounters {
                    name: n.clone(),
                    ..OutboundCounters::default()
                })
            })
            .collect();
        Ok(Outbounds {
            factory,
            resolvers,
            names,
            counters,
            proxies,
            groups,
            rules,
            rule_labels,
            relay: RelayOptions {
                splice: relay.splice,
                buffer: relay_buffer,
                pipe_size: relay.pipe_size,
            },
        })
    }

    /// The route of a destination: the first matching rule's, else direct;
    /// a rule naming a group takes the group's current member. A few hash
    /// lookups per domain rule, an atomic load per group level; no
    /// allocation.
    pub fn route(&self, dst: &Target<'_>) -> Route {
        self.route_why(dst).0
    }

    /// [`Outbounds::route`], with the rule and groups that chose it.
    pub fn route_why(&self, dst: &Target<'_>) -> (Route, Why) {
        let mut why = Why::default();
        let route = match self.rules.decide_at(dst) {
            Some((i, pick)) => {
                why.rule = u16::try_from(i).unwrap_or(u16::MAX);
                match pick {
                    Pick::Route(r) => *r,
                    Pick::Group(g) => self.groups.resolve_path(*g, &mut why),
                }
            }
            None => Route::Direct,
        };
        (route, why)
    }

    /// Name what `why` holds: the rule's label ([`Rule::label`]) and the
    /// groups, outermost first; `None` when neither a rule nor a group
    /// chose the route (the default route), which allocates nothing.
    pub fn explain(&self, why: &Why) -> Option<Box<Explained>> {
        let rule = why.rule().and_then(|i| self.rule_labels.get(i).cloned());
        if rule.is_none() && why.depth == 0 {
            return None;
        }
        let chain = why.groups().map(|g| self.groups.name(g).into()).collect();
        Some(Box::new(Explained { rule, chain }))
    }

    /// Whether a domain (sniffed from the connection's first bytes) could
    /// route a connection to the real address `addr` differently than the
    /// address alone: some rule with domain conditions that `addr` passes
    /// comes before the first address-only rule matching it and leads
    /// elsewhere. When false, sniffing would only delay the connection.
    pub fn needs_domain(&self, addr: SocketAddr) -> bool {
        self.rules.needs_domain(addr, &Pick::Route(Route::Direct))
    }

    /// [`Outbounds::needs_domain`] for a flow on `network` (rules with a
    /// `network` condition count only for their transport).
    pub fn needs_domain_on(&self, network: crate::rules::Network, addr: SocketAddr) -> bool {
        self.rules
            .needs_domain_on(network, addr, &Pick::Route(Route::Direct))
    }

    /// Whether a flow of `network` to `addr` must know its owner before it
    /// is routed: a `package` / `uid` rule could match it
    /// ([`crate::rules::RuleSet::needs_owner_on`]).
    pub fn needs_owner_on(&self, network: crate::rules::Network, addr: SocketAddr) -> bool {
        self.rules.needs_owner_on(network, addr)
    }

    /// The host reported a network whose DNS servers are `servers`: they
    /// resolve proxy host names from now on, unless `[direct] bootstrap`
    /// is set ([`resolve::Resolvers::set_platform`]).
    pub fn set_platform_dns(&self, servers: &[std::net::IpAddr]) {
        self.resolvers.set_platform(servers);
    }

    /// The time one DNS question to a resolver may take (`dns.timeout_ms`).
    pub fn resolver_timeout(&self) -> Duration {
        self.resolvers.timeout()
    }

    /// Forget every proxy address learned by resolving a host name (the
    /// network moved: they may not hold on the new one); the next
    /// connection to such a proxy resolves its name again. Proxies given
    /// by address stay as they are.
    pub fn forget_names(&self) {
        for p in &self.proxies {
            let (Proxy::Socks5 { server, .. } | Proxy::Shadowsocks { server, .. }) = p;
            if let Server::Name(n) = server {
                n.forget();
            }
        }
    }

    /// The configured outbound names, in index order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Every proxy's counters, in index order.
    pub fn counters(&self) -> &[Arc<OutboundCounters>] {
        &self.counters
    }

    /// The counters of proxy `i`.
    pub fn counters_of(&self, i: usize) -> Option<&Arc<OutboundCounters>> {
        self.counters.get(i)
    }

    /// Take over `old`'s counters for every outbound of the same name (a
    /// reload), so the statistics of an outbound that stays go on.
    pub fn carry_counters(&mut self, old: &Outbounds) {
        for (name, c) in self.names.iter().zip(self.counters.iter_mut()) {
            if let Some(i) = old.names.iter().position(|n| n == name) {
                *c = old.counters[i].clone();
            }
        }
    }

    /// Whether a connection on the outbound named `name` (`direct` or a
    /// proxy) still has that outbound here.
    pub fn has_outbound(&self, name: &str) -> bool {
        name == "direct" || self.names.iter().any(|n| n == name)
    }

    /// A route's name, for logs.
    pub fn name(&self, route: Route) -> &str {
        match route {
            Route::Direct => "direct",
            Route::Reject => "reject",
            Route::Proxy(i) => self.names.get(i).map_or("?", String::as_str),
        }
    }

    /// Open a TCP outbound to `dst` along `route`, handshake included, and
    /// count the outcome per outbound.
    pub async fn connect(
        &self,
        route: Route,
        dst: &Address,
        stats: &Stats,
    ) -> Result<OutboundStream, OutboundError> {
        let _ = stats;
        let r = self.connect_inner(route, dst).await;
        if let Route::Proxy(i) = route
            && let Some(c) = self.counters.get(i)
        {
            match &r {
                Ok(_) => c.tcp_connects.fetch_add(1, Relaxed),
                Err(OutboundError::Resolve { .. }) => c.resolve_failures.fetch_add(1, Relaxed),
                Err(e) if e.is_protocol() => c.protocol_errors.fetch_add(1, Relaxed),
                Err(_) => c.tcp_failures.fetch_add(1, Relaxed),
            };
        }
        r
    }

    async fn connect_inner(
        &self,
        route: Route,
        dst: &Address,
    ) -> Result<OutboundStream, OutboundError> {
        let timeout = self.factory.connect_timeout;
        let proxy = match route {
            Route::Reject => return Err(OutboundError::Rejected),
            Route::Direct => {
                // A direct connection needs an address: the caller resolves
                // domains first (through kerntun's DNS, never the host's).
                let Address::Ip(dst) = dst else {
                    return Err(OutboundError::Unresolved(dst.to_string()));
                };
                return Ok(OutboundStream {
                    stream: self.factory.connect_tcp(*dst).await?,
                    framing: None,
                    route,
                    why: None,
                    counters: None,
                });
            }
            Route::Proxy(i) => self.proxies.get(i).ok_or(OutboundError::Rejected)?,
        };
        match proxy {
            Proxy::Socks5 { server, creds, .. } => {
                let (mut s, _) = self.connect_server(route, server).await?;
                socks5::handshake(
                    &mut s,
                    creds.as_ref(),
                    socks5::Command::Connect,
                    dst,
                    timeout,
                )
                .await?;
                Ok(OutboundStream {
                    stream: s,
                    framing: None,
                    route,
                    why: None,
                    counters: self.counters_of_route(route),
                })
            }
            Proxy::Shadowsocks { server, key, .. } => {
                let (mut s, _) = self.connect_server(route, server).await?;
                let session = shadowsocks::tcp_session(key, dst)?;
                match tokio::time::timeout(timeout, s.write_all(&session.header)).await {
                    Ok(r) => r?,
                    Err(_) => return Err(OutboundError::Timeout(timeout)),
                }
                Ok(OutboundStream {
                    stream: s,
                    framing: session.framing.map(|f| Box::new(f) as Box<dyn Framing>),
                    route,
                    why: None,
                    counters: self.counters_of_route(route),
                })
            }
        }
    }

    /// A TCP connection to a proxy server, and the address it reached.
    async fn connect_server(
        &self,
        route: Route,
        server: &Server,
    ) -> Result<(TcpStream, SocketAddr), OutboundError> {
        let n = match server {
            Server::Ip(a) => return Ok((self.factory.connect_tcp(*a).await?, *a)),
            Server::Name(n) => n,
        };
        let addrs = self.server_addresses(route, n).await?;
        match resolve::connect_happy(&self.factory, &addrs).await {
            Ok((s, a)) => {
                n.connected(a.ip()).await;
                Ok((s, a))
            }
            Err(e) => {
                n.connect_failed().await;
                Err(io::Error::new(
                    e.kind(),
                    format!("{} ({}): {e}", n.name(), self.name(route)),
                )
                .into())
            }
        }
    }

    /// The addresses of a named proxy server, from the cache or the resolvers.
    async fn server_addresses(
        &self,
        route: Route,
        n: &resolve::Named,
    ) -> Result<Vec<SocketAddr>, OutboundError> {
        n.addresses(&self.factory, &self.resolvers)
            .await
            .map_err(|reason| OutboundError::Resolve {
                outbound: self.name(route).to_owned(),
                name: n.name().to_owned(),
                reason,
            })
    }

    fn counters_of_route(&self, route: Route) -> Option<Arc<OutboundCounters>> {
        match route {
            Route::Proxy(i) => self.counters.get(i).cloned(),
            Route::Direct | Route::Reject => None,
        }
    }

    /// Whether UDP flows on `route` go through a proxy (the queued path).
    pub fn udp_proxied(&self, route: Route) -> bool {
        matches!(route, Route::Proxy(_)) && self.proxy_udp(route) == OutboundUdp::Relay
    }

    /// The route a UDP flow the rules send along `route` takes: the same,
    /// or direct for a proxy with `udp = "direct"`; `None` when the proxy
    /// refuses UDP (`udp = false`), which the caller counts and answers
    /// like a `reject` rule's refusal.
    pub fn udp_route(&self, route: Route) -> Option<Route> {
        match self.proxy_udp(route) {
            OutboundUdp::Relay => Some(route),
            OutboundUdp::Direct => Some(Route::Direct),
            OutboundUdp::Refuse => None,
        }
    }

    /// A proxy route's `udp` setting; `Relay` for the built-in routes
    /// (they are what they say).
    fn proxy_udp(&self, route: Route) -> OutboundUdp {
        match route {
            Route::Proxy(i) => match self.proxies.get(i) {
                Some(Proxy::Socks5 { udp, .. } | Proxy::Shadowsocks { udp, .. }) => *udp,
                None => OutboundUdp::Refuse,
            },
            Route::Direct | Route::Reject => OutboundUdp::Relay,
        }
    }

    /// The socket factory (direct UDP flows use it as it is).
    pub fn factory(&self) -> &SocketFactory {
        &self.factory
    }

    /// Open a UDP association through proxy `i` (SOCKS5 UDP ASSOCIATE, or a
    /// Shadowsocks UDP session).
    pub async fn udp(&self, i: usize) -> Result<ProxyUdp, OutboundError> {
        let timeout = self.factory.connect_timeout;
        match self.proxies.get(i) {
            Some(Proxy::Socks5 {
                server,
                creds,
                udp: OutboundUdp::Relay,
            }) => {
                let (mut control, server) = self.connect_server(Route::Proxy(i), server).await?;
                // The client's own UDP address is not known before the socket
                // is connected; the unspecified address says "any" (RFC 1928).
                let any = match server.ip() {
                    IpAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
                    IpAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
                };
                let bound = socks5::handshake(
                    &mut control,
                    creds.as_ref(),
                    socks5::Command::UdpAssociate,
                    &Address::Ip(any),
                    timeout,
                )
                .await?;
                let relay = socks5::udp_relay_addr(&bound, server);
                let sock = self.factory.udp_connected(relay)?;
                Ok(ProxyUdp {
                    sock,
                    control: Some(control),
                    codec: UdpCodec { session: None },
                })
            }
            Some(Proxy::Shadowsocks {
                server,
                key,
                udp: OutboundUdp::Relay,
            }) => Ok(ProxyUdp {
                sock: match server {
                    Server::Ip(a) => self.factory.udp_connected(*a)?,
                    Server::Name(n) => {
                        let addrs = self.server_addresses(Route::Proxy(i), n).await?;
                        resolve::udp_first(&self.factory, &addrs)?
                    }
                },
                control: None,
                codec: UdpCodec {
                    session: Some(UdpSession::new(key)),
                },
            }),
            _ => Err(OutboundError::Rejected),
        }
    }
}

/// One UDP flow's association with a proxy.
#[derive(Debug)]
pub struct ProxyUdp {
    /// Connected to the SOCKS5 relay address or the Shadowsocks server.
    pub sock: UdpSocket,
    /// SOCKS5: the association lives as long as this TCP connection.
    pub control: Option<TcpStream>,
    /// The datagram framing.
    pub codec: UdpCodec,
}

/// SOCKS5 or Shadowsocks datagram framing (sans-I/O).
#[derive(Debug)]
pub struct UdpCodec {
    /// Shadowsocks session; `None` for SOCKS5.
    session: Option<UdpSession>,
}

impl UdpCodec {
    /// SOCKS5's framing, for tests of what decodes it.
    #[cfg(test)]
    pub(crate) fn socks5() -> Self {
        UdpCodec { session: None }
    }

    /// Wrap `payload` for `target` into `out` (cleared first).
    pub fn encode(
        &mut self,
        target: &Address,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), OutboundError> {
        match &mut self.session {
            Some(s) => Ok(s.encode(target, payload, out)?),
            None => {
                out.clear();
                socks5::encode_udp_header(target, out)?;
                out.extend_from_slice(payload);
                Ok(())
            }
        }
    }

    /// Unwrap a datagram from the proxy in place: its source and the payload.
    pub fn decode(&mut self, buf: &mut [u8]) -> Result<(Address, Range<usize>), OutboundError> {
        match &mut self.session {
            Some(s) => Ok(s.decode(buf)?),
            None => {
                let (a, off) = socks5::parse_udp(buf)?;
                Ok((a, off..buf.len()))
            }
        }
    }
}
