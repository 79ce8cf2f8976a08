//! `Engine::reload` end to end (`core/src/engine/reload.rs`): an engine in
//! the client namespace routes by port to two SOCKS5 servers (fast-socks5,
//! in the server namespace) and is reloaded while a stream through one of
//! them is moving:
//!
//! * a refused configuration (one that does not validate, one that changes
//!   `tun.mtu`) changes nothing: routing stays as it was;
//! * after the reload the stream opened before it keeps moving, byte for
//!   byte; new connections follow the new rules (a port that went to `b`
//!   is now rejected, a new outbound carries another port);
//! * the connection through `b`, which the new configuration removed, is
//!   closed and counted (`reload_closed`), and the host hears `Reloaded`;
//! * the listing names the connection opened before by its own outbound,
//!   though that outbound's index moved in the new configuration, and its
//!   per-outbound statistics go on.
//!
//! Needs root (CI runs as root); otherwise each test prints why it skipped.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use kerntun::config::{ConfigError, DriverMode, OutboundUdp, StackKind};
use kerntun::rules::{Action, Rule};
use kerntun::{EngineEvent, EventSink, ReloadError};
use kerntun_testkit::rig::{Rig, socks5};
use kerntun_testkit::servers::{self, Mode};
use kerntun_testkit::tokio_servers::{InProcess, socks5_server};
use kerntun_testkit::{client, root_topology};
use parking_lot::Mutex;

/// Echo servers: through `a`, through `b` (then rejected), direct (then
/// through the new outbound `0new`).
const PORT_A: u16 = 7001;
const PORT_B: u16 = 7002;
const PORT_C: u16 = 7003;
/// Bytes of each round trip of the held stream, and the most it makes.
const CHUNK: usize = 16 * 1024;
const MAX_CHUNKS: u64 = 20_000;

/// Collects the engine's events.
#[derive(Default)]
struct Heard(Mutex<Vec<EngineEvent>>);

impl EventSink for Heard {
    fn event(&self, e: EngineEvent) {
        self.0.lock().push(e);
    }
}

fn served(s: &InProcess) -> u64 {
    s.relayed.load(Relaxed)
}

fn ports(p: u16, to: &str) -> Rule {
    Rule {
        ports: Some(p.to_string().parse().expect("port")),
        action: Action::from(to),
        ..Rule::default()
    }
}

/// One short echo exchange through the TUN.
fn exchange(to: SocketAddr) -> bool {
    client::echo_transfer(to, 7, 10_000, false).is_ok()
}

/// A connection held open, echoed once.
fn held(to: SocketAddr) -> TcpStream {
    client::held_echo(to, b"hello!")
}

