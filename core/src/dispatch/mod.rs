//! Where a new flow goes, decided once per flow ([`Dispatcher::plan`]) for
//! both TCP stacks and the UDP flow table: answered by kerntun's DNS service
//! (a hijacked address's port 53), routed now (the common case, and fake-ip
//! addresses, whose domain is known at the first packet), accepted first
//! (TCP) or held (UDP) so its domain can be sniffed from the first bytes or
//! its owning app looked up (`owner.rs`) before it is routed, or refused
//! (TCP: an RST; UDP: the datagram dropped), counted in one place.
//! Then, for TCP, the session that serves the connection, generic over the
//! app's side of it ([`session`]).
//!
//! [`Dispatcher`] is everything that decision and the sessions need: the
//! rules and outbounds, the DNS service, sniffing, admission, statistics and
//! the engine's phase. Both stacks and the UDP path hold it; it holds no
//! stack state and no device.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use crate::budget::{Admission, ByteBudget, OwnedPermit};
use crate::conns::Connections;
use crate::dns::Dns;
use crate::lifecycle::Lifecycle;
use crate::outbound::{Address, OutboundError, OutboundStream, Outbounds, Route, Why};
use crate::owner::{Owner, Owners};
use crate::rules::Target;
use crate::sniff::SniffConfig;
use crate::stats::{EngineDrop, Stats, WarnLimiter};

pub(crate) mod session;

/// One generation of what routes new flows: the part of the configuration
/// `Engine::reload` replaces while the engine runs.
#[derive(Debug)]
pub(crate) struct Routing {
    /// Proxies, the rules resolved to them, and the relay options.
    pub outbounds: Arc<Outbounds>,
    /// The DNS service, when `[dns]` is on.
    pub dns: Option<Arc<Dns>>,
    /// Domain sniffing (`[sniff]`).
    pub sniff: SniffConfig,
}

/// The current [`Routing`], shared by the dispatcher and the engine's
/// handle. An `ArcSwap`, not a lock: every new flow (a SYN, a UDP flow's
/// first datagram, on the driver's thread) reads it with one atomic load
/// and never waits for a reload; a reload stores a new generation, and
/// flows already planned keep the one they read (their `Route` indexes
/// that generation's outbounds).
pub(crate) type Current = arc_swap::ArcSwap<Routing>;

/// What deciding and serving a flow needs, shared by both stacks and UDP.
#[derive(Debug)]
pub(crate) struct Dispatcher {
    /// Rules, outbounds, DNS and sniffing: read once per new flow.
    pub routing: Arc<Current>,
    /// TCP relay options (`[relay]`; fixed for the engine's life).
    pub relay: crate::relay::RelayOptions,
    pub admission: Arc<Admission>,
    /// Bytes the sessions' full-size relay buffers may hold at once.
    pub relay_pool: Arc<ByteBudget>,
    pub stats: Arc<Stats>,
    /// Rate-limited warnings (one per interval) for refusals under load.
    pub warn: WarnLimiter,
    pub life: Arc<Lifecycle>,
    /// The live connection list the sessions register in.
    pub conns: Arc<Connections>,
    /// The host's lookup of a flow's owning app (`owner.rs`); `None` on
    /// platforms without one.
    pub owners: Option<Arc<Owners>>,
}

/// The transport of a new flow: the rules' `network` condition sees it,
/// and it says what its plan may be (only TCP is sniffed) and the names its
/// refusals are counted under.
pub(crate) use crate::rules::Network;

/// The decision for a new flow: a TCP connection's SYN, a UDP flow's first
/// datagram.
#[derive(Debug)]
pub(crate) enum Plan {
    /// DNS to a hijacked address: answered by kerntun's DNS service (over
    /// TCP in a session; over UDP query by query, opening no flow).
    Dns,
    /// Route chosen now: connect the outbound before the app's SYN is
    /// answered (TCP), or open the flow's socket or association (UDP).
    /// `dst` is a fake address's domain, or the address the app used;
    /// `on` the routing generation `route` belongs to, `why` the rule and
    /// groups of it that chose `route`.
    Connect {
        route: Route,
        dst: Address,
        on: Arc<Routing>,
        why: Why,
    },
    /// TCP only: accept the app's connection first, read its TLS SNI / HTTP
    /// Host (bounded wait), then route by domain and connect. (UDP: hold
    /// the flow's first datagrams while its QUIC Initials are read.) With
    /// an owner lookup, the owner is asked for meanwhile and routes too.
    Sniff,
    /// A `package` / `uid` rule could match: accept first (TCP) or hold
    /// the first datagrams (UDP), look up the owning app (bounded,
    /// `owner.rs`), then route by it.
    Owner,
}

