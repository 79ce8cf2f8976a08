//! Proxy servers by host name: the outbound resolves the name with the
//! in-process DNS server of the server namespace (testkit/src/dns.rs),
//! through the socket factory's loop avoidance (bound to the client veth),
//! and connects to a SOCKS5 recorder that tells which server was reached.
//! The server moves (the answer changes), a name does not exist, a name has
//! only an IPv6 address.
//!
//! Needs root (CI runs as root); otherwise each test prints why it skipped.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use kerntun::config::{DirectConfig, OutboundConfig, OutboundUdp, RelayConfig, Socks5Config};
use kerntun::dns::Upstream;
use kerntun::outbound::resolve::Resolvers;
use kerntun::outbound::{Address, OutboundError, Outbounds, Route, SocketFactory};
use kerntun::stats::Stats;
use kerntun_testkit::dns::{DnsServer, Socks5Recorder, Zone};
use kerntun_testkit::{Topology, require_root};

const PORT: u16 = 1080;

struct Rig {
    topo: Topology,
    dns: DnsServer,
    dns_addr: SocketAddr,
    rt: tokio::runtime::Runtime,
}

impl Rig {
    fn new(zone: Zone) -> Rig {
        let topo = Topology::new().expect("topology");
        let dns_addr = SocketAddr::new(IpAddr::V4(topo.server_v4()), 0);
        let dns = DnsServer::start(&topo.server, dns_addr, zone).expect("dns server");
        topo.client.enter().expect("enter client ns");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        Rig {
            topo,
            dns_addr: dns.addr,
            dns,
            rt,
        }
    }

    /// Serve `zone` from now on (the same server and address).
    fn set_zone(&self, zone: Zone) {
        self.dns.set_zone(zone);
    }

    fn queries(&self) -> u64 {
        self.dns.queries()
    }

    /// Outbounds with one SOCKS5 proxy, `name`, at `server`.
    fn outbounds(&self, name: &str, server: &str) -> (Outbounds, Stats) {
        let mut map = BTreeMap::new();
        map.insert(
            name.to_owned(),
            OutboundConfig::Socks5(Socks5Config {
                server: kerntun::outbound::link::parse_server(server).expect("server"),
                username: None,
                password: None,
                udp: OutboundUdp::Relay,
            }),
        );
        let direct = DirectConfig {
            interface: Some(kerntun_testkit::CLIENT_VETH.into()),
            connect_timeout_ms: 2_000,
            ..DirectConfig::default()
        };
        let up: Upstream = format!("udp://{}", self.dns_addr)
            .parse()
            .expect("upstream");
        let ob = Outbounds::new(
            &map,
            &BTreeMap::new(),
            &[],
            &RelayConfig::default(),
            SocketFactory::new(&direct, None),
            65_536,
            Resolvers::new(vec![up], Duration::from_secs(1)),
        )
        .expect("outbounds");
        let stats = Stats::with_outbounds(ob.counters());
        (ob, stats)
    }

    fn connect(&self, ob: &Outbounds, stats: &Stats) -> Result<(), OutboundError> {
        let dst = Address::Domain("target.example".into(), 80);
        self.rt
            .block_on(ob.connect(Route::Proxy(0), &dst, stats))
            .map(drop)
    }
}

fn recorder(rig: &Rig, ip: IpAddr) -> Socks5Recorder {
    Socks5Recorder::start(&rig.topo.server, SocketAddr::new(ip, PORT)).expect("socks5 recorder")
}

