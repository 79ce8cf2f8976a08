//! Where a new TCP connection goes, decided once per connection for both
//! stacks: answered here (DNS over TCP to a hijacked address), routed now and
//! connected first (the common case, and fake-ip addresses, whose domain is
//! known at SYN time), accepted first so its domain can be sniffed from the
//! first bytes, or refused with an RST. Then the session that serves it,
//! generic over the app's side of the connection ([`session`]).
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
use crate::dns::Dns;
use crate::lifecycle::Lifecycle;
use crate::outbound::{Address, OutboundError, OutboundStream, Outbounds, Route};
use crate::rules::Target;
use crate::sniff::SniffConfig;
use crate::stats::{EngineDrop, Stats, WarnLimiter};

pub(crate) mod session;

/// What deciding and serving a flow needs, shared by both stacks and UDP.
#[derive(Debug)]
pub(crate) struct Dispatcher {
    /// Proxies, the rules resolved to them, and the relay options.
    pub outbounds: Arc<Outbounds>,
    /// The DNS service, when `[dns]` is on.
    pub dns: Option<Arc<Dns>>,
    /// Domain sniffing (`[sniff]`).
    pub sniff: SniffConfig,
    pub admission: Arc<Admission>,
    /// Bytes the sessions' full-size relay buffers may hold at once.
    pub relay_pool: Arc<ByteBudget>,
    pub stats: Arc<Stats>,
    /// Rate-limited warnings (one per interval) for refusals under load.
    pub warn: WarnLimiter,
    pub life: Arc<Lifecycle>,
}

/// The decision for a new connection's SYN.
#[derive(Debug)]
pub(crate) enum Plan {
    /// DNS over TCP to a hijacked address: answered by kerntun's DNS service.
    Dns,
    /// Route chosen now; connect the outbound before the app's SYN is answered.
    Connect { route: Route, dst: Address },
    /// Accept the app's connection first, read its TLS SNI / HTTP Host
    /// (bounded wait), then route by domain and connect.
    Sniff,
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
}

/// Why a SYN is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// A `reject` rule matched.
    Rule,
    /// A fake-ip address that stands for no domain (evicted, or never given).
    UnknownFake,
}

impl Dispatcher {
    /// Connect-first admission of a new connection to `server`: its plan
    /// and an admission permit, or `None` when it is refused (a rule, an
    /// unknown fake address, or admission full; counted here, and the
    /// caller answers the SYN with an RST). `now`: the driver's clock for
    /// this packet (memory pressure decays with it). No await, no I/O: called from
    /// the driver for every new flow's SYN, by both stacks.
    pub fn admit(&self, server: SocketAddr, now: Instant) -> Option<(Plan, OwnedPermit)> {
        let plan = match self.plan(server) {
            Ok(plan) => plan,
            Err(Refusal::Rule) => {
                self.stats.tcp_rejected_by_rule.fetch_add(1, Relaxed);
                return None;
            }
            Err(Refusal::UnknownFake) => {
                Stats::drop(&self.stats, EngineDrop::FakeIpUnknown);
                return None;
            }
        };
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

    /// Decide what happens to a new connection to `server`.
    fn plan(&self, server: SocketAddr) -> Result<Plan, Refusal> {
        if let Some(dns) = &self.dns {
            if dns.hijacks(server) {
                return Ok(Plan::Dns);
            }
            if dns.is_fake(server.ip()) {
                let Some(domain) = dns.fake_domain(server.ip()) else {
                    return Err(Refusal::UnknownFake);
                };
                return match self.outbounds.route(&Target::fake_ip(server, &domain)) {
                    Route::Reject => Err(Refusal::Rule),
                    route => Ok(Plan::Connect {
                        route,
                        dst: Address::Domain(domain.to_string(), server.port()),
                    }),
                };
            }
        }
        // Sniffing delays routing until the app speaks, so it is only done
        // where a domain could change the route.
        if self.sniff.covers(server.port()) && self.outbounds.needs_domain(server) {
            return Ok(Plan::Sniff);
        }
        match self.outbounds.route(&Target::ip(server)) {
            Route::Reject => Err(Refusal::Rule),
            route => Ok(Plan::Connect {
                route,
                dst: Address::Ip(server),
            }),
        }
    }

    /// Connect `dst` along `route`. A domain on a direct route is resolved
    /// through kerntun's DNS service (never the host's resolver, which would
    /// leak the query around the tunnel); the family follows the address the
    /// app used. A failure is counted.
    pub async fn connect(
        &self,
        route: Route,
        dst: &Address,
        v6: bool,
    ) -> Result<OutboundStream, OutboundError> {
        let r = match (route, dst) {
            (Route::Direct, Address::Domain(domain, port)) => match &self.dns {
                None => Err(OutboundError::Unresolved(dst.to_string())),
                Some(dns) => match dns.resolve(domain, v6, &self.stats).await {
                    Ok(ip) => {
                        let resolved = Address::Ip(SocketAddr::new(ip, *port));
                        self.outbounds.connect(route, &resolved, &self.stats).await
                    }
                    Err(e) => Err(OutboundError::Unresolved(format!("{dst}: {e}"))),
                },
            },
            _ => self.outbounds.connect(route, dst, &self.stats).await,
        };
        if let Err(e) = &r {
            self.stats.tcp_connect_failed.fetch_add(1, Relaxed);
            tracing::debug!("connect {dst} via {}: {e}", self.outbounds.name(route));
        }
        r
    }

    /// The connect-first step of a plan: the outbound connected (`None` if
    /// that failed; counted), or nothing to connect yet (DNS, sniffing).
    pub async fn prepare(&self, plan: Plan, server: SocketAddr) -> Option<Next> {
        match plan {
            Plan::Connect { route, dst } => self
                .connect(route, &dst, server.is_ipv6())
                .await
                .ok()
                .map(Next::Relay),
            Plan::Dns => Some(Next::Dns),
            Plan::Sniff => Some(Next::Sniff),
        }
    }

    /// The route for a sniffed connection (the sniffed name only picks the
    /// rule; the outbound is given the address the app used).
    pub fn route_sniffed(&self, server: SocketAddr, domain: Option<&str>) -> Route {
        self.outbounds.route(&match domain {
            Some(d) => Target::sniffed(server, d),
            None => Target::ip(server),
        })
    }
}
