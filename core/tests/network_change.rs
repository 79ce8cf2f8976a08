//! The host's network moves (`Engine::network_changed`, `core/src/network.rs`):
//! two uplinks from the client namespace to the server namespace, A (the
//! topology's veth, which the engine's sockets are bound to at start) and
//! B (a second veth this test adds, with the default route). While
//! streams run, the host first says B is the default (A keeps its
//! address: sessions on A go on), then A loses its address and route and
//! the host says so: within 1 s the session on A is reset and counted, its
//! UDP flow closed, a session already on B keeps moving byte-exact, new
//! connections go out on B, and a DNS answer cached before is asked
//! upstream again. Through a SOCKS5 outbound, a UDP flow whose
//! association left on A is closed and counted, one on B kept. A proxy
//! given by name is resolved through the DNS servers the host reports.
//!
//! Needs root (namespaces, TUN); otherwise each test prints why it skipped.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hickory_proto::rr::RecordType;
use kerntun::config::{DriverMode, OutboundConfig, OutboundUdp, Socks5Config, StackKind};
use kerntun::network::{DefaultInterface, NetworkError, NetworkInfo};
use kerntun::outbound::Address;
use kerntun::rules::{Action, Rule};
use kerntun_testkit::dns::{self, DnsServer, Socks5Recorder, Zone};
use kerntun_testkit::rig::{RESOLVER, Rig, socks5};
use kerntun_testkit::servers::Mode;
use kerntun_testkit::{
    CLIENT_VETH, Topology, client, pattern, require_root, root_topology, uninterrupted, within,
};

/// The second uplink's ends: client side and server side.
const UPLINK_B: &str = "ktb";
const UPLINK_B_PEER: &str = "ktsb";

/// The client's and the server's addresses on uplink B.
fn uplink_b(topo: &Topology) -> (Ipv4Addr, Ipv4Addr) {
    let id = topo.id as u8;
    (Ipv4Addr::new(198, 20, id, 1), Ipv4Addr::new(198, 20, id, 2))
}

/// Add uplink B and make it the default route of the client namespace.
/// The server answers on it from its A address too (the server's
/// addresses are all local to its namespace). Removed with the
/// namespaces.
fn add_uplink_b(topo: &Topology) {
    let (c, s) = uplink_b(topo);
    topo.client
        .ip(&[
            "link",
            "add",
            UPLINK_B,
            "type",
            "veth",
            "peer",
            "name",
            UPLINK_B_PEER,
            "netns",
            topo.server.name(),
        ])
        .expect("veth B");
    topo.client
        .addr_up(UPLINK_B, &format!("{c}/24"))
        .expect("client address on B, up");
    topo.server
        .addr_up(UPLINK_B_PEER, &format!("{s}/24"))
        .expect("server address on B's peer, up");
    // Sockets bound to B reach the server's A address through it (the
    // host route into the TUN and A's connected route name other devices).
    topo.client
        .ip(&[
            "route",
            "add",
            "default",
            "via",
            &s.to_string(),
            "dev",
            UPLINK_B,
        ])
        .expect("default route via B");
}

fn on_b(topo: &Topology) -> NetworkInfo {
    NetworkInfo {
        interface: Some(DefaultInterface {
            name: UPLINK_B.into(),
            index: 0,
        }),
        has_ipv4: true,
        has_ipv6: false,
        dns_servers: vec![IpAddr::V4(uplink_b(topo).1)],
        expensive: true,
        constrained: false,
    }
}

/// The local addresses of the engine's outbound TCP sockets connected to
/// `to` (`/proc/thread-self/net/tcp`: this thread is in the namespace),
/// leaving out the apps' own, whose source is the TUN's address.
fn tcp_sources(to: SocketAddr) -> Vec<Ipv4Addr> {
    let text = std::fs::read_to_string("/proc/thread-self/net/tcp").expect("/proc/net/tcp");
    let addr = |s: &str| -> Option<SocketAddr> {
        let (ip, port) = s.split_once(':')?;
        // The network-order word printed as a host integer.
        let ip = u32::from_str_radix(ip, 16).ok()?.to_ne_bytes();
        let port = u16::from_str_radix(port, 16).ok()?;
        Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), port))
    };
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // State 01: established.
            if f.get(3) != Some(&"01") || addr(f.get(2)?)? != to {
                return None;
            }
            match addr(f.get(1)?)?.ip() {
                IpAddr::V4(v4) if v4.octets()[..2] != [198, 18] => Some(v4),
                _ => None,
            }
        })
        .collect()
}