/// What an admitted connection does once the app's side is accepted.
#[derive(Debug)]
pub(crate) enum Next {
    /// Relay to the outbound connected at SYN time (handshake done; it
    /// carries the route and the framing).
    Relay(OutboundStream),
    /// DNS over TCP, answered by kerntun.
    Dns,
    /// Sniff the domain from the first bytes, then route and connect.
    Sniff,
    /// Look up the owning app, then route and connect.
    Owner,
}

/// Why a new flow is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A `reject` rule matched.
    Rule,
    /// A fake-ip address that stands for no domain (evicted, or never given).
    UnknownFake,
    /// TCP to port 853 of a hijacked address (`dns.reset_dot`).
    DnsOverTls,
    /// UDP routed to a proxy that refuses UDP (`udp = false`).
    NoUdp,
}

impl Refusal {
    /// The drop a refused UDP datagram is counted as.
    pub fn udp_drop(self) -> EngineDrop {
        match self {
            Refusal::Rule => EngineDrop::UdpRejected,
            Refusal::UnknownFake => EngineDrop::FakeIpUnknown,
            Refusal::DnsOverTls => EngineDrop::DnsTlsReset,
            Refusal::NoUdp => EngineDrop::UdpOutboundRefused,
        }
    }
}

impl Dispatcher {
    /// Connect-first admission of a new connection to `server`: its plan
    /// and an admission permit, or `None` when it is refused (a rule, an
    /// unknown fake address, or admission full; counted here, and the
    /// caller answers the SYN with an RST). `now`: the driver's clock for
    /// this packet (memory pressure decays with it). No await, no I/O: called from
    /// the driver for every new flow's SYN, by both stacks.
    pub fn admit(&self, server: SocketAddr, now: Instant) -> Option<(Plan, OwnedPermit)> {
        let plan = self.plan(server, Network::Tcp)?;
        let Some(permit) = self.admission.try_acquire_owned(now) else {
            self.stats.admission_refused.fetch_add(1, Relaxed);
            self.warn.warn(format_args!(
                "TCP admission refused a session ({} active, limit {} at {:?} pressure)",
                self.admission.active(),
                self.admission.limit(now),
                self.admission.pressure(now)
            ));
            return None;
        };
        Some((plan, permit))
    }

    /// Decide what happens to a new flow of `network` to `server`: `None`
    /// when it is refused, counted here. No await, no I/O: called from the
    /// driver for a new TCP connection's SYN and a new UDP flow's first
    /// datagram.
    pub fn plan(&self, server: SocketAddr, network: Network) -> Option<Plan> {
        self.plan_or_refusal(server, network).ok()
    }

    /// [`Dispatcher::plan`], saying why a flow is refused (counted here
    /// too): the UDP flow table answers a rule's refusal with an ICMP error.
    pub fn plan_or_refusal(&self, server: SocketAddr, network: Network) -> Result<Plan, Refusal> {
        self.decide(server, network).inspect_err(|&refusal| {
            self.count_refusal(refusal, network);
        })
    }

    /// Count a refused flow, under the names the statistics have always
    /// had (the FFI exports them): a rule's refusal is `tcp_rejected_by_rule`
    /// for TCP and the drop `udp_rejected` for UDP; a fake address no domain
    /// holds is the drop `fake_ip_unknown` for both; a UDP flow a proxy
    /// refuses is `udp_outbound_refused` ([`Refusal::udp_drop`]).
    fn count_refusal(&self, refusal: Refusal, network: Network) {
        match (refusal, network) {
            (Refusal::Rule, Network::Tcp) => {
                self.stats.tcp_rejected_by_rule.fetch_add(1, Relaxed);
            }
            (r, _) => Stats::drop(&self.stats, r.udp_drop()),
        }
    }

