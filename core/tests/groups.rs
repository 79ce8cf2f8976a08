//! Outbound groups end to end (`core/src/outbound/group.rs`): the app's
//! connections enter the TUN in the client namespace, a rule sends them to
//! a group, and the group's member (a real SOCKS5 server, fast-socks5, in
//! the server namespace) carries them. Which server saw the CONNECT tells
//! which member a flow took.
//!
//! * `select` switches new flows at `Engine::select`; a connection opened
//!   before keeps its proxy;
//! * `fallback` takes the first member whose probe answers, and comes back
//!   to it when it answers again;
//! * `url-test` moves off a member whose upstream was cut (its packets
//!   dropped, so the probe times out) within one interval plus one probe
//!   timeout;
//! * `test_latency` measures an upstream behind an added delay (netem).
//!
//! Needs root (CI runs as root); otherwise each test prints why it skipped.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use kerntun::config::{DriverMode, GroupConfig, GroupKind, OutboundUdp, StackKind};
use kerntun::outbound::group::{Health, SelectError};
use kerntun::rules::{Action, Rule};
use kerntun::{EngineEvent, EventSink, LatencyError, SelectionError};
use kerntun_testkit::rig::{Rig, RigBuilder, socks5};
use kerntun_testkit::servers::Mode;
use kerntun_testkit::tokio_servers::{InProcess, accept_each, socks5_server};
use kerntun_testkit::{Netns, Topology, client, require_root, root_topology};
use parking_lot::Mutex;

/// The port of the probe target ([`http_server`]): CONNECTs to it are
/// probes, which [`socks5_server`] does not count.
const PROBE_PORT: u16 = 8080;

/// A minimal HTTP server on `addr`: reads a request head, answers `204 No
/// Content` and closes. [`InProcess::relayed`] counts the requests.
fn http_server(ns: &Netns, addr: SocketAddr) -> InProcess {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    accept_each(ns, addr, |mut s, served| async move {
        let mut head = Vec::new();
        let mut b = [0u8; 512];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut b).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&b[..n]),
            }
        }
        served.fetch_add(1, Relaxed);
        let _ = s
            .write_all(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
            .await;
    })
}

/// Collects the engine's events.
#[derive(Default)]
struct Heard(Mutex<Vec<EngineEvent>>);

impl EventSink for Heard {
    fn event(&self, e: EngineEvent) {
        self.0.lock().push(e);
    }
}

impl Heard {
    fn has(&self, e: &EngineEvent) -> bool {
        self.0.lock().contains(e)
    }
}

/// An engine (system stack) whose catch-all rule sends everything to the
/// group `proxy`, built by `group`; the SOCKS5 outbounds `a` and `b` at
/// `a` and `b`.
fn rig<'a>(a: SocketAddr, b: SocketAddr, group: GroupConfig) -> RigBuilder<'a> {
    Rig::builder()
        .stack(StackKind::System)
        .driver(DriverMode::PerPacket)
        .ipv4_only()
        .outbound("a", socks5(a, None, OutboundUdp::Relay))
        .outbound("b", socks5(b, None, OutboundUdp::Relay))
        .rule(Rule {
            action: Action::from("proxy"),
            ..Rule::default()
        })
        .config(move |_, c| {
            c.groups.insert("proxy".into(), group);
        })
}

/// One short echo exchange through the TUN to `to`.
fn exchange(to: SocketAddr) {
    client::echo_transfer(to, 7, 10_000, false).expect("echo through the group");
}

fn served(s: &InProcess) -> u64 {
    s.relayed.load(Relaxed)
}