fn connect(to: SocketAddr) -> TcpStream {
    let s = TcpStream::connect_timeout(&to, Duration::from_secs(3)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    s
}

/// Send `data` and read the echo back, byte-exact.
fn echo(s: &mut TcpStream, data: &[u8]) {
    s.write_all(data).expect("write");
    let mut back = vec![0u8; data.len()];
    s.read_exact(&mut back).expect("echo");
    assert!(back == data, "the echo differs");
}

/// Round trips on a stream in a thread until `stop`: each 16 KiB of a
/// distinct pattern, checked byte-exact; counts them into `rounds`.
fn keep_echoing(
    mut s: TcpStream,
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicU64>,
) -> std::thread::JoinHandle<Result<(), String>> {
    std::thread::spawn(move || {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let data = pattern(n, 16 * 1024);
            s.write_all(&data)
                .map_err(|e| format!("round {n}: write: {e}"))?;
            let mut back = vec![0u8; data.len()];
            s.read_exact(&mut back)
                .map_err(|e| format!("round {n}: read: {e}"))?;
            if back != data {
                return Err(format!("round {n}: the echo differs"));
            }
            n += 1;
            rounds.store(n, Ordering::Relaxed);
        }
        Ok(())
    })
}

fn udp_round_trip(sock: &UdpSocket, to: SocketAddr, payload: &[u8]) -> bool {
    sock.send_to(payload, to).expect("send");
    let mut buf = [0u8; 64];
    match uninterrupted(|| sock.recv_from(&mut buf)) {
        Ok((n, _)) if &buf[..n] == payload => true,
        // What came instead, for the failure this leads to.
        got => {
            let got = got.map(|(n, from)| (from, String::from_utf8_lossy(&buf[..n]).into_owned()));
            eprintln!(
                "{to}: sent {:?}, got {got:?}",
                String::from_utf8_lossy(payload)
            );
            false
        }
    }
}

