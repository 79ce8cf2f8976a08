//! Memory budgets measured end to end: 1000 idle TCP connections held
//! through an engine running under the iOS budget (system stack), and the
//! engine's resident memory read against what `budget` documents per
//! session. The engine runs in a child process of its own (this test binary
//! again, with [`CHILD`] set), so its memory is read alone: the clients and
//! the server that hold the other ends live in this process.
//!
//! Needs root (CI runs as root); otherwise the test prints why it skipped.
//! Bounded: 1000 connections, every wait has a deadline, the child stops
//! when its stdin closes (also when this process dies) and is killed if it
//! does not.

use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kerntun::budget::{self, Budget, Platform, TcpStack};
use kerntun::config::{DriverMode, StackKind};
use kerntun::{Engine, TunSource};
use kerntun_testkit::child::{self, EngineProcess};
use kerntun_testkit::{Topology, require_root, rig, servers, wait_until};

/// Set in the child: the engine's TUN name.
const CHILD: &str = "KERNTUN_MEMORY_ENGINE_CHILD";
/// Connections held at once.
const HELD: usize = 1000;

/// The engine's side: start under the iOS budget (and the iOS MTU), IPv4
/// only, in the namespace it inherited, say so, answer `stats` lines with
/// the session counts, stop when stdin closes. The parent routes into the
/// TUN (this process has no topology to do it with).
fn engine_child(tun: &str, stack: StackKind) {
    let mut c = rig::config(tun);
    c.stack = stack;
    c.driver = DriverMode::PerPacket;
    c.budget.platform = Some(Platform::Ios);
    c.tun.mtu = Platform::Ios.default_mtu();
    c.tun.ipv6 = None;
    let engine = Engine::start(c, TunSource::Create, None).expect("engine");
    child::serve(engine, |s| {
        vec![
            s.tcp_sessions_active,
            s.admission_limit,
            s.admission_refused,
        ]
    });
}

/// (sessions active, admission limit, refusals) as the engine counts them.
fn session_counts(engine: &mut EngineProcess) -> (u64, u64, u64) {
    let v = engine.stats();
    (v[0], v[1], v[2])
}

/// Run this test again in a child (it inherits the calling thread's
/// network namespace) as the engine, with its `RLIMIT_NOFILE` set to
/// (soft, hard) before it runs (by `prlimit`, which then execs it).
fn start_engine(tun: &str, nofile: Option<(u64, u64)>) -> EngineProcess {
    start_engine_for("thousand_idle_connections_fit_the_ios_budget", tun, nofile)
}

/// [`start_engine`] running test `test` as the child.
fn start_engine_for(test: &str, tun: &str, nofile: Option<(u64, u64)>) -> EngineProcess {
    let limit = nofile.map(|(soft, hard)| format!("--nofile={soft}:{hard}"));
    let wrapper: Vec<&str> = match &limit {
        Some(l) => vec!["prlimit", l, "--"],
        None => Vec::new(),
    };
    EngineProcess::start(test, (CHILD, tun), &wrapper)
}

/// [`start_engine_for`] `test` on the topology's TUN without a descriptor
/// limit, once it is ready, with the client's routes through its TUN.
fn routed_engine(topo: &Topology, test: &str) -> EngineProcess {
    let mut engine = start_engine_for(test, &topo.tun_name(), None);
    let tun = engine
        .line()
        .strip_prefix("READY ")
        .expect("a ready line")
        .to_owned();
    topo.route_via_tun(&tun).expect("route");
    eprintln!("[memory] engine ready on {tun}");
    engine
}

/// Connections opened before the baseline, to warm the engine up.
const WARM: usize = 8;

/// Once the engine runs every held and warm-up session and `quiet` has
/// passed: its resident memory in KiB and its admission limit. Every
/// session was admitted, none refused, under a limit of at least [`HELD`].
fn all_sessions_running(engine: &mut EngineProcess, quiet: Duration) -> (u64, u64) {
    wait_until("every session running", Duration::from_secs(10), || {
        session_counts(engine).0 == (HELD + WARM) as u64
    });
    std::thread::sleep(quiet);
    let rss = rss_kib(engine);
    let (active, limit, refused) = session_counts(engine);
    assert_eq!(
        (active, refused),
        ((HELD + WARM) as u64, 0),
        "admission limit {limit}"
    );
    assert!(limit >= HELD as u64, "admission limit {limit}");
    (rss, limit)
}

/// Resident memory of the engine process, in KiB.
fn rss_kib(engine: &EngineProcess) -> u64 {
    kerntun_testkit::vm_kib(Some(engine.pid()), "VmRSS").expect("VmRSS of the engine process")
}