#[test]
fn select_switches_new_flows() {
    let topo = root_topology!();
    let (a_addr, b_addr) = (topo.server_addr(false, 1080), topo.server_addr(false, 1081));
    let a = socks5_server(&topo.server, a_addr, Some(PROBE_PORT));
    let b = socks5_server(&topo.server, b_addr, Some(PROBE_PORT));
    let mut g = GroupConfig::new(GroupKind::Select, &["a", "b", "direct", "reject"]);
    g.default = Some("a".into());
    let rig = rig(a_addr, b_addr, g).start_in(topo);
    let heard = Arc::new(Heard::default());
    rig.engine.set_event_sink(Some(heard.clone()));
    let echo = rig.tcp_server(false, Mode::Echo);

    exchange(echo.addr);
    assert_eq!((served(&a), served(&b)), (1, 0), "the default, a");
    assert_eq!(rig.engine.groups()[0].selected, "a");

    // A connection opened before the selection keeps its proxy.
    let mut held = client::held_echo(echo.addr, b"before");
    assert_eq!((served(&a), served(&b)), (2, 0));

    rig.engine.select("proxy", "b").expect("select b");
    assert!(heard.has(&EngineEvent::GroupSelected {
        group: "proxy".into(),
        member: "b".into()
    }));
    assert_eq!(rig.engine.groups()[0].selected, "b");
    for _ in 0..3 {
        exchange(echo.addr);
    }
    assert_eq!((served(&a), served(&b)), (2, 3), "new flows take b");
    held.write_all(b"after!").expect("write after");
    let mut buf = [0u8; 6];
    held.read_exact(&mut buf).expect("echo after");
    assert_eq!(
        &buf, b"after!",
        "the held connection still moves, through a"
    );

    rig.engine.select("proxy", "direct").expect("select direct");
    let accepted = echo.accepted.load(Relaxed);
    exchange(echo.addr);
    assert_eq!((served(&a), served(&b)), (2, 3), "direct: neither proxy");
    assert_eq!(echo.accepted.load(Relaxed), accepted + 1);
    let s = rig.stats();
    assert_eq!(
        (s.outbounds[0].tcp_connects, s.outbounds[1].tcp_connects),
        (2, 3),
        "per-outbound counters follow the member: {s:?}"
    );

    // UDP flows follow the group too: each new flow (a socket of its own)
    // takes the member of the moment.
    let udp = rig.udp_echo(false);
    let ok = client::udp_round_trips(udp.addr, 5, 100).expect("UDP through proxy -> direct");
    assert_eq!(ok, 5);
    rig.engine.select("proxy", "reject").expect("select reject");
    let refused = client::udp_round_trips(udp.addr, 1, 100);
    assert!(
        !matches!(refused, Ok(1)),
        "a new UDP flow through proxy -> reject gets no answer: {refused:?}"
    );
    assert_eq!(udp.accepted.load(Relaxed), 5, "nothing reached the server");
    assert!(
        client::echo_transfer(echo.addr, 8, 1_000, false).is_err(),
        "a new TCP connection through proxy -> reject is refused"
    );
    rig.engine.select("proxy", "direct").expect("select direct");

    // Refusals are typed and change nothing.
    assert_eq!(
        rig.engine.select("nope", "a"),
        Err(SelectionError::Group(SelectError::UnknownGroup(
            "nope".into()
        )))
    );
    assert!(matches!(
        rig.engine.select("proxy", "c"),
        Err(SelectionError::Group(SelectError::UnknownMember { .. }))
    ));
    assert_eq!(rig.engine.groups()[0].selected, "direct");
    let members: Vec<_> = rig.engine.groups()[0]
        .members
        .iter()
        .map(|m| (m.name.clone(), m.health))
        .collect();
    assert_eq!(
        members,
        [
            ("a", Health::Unknown),
            ("b", Health::Unknown),
            ("direct", Health::Unknown),
            ("reject", Health::Unknown)
        ]
        .map(|(n, h)| (n.to_owned(), h)),
        "a select group never probes"
    );
    drop(held);
}

/// A probing group of `kind` over `a` and `b`, probing `url` every
/// `interval_ms` with `timeout_ms`.
fn probing(kind: GroupKind, url: String, interval_ms: u64, timeout_ms: u64) -> GroupConfig {
    let mut g = GroupConfig::new(kind, &["a", "b"]);
    g.url = Some(url);
    g.interval_ms = Some(interval_ms);
    g.timeout_ms = Some(timeout_ms);
    g
}

fn selected(rig: &Rig) -> String {
    rig.engine.groups()[0].selected.clone()
}

fn health(rig: &Rig) -> Vec<Health> {
    rig.engine.groups()[0]
        .members
        .iter()
        .map(|m| m.health)
        .collect()
}

