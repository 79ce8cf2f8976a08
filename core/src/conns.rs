//! The live connection list: one record per TCP session (both stacks),
//! registered by the session when it starts and removed when it ends
//! ([`Registered`]), and the host's way to close one
//! ([`Connections::close`]).
//!
//! A record is fixed-size and kept with its flow (an `Arc` the session
//! holds); the registry only maps ids to those `Arc`s, in
//! [`SHARDS`] maps each behind its own lock, taken once when a flow starts,
//! once when it ends, and by a listing or a close. The relay adds to the
//! record's byte counters per relayed chunk, with no lock
//! (`relay::Meter::flow`). A listing copies at most [`LIST_CAP`] records
//! and says when it left some out.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::Notify;

use crate::outbound::Explained;
use crate::owner::Owner;
use crate::rules::Network;
use crate::stats::Stats;

/// Records one listing copies at most.
pub const LIST_CAP: usize = 10_000;

/// Maps the registry is split into, so that sessions starting and ending
/// on different threads rarely wait for each other.
const SHARDS: usize = 16;

/// Where a connection's domain came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DomainSource {
    /// No domain is known: the app connected to an address.
    None,
    /// The app connected to a fake-ip address kerntun's DNS handed out.
    FakeIp,
    /// Read from the first bytes (TLS SNI, HTTP Host).
    Sniffed,
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnState {
    /// Accepted; reading its first bytes for a domain, then connecting.
    Sniffing,
    /// Relaying between the app and its outbound.
    Relaying,
    /// Asked to close ([`Connections::close`]); ending.
    Closing,
}

impl ConnState {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => ConnState::Sniffing,
            1 => ConnState::Relaying,
            _ => ConnState::Closing,
        }
    }
}

/// One connection, as a listing copies it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Connection {
    /// Unique for the engine's life.
    pub id: u64,
    pub network: Network,
    /// The app's address and port.
    pub source: SocketAddr,
    /// The address the app connected to.
    pub destination: SocketAddr,
    /// The domain the flow was routed by, if any.
    pub domain: Option<String>,
    pub domain_source: DomainSource,
    /// The rule that matched ([`crate::rules::Rule::label`]): its `name`,
    /// or its place and conditions. `None` while a sniffing connection is
    /// not routed yet, and when no rule matched (the default route,
    /// direct).
    pub rule: Option<String>,
    /// The groups the flow went through to its outbound, outermost first
    /// (empty when a rule named the outbound itself).
    pub chain: Vec<String>,
    /// The outbound's name (`direct`, or a proxy's); `None` until a
    /// sniffing connection is routed.
    pub outbound: Option<String>,
    /// Payload bytes from the app to the outbound.
    pub bytes_up: u64,
    /// Payload bytes from the outbound to the app.
    pub bytes_down: u64,
    /// When the session started, in milliseconds since the Unix epoch.
    pub started_unix_ms: u64,
    pub state: ConnState,
    /// The uid of the app that owns the flow, once the host named it
    /// (`owner.rs`); `None` where there is no lookup, before it answered,
    /// or when it failed.
    pub uid: Option<u32>,
    /// That app's package name, when the host named one.
    pub package: Option<String>,
}

/// A listing: at most [`LIST_CAP`] connections (`truncated` when there
/// were more), in no particular order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Listing {
    pub connections: Vec<Connection>,
    pub truncated: bool,
}

/// A connection's record, kept with its session.
#[derive(Debug)]
pub(crate) struct Record {
    id: u64,
    network: Network,
    source: SocketAddr,
    destination: SocketAddr,
    started_unix_ms: u64,
    /// Set once, when the domain is known (at start for fake-ip, after
    /// sniffing otherwise).
    domain: OnceLock<(Box<str>, DomainSource)>,
    /// Set once, when the route is known: the outbound's name (a route
    /// alone indexes one configuration's outbounds, which a reload
    /// replaces).
    outbound: OnceLock<Box<str>>,
    /// Set with it when a rule or a group chose the route: their names.
    why: OnceLock<Box<Explained>>,
    /// Set once, when the host named the app that owns the flow.
    owner: OnceLock<Arc<Owner>>,
    state: AtomicU8,
    /// Updated per relayed chunk (`relay::Meter::flow`).
    pub up: AtomicU64,
    pub down: AtomicU64,
    /// Notified once by [`Connections::close`]; the permit waits for a
    /// session not yet listening.
    close: Notify,
}

impl Record {
    /// Record the domain the flow was routed by (the first one holds).
    pub fn set_domain(&self, domain: &str, source: DomainSource) {
        let _ = self.domain.set((domain.into(), source));
    }