    /// The route a rule chose, for a new flow of `network`: refused by a
    /// `reject` rule, or (UDP) by a proxy with `udp = false`; a proxy with
    /// `udp = "direct"` sends a UDP flow direct
    /// ([`Outbounds::udp_route`]).
    fn routed(on: &Routing, route: Route, network: Network) -> Result<Route, Refusal> {
        match (route, network) {
            (Route::Reject, _) => Err(Refusal::Rule),
            (r, Network::Udp) => on.outbounds.udp_route(r).ok_or(Refusal::NoUdp),
            (r, Network::Tcp) => Ok(r),
        }
    }

    /// The routing generation new flows take now.
    pub fn routing(&self) -> Arc<Routing> {
        self.routing.load_full()
    }

    /// The plan for a new flow, or why it is refused.
    fn decide(&self, server: SocketAddr, network: Network) -> Result<Plan, Refusal> {
        // The flow's one read of the routing generation.
        let on = self.routing.load_full();
        if let Some(dns) = &on.dns {
            if dns.hijacks(server) {
                return Ok(Plan::Dns);
            }
            if network == Network::Tcp && dns.resets_dot(server) {
                return Err(Refusal::DnsOverTls);
            }
            if dns.is_fake(server.ip()) {
                let Some(domain) = dns.fake_domain(server.ip()) else {
                    return Err(Refusal::UnknownFake);
                };
                if self.owner_first(&on, network, server) {
                    return Ok(Plan::Owner);
                }
                let target = Target::fake_ip(server, &domain).on(network);
                let (route, why) = on.outbounds.route_why(&target);
                let route = Self::routed(&on, route, network)?;
                return Ok(Plan::Connect {
                    route,
                    dst: Address::Domain(domain.to_string(), server.port()),
                    on,
                    why,
                });
            }
        }
        // Sniffing delays routing until the app speaks, so it is only done
        // where a domain could change the route: a TCP connection's first
        // bytes (TLS SNI, HTTP Host), a UDP flow's QUIC Initials
        // (`udp/sniff.rs`).
        if on.sniff.covers(server.port()) && on.outbounds.needs_domain_on(network, server) {
            return Ok(Plan::Sniff);
        }
        if self.owner_first(&on, network, server) {
            return Ok(Plan::Owner);
        }
        let (route, why) = on.outbounds.route_why(&Target::ip(server).on(network));
        Ok(Plan::Connect {
            route: Self::routed(&on, route, network)?,
            dst: Address::Ip(server),
            on,
            why,
        })
    }

    /// Whether a new flow waits for its owner before it is routed: the
    /// host can look owners up and a `package` / `uid` rule could match it.
    fn owner_first(&self, on: &Routing, network: Network, server: SocketAddr) -> bool {
        self.owners.is_some() && on.outbounds.needs_owner_on(network, server)
    }

    /// [`Dispatcher::owner_first`] in the routing generation of now: a UDP
    /// flow held for its QUIC Initials waits for its owner too when this
    /// holds (`udp/sniff.rs`).
    pub fn needs_owner(&self, network: Network, server: SocketAddr) -> bool {
        self.owner_first(&self.routing.load(), network, server)
    }

    /// The owner of the flow from `client` to `server`, from the host's
    /// lookup (bounded and counted, `owner.rs`); `None` without one.
    pub async fn owner(
        &self,
        network: Network,
        client: SocketAddr,
        server: SocketAddr,
    ) -> Option<Arc<Owner>> {
        match &self.owners {
            Some(o) => o.lookup(network, client, server).await,
            None => None,
        }
    }

    /// Look up the owner of a flow already routed, for its record in the
    /// connection list alone: in a task of its own, so the flow never
    /// waits for it. Nothing without a lookup.
    pub fn record_owner(
        self: &Arc<Self>,
        record: &Arc<crate::conns::Record>,
        network: Network,
        client: SocketAddr,
        server: SocketAddr,
    ) {
        if self.owners.is_none() {
            return;
        }
        let (d, record) = (self.clone(), record.clone());
        tokio::spawn(async move {
            if let Some(o) = d.owner(network, client, server).await {
                record.set_owner(o);
            }
        });
    }

