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
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use kerntun::config::{DriverMode, GroupConfig, GroupKind, OutboundUdp, StackKind};
use kerntun::outbound::group::{Health, SelectError};
use kerntun::rules::{Action, Rule};
use kerntun::{EngineEvent, EventSink, SelectionError};
use kerntun_testkit::rig::{Rig, RigBuilder, socks5};
use kerntun_testkit::servers::Mode;
use kerntun_testkit::tokio_servers::{InProcess, in_process, listen};
use kerntun_testkit::{Netns, Topology, client, require_root};
use parking_lot::Mutex;

/// The port of the probe target ([`http_server`]): CONNECTs to it are
/// probes, which [`socks5_server`] does not count.
const PROBE_PORT: u16 = 8080;

/// fast-socks5's server on `addr`, CONNECT only; [`InProcess::relayed`]
/// counts the CONNECTs it served, probes left out.
fn socks5_server(ns: &Netns, addr: SocketAddr) -> InProcess {
    use fast_socks5::Socks5Command;
    use fast_socks5::server::{Socks5ServerProtocol, run_tcp_proxy};
    use fast_socks5::util::target_addr::TargetAddr;
    in_process(ns, move |ready, served| async move {
        let Some(l) = listen(addr, &ready).await else {
            return;
        };
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let served = served.clone();
            tokio::spawn(async move {
                let Ok(proto) = Socks5ServerProtocol::accept_no_auth(s).await else {
                    return;
                };
                let Ok((proto, cmd, target)) = proto.read_command().await else {
                    return;
                };
                if cmd == Socks5Command::TCPConnect {
                    if !matches!(&target, TargetAddr::Ip(a) if a.port() == PROBE_PORT) {
                        served.fetch_add(1, Relaxed);
                    }
                    let _ = run_tcp_proxy(proto, &target, Duration::from_secs(5), true).await;
                }
            });
        }
    })
}

/// A minimal HTTP server on `addr`: reads a request head, answers `204 No
/// Content` and closes. [`InProcess::relayed`] counts the requests.
fn http_server(ns: &Netns, addr: SocketAddr) -> InProcess {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    in_process(ns, move |ready, served| async move {
        let Some(l) = listen(addr, &ready).await else {
            return;
        };
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                continue;
            };
            let served = served.clone();
            tokio::spawn(async move {
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
            });
        }
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
    require_root!();
    let topo = Topology::new().expect("topology");
    let (a_addr, b_addr) = (topo.server_addr(false, 1080), topo.server_addr(false, 1081));
    let a = socks5_server(&topo.server, a_addr);
    let b = socks5_server(&topo.server, b_addr);
    let mut g = GroupConfig::new(GroupKind::Select, &["a", "b", "direct"]);
    g.default = Some("a".into());
    let rig = rig(a_addr, b_addr, g).start_in(topo);
    let heard = Arc::new(Heard::default());
    rig.engine.set_event_sink(Some(heard.clone()));
    let echo = rig.tcp_server(false, Mode::Echo);

    exchange(echo.addr);
    assert_eq!((served(&a), served(&b)), (1, 0), "the default, a");
    assert_eq!(rig.engine.groups()[0].selected, "a");

    // A connection opened before the selection keeps its proxy.
    let mut held = TcpStream::connect_timeout(&echo.addr, Duration::from_secs(3)).expect("held");
    held.set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    held.write_all(b"before").expect("write");
    let mut buf = [0u8; 6];
    held.read_exact(&mut buf).expect("echo before");
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
            ("direct", Health::Unknown)
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
    require_root!();
    let topo = Topology::new().expect("topology");
    let (a_addr, b_addr) = (topo.server_addr(false, 1080), topo.server_addr(false, 1081));
    let probe = topo.server_addr(false, PROBE_PORT);
    let http = http_server(&topo.server, probe);
    // a's proxy is down at start.
    let b = socks5_server(&topo.server, b_addr);
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
    let a = socks5_server(&rig.topo.server, a_addr);
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