fn moves_to_uplink_b(stack: StackKind) {
    let topo = Topology::new().expect("topology");
    let srv = topo.tcp_server(false, Mode::Echo);
    let udp = topo.udp_echo(false);
    let web: IpAddr = "198.19.7.7".parse().expect("ip");
    let resolver = DnsServer::start(
        &topo.server,
        topo.server_addr(false, 53),
        Zone::new(300).with("www.test", web),
    )
    .expect("dns server");
    let mut rig = Rig::builder()
        .stack(stack)
        .driver(DriverMode::PerPacket)
        .ipv4_only()
        .dns(vec![format!("udp://{}", resolver.addr)])
        .config(|_, c| c.dns.timeout_ms = 500)
        .start_in(topo);
    let topo = &rig.topo;
    let (a_client, b_client) = (topo.client_v4(), uplink_b(topo).0);

    // On uplink A (the rig binds the engine's sockets to it): a stream, a
    // UDP flow, a cached DNS answer.
    let mut on_a = connect(srv.addr);
    echo(&mut on_a, &pattern(1, 4096));
    assert_eq!(
        tcp_sources(srv.addr),
        vec![a_client],
        "the session leaves on A"
    );
    let app_udp = UdpSocket::bind("0.0.0.0:0").expect("udp");
    app_udp
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    assert!(udp_round_trip(&app_udp, udp.addr, b"before"), "UDP on A");
    let ask = |id| {
        dns::ask_udp(
            RESOLVER,
            &dns::query("www.test", RecordType::A, id),
            Duration::from_secs(3),
        )
        .expect("ask")
        .expect("an answer")
    };
    assert_eq!(dns::first_addr(&ask(1)), Some(web));
    assert_eq!(dns::first_addr(&ask(2)), Some(web));
    assert_eq!(
        resolver.queries(),
        1,
        "the second answer came from the cache"
    );

    // B comes up and becomes the default; A keeps its address. The host
    // says so: new sockets bind to B, the session on A is still valid.
    add_uplink_b(topo);
    assert!(rig.engine.network_changed(on_b(topo)).expect("running"));
    let mut on_b_stream = connect(srv.addr);
    echo(&mut on_b_stream, &pattern(2, 4096));
    let sources = tcp_sources(srv.addr);
    assert!(
        sources.contains(&a_client) && sources.contains(&b_client),
        "one session on each uplink: {sources:?}"
    );
    std::thread::sleep(Duration::from_millis(200));
    echo(&mut on_a, &pattern(3, 4096));
    let s = rig.stats();
    assert_eq!(s.network_changes, 1);
    assert_eq!(s.sessions_reset_on_network_change, 0, "A still carries it");
    assert_eq!(s.udp_flows_dropped_on_network_change, 0);
    assert_eq!(resolver.queries(), 1);
    assert_eq!(dns::first_addr(&ask(3)), Some(web));
    assert_eq!(resolver.queries(), 2, "the change forgot the cached answer");

    // The session on B keeps moving through the next change.
    let (stop, rounds) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let mover = keep_echoing(on_b_stream, stop.clone(), rounds.clone());

    // A loses its address and routes; the host reports the same default
    // interface, over other addresses: a change.
    topo.client
        .ip(&["addr", "flush", "dev", CLIENT_VETH])
        .expect("flush A's addresses");
    let changed = Instant::now();
    assert!(rig.engine.network_changed(on_b(topo)).expect("running"));
    // The app's session on A is reset at once: its read fails or ends.
    on_a.set_read_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    let (ended, r) = client::read_ended(&mut on_a);
    let took = changed.elapsed();
    assert!(ended, "the session on A ends: {r:?} after {took:?}");
    assert!(took < Duration::from_secs(1), "within 1 s: {took:?}");
    rig.wait_until(
        "the reset and the UDP flow counted",
        Duration::from_secs(1),
        |s| s.sessions_reset_on_network_change == 1 && s.udp_flows_dropped_on_network_change == 1,
    );

    // New connections and flows go out on B.
    let mut fresh = connect(srv.addr);
    echo(&mut fresh, &pattern(4, 64 * 1024));
    assert!(
        udp_round_trip(&app_udp, udp.addr, b"after"),
        "the app's next datagram opens a flow on B"
    );
    let sources = tcp_sources(srv.addr);
    assert!(
        !sources.is_empty() && sources.iter().all(|s| *s == b_client),
        "every session leaves on B: {sources:?}"
    );

    // The session that was on B went on moving, byte-exact.
    let at_change = rounds.load(Ordering::Relaxed);
    let moved = within(Duration::from_secs(3), || {
        rounds.load(Ordering::Relaxed) >= at_change + 20
    });
    stop.store(true, Ordering::Relaxed);
    let result = mover.join().expect("mover thread");
    assert_eq!(result, Ok(()), "the session on B");
    assert!(
        moved.is_some(),
        "the session on B kept moving after the change"
    );

    // The same report again changes nothing and counts nothing.
    assert!(!rig.engine.network_changed(on_b(topo)).expect("running"));
    let s = rig.stats();
    assert_eq!(s.network_changes, 2, "{s:?}");
    assert_eq!(s.sessions_reset_on_network_change, 1);

    // Stopped: a typed error, no panic.
    rig.engine.stop();
    assert!(matches!(
        rig.engine.network_changed(on_b(&rig.topo)),
        Err(NetworkError::NotRunning)
    ));
}

kerntun_testkit::root_tests!(moves_to_uplink_b;
    system_stack_moves_to_the_new_uplink(StackKind::System),
    smoltcp_moves_to_the_new_uplink(StackKind::Smoltcp),
);