#[test]
fn a_moved_server_is_followed_after_the_ttl_and_after_a_connect_failure() {
    require_root!();
    let rig = Rig::new(Zone::new(0));
    let (v4, v6) = (
        IpAddr::V4(rig.topo.server_v4()),
        IpAddr::V6(rig.topo.server_v6()),
    );
    rig.set_zone(Zone::new(1).with("proxy.test", v4));
    let at_v4 = recorder(&rig, v4);
    let at_v6 = recorder(&rig, v6);
    let (ob, stats) = rig.outbounds("proxy", "proxy.test:1080");

    rig.connect(&ob, &stats).expect("first connect");
    assert_eq!(at_v4.asked(), ["target.example:80"]);
    let asked = rig.queries();
    assert_eq!(asked, 2, "one A and one AAAA query");
    rig.connect(&ob, &stats).expect("cached");
    assert_eq!(rig.queries(), asked, "answered from the cache");

    // The server moves; the old address still answers, so only the TTL
    // (1 s) can make the engine follow.
    rig.set_zone(Zone::new(300).with("proxy.test", v6));
    std::thread::sleep(Duration::from_millis(1_100));
    rig.connect(&ob, &stats).expect("after the ttl");
    assert_eq!(at_v6.asked().len(), 1, "the new address after the TTL");
    assert_eq!(at_v4.asked().len(), 2);

    // It moves back under a 300 s TTL and the v6 server goes away: the
    // connect that fails makes the next one ask again.
    rig.set_zone(Zone::new(300).with("proxy.test", v4));
    drop(at_v6);
    let e = rig
        .connect(&ob, &stats)
        .expect_err("the old address is gone");
    let msg = e.to_string();
    assert!(msg.contains("proxy.test") && msg.contains("proxy"), "{msg}");
    let t = Instant::now();
    rig.connect(&ob, &stats)
        .expect("re-resolved after the failure");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(at_v4.asked().len(), 3);
    let s = stats.snapshot_outbounds();
    assert_eq!(
        (s.tcp_connects, s.tcp_failures, s.resolve_failures),
        (4, 1, 0)
    );
}

#[test]
fn nxdomain_is_a_named_counted_error() {
    require_root!();
    let rig = Rig::new(Zone::new(60));
    let (ob, stats) = rig.outbounds("ghost", "missing.test:1080");
    let e = rig.connect(&ob, &stats).expect_err("no such name");
    assert!(
        matches!(&e, OutboundError::Resolve { outbound, name, .. } if outbound == "ghost" && name == "missing.test"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("ghost") && msg.contains("missing.test") && msg.contains("NXDOMAIN"),
        "{msg}"
    );
    let asked = rig.queries();
    // A burst of connections right after costs no more lookups.
    let again = rig.connect(&ob, &stats).expect_err("held");
    assert_eq!(again.to_string(), msg);
    assert_eq!(rig.queries(), asked, "the failure is held, not asked again");
    let s = stats.snapshot_outbounds();
    assert_eq!((s.resolve_failures, s.tcp_failures), (2, 0));
}

#[test]
fn ipv6_only_name() {
    require_root!();
    let rig = Rig::new(Zone::new(0));
    let v6 = IpAddr::V6(rig.topo.server_v6());
    rig.set_zone(Zone::new(60).with("six.test", v6));
    let at_v6 = recorder(&rig, v6);
    let (ob, stats) = rig.outbounds("six", "six.test:1080");
    rig.connect(&ob, &stats).expect("over IPv6");
    assert_eq!(at_v6.asked(), ["target.example:80"]);
    // UDP through the proxy reaches the same address (the recorder answers
    // UDP ASSOCIATE with its own IPv6 address).
    let udp = rig.rt.block_on(ob.udp(0)).expect("udp association");
    let peer = udp.sock.peer_addr().expect("peer");
    assert!(peer.is_ipv6(), "{peer}");
    assert_eq!(stats.snapshot_outbounds().tcp_connects, 1);
}

/// The one outbound's counters.
trait OneOutbound {
    fn snapshot_outbounds(&self) -> kerntun::stats::OutboundSnapshot;
}

impl OneOutbound for Stats {
    fn snapshot_outbounds(&self) -> kerntun::stats::OutboundSnapshot {
        self.snapshot()
            .outbounds
            .into_iter()
            .next()
            .expect("one outbound")
    }
}