    /// Record the app that owns the flow (the first one holds).
    pub fn set_owner(&self, owner: Arc<Owner>) {
        let _ = self.owner.set(owner);
    }

    /// Record the outbound by name and why it was taken (the first one
    /// holds), and that the relay started.
    pub fn relaying(&self, outbound: &str, why: Option<Box<Explained>>) {
        if self.outbound.set(outbound.into()).is_ok()
            && let Some(why) = why
        {
            let _ = self.why.set(why);
        }
        let _ = self.state.compare_exchange(
            ConnState::Sniffing as u8,
            ConnState::Relaying as u8,
            Relaxed,
            Relaxed,
        );
    }

    /// Mark the flow as closing and wake its session: true the first time.
    fn mark_closing(&self) -> bool {
        let was = self.state.swap(ConnState::Closing as u8, Relaxed);
        if was == ConnState::Closing as u8 {
            return false;
        }
        self.close.notify_one();
        true
    }

    /// [`Record::mark_closing`] for the host, counted.
    fn ask_close(&self, stats: &Stats) -> bool {
        let first = self.mark_closing();
        if first {
            stats.connections_closed_by_host.fetch_add(1, Relaxed);
        }
        first
    }

    /// Where the flow is in its life.
    pub fn state(&self) -> ConnState {
        ConnState::from_u8(self.state.load(Relaxed))
    }

    /// Resolves once the host asked to close this connection.
    pub async fn closed(&self) {
        self.close.notified().await;
    }

    fn copy(&self) -> Connection {
        let (domain, domain_source) = match self.domain.get() {
            Some((d, s)) => (Some(d.to_string()), *s),
            None => (None, DomainSource::None),
        };
        let (rule, chain) = match self.why.get() {
            Some(why) => (
                why.rule.as_deref().map(str::to_owned),
                why.chain.iter().map(|g| g.to_string()).collect(),
            ),
            None => (None, Vec::new()),
        };
        Connection {
            id: self.id,
            network: self.network,
            source: self.source,
            destination: self.destination,
            domain,
            domain_source,
            rule,
            chain,
            outbound: self.outbound.get().map(|o| o.to_string()),
            bytes_up: self.up.load(Relaxed),
            bytes_down: self.down.load(Relaxed),
            started_unix_ms: self.started_unix_ms,
            state: ConnState::from_u8(self.state.load(Relaxed)),
            uid: self.owner.get().map(|o| o.uid),
            package: self.owner.get().and_then(|o| o.package.clone()),
        }
    }
}

/// The registry of live connections.
#[derive(Debug)]
pub(crate) struct Connections {
    shards: [Mutex<HashMap<u64, Arc<Record>>>; SHARDS],
    next: AtomicU64,
}

impl Default for Connections {
    fn default() -> Self {
        Connections {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            next: AtomicU64::new(1),
        }
    }
}

impl Connections {
    fn shard(&self, id: u64) -> &Mutex<HashMap<u64, Arc<Record>>> {
        &self.shards[id as usize % SHARDS]
    }

    /// Register a new flow; it is listed until the returned guard drops.
    pub fn register(
        self: &Arc<Self>,
        network: Network,
        source: SocketAddr,
        destination: SocketAddr,
    ) -> Registered {
        let id = self.next.fetch_add(1, Relaxed);
        let started_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let record = Arc::new(Record {
            id,
            network,
            source,
            destination,
            started_unix_ms,
            domain: OnceLock::new(),
            outbound: OnceLock::new(),
            why: OnceLock::new(),
            owner: OnceLock::new(),
            state: AtomicU8::new(ConnState::Sniffing as u8),
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
            close: Notify::new(),
        });
        self.shard(id).lock().insert(id, record.clone());
        Registered {
            conns: self.clone(),
            record,
        }
    }

    /// Flows listed now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Copy at most `cap` records (one shard's lock held at a time).
    pub fn list(&self, cap: usize) -> Listing {
        let mut listing = Listing::default();
        for shard in &self.shards {
            let shard = shard.lock();
            for record in shard.values() {
                if listing.connections.len() == cap {
                    listing.truncated = true;
                    return listing;
                }
                listing.connections.push(record.copy());
            }
        }
        listing
    }

    /// Ask the connection `id` to close: a TCP session resets the app and
    /// closes its outbound; a UDP flow leaves the table within a second
    /// (`udp/listed.rs`), its socket closed, and the app's next datagram
    /// opens a new one. False when no such connection is listed (ended
    /// already, or never was). Counted (`connections_closed_by_host`).
    pub fn close(&self, id: u64, stats: &Stats) -> bool {
        let Some(record) = self.shard(id).lock().get(&id).cloned() else {
            return false;
        };
        record.ask_close(stats);
        true
    }