/// UDP flows through a SOCKS5 outbound: one associated while the engine's
/// sockets leave on A, one after the host said B is the default. A loses
/// its address: the flow on A (its association's UDP socket and control
/// connection were on A) is closed and counted, and the app's next
/// datagram opens a new association on B; the flow on B keeps its
/// association.
#[test]
fn proxied_udp_flow_on_a_lost_uplink_is_dropped() {
    let topo = root_topology!();
    let proxy = Socks5Recorder::start(&topo.server, topo.server_addr(false, 1080)).expect("socks5");
    let rig = Rig::builder()
        .stack(StackKind::System)
        .driver(DriverMode::PerPacket)
        .ipv4_only()
        .outbound("proxy", socks5(proxy.addr, None, OutboundUdp::Relay))
        .rule(Rule {
            action: Action::from("proxy"),
            ..Rule::default()
        })
        .start_in(topo);
    let topo = &rig.topo;
    // The recorder echoes every datagram whatever its target.
    let (to_a, to_b) = (topo.server_addr(false, 7001), topo.server_addr(false, 7002));
    let app = |to| {
        let s = UdpSocket::bind("0.0.0.0:0").expect("udp");
        s.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        assert!(
            udp_round_trip(&s, to, b"hello"),
            "UDP through SOCKS5 to {to}"
        );
        s
    };
    let flow_a = app(to_a);
    add_uplink_b(topo);
    assert!(rig.engine.network_changed(on_b(topo)).expect("running"));
    let flow_b = app(to_b);
    let s = rig.stats();
    assert_eq!(s.outbounds[0].udp_flows, 2, "{s:?}");
    assert_eq!(
        s.udp_flows_dropped_on_network_change, 0,
        "A still carries it"
    );
    assert!(udp_round_trip(&flow_a, to_a, b"still on A"));

    topo.client
        .ip(&["addr", "flush", "dev", CLIENT_VETH])
        .expect("flush A's addresses");
    assert!(rig.engine.network_changed(on_b(topo)).expect("running"));
    rig.wait_until(
        "the proxied flow on A counted",
        Duration::from_secs(1),
        |s| s.udp_flows_dropped_on_network_change == 1,
    );
    // The flow on B keeps its association; the one on A gets a new one,
    // on B.
    assert!(udp_round_trip(&flow_b, to_b, b"kept"), "the flow on B");
    assert_eq!(rig.stats().outbounds[0].udp_flows, 2);
    assert!(
        udp_round_trip(&flow_a, to_a, b"after"),
        "the app's next datagram opens an association on B"
    );
    let s = rig.stats();
    assert_eq!(s.outbounds[0].udp_flows, 3, "{s:?}");
    assert_eq!(s.udp_flows_dropped_on_network_change, 1, "{s:?}");
}

/// A SOCKS5 proxy given as `proxy.test`, a name only the network's DNS
/// server (UDP port 53 in the server namespace) knows, and a system-stack
/// engine that sends everything to it, with no `bootstrap`, its
/// configuration tweaked by `tweak`; `before` runs in the topology first
/// (a server the tweak names).
struct NamedProxy<T> {
    rig: Rig,
    proxy: Socks5Recorder,
    platform: DnsServer,
    before: T,
}

fn named_proxy<T>(
    before: impl FnOnce(&Topology) -> T,
    tweak: impl FnOnce(&T, &mut kerntun::Config),
) -> NamedProxy<T> {
    let topo = Topology::new().expect("topology");
    let proxy = Socks5Recorder::start(&topo.server, topo.server_addr(false, 1080)).expect("socks5");
    let platform = DnsServer::start(
        &topo.server,
        topo.server_addr(false, 53),
        Zone::new(300).with("proxy.test", proxy.addr.ip()),
    )
    .expect("the network's dns server");
    let before = before(&topo);
    let seen = &before;
    let rig = Rig::builder()
        .stack(StackKind::System)
        .driver(DriverMode::PerPacket)
        .ipv4_only()
        .outbound(
            "proxy",
            OutboundConfig::Socks5(Socks5Config {
                server: Address::Domain("proxy.test".into(), proxy.addr.port()),
                username: None,
                password: None,
                udp: OutboundUdp::Relay,
            }),
        )
        .rule(Rule {
            action: Action::from("proxy"),
            ..Rule::default()
        })
        .config(move |_, c| {
            c.direct.bootstrap = Vec::new();
            c.dns.timeout_ms = 500;
            tweak(seen, c);
        })
        .start_in(topo);
    NamedProxy {
        rig,
        proxy,
        platform,
        before,
    }
}

