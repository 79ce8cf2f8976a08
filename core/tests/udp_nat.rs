//! UDP as apps use it: large datagrams through a gateway that forwards the
//! app into the TUN (the router topology, `testkit::router`).
//!
//! Needs root (CI runs as root); otherwise each test prints why it skipped.

use std::net::SocketAddr;

use kerntun::config::{Config, DriverMode, StackKind};
use kerntun::{Engine, TunSource};
use kerntun_testkit::router::Router;
use kerntun_testkit::{Topology, client, require_root, servers};

/// The engine's configuration in a topology's client namespace.
fn config(topo: &Topology, driver: DriverMode, mtu: u16) -> Config {
    let mut c = Config {
        stack: StackKind::System,
        ..Config::default()
    };
    c.tun.name = format!("kt{}", topo.id);
    c.tun.mtu = mtu;
    c.tun.ipv4 = Some("198.18.0.1/16".parse().expect("net"));
    c.tun.ipv6 = Some("fd00:18::1/64".parse().expect("net"));
    c.driver = driver;
    c.direct.interface = Some(kerntun_testkit::CLIENT_VETH.into());
    c.direct.connect_timeout_ms = 2_000;
    c
}

/// An app namespace forwarded into the engine's TUN by the client
/// namespace, both families, over 1500-byte links.
struct Gateway {
    topo: Topology,
    router: Router,
    engine: Engine,
}

impl Gateway {
    fn new(driver: DriverMode, tun_mtu: u16, tweak: impl FnOnce(&mut Config)) -> Gateway {
        let topo = Topology::new().expect("topology");
        let router = Router::attach(&topo).expect("router");
        router.add_v6(&topo).expect("router ipv6");
        router.set_mtu(&topo, 1500).expect("link mtu");
        topo.client.enter().expect("enter client ns");
        let mut cfg = config(&topo, driver, tun_mtu);
        tweak(&mut cfg);
        let engine = Engine::start(cfg, TunSource::Create, None).expect("engine start");
        let tun = engine.tun_name().expect("tun name");
        router.route_via_tun(&topo, &tun).expect("route");
        router.route_v6_via_tun(&topo, &tun).expect("route v6");
        Gateway {
            topo,
            router,
            engine,
        }
    }
}

/// 8000- and 60,000-byte UDP echoes from an app forwarded into the TUN
/// over 1500-byte links: the app's kernel sends them as fragments, the
/// engine reassembles and relays them, and every echo comes back byte for
/// byte, IPv4 and IPv6, both drivers, with the TUN's MTU at 1500 and at
/// Android's 9000. At 9000 the engine used to write an 8000-byte echo as
/// one packet (IPv4 with DF), which the gateway could not forward onto the
/// app's 1500-byte link: 0 of 10 came back. Replies now go in fragments no
/// longer than the app's own (`udp::ReplyState::lower_mtu`), and IPv4
/// replies the engine writes whole carry no DF.
#[test]
fn large_datagrams_round_trip_through_a_gateway() {
    require_root!();
    for tun_mtu in [9000, 1500] {
        for driver in [DriverMode::PerPacket, DriverMode::Batch] {
            let gw = Gateway::new(driver, tun_mtu, |_| {});
            for v6 in [false, true] {
                let echo =
                    servers::udp_echo(&gw.topo.server, SocketAddr::new(gw.topo.server(v6), 0))
                        .expect("echo server");
                for (size, count) in [(8000, 10), (60_000, 5)] {
                    let to = echo.addr;
                    let ok = gw
                        .router
                        .app
                        .spawn(move || client::udp_round_trips(to, count, size))
                        .expect("app thread")
                        .join()
                        .expect("app thread")
                        .expect("round trips");
                    let s = gw.engine.stats();
                    assert_eq!(
                        ok, count,
                        "{size}-byte echoes, v6 {v6}, {driver:?}, TUN MTU {tun_mtu}: {s:?}"
                    );
                }
            }
            let s = gw.engine.stats();
            assert_eq!(s.drop_count("udp_reply_too_big"), 0, "{s:?}");
        }
    }
}