    /// Close every listed connection `filter` matches, as
    /// [`Connections::close`] does; how many were asked to. Each shard's
    /// lock is held only while its records are copied out.
    pub fn close_matching(&self, filter: &ConnectionFilter, stats: &Stats) -> u64 {
        let mut closed = 0;
        let mut batch = Vec::new();
        for shard in &self.shards {
            batch.clear();
            batch.extend(shard.lock().values().cloned());
            for record in &batch {
                if filter.matches(record) && record.ask_close(stats) {
                    closed += 1;
                }
            }
        }
        closed
    }

    /// Close, as [`Connections::close`] does (not counted as the host's),
    /// every connection relaying through an outbound `keep` says is gone
    /// (a reload); the number closed. One shard's lock at a time;
    /// connections still sniffing have no outbound yet and route by the
    /// new configuration.
    pub fn close_unless(&self, keep: impl Fn(&str) -> bool) -> u64 {
        let mut closed = 0;
        for shard in &self.shards {
            let doomed: Vec<Arc<Record>> = shard
                .lock()
                .values()
                .filter(|r| r.outbound.get().is_some_and(|o| !keep(o)))
                .cloned()
                .collect();
            for r in doomed {
                if r.mark_closing() {
                    closed += 1;
                }
            }
        }
        closed
    }
}

/// Which connections [`Connections::close_matching`] closes: every
/// condition given must hold; the empty filter matches every connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectionFilter {
    pub network: Option<Network>,
    /// The outbound's name (`direct`, a proxy's).
    pub outbound: Option<String>,
    /// A group the connection went through (its `chain`).
    pub group: Option<String>,
    /// The connection's domain is this one or under it (`b.test` matches
    /// `a.b.test`), ASCII case-insensitive.
    pub domain_suffix: Option<String>,
    /// The address the app connected to.
    pub destination_ip: Option<std::net::IpAddr>,
}

impl ConnectionFilter {
    fn matches(&self, r: &Record) -> bool {
        self.network.is_none_or(|n| n == r.network)
            && self
                .destination_ip
                .is_none_or(|ip| ip == r.destination.ip())
            && self
                .outbound
                .as_deref()
                .is_none_or(|want| r.outbound.get().is_some_and(|o| **o == *want))
            && self.group.as_deref().is_none_or(|want| {
                (r.why.get()).is_some_and(|why| why.chain.iter().any(|g| **g == *want))
            })
            && self.domain_suffix.as_deref().is_none_or(|want| {
                let want = want.trim_end_matches('.').as_bytes();
                r.domain.get().is_some_and(|(d, _)| {
                    let d = d.trim_end_matches('.').as_bytes();
                    d.len() >= want.len()
                        && d[d.len() - want.len()..].eq_ignore_ascii_case(want)
                        && (d.len() == want.len() || d[d.len() - want.len() - 1] == b'.')
                })
            })
    }
}

/// A registered flow: its record, removed from the registry on drop.
#[derive(Debug)]
pub(crate) struct Registered {
    conns: Arc<Connections>,
    pub record: Arc<Record>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.conns
            .shard(self.record.id)
            .lock()
            .remove(&self.record.id);
    }
}

/// Entry points of the connection list's criterion bench
/// (`benches/benches/relay.rs`), built with the `bench-internals` feature
/// only.
#[cfg(feature = "bench-internals")]
pub mod bench {
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    use std::sync::Arc;

    use super::{Connections, DomainSource, LIST_CAP, Listing, Registered};
    use crate::rules::Network;

    /// A registry of `n` relaying connections, each with a domain of the
    /// longest kind a name can have (253 bytes): the listing's worst case.
    #[derive(Debug)]
    pub struct Registry {
        conns: Arc<Connections>,
        _held: Vec<Registered>,
    }