/// A server in the server namespace that accepts and holds every connection
/// (one thread, no per-connection state beyond the socket).
fn hold_server(topo: &Topology) -> servers::Server {
    let mut held = Vec::new();
    servers::accepting(&topo.server, topo.server_addr(false, 0), move |s, _| {
        held.push(s)
    })
    .expect("hold server")
}

/// The engine raises its descriptor limit to what its admission needs
/// (iOS starts a Network Extension with a soft limit of 256, 1000 sessions
/// need about 2000), and where the hard limit stops it, admission is cut to
/// what fits instead of sessions failing with EMFILE after their handshake.
#[test]
fn admission_fits_the_descriptor_limit() {
    require_root!();
    let ios = Budget::for_platform(Platform::Ios);
    let sessions = ios.tcp_sessions(TcpStack::System)[0];
    let need = budget::descriptors_needed(sessions, TcpStack::System, ios.udp_flows) as u64;
    let topo = Topology::new().expect("topology");
    topo.client.enter().expect("enter client ns");
    for (hard, admitted, soft_after) in [
        (4096, sessions as u64, need),
        (
            1024,
            budget::fit_descriptors([sessions; 3], TcpStack::System, ios.udp_flows, 1024)[0] as u64,
            1024,
        ),
    ] {
        let mut engine = start_engine(&topo.tun_name(), Some((256, hard)));
        engine.line();
        let (_, limit, _) = session_counts(&mut engine);
        let soft = soft_nofile(&engine.pid().to_string()).expect("soft NOFILE of the engine");
        eprintln!("[memory] NOFILE 256:{hard} -> soft {soft}, admission {limit}");
        assert_eq!(soft, soft_after, "soft limit raised (hard {hard})");
        assert_eq!(
            limit, admitted,
            "admission within the descriptors (hard {hard})"
        );
    }
}

/// The soft `RLIMIT_NOFILE` of process `pid` ("self": this one).
fn soft_nofile(pid: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/limits"))
        .ok()?
        .lines()
        .find(|l| l.starts_with("Max open files"))?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()
}

/// Enough descriptors for 1000 connections on each side (the engine's
/// child inherits the limit); root may raise it.
fn raise_nofile() {
    if soft_nofile("self").unwrap_or(0) < 8192 {
        let pid = std::process::id().to_string();
        kerntun_testkit::sh("prlimit", &["--pid", &pid, "--nofile=8192:8192"])
            .expect("raise RLIMIT_NOFILE");
    }
}

/// 1000 idle connections through an engine under the iOS budget: all are
/// admitted (the budget admits more than 1000 at normal pressure), and the
/// engine's resident memory grows by no more than the per-session state the
/// budget charges each system-stack session while it is idle
/// (`budget::SESSION_STATE`), so 1000 sessions stay far below the 50 MiB
/// a Network Extension may use.
#[test]
fn thousand_idle_connections_fit_the_ios_budget() {
    if let Some(tun) = std::env::var_os(CHILD) {
        return engine_child(&tun.to_string_lossy(), StackKind::System);
    }
    require_root!();
    let ios = Budget::for_platform(Platform::Ios);
    raise_nofile();
    let topo = Topology::new().expect("topology");
    let server = hold_server(&topo);
    topo.client.enter().expect("enter client ns");
    let mut engine = routed_engine(&topo, "thousand_idle_connections_fit_the_ios_budget");
    // Warm up (the first sessions build runtime state lazily), then let the
    // engine settle before the baseline. The server holds these too.
    let warm: Vec<_> = (0..WARM)
        .map(|_| TcpStream::connect_timeout(&server.addr, Duration::from_secs(3)).expect("warm-up"))
        .collect();
    wait_until("warm-up sessions running", Duration::from_secs(10), || {
        session_counts(&mut engine).0 == WARM as u64
    });
    std::thread::sleep(Duration::from_millis(300));
    let rss0 = rss_kib(&engine);
    eprintln!("[memory] baseline {rss0} KiB");
    let started = Instant::now();
    let mut held = Vec::with_capacity(HELD);
    for i in 0..HELD {
        match TcpStream::connect_timeout(&server.addr, Duration::from_secs(3)) {
            Ok(s) => held.push(s),
            Err(e) => panic!("connection {} of {HELD} failed: {e}", i + 1),
        }
    }
    let took = started.elapsed();
    wait_until(
        "the server holds every connection",
        Duration::from_secs(10),
        || server.accepted.load(Ordering::Relaxed) >= (HELD + WARM) as u64,
    );
    let (rss1, limit) = all_sessions_running(&mut engine, Duration::from_millis(300));
    let per_session = (rss1.saturating_sub(rss0) * 1024) / HELD as u64;
    eprintln!(
        "[memory] {HELD} idle system-stack sessions under the iOS budget (admission limit {limit}): \
         opened in {:.1} s; engine rss {rss0} -> {rss1} KiB, {per_session} bytes per session \
         (budgeted state {} bytes, worst case with both relay buffers {} bytes)",
        took.as_secs_f64(),
        budget::SESSION_STATE,
        ios.session_cost(TcpStack::System),
    );
    assert!(
        per_session <= budget::SESSION_STATE as u64,
        "an idle session costs {per_session} bytes, more than the {} the budget charges",
        budget::SESSION_STATE
    );
    // Whatever else the engine holds, 1000 sessions leave it far below
    // the extension's 50 MiB.
    assert!(rss1 < 25 * 1024, "engine rss {rss1} KiB");
    drop(held);
    drop(warm);
    drop(engine);
    drop(server);
}

