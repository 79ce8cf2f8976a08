//! Outbounds: direct, SOCKS5 and Shadowsocks, and the rules that pick one
//! per connection (at SYN time) and per UDP flow.
//!
//! Every socket the engine opens toward the network, to a destination or to
//! a proxy, goes through [`SocketFactory`], which applies the loop-avoidance
//! the host chose (bind to an interface, an fwmark, or the app's
//! `protect(fd)` hook) before the first packet leaves, so nothing the engine
//! sends loops back into the TUN.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;

use crate::framing::Framing;
use crate::relay::{RelayConfig, RelayOptions};
use crate::rules::{Action, Rule, RuleError, RuleSet, Target};
use crate::stats::OutboundCounters;

pub mod addr;
pub mod config;
mod connect;
pub mod group;
pub mod link;
pub mod nat64;
pub mod resolve;
pub mod shadowsocks;
mod socket;
pub mod socks5;

pub use addr::Address;
use config::{BadOutbound, OutboundConfig, OutboundUdp};
pub use connect::{ProxyUdp, UdpCodec};
use group::{BadGroup, GroupConfig, Groups, Pick};
use shadowsocks::{Key, ShadowsocksError};
pub use socket::{
    KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES, Protect, SocketFactory, reset_on_close,
    set_keepalive,
};
use socks5::{Credentials, HandshakeError, Socks5Error};

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
    /// Resolve `rules` against the configured outbounds and the groups
    /// (`[groups]`) they may name too, and derive keys.
    pub fn new(
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
}