    impl Registry {
        pub fn new(n: usize) -> Self {
            let conns = Arc::new(Connections::default());
            let domain = format!("{}.test", "a".repeat(248));
            let held = (0..n)
                .map(|i| {
                    let source = SocketAddr::new(
                        IpAddr::V4(Ipv4Addr::new(10, 0, (i >> 16) as u8, (i >> 8) as u8)),
                        i as u16,
                    );
                    let destination = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(1, 1, 1, 1)), 443);
                    let r = conns.register(Network::Tcp, source, destination);
                    r.record.set_domain(&domain, DomainSource::Sniffed);
                    r.record.relaying("direct", None);
                    r
                })
                .collect();
            Registry { conns, _held: held }
        }

        /// One listing, as `Engine::connections` makes it.
        pub fn list(&self) -> Listing {
            self.conns.list(LIST_CAP)
        }
    }

    /// The heap a listing holds: its vector and each record's strings.
    pub fn listing_bytes(l: &Listing) -> usize {
        l.connections.capacity() * std::mem::size_of::<super::Connection>()
            + l.connections
                .iter()
                .map(|c| {
                    c.domain.as_ref().map_or(0, String::capacity)
                        + c.rule.as_ref().map_or(0, String::capacity)
                        + c.outbound.as_ref().map_or(0, String::capacity)
                        + c.package.as_ref().map_or(0, String::capacity)
                })
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("a test address")
    }

    /// A filter's conditions all hold for what it closes; a domain suffix
    /// matches on label boundaries, case-insensitive, and a flow is asked
    /// to close once.
    #[test]
    fn filters_close_what_they_match() {
        let conns = Arc::new(Connections::default());
        let stats = Stats::default();
        let flows: Vec<Registered> = [
            (Network::Tcp, "a.Example.test"),
            (Network::Udp, "example.test."),
            (Network::Tcp, "badexample.test"),
            (Network::Tcp, ""),
        ]
        .into_iter()
        .map(|(net, domain)| {
            let f = conns.register(net, addr("10.0.0.2:4000"), addr("1.1.1.1:443"));
            if !domain.is_empty() {
                f.record.set_domain(domain, DomainSource::Sniffed);
            }
            f.record.relaying("direct", None);
            f
        })
        .collect();
        let suffix = |net| ConnectionFilter {
            network: net,
            domain_suffix: Some("EXAMPLE.test".into()),
            ..ConnectionFilter::default()
        };
        assert_eq!(conns.close_matching(&suffix(Some(Network::Udp)), &stats), 1);
        assert_eq!(flows[1].record.state(), ConnState::Closing);
        assert_eq!(conns.close_matching(&suffix(None), &stats), 1, "a. only");
        assert_eq!(flows[0].record.state(), ConnState::Closing);
        assert_eq!(flows[2].record.state(), ConnState::Relaying);
        let proxy = ConnectionFilter {
            outbound: Some("some-proxy".into()),
            ..ConnectionFilter::default()
        };
        assert_eq!(conns.close_matching(&proxy, &stats), 0);
        let all = ConnectionFilter::default();
        assert_eq!(conns.close_matching(&all, &stats), 2, "the rest");
        assert_eq!(stats.connections_closed_by_host.load(Relaxed), 4);
    }

    /// A reload closes the connections relaying through an outbound that
    /// is gone, once each, and leaves the rest (and those still sniffing,
    /// which have no outbound yet) alone; the listing keeps naming each by
    /// the outbound it was connected through.
    #[tokio::test]
    async fn close_unless_closes_connections_on_gone_outbounds() {
        let conns = Arc::new(Connections::default());
        let on = |name: &str| {
            let r = conns.register(Network::Tcp, addr("10.0.0.2:4000"), addr("1.1.1.1:443"));
            r.record.relaying(name, None);
            r
        };
        let (a, b, direct) = (on("a"), on("b"), on("direct"));
        let sniffing = conns.register(Network::Tcp, addr("10.0.0.2:4001"), addr("1.1.1.1:443"));
        let keep = |n: &str| n == "a" || n == "direct";
        assert_eq!(conns.close_unless(keep), 1);
        assert_eq!(conns.close_unless(keep), 0, "closing already");
        tokio::time::timeout(std::time::Duration::from_secs(1), b.record.closed())
            .await
            .expect("the session on b is woken");
        let mut l = conns.list(LIST_CAP).connections;
        l.sort_by_key(|c| c.id);
        let states: Vec<_> = l.iter().map(|c| (c.outbound.as_deref(), c.state)).collect();
        assert_eq!(
            states,
            [
                (Some("a"), ConnState::Relaying),
                (Some("b"), ConnState::Closing),
                (Some("direct"), ConnState::Relaying),
                (None, ConnState::Sniffing),
            ]
        );
        drop((a, b, direct, sniffing));
    }

    /// A rule is listed by its name, or by its place and conditions.
    #[test]
    fn rules_are_labelled() {
        use crate::rules::{PortRange, Rule};
        let named = Rule {
            name: Some("ads".into()),
            ..Rule::default()
        };
        assert_eq!(named.label(3), "ads");
        let r = Rule {
            domain_suffix: vec!["b.test".into(), "c.test".into(), "d.test".into()],
            ports: Some(PortRange {
                start: 443,
                end: 443,
            }),
            network: Some(Network::Udp),
            ..Rule::default()
        };
        assert_eq!(
            r.label(2),
            "rules[2] domain_suffix=b.test+2 ports=443 network=udp"
        );
    }

    /// A flow is listed from its registration until its guard drops, with
    /// what it recorded; ids are not reused.
    #[test]
    fn a_flow_is_listed_while_registered() {
        let conns = Arc::new(Connections::default());
        let a = conns.register(Network::Tcp, addr("10.0.0.2:4000"), addr("1.1.1.1:443"));
        let b = conns.register(Network::Udp, addr("10.0.0.2:5000"), addr("8.8.8.8:53"));
        a.record.set_domain("example.test", DomainSource::Sniffed);
        a.record.set_domain("other.test", DomainSource::FakeIp);
        a.record.relaying("direct", None);
        a.record.up.fetch_add(100, Relaxed);
        a.record.down.fetch_add(7, Relaxed);
        let owner = |uid, package: &str| {
            Arc::new(Owner {
                uid,
                package: Some(package.into()),
            })
        };
        a.record.set_owner(owner(10042, "com.example.app"));
        a.record.set_owner(owner(10043, "com.example.other"));
        assert_ne!(a.record.id, b.record.id);
        let mut l = conns.list(LIST_CAP);
        assert!(!l.truncated);
        l.connections.sort_by_key(|c| c.id);
        assert_eq!(l.connections.len(), 2);
        let c = &l.connections[0];
        assert_eq!(c.id, a.record.id);
        assert_eq!(c.network, Network::Tcp);
        assert_eq!(c.destination, addr("1.1.1.1:443"));
        assert_eq!(c.domain.as_deref(), Some("example.test"), "the first holds");
        assert_eq!(c.domain_source, DomainSource::Sniffed);
        assert_eq!(c.outbound.as_deref(), Some("direct"));
        assert_eq!((c.bytes_up, c.bytes_down), (100, 7));
        assert_eq!(c.state, ConnState::Relaying);
        assert_eq!(c.uid, Some(10042), "the first owner holds");
        assert_eq!(c.package.as_deref(), Some("com.example.app"));
        let u = &l.connections[1];
        assert_eq!((u.network, u.outbound.clone()), (Network::Udp, None));
        assert_eq!((u.uid, u.package.clone()), (None, None));
        assert_eq!(u.state, ConnState::Sniffing);
        let first = a.record.id;
        drop(a);
        assert_eq!(conns.len(), 1);
        let c = conns.register(Network::Tcp, addr("10.0.0.2:4001"), addr("1.1.1.1:443"));
        assert!(c.record.id > first, "ids are never reused");
        drop((b, c));
        assert_eq!(conns.len(), 0);
        assert!(conns.list(LIST_CAP).connections.is_empty());
    }

    /// A listing copies at most its cap and says it left some out.
    #[test]
    fn a_listing_stops_at_its_cap() {
        let conns = Arc::new(Connections::default());
        let held: Vec<_> = (0..40u16)
            .map(|p| {
                conns.register(
                    Network::Tcp,
                    SocketAddr::from(([10, 0, 0, 2], p)),
                    addr("1.1.1.1:80"),
                )
            })
            .collect();
        let l = conns.list(25);
        assert_eq!(l.connections.len(), 25);
        assert!(l.truncated);
        let l = conns.list(40);
        assert_eq!(l.connections.len(), 40);
        assert!(!l.truncated, "exactly the cap is everything");
        drop(held);
    }

    /// Closing wakes the session once (also one that listens only later),
    /// is counted once, and an unknown id is refused.
    #[tokio::test]
    async fn close_wakes_the_session_once_and_unknown_ids_are_false() {
        let conns = Arc::new(Connections::default());
        let stats = Stats::default();
        let a = conns.register(Network::Tcp, addr("10.0.0.2:4000"), addr("1.1.1.1:443"));
        let id = a.record.id;
        assert!(!conns.close(id + 1000, &stats));
        assert!(conns.close(id, &stats));
        assert!(conns.close(id, &stats), "still listed while it ends");
        assert_eq!(stats.connections_closed_by_host.load(Relaxed), 1);
        tokio::time::timeout(std::time::Duration::from_secs(1), a.record.closed())
            .await
            .expect("woken by the close that came before it listened");
        a.record.relaying("direct", None);
        let l = conns.list(LIST_CAP);
        assert_eq!(l.connections[0].state, ConnState::Closing, "stays closing");
        drop(a);
        assert!(!conns.close(id, &stats), "ended");
    }
}