/// Round trips of `CHUNK` bytes on `s`, each checked byte for byte, until
/// `stop` (or `MAX_CHUNKS`); `done` counts them.
fn keep_moving(
    mut s: TcpStream,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> std::thread::JoinHandle<Result<u64, String>> {
    std::thread::spawn(move || {
        let mut back = vec![0u8; CHUNK];
        for i in 0..MAX_CHUNKS {
            if stop.load(Relaxed) {
                return Ok(i);
            }
            let data = kerntun_testkit::pattern(i, CHUNK);
            s.write_all(&data)
                .map_err(|e| format!("chunk {i}: write {e}"))?;
            s.read_exact(&mut back)
                .map_err(|e| format!("chunk {i}: read {e}"))?;
            if back != data {
                return Err(format!("chunk {i} came back changed"));
            }
            done.fetch_add(1, Relaxed);
        }
        Ok(MAX_CHUNKS)
    })
}

#[test]
fn reload_routes_new_flows_and_keeps_running_ones() {
    let topo = root_topology!();
    let (a_addr, b_addr) = (topo.server_addr(false, 1080), topo.server_addr(false, 1081));
    let a = socks5_server(&topo.server, a_addr, None);
    let b = socks5_server(&topo.server, b_addr, None);
    let echo = |port| servers::tcp(&topo.server, topo.server_addr(false, port), Mode::Echo);
    let (echo_a, echo_b, echo_c) = (
        echo(PORT_A).expect("echo a"),
        echo(PORT_B).expect("echo b"),
        echo(PORT_C).expect("echo c"),
    );
    let rig = Rig::builder()
        .stack(StackKind::System)
        .driver(DriverMode::PerPacket)
        .ipv4_only()
        .outbound("a", socks5(a_addr, None, OutboundUdp::Relay))
        .outbound("b", socks5(b_addr, None, OutboundUdp::Relay))
        .rule(ports(PORT_A, "a"))
        .rule(ports(PORT_B, "b"))
        .start_in(topo);
    let heard = Arc::new(Heard::default());
    rig.engine.set_event_sink(Some(heard.clone()));

    assert!(exchange(echo_a.addr));
    assert!(exchange(echo_b.addr));
    assert!(exchange(echo_c.addr));
    assert_eq!((served(&a), served(&b)), (1, 1), "by port: a, b, direct");

    let on_b = held(echo_b.addr);
    let on_a = held(echo_a.addr);
    assert_eq!((served(&a), served(&b)), (2, 2));
    let listed = rig.engine.connections().connections;
    let via = |port: u16| {
        rig.engine
            .connections()
            .connections
            .into_iter()
            .find(|c| c.destination.port() == port)
            .and_then(|c| c.outbound)
    };
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(via(PORT_A).as_deref(), Some("a"));
    assert_eq!(via(PORT_B).as_deref(), Some("b"));

    // Refused: a rule naming no outbound; a restart-only field. Nothing
    // changes: b still carries its port.
    let mut bad = rig.config.clone();
    bad.rules.push(ports(9, "nope"));
    match rig.engine.reload(bad) {
        Err(ReloadError::Config(e @ ConfigError::UnknownOutbound { .. })) => {
            assert!(e.to_string().starts_with("rules[2].action"), "{e}");
        }
        other => panic!("a rule naming no outbound is refused: {other:?}"),
    }
    let mut mtu = rig.config.clone();
    mtu.tun.mtu = 1400;
    assert_eq!(
        rig.engine.reload(mtu).err(),
        Some(ReloadError::NeedsRestart { field: "tun.mtu" })
    );
    assert!(exchange(echo_b.addr), "routing as it was");
    assert_eq!((served(&a), served(&b)), (2, 3));
    assert!(
        heard
            .0
            .lock()
            .iter()
            .all(|e| !matches!(e, EngineEvent::Reloaded { .. }))
    );

    // Under load: the stream through a moves while the engine reloads.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mover = keep_moving(on_a, stop.clone(), done.clone());
    rig.wait_until("the held stream moving", Duration::from_secs(10), |_| {
        done.load(Relaxed) >= 20
    });
    // b is gone; a new outbound `0new` (b's server) comes before `a` in
    // index order; port B is now rejected, port C goes through `0new`.
    let mut new = rig.config.clone();
    new.outbounds.remove("b");
    new.outbounds
        .insert("0new".into(), socks5(b_addr, None, OutboundUdp::Relay));
    new.rules = vec![
        ports(PORT_A, "a"),
        ports(PORT_B, "reject"),
        ports(PORT_C, "0new"),
    ];
    let before = done.load(Relaxed);
    let report = rig.engine.reload(new).expect("reload");
    assert_eq!(report.closed, 1, "{report:?}");
    assert!(
        heard
            .0
            .lock()
            .contains(&EngineEvent::Reloaded { closed: 1 })
    );

    // The connection through b hears its reset.
    let mut on_b = on_b;
    let mut buf = [0u8; 6];
    let r = on_b.write_all(b"again!").and_then(|()| on_b.read(&mut buf));
    assert!(
        matches!(r, Ok(0) | Err(_)),
        "the connection on the removed outbound is closed: {r:?}"
    );

    // The held stream keeps moving, byte for byte.
    rig.wait_until(
        "the held stream moving after the reload",
        Duration::from_secs(10),
        |_| done.load(Relaxed) >= before + 50,
    );
    stop.store(true, Relaxed);
    let chunks = mover.join().expect("mover").expect("byte-exact");
    assert!(
        chunks > before,
        "{chunks} chunks, {before} before the reload"
    );
    assert_eq!(served(&a), 2, "still the one CONNECT to a");

    // New flows follow the new rules.
    let rejected = rig.stats().tcp_rejected_by_rule;
    assert!(!exchange(echo_b.addr), "port B is rejected now");
    assert_eq!(rig.stats().tcp_rejected_by_rule, rejected + 1);
    assert_eq!(served(&b), 3, "nothing reached b's server for port B");
    assert!(exchange(echo_c.addr), "port C through 0new");
    assert_eq!(served(&b), 4, "0new is b's server");
    assert!(exchange(echo_a.addr));
    assert_eq!(served(&a), 3);

    let s = rig.stats();
    assert_eq!(s.reload_closed, 1);
    let named: Vec<_> = s
        .outbounds
        .iter()
        .map(|o| (o.name.as_str(), o.tcp_connects))
        .collect();
    assert_eq!(
        named,
        [("0new", 1), ("a", 3)],
        "a's counters go on; b's left with it"
    );
    drop(on_b);
    let deadline = Instant::now() + Duration::from_secs(5);
    while rig.engine.connections().connections.len() > 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(via(PORT_A), None, "the held stream ended");
    assert!(rig.engine.is_running());
}

/// The listing names a connection by the outbound it was connected
/// through, also when a reload moved that outbound's index.
#[test]
fn listing_keeps_old_connections_named() {
    let topo = root_topology!();
    let a_addr = topo.server_addr(false, 1080);
    let a = socks5_server(&topo.server, a_addr, None);
    let echo_a =
        servers::tcp(&topo.server, topo.server_addr(false, PORT_A), Mode::Echo).expect("echo");
    let rig = Rig::builder()
        .stack(StackKind::Smoltcp)
        .driver(DriverMode::PerPacket)
        .ipv4_only()
        .outbound("a", socks5(a_addr, None, OutboundUdp::Relay))
        .rule(ports(PORT_A, "a"))
        .start_in(topo);
    let mut on_a = held(echo_a.addr);
    assert_eq!(served(&a), 1);
    // Two outbounds now sort before `a`: its index goes from 0 to 2.
    let mut new = rig.config.clone();
    for n in ["0x", "0y"] {
        new.outbounds
            .insert(n.into(), socks5(a_addr, None, OutboundUdp::Relay));
    }
    assert_eq!(rig.engine.reload(new).expect("reload").closed, 0);
    let listed = rig.engine.connections().connections;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].outbound.as_deref(), Some("a"));
    on_a.write_all(b"after!").expect("write");
    let mut b = [0u8; 6];
    on_a.read_exact(&mut b).expect("still moving");
    assert_eq!(&b, b"after!");
    assert_eq!(rig.stats().reload_closed, 0);
}