impl<T> NamedProxy<T> {
    /// A connection before the host reported a network: refused at once,
    /// counted in `resolve_failures`, the network's server not asked.
    fn refused_before_the_report(&self, target: SocketAddr) {
        let e =
            TcpStream::connect_timeout(&target, Duration::from_secs(3)).expect_err("unresolved");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
        let s = self.rig.stats();
        assert_eq!(s.outbounds[0].resolve_failures, 1, "{s:?}");
        assert_eq!(self.platform.queries(), 0);
    }

    /// The host reports a network whose DNS server is the platform one:
    /// the next connection resolves the name there and goes through the
    /// proxy, byte-exact.
    fn through_after_the_report(&self, target: SocketAddr, seed: u64) {
        let info = NetworkInfo {
            interface: Some(DefaultInterface {
                name: CLIENT_VETH.into(),
                index: 0,
            }),
            has_ipv4: true,
            dns_servers: vec![self.platform.addr.ip()],
            ..NetworkInfo::default()
        };
        assert!(self.rig.engine.network_changed(info).expect("running"));
        let mut through = connect(target);
        echo(&mut through, &pattern(seed, 4096));
        assert!(self.platform.queries() >= 1, "asked the network's server");
        assert_eq!(
            self.proxy.asked(),
            vec![target.to_string()],
            "through the proxy"
        );
        let s = self.rig.stats();
        assert_eq!(s.outbounds[0].tcp_connects, 1, "{s:?}");
    }
}

/// A SOCKS5 proxy given by name, no `bootstrap`, and a configured
/// upstream that does not know the name: the proxy cannot be reached
/// (counted in `resolve_failures`) until the host reports a network whose
/// DNS server (UDP port 53, in the server namespace) answers the name;
/// then the next connection resolves it there and goes through the proxy.
#[test]
fn a_proxy_name_resolves_through_the_networks_dns() {
    require_root!();
    let np = named_proxy(
        |topo| {
            DnsServer::start(&topo.server, topo.server_addr(false, 5353), Zone::new(300))
                .expect("a configured upstream")
        },
        |configured, c| c.dns.upstreams = vec![format!("udp://{}", configured.addr)],
    );
    let target = np.rig.topo.server_addr(false, 7001);
    // Before any network change: the configured upstream, which says
    // NXDOMAIN; the app hears a refusal.
    np.refused_before_the_report(target);
    assert!(np.before.queries() >= 1);
    np.through_after_the_report(target, 5);
}

/// On Android (its budget here) the host reports the network's DNS
/// servers, and there is no resolver file: an engine whose proxy is given
/// by host name, with no `bootstrap` and no `dns.upstreams`, starts
/// (`outbound::resolve` tests: one that can never learn a resolver refuses
/// it); a connection before the host reported any server is refused and
/// counted in `resolve_failures`; after `network_changed` names one, the
/// proxy name resolves there and the connection goes through it.
#[test]
fn a_phone_starts_with_a_proxy_name_and_resolves_it_once_the_network_is_known() {
    require_root!();
    let np = named_proxy(
        |_| (),
        |(), c| {
            c.budget.platform = Some(kerntun::budget::Platform::Android);
            c.dns.upstreams = Vec::new();
        },
    );
    let target = np.rig.topo.server_addr(false, 7001);
    np.refused_before_the_report(target);
    np.through_after_the_report(target, 6);
}