    /// Connect `dst` along `route` of the routing generation `on`. A
    /// domain on a direct route is resolved through kerntun's DNS service
    /// (never the host's resolver, which would leak the query around the
    /// tunnel); the family follows the address the app used. A failure is
    /// counted.
    pub async fn connect(
        &self,
        on: &Routing,
        route: Route,
        dst: &Address,
        v6: bool,
    ) -> Result<OutboundStream, OutboundError> {
        let r = match (route, dst) {
            (Route::Direct, Address::Domain(domain, port)) => match &on.dns {
                None => Err(OutboundError::Unresolved(dst.to_string())),
                Some(dns) => match dns.resolve(domain, v6, &self.stats).await {
                    Ok(ip) => {
                        let resolved = Address::Ip(SocketAddr::new(ip, *port));
                        on.outbounds.connect(route, &resolved, &self.stats).await
                    }
                    Err(e) => Err(OutboundError::Unresolved(format!("{dst}: {e}"))),
                },
            },
            _ => on.outbounds.connect(route, dst, &self.stats).await,
        };
        if let Err(e) = &r {
            self.stats.tcp_connect_failed.fetch_add(1, Relaxed);
            tracing::debug!("connect {dst} via {}: {e}", on.outbounds.name(route));
        }
        r
    }

    /// The connect-first step of a plan: the outbound connected (`None` if
    /// that failed; counted), or nothing to connect yet (DNS, sniffing).
    pub async fn prepare(&self, plan: Plan, server: SocketAddr) -> Option<Next> {
        match plan {
            Plan::Connect {
                route,
                dst,
                on,
                why,
            } => self
                .connect(&on, route, &dst, server.is_ipv6())
                .await
                .ok()
                .map(|out| {
                    let why = on.outbounds.explain(&why);
                    Next::Relay(OutboundStream { why, ..out })
                }),
            Plan::Dns => Some(Next::Dns),
            Plan::Sniff => Some(Next::Sniff),
            Plan::Owner => Some(Next::Owner),
        }
    }

    /// The route for a flow accepted (TCP) or held (UDP) before routing,
    /// in the routing generation `on`, with the rule and groups that chose
    /// it and where the outbound sends it: a fake address's domain (it
    /// also picks the rule), or the address the app used (a sniffed name
    /// only picks the rule). `owner`: the app that owns the flow, when the
    /// host named it. `None` for a fake address that stands for no domain
    /// any more.
    pub fn route_later(
        on: &Routing,
        server: SocketAddr,
        sniffed: Option<&str>,
        owner: Option<&Owner>,
        network: Network,
    ) -> Option<(Route, Why, Address)> {
        let fake = match &on.dns {
            Some(dns) if dns.is_fake(server.ip()) => Some(dns.fake_domain(server.ip())?),
            _ => None,
        };
        let mut target = match (&fake, sniffed) {
            (Some(d), _) => Target::fake_ip(server, d),
            (None, Some(d)) => Target::sniffed(server, d),
            (None, None) => Target::ip(server),
        };
        if let Some(o) = owner {
            target = target.owned_by(o.uid, o.package.as_deref());
        }
        let (route, why) = on.outbounds.route_why(&target.on(network));
        let dst = match fake {
            Some(d) => Address::Domain(d.to_string(), server.port()),
            None => Address::Ip(server),
        };
        Some((route, why, dst))
    }