#[test]
fn fallback_follows_the_order() {
    let topo = root_topology!();
    let (a_addr, b_addr) = (topo.server_addr(false, 1080), topo.server_addr(false, 1081));
    let probe = topo.server_addr(false, PROBE_PORT);
    let http = http_server(&topo.server, probe);
    // a's proxy is down at start.
    let b = socks5_server(&topo.server, b_addr, Some(PROBE_PORT));
    let g = probing(
        GroupKind::Fallback,
        format!("http://{probe}/generate_204"),
        300,
        1_000,
    );
    let rig = rig(a_addr, b_addr, g).start_in(topo);
    let heard = Arc::new(Heard::default());
    rig.engine.set_event_sink(Some(heard.clone()));
    let echo = rig.tcp_server(false, Mode::Echo);

    kerntun_testkit::wait_until("fallback moves to b", Duration::from_secs(5), || {
        selected(&rig) == "b"
    });
    assert_eq!(health(&rig), [Health::Down, Health::Up]);
    exchange(echo.addr);
    assert_eq!(served(&b), 1, "the second member carries new flows");

    // a comes back: the first healthy member again.
    let a = socks5_server(&rig.topo.server, a_addr, Some(PROBE_PORT));
    let back = kerntun_testkit::wait_until("fallback back to a", Duration::from_secs(5), || {
        selected(&rig) == "a"
    });
    eprintln!("fallback: back to a {back:?} after a's proxy started");
    assert!(back <= Duration::from_millis(300 + 1_000 + 500), "{back:?}");
    assert_eq!(health(&rig), [Health::Up, Health::Up]);
    let ms = rig.engine.groups()[0].members[0].latency_ms;
    assert!(ms.is_some_and(|ms| ms < 1_000), "{ms:?}");
    exchange(echo.addr);
    assert_eq!((served(&a), served(&b)), (1, 1));
    assert!(heard.has(&EngineEvent::GroupSelected {
        group: "proxy".into(),
        member: "a".into()
    }));
    assert!(
        heard.0.lock().iter().any(|e| matches!(e,
            EngineEvent::OutboundHealth { member, healthy: true, .. } if member == "a")),
        "{:?}",
        heard.0.lock()
    );
    assert!(served(&http) >= 3, "probes reached the target");

    // Probes end with the engine.
    let mut rig = rig;
    rig.engine.stop();
    let after_stop = served(&http);
    std::thread::sleep(Duration::from_millis(1_000));
    assert_eq!(served(&http), after_stop, "no probe after stop");
}
#[test]
fn url_test_moves_off_a_cut_member() {
    let topo = root_topology!();
    // a listens on an address of its own, 198.19.N.3, which the test
    // removes to cut it: its packets are then dropped in silence (the
    // server namespace does not forward), so a's probe times out.
    let cut = format!("198.19.{}.3", topo.id);
    topo.server
        .ip(&["addr", "add", &format!("{cut}/24"), "dev", "kts"])
        .expect("a's address");
    topo.client
        .pin_neighbour(
            "-4",
            &cut,
            &format!("02:6b:74:00:{:02x}:02", topo.id),
            kerntun_testkit::CLIENT_VETH,
        )
        .expect("a's neighbour");
    let a_addr: SocketAddr = format!("{cut}:1080").parse().expect("a");
    let b_addr = topo.server_addr(false, 1081);
    let probe = topo.server_addr(false, PROBE_PORT);
    let _http = http_server(&topo.server, probe);
    let a = socks5_server(&topo.server, a_addr, Some(PROBE_PORT));
    let b = socks5_server(&topo.server, b_addr, Some(PROBE_PORT));
    let (interval, timeout) = (500, 400);
    let mut g = probing(
        GroupKind::UrlTest,
        format!("http://{probe}/"),
        interval,
        timeout,
    );
    // Both are about as fast here: a (the first, taken before any probe)
    // stays until it fails.
    g.tolerance_ms = Some(1_000);
    let rig = rig(a_addr, b_addr, g).start_in(topo);
    let heard = Arc::new(Heard::default());
    rig.engine.set_event_sink(Some(heard.clone()));
    let echo = rig.tcp_server(false, Mode::Echo);
    kerntun_testkit::wait_until("both members probed", Duration::from_secs(5), || {
        health(&rig) == [Health::Up, Health::Up]
    });
    assert_eq!(selected(&rig), "a");
    exchange(echo.addr);
    assert_eq!((served(&a), served(&b)), (1, 0));

    rig.topo
        .server
        .ip(&["addr", "del", &format!("{cut}/24"), "dev", "kts"])
        .expect("cut a");
    let cut_at = Instant::now();
    let moved = kerntun_testkit::wait_until("url-test moves to b", Duration::from_secs(5), || {
        selected(&rig) == "b"
    });
    // The probe round after the cut starts within one interval and its
    // probe of a fails after one timeout; 300 ms for the round's own work
    // and the test's polling on a shared machine.
    let bound = Duration::from_millis(interval + timeout + 300);
    eprintln!("url-test: moved to b {moved:?} after the cut (bound {bound:?})");
    assert!(
        moved <= bound,
        "moved after {moved:?} ({:?} since the cut), bound {bound:?}",
        cut_at.elapsed()
    );
    assert_eq!(health(&rig), [Health::Down, Health::Up]);
    assert!(heard.has(&EngineEvent::GroupSelected {
        group: "proxy".into(),
        member: "b".into()
    }));
    assert!(heard.0.lock().iter().any(|e| matches!(e,
        EngineEvent::OutboundHealth { member, healthy: false, latency_ms: None, .. } if member == "a")));
    exchange(echo.addr);
    assert_eq!((served(&a), served(&b)), (1, 1), "new flows take b");
}

