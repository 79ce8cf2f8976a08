//! UDP as apps use it: large datagrams through a gateway that forwards the
//! app into the TUN (the router topology, `testkit::router`), and the
//! engine's UDP NAT (`direct.udp_nat`): replies from any peer, one mapping
//! per app source seen by a STUN server (`testkit::stun`).
//!
//! Needs root (CI runs as root); otherwise each test prints why it skipped.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use kerntun::config::{Config, DriverMode, StackKind, UdpNat};
use kerntun::{Engine, TunSource};
use kerntun_testkit::router::Router;
use kerntun_testkit::{Topology, client, require_root, servers, stun};

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

/// An engine in a topology's client namespace (the app beside it), with a
/// second server address on the server's link, fd00:19:N::3 and
/// 198.19.N.3, routed into the TUN with the first.
struct Local {
    topo: Topology,
    engine: Engine,
}

impl Local {
    fn new(nat: UdpNat, driver: DriverMode) -> Local {
        let topo = Topology::new().expect("topology");
        topo.client.enter().expect("enter client ns");
        let mut cfg = config(&topo, driver, 1500);
        cfg.direct.udp_nat = nat;
        let engine = Engine::start(cfg, TunSource::Create, None).expect("engine start");
        let tun = engine.tun_name().expect("tun name");
        topo.route_via_tun(&tun).expect("routes");
        for v6 in [false, true] {
            let (fam, second, len) = Local::second(&topo, v6);
            let addr = format!("{second}/{len}");
            let mut args = vec![fam, "addr", "add", &addr, "dev", "kts"];
            if v6 {
                // Usable at once, not tentative for a second (DAD).
                args.push("nodad");
            }
            topo.server.ip(&args).expect("second address");
            topo.client
                .ip(&[fam, "route", "add", &second.to_string(), "dev", &tun])
                .expect("second route");
        }
        Local { topo, engine }
    }

    /// The second server address of a family (`ip` family flag, address,
    /// prefix length).
    fn second(topo: &Topology, v6: bool) -> (&'static str, IpAddr, u8) {
        match topo.server(v6) {
            IpAddr::V4(a) => {
                let o = a.octets();
                ("-4", Ipv4Addr::new(o[0], o[1], o[2], 3).into(), 24)
            }
            IpAddr::V6(a) => {
                let mut s = a.segments();
                s[7] = 3;
                ("-6", Ipv6Addr::from(s).into(), 64)
            }
        }
    }
}

/// The app sends to the server's port A; the server answers from A, then
/// from its port B and from its second address. With endpoint-independent
/// filtering (the default) all three reach the app, each from the address
/// and port it came from; with `udp_nat = "connected"` only A's does. Both
/// families, both drivers.
#[test]
fn replies_from_other_ports_and_addresses_follow_udp_nat() {
    require_root!();
    for (nat, driver) in [
        (UdpNat::EndpointIndependent, DriverMode::PerPacket),
        (UdpNat::EndpointIndependent, DriverMode::Batch),
        (UdpNat::Connected, DriverMode::PerPacket),
    ] {
        let rig = Local::new(nat, driver);
        for v6 in [false, true] {
            let server = rig.topo.server(v6);
            let second = Local::second(&rig.topo, v6).1;
            let (got, sent) = client::replies_from_three_places(&rig.topo.server, server, second);
            let want = if nat == UdpNat::EndpointIndependent {
                &sent[..]
            } else {
                &sent[..1]
            };
            assert_eq!(
                got,
                want,
                "{nat:?} {driver:?} v6 {v6}: {:?}",
                rig.engine.stats()
            );
        }
        // One flow per app source with endpoint-independent mapping (two
        // families: two); one per destination it sent to, connected.
        assert_eq!(rig.engine.stats().udp_flows_total, 2, "{nat:?}");
    }
}

/// A STUN binding request through the engine to two STUN servers on two
/// addresses, from one app socket: with endpoint-independent mapping both
/// report the same mapped address (the engine's outbound address on the
/// client link and one port), so an ICE agent's server-reflexive candidate
/// holds for every peer; with `udp_nat = "connected"` each destination got
/// its own port. Both families.
#[test]
fn stun_reports_one_mapping_across_destinations() {
    require_root!();
    for nat in [UdpNat::EndpointIndependent, UdpNat::Connected] {
        let rig = Local::new(nat, DriverMode::PerPacket);
        for v6 in [false, true] {
            let second = Local::second(&rig.topo, v6).1;
            let one = stun::server(&rig.topo.server, SocketAddr::new(rig.topo.server(v6), 0))
                .expect("stun server");
            let two = stun::server(&rig.topo.server, SocketAddr::new(second, one.addr.port()))
                .expect("second stun server");
            let app = client::udp_app_socket(v6);
            let mut mapped = Vec::new();
            for (i, to) in [one.addr, two.addr].into_iter().enumerate() {
                let id = [b'k', b't', i as u8, 0, 0, 0, 0, 0, 0, 0, 0, v6 as u8];
                app.send_to(&stun::binding_request(id), to).expect("send");
                let mut buf = [0u8; 256];
                let (n, src) =
                    kerntun_testkit::uninterrupted(|| app.recv_from(&mut buf)).expect("answer");
                assert_eq!(src, to, "answered by the server asked");
                mapped.push(stun::mapped_address(&buf[..n], id).expect("mapped address"));
            }
            let outbound = if v6 {
                IpAddr::V6(rig.topo.client_v6())
            } else {
                IpAddr::V4(rig.topo.client_v4())
            };
            assert!(
                mapped.iter().all(|m| m.ip() == outbound),
                "{nat:?} v6 {v6}: {mapped:?}"
            );
            match nat {
                UdpNat::EndpointIndependent => {
                    assert_eq!(mapped[0], mapped[1], "one mapping, v6 {v6}")
                }
                UdpNat::Connected => {
                    assert_ne!(mapped[0], mapped[1], "a port per destination, v6 {v6}")
                }
            }
        }
    }
}