    /// The route for a UDP flow held before routing (its QUIC Initials
    /// named its server or named nothing, its owner is known or not), with
    /// the generation it belongs to and where it goes, or why it is
    /// refused: a `reject` rule, a proxy with `udp = false`, a fake address
    /// gone meanwhile. Not counted here: the table counts each datagram it
    /// refused ([`Refusal::udp_drop`]).
    pub fn route_held_udp(
        &self,
        server: SocketAddr,
        domain: Option<&str>,
        owner: Option<&Owner>,
    ) -> Result<(Route, Why, Address, Arc<Routing>), Refusal> {
        let on = self.routing();
        let (route, why, dst) = Self::route_later(&on, server, domain, owner, Network::Udp)
            .ok_or(Refusal::UnknownFake)?;
        Ok((Self::routed(&on, route, Network::Udp)?, why, dst, on))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;
    use crate::budget::Pressure;
    use crate::dns::DnsConfig;
    use crate::outbound::SocketFactory;
    use crate::outbound::config::DirectConfig;
    use crate::relay::RelayConfig;
    use crate::rules::{Action, Rule};

    /// Rules: port 9 refused by address; `blocked.test` refused by domain
    /// (so a domain could change the route of any address: sniffed ports
    /// are sniffed). DNS on, hijacking 198.18.0.3, with a fake-ip pool.
    fn dispatcher() -> Dispatcher {
        let rules = vec![
            Rule {
                ports: Some("9".parse().expect("port")),
                action: Action::Reject,
                ..Rule::default()
            },
            Rule {
                domain_suffix: vec!["blocked.test".into()],
                action: Action::Reject,
                ..Rule::default()
            },
            Rule {
                ports: Some("4433".parse().expect("port")),
                network: Some(Network::Udp),
                action: Action::Reject,
                ..Rule::default()
            },
        ];
        let factory = SocketFactory::new(&DirectConfig::default(), None);
        let outbounds = Arc::new(
            Outbounds::new(
                &BTreeMap::new(),
                &BTreeMap::new(),
                &rules,
                &RelayConfig::default(),
                factory,
                64 * 1024,
                Default::default(),
            )
            .expect("outbounds"),
        );
        let pressure = Arc::new(Pressure::default());
        let bytes = || Arc::new(ByteBudget::new(1 << 20, pressure.clone()));
        let dns_cfg = DnsConfig {
            enabled: true,
            hijack: vec!["198.18.0.3".parse().expect("static")],
            upstreams: vec!["udp://192.0.2.1:53".into()],
            fake_ip: true,
            ..DnsConfig::default()
        };
        let nets = ["198.18.0.1/16".parse().expect("static")];
        let dns = Dns::new(
            &dns_cfg,
            &nets,
            outbounds.clone(),
            bytes(),
            bytes(),
            bytes(),
        )
        .expect("dns config");
        Dispatcher {
            stats: Arc::new(Stats::with_outbounds(outbounds.counters())),
            relay: outbounds.relay,
            routing: Arc::new(Current::from_pointee(Routing {
                outbounds,
                dns,
                sniff: SniffConfig::default(),
            })),
            admission: Arc::new(Admission::with_pressure([16; 3], pressure.clone())),
            relay_pool: bytes(),
            warn: WarnLimiter::new(Duration::from_secs(5)),
            life: Arc::new(Lifecycle::default()),
            conns: Arc::default(),
            owners: None,
        }
    }

    /// One plan for both networks: the rule that refuses a TCP connection
    /// refuses the UDP flow to the same place, each counted under its own
    /// name; a fake address no domain holds is `fake_ip_unknown` for both;
    /// port 53 of the hijacked address is DNS for both; a sniffed port is
    /// sniffed for both (UDP: its QUIC Initials).
    #[test]
    fn one_plan_for_tcp_and_udp_refusals_counted_by_network() {
        let d = dispatcher();
        let drops = |why: EngineDrop| d.stats.drops[why as usize].load(Relaxed);
        let rejected: SocketAddr = "203.0.113.5:9".parse().expect("static");
        assert!(d.plan(rejected, Network::Tcp).is_none());
        assert_eq!(d.stats.tcp_rejected_by_rule.load(Relaxed), 1);
        assert_eq!(drops(EngineDrop::UdpRejected), 0);
        assert!(d.plan(rejected, Network::Udp).is_none());
        assert!(d.plan(rejected, Network::Udp).is_none());
        assert_eq!(d.stats.tcp_rejected_by_rule.load(Relaxed), 1);
        assert_eq!(drops(EngineDrop::UdpRejected), 2);
        // Admission goes through the same plan.
        assert!(d.admit(rejected, Instant::now()).is_none());
        assert_eq!(d.stats.tcp_rejected_by_rule.load(Relaxed), 2);

        // In the pool, never handed out.
        let unknown: SocketAddr = "198.18.200.1:443".parse().expect("static");
        for net in [Network::Tcp, Network::Udp] {
            assert!(d.plan(unknown, net).is_none(), "{net:?}");
        }
        assert_eq!(drops(EngineDrop::FakeIpUnknown), 2);

        let hijacked: SocketAddr = "198.18.0.3:53".parse().expect("static");
        for net in [Network::Tcp, Network::Udp] {
            assert!(matches!(d.plan(hijacked, net), Some(Plan::Dns)), "{net:?}");
        }
        let sniffed: SocketAddr = "203.0.113.5:443".parse().expect("static");
        for net in [Network::Tcp, Network::Udp] {
            assert!(matches!(d.plan(sniffed, net), Some(Plan::Sniff)), "{net:?}");
        }
        // DNS over TLS to the hijacked address is refused (an RST), and
        // counted on its own; QUIC-style UDP to 853 and 853 elsewhere are
        // ordinary flows.
        let dot: SocketAddr = "198.18.0.3:853".parse().expect("static");
        assert!(d.plan(dot, Network::Tcp).is_none());
        assert!(d.admit(dot, Instant::now()).is_none());
        assert_eq!(drops(EngineDrop::DnsTlsReset), 2);
        assert!(matches!(
            d.plan(dot, Network::Udp),
            Some(Plan::Connect { .. })
        ));
        let elsewhere: SocketAddr = "203.0.113.5:853".parse().expect("static");
        assert!(matches!(
            d.plan(elsewhere, Network::Tcp),
            Some(Plan::Connect { .. })
        ));
        // Nothing else was counted as refused.
        assert_eq!(d.stats.tcp_rejected_by_rule.load(Relaxed), 2);
        assert_eq!(drops(EngineDrop::UdpRejected), 2);
        assert_eq!(drops(EngineDrop::FakeIpUnknown), 2);
        assert_eq!(drops(EngineDrop::DnsTlsReset), 2);
    }

    /// `dns.reset_dot = false`: port 853 of the hijacked address is an
    /// ordinary flow.
    #[test]
    fn dot_to_the_hijacked_address_is_a_flow_when_reset_is_off() {
        let d = dispatcher();
        let mut cfg = DnsConfig {
            enabled: true,
            hijack: vec!["198.18.0.3".parse().expect("static")],
            upstreams: vec!["udp://192.0.2.1:53".into()],
            reset_dot: false,
            ..DnsConfig::default()
        };
        let pressure = Arc::new(Pressure::default());
        let bytes = || Arc::new(ByteBudget::new(1 << 20, pressure.clone()));
        let nets = ["198.18.0.1/16".parse().expect("static")];
        let set_dns = |cfg: &DnsConfig| {
            let old = d.routing();
            let dns = Dns::new(cfg, &nets, old.outbounds.clone(), bytes(), bytes(), bytes());
            d.routing.store(Arc::new(Routing {
                outbounds: old.outbounds.clone(),
                dns: dns.expect("dns"),
                sniff: old.sniff.clone(),
            }));
        };
        set_dns(&cfg);
        let dot: SocketAddr = "198.18.0.3:853".parse().expect("static");
        assert!(matches!(
            d.plan(dot, Network::Tcp),
            Some(Plan::Connect { .. })
        ));
        cfg.reset_dot = true;
        set_dns(&cfg);
        assert!(d.plan(dot, Network::Tcp).is_none());
    }

    /// The `network` condition sees the flow's transport: `network = "udp"`
    /// refuses UDP to port 4433 and lets TCP to it through.
    #[test]
    fn network_condition_sees_the_transport() {
        let d = dispatcher();
        let quic: SocketAddr = "203.0.113.5:4433".parse().expect("static");
        assert!(matches!(
            d.plan(quic, Network::Tcp),
            Some(Plan::Connect {
                route: Route::Direct,
                ..
            })
        ));
        assert_eq!(
            d.plan_or_refusal(quic, Network::Udp).err(),
            Some(Refusal::Rule)
        );
    }
}