/// A TCP forwarder on `addr` to `upstream` that holds every chunk coming
/// back from `upstream` for `delay` before passing it on, so each answer
/// arrives `delay` late: the stand-in for netem on a kernel built without
/// it (`CONFIG_NET_SCH_NETEM`). The TCP handshake with the forwarder itself
/// is not delayed.
fn delay_line(ns: &Netns, addr: SocketAddr, upstream: SocketAddr, delay: Duration) -> InProcess {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    accept_each(ns, addr, move |client, _| async move {
        let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
            return;
        };
        let (mut cr, mut cw) = client.into_split();
        let (mut ur, mut uw) = up.into_split();
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut cr, &mut uw).await;
            let _ = uw.shutdown().await;
        });
        let mut b = [0u8; 4096];
        loop {
            let n = match ur.read(&mut b).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            tokio::time::sleep(delay).await;
            if cw.write_all(&b[..n]).await.is_err() {
                return;
            }
        }
        tokio::time::sleep(delay).await;
        let _ = cw.shutdown().await;
    })
}

/// The fastest of three probes through `outbound`.
fn fastest(rig: &Rig, outbound: &str, url: &str) -> Duration {
    (0..3)
        .map(|_| {
            rig.engine
                .test_latency(outbound, url, Duration::from_secs(3))
                .unwrap_or_else(|e| panic!("{outbound}: {e}"))
        })
        .min()
        .expect("three probes")
}

#[test]
fn test_latency_measures_an_added_delay() {
    let topo = root_topology!();
    let (a_addr, b_addr) = (topo.server_addr(false, 1080), topo.server_addr(false, 1081));
    let probe = topo.server_addr(false, PROBE_PORT);
    let _http = http_server(&topo.server, probe);
    let _a = socks5_server(&topo.server, a_addr, Some(PROBE_PORT));
    // b's proxy never runs.
    let g = GroupConfig::new(GroupKind::Select, &["a", "b"]);
    let rig = rig(a_addr, b_addr, g).start_in(topo);
    let url = format!("http://{probe}/generate_204");

    let t = Duration::from_secs(1);
    let e = &rig.engine;
    assert!(
        matches!(e.test_latency("nope", &url, t), Err(LatencyError::UnknownOutbound(n)) if n == "nope")
    );
    assert!(matches!(
        e.test_latency("a", "https://x/", t),
        Err(LatencyError::BadUrl(_))
    ));
    assert!(matches!(
        e.test_latency("reject", &url, t),
        Err(LatencyError::Rejected(_))
    ));
    assert!(
        matches!(e.test_latency("b", &url, t), Err(LatencyError::Failed(_))),
        "b is down"
    );
    // A target that accepts and never answers: the timeout, bounded.
    let hold = rig.tcp_server(false, Mode::Hold);
    let mute = format!("http://{}/", hold.addr);
    let start = Instant::now();
    assert!(matches!(
        e.test_latency("a", &mute, Duration::from_millis(300)),
        Err(LatencyError::Timeout(_))
    ));
    assert!(
        start.elapsed() < Duration::from_millis(800),
        "{:?}",
        start.elapsed()
    );

    // Called from a thread that runs a runtime of its own: it waits, it
    // does not panic.
    let own = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let inside = own.block_on(async { e.test_latency("direct", &url, Duration::from_secs(2)) });
    assert!(inside.is_ok(), "{inside:?}");

    let base: Vec<Duration> = ["direct", "a", "proxy"]
        .iter()
        .map(|o| fastest(&rig, o, &url))
        .collect();
    eprintln!("test_latency without delay: direct, a, proxy (-> a): {base:?}");

    const DELAY: Duration = Duration::from_millis(100);
    // netem on the server's end of the veth delays every packet toward the
    // client: each round trip between the client and the server
    // namespace, the proxy's included, gains 100 ms. Direct: the TCP
    // handshake and the GET (2). Through SOCKS5 (no auth): the handshake,
    // the method choice, the CONNECT reply and the GET (4).
    let netem = rig.topo.server.exec(
        "tc",
        &[
            "qdisc", "add", "dev", "kts", "root", "netem", "delay", "100ms",
        ],
    );
    let mut _line = None;
    let (url, round_trips) = match netem {
        Ok(_) => (url, [2u32, 4, 4]),
        Err(err) => {
            // Only the answer to the GET passes the forwarder: one delayed
            // round trip whatever the outbound.
            eprintln!("netem unavailable ({err}): delaying answers in process instead");
            let line = rig.topo.server_addr(false, PROBE_PORT + 1);
            _line = Some(delay_line(&rig.topo.server, line, probe, DELAY));
            (format!("http://{line}/generate_204"), [1, 1, 1])
        }
    };
    for ((outbound, base), rtts) in ["direct", "a", "proxy"].iter().zip(&base).zip(round_trips) {
        let added = DELAY * rtts;
        let want = *base + added;
        let got = fastest(&rig, outbound, &url);
        eprintln!("test_latency {outbound}: {got:?}, expected {want:?}");
        let off = got.abs_diff(want);
        assert!(
            off <= added / 5,
            "{outbound}: measured {got:?}, expected {want:?} (+/- 20 % of {added:?})"
        );
    }
}