/// Bytes each small exchange sends and reads back.
const SMALL: usize = 17;
/// Bytes each bulk exchange sends and reads back: four times the iOS ring.
const BULK: usize = 256 * 1024;
/// One connection in this many exchanges [`BULK`] bytes.
const BULK_EVERY: usize = 32;

/// A server in the server namespace that echoes every connection (a
/// thread each, ending at the client's FIN) and counts them.
fn echo_server(topo: &Topology) -> servers::Server {
    servers::accepting(&topo.server, topo.server_addr(false, 0), |mut s, _| {
        let _ = s.set_nonblocking(false);
        let _ = std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || {
                let mut r = s.try_clone().expect("clone");
                let _ = std::io::copy(&mut r, &mut s);
            });
    })
    .expect("echo server")
}

/// Send `n` bytes on `s` and read them back (a writer thread, so a large
/// exchange never waits on both sides' buffers).
fn exchange(s: &TcpStream, n: usize) {
    use std::io::{Read, Write};
    let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    let mut w = s.try_clone().expect("clone");
    let sent = data.clone();
    let writer = std::thread::spawn(move || w.write_all(&sent));
    let mut back = vec![0u8; n];
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    (&*s).read_exact(&mut back).expect("echo back");
    writer.join().expect("writer").expect("write");
    assert!(back == data, "echoed bytes differ");
}

/// 1000 connections through the smoltcp stack under the iOS budget, each
/// of which exchanged data (17 bytes each way; one in 32 256 KiB each way,
/// four times its rings), then went quiet: the engine's resident memory
/// grows by at most 16 KiB per connection (a quiet socket is back on its
/// small rings, and the full ones it borrowed keep no pages:
/// `stack/smoltcp/rings.rs`); every one admitted by the iOS budget itself
/// (1489 smoltcp sessions at normal pressure: `Budget::session_cost`).
#[test]
fn thousand_smoltcp_connections_that_moved_data_fit_16_kib() {
    if let Some(tun) = std::env::var_os(CHILD) {
        return engine_child(&tun.to_string_lossy(), StackKind::Smoltcp);
    }
    require_root!();
    raise_nofile();
    let topo = Topology::new().expect("topology");
    let server = echo_server(&topo);
    topo.client.enter().expect("enter client ns");
    let mut engine = routed_engine(
        &topo,
        "thousand_smoltcp_connections_that_moved_data_fit_16_kib",
    );
    let connect = || TcpStream::connect_timeout(&server.addr, Duration::from_secs(3));
    // Warm up (runtime state, relay buffers, the heap's arenas: a bulk
    // exchange too), then let the rings go quiet before the baseline.
    let warm: Vec<_> = (0..WARM)
        .map(|i| {
            let s = connect().expect("warm-up");
            exchange(&s, if i == 0 { BULK } else { SMALL });
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(2500));
    let rss0 = rss_kib(&engine);
    let started = Instant::now();
    let mut held = Vec::with_capacity(HELD);
    for i in 0..HELD {
        let s = connect().unwrap_or_else(|e| panic!("connection {} of {HELD}: {e}", i + 1));
        exchange(&s, if i % BULK_EVERY == 0 { BULK } else { SMALL });
        held.push(s);
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "exchanges too slow"
        );
    }
    let took = started.elapsed();
    // Quiet: past `RING_QUIET` (1 s) the transmit rings are handed back.
    let (rss1, limit) = all_sessions_running(&mut engine, Duration::from_millis(2500));
    let per_conn = (rss1.saturating_sub(rss0) * 1024) / HELD as u64;
    eprintln!(
        "[memory] {HELD} smoltcp sessions under the iOS budget (admission limit {limit}), \
         {} of them {BULK} bytes each way, the rest {SMALL}: exchanged in {:.1} s; engine rss \
         {rss0} -> {rss1} KiB, {per_conn} bytes per connection",
        HELD.div_ceil(BULK_EVERY),
        took.as_secs_f64(),
    );
    assert!(
        per_conn <= 16 * 1024,
        "a quiet smoltcp connection costs {per_conn} bytes, more than 16 KiB"
    );
    drop(held);
    drop(warm);
    drop(engine);
    drop(server);
}