/// Probes speak each outbound's framing: through shadowsocks-rust's server
/// with an AEAD and an AEAD-2022 method the GET is sealed and the answer
/// opened; with the wrong key the server never reaches the target and the
/// probe fails. A url-test group of Shadowsocks members finds them up.
#[test]
fn probes_through_shadowsocks() {
    require_root!();
    use kerntun::config::{OutboundConfig, ShadowsocksConfig, ShadowsocksMethod};
    use kerntun_testkit::tokio_servers::shadowsocks;
    const PSK32: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    let topo = Topology::new().expect("topology");
    let probe = topo.server_addr(false, PROBE_PORT);
    let http = http_server(&topo.server, probe);
    let (aead, sip022) = (topo.server_addr(false, 8388), topo.server_addr(false, 8389));
    let _s1 = shadowsocks(&topo.server, aead, "aes-256-gcm", "kerntun-test");
    let _s2 = shadowsocks(&topo.server, sip022, "2022-blake3-aes-256-gcm", PSK32);
    let ss = |server: SocketAddr, method, password: &str| {
        OutboundConfig::Shadowsocks(ShadowsocksConfig {
            server: server.into(),
            method,
            password: password.into(),
            udp: OutboundUdp::Relay,
        })
    };
    let url = format!("http://{probe}/generate_204");
    let mut g = GroupConfig::new(GroupKind::UrlTest, &["aead", "sip022"]);
    g.url = Some(url.clone());
    g.interval_ms = Some(200);
    let rig = Rig::builder()
        .stack(StackKind::System)
        .driver(DriverMode::PerPacket)
        .ipv4_only()
        .outbound(
            "aead",
            ss(aead, ShadowsocksMethod::Aes256Gcm, "kerntun-test"),
        )
        .outbound(
            "sip022",
            ss(sip022, ShadowsocksMethod::Blake3Aes256Gcm, PSK32),
        )
        .outbound("wrong", ss(aead, ShadowsocksMethod::Aes256Gcm, "wrong"))
        .config(move |_, c| {
            c.groups.insert("auto".into(), g);
        })
        .start_in(topo);
    for outbound in ["aead", "sip022", "auto"] {
        let before = served(&http);
        let d = rig
            .engine
            .test_latency(outbound, &url, Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("{outbound}: {e}"));
        assert!(d < Duration::from_secs(1), "{outbound}: {d:?}");
        assert!(
            served(&http) > before,
            "{outbound}: the probe reached the target"
        );
    }
    let e = rig
        .engine
        .test_latency("wrong", &url, Duration::from_secs(2))
        .expect_err("a wrong key reaches nothing");
    assert!(
        matches!(e, LatencyError::Failed(_) | LatencyError::Timeout(_)),
        "{e:?}"
    );
    kerntun_testkit::wait_until("both members probed", Duration::from_secs(5), || {
        health(&rig) == [Health::Up, Health::Up]
    });
}
