//! Floods a hostile or unlucky app sends, against a running engine in
//! namespaces: malformed L4 of many kinds, UDP to many ports, SYNs from
//! spoofed sources, connection churn, resets and half-closes. Each runs
//! against both stacks, under the desktop and the iOS budget, bounded in
//! count and time, while a long-lived stream keeps moving; after each, a
//! fresh connection must succeed within 1 s and descriptors and flows must
//! be back to idle within 5 s. They print the `[flood]` lines that
//! `docs/reliability.md` records.
//!
//! Packets are written to the TUN's transmit side from the client
//! namespace (`testkit/scripts/flood_via_tun.py`), so the engine reads them
//! as an app's; spoofed sources are inside the TUN's own prefixes
//! (198.18.0.0/16, fd00:18::/64), which no namespace owns.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kerntun::budget::{Budget, Platform};
use kerntun::config::{Config, DriverMode, StackKind};
use kerntun::{Engine, StatsSnapshot, TunSource};
use kerntun_testkit::servers::{self, Mode};
use kerntun_testkit::{Topology, count_fds, require_root};

static SERIAL: Mutex<()> = Mutex::new(());

/// One at a time: they measure process-wide descriptors and memory.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn config(topo: &Topology, stack: StackKind, platform: Platform) -> Config {
    let mut c = Config {
        stack,
        ..Config::default()
    };
    c.tun.name = format!("kt{}", topo.id);
    c.tun.mtu = 1500;
    c.tun.ipv4 = Some("198.18.0.1/16".parse().expect("net"));
    c.tun.ipv6 = Some("fd00:18::1/64".parse().expect("net"));
    c.driver = DriverMode::Auto;
    c.budget.platform = Some(platform);
    c.direct.interface = Some(kerntun_testkit::CLIENT_VETH.into());
    c.direct.connect_timeout_ms = 2_000;
    c.timeouts.tcp_linger_s = 1;
    c
}

/// Resident memory of this process, in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A stream that echoes 1000-byte chunks until stopped, and reports how
/// many round trips it made and its longest stall.
struct Live {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<io::Result<(u64, Duration)>>,
}

impl Live {
    fn start(addr: SocketAddr) -> Live {
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("live stream");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let handle = std::thread::spawn(move || {
            let (mut trips, mut worst) = (0u64, Duration::ZERO);
            let mut buf = [0u8; 1000];
            while !stop2.load(Ordering::Relaxed) {
                let started = Instant::now();
                let chunk = [(trips % 251) as u8; 1000];
                s.write_all(&chunk)?;
                s.read_exact(&mut buf)?;
                if buf != chunk {
                    return Err(io::Error::other("live stream corrupted"));
                }
                trips += 1;
                worst = worst.max(started.elapsed());
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok((trips, worst))
        });
        Live { stop, handle }
    }

    fn finish(self) -> (u64, Duration) {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .join()
            .expect("live thread")
            .expect("the live stream kept moving")
    }
}

/// One fresh connection and one echo; how long it took.
fn fresh_connection(addr: SocketAddr) -> io::Result<Duration> {
    let started = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(1)))?;
    s.write_all(b"fresh")?;
    let mut buf = [0u8; 5];
    s.read_exact(&mut buf)?;
    Ok(started.elapsed())
}

/// The flood kinds `flood_via_tun.py` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Malformed,
    Udp,
    Syn,
    Churn,
}

impl Kind {
    fn arg(self) -> &'static str {
        match self {
            Kind::Malformed => "malformed",
            Kind::Udp => "udp",
            Kind::Syn => "syn",
            Kind::Churn => "churn",
        }
    }
}

/// Write `count` packets of `kind` into the TUN from the client namespace;
/// returns how many the kernel took.
fn inject(topo: &Topology, tun: &str, kind: Kind, count: usize, port: u16) -> u64 {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testkit/scripts/flood_via_tun.py"
    );
    let (d4, d6) = (topo.server_v4().to_string(), topo.server_v6().to_string());
    topo.client
        .exec(
            "python3",
            &[
                script,
                tun,
                kind.arg(),
                &count.to_string(),
                "7",
                &d4,
                &d6,
                &port.to_string(),
            ],
        )
        .expect("flood script")
        .trim()
        .parse()
        .expect("count")
}

/// Packets the TUN's own queue dropped (they never reached the engine).
fn tx_dropped(topo: &Topology, tun: &str) -> u64 {
    let path = format!("/sys/class/net/{tun}/statistics/tx_dropped");
    topo.client
        .exec("cat", &[&path])
        .expect("tx_dropped")
        .trim()
        .parse()
        .expect("number")
}

/// Sum of the named counters.
fn counted(s: &StatsSnapshot, names: &[&str]) -> u64 {
    names.iter().map(|n| s.drop_count(n)).sum()
}

fn wait_until(limit: Duration, mut ok: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    while !ok() {
        if started.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(started.elapsed())
}

/// What one flood run measured.
struct Outcome<'a> {
    stats: StatsSnapshot,
    reached: u64,
    /// Descriptors before the flood and at its peak.
    fds: (usize, usize),
    engine: &'a Engine,
}

impl Outcome<'_> {
    /// The engine's statistics now.
    fn engine_stats(&self) -> StatsSnapshot {
        self.engine.stats()
    }
}

/// Start an engine, a live stream through it, flood, then check the bar:
/// the live stream kept moving, a fresh connection works within 1 s,
/// descriptors and flows are back to idle within `settle`. `check` looks
/// at the stats after the flood.
#[allow(clippy::too_many_arguments)]
fn run<T>(
    kind: Kind,
    stack: StackKind,
    platform: Platform,
    count: usize,
    settle: Duration,
    tweak: impl FnOnce(&mut Config),
    prepare: impl FnOnce(&Topology) -> T,
    check: impl FnOnce(&Outcome<'_>, T),
) {
    let _s = serial();
    let topo = Topology::new().expect("topology");
    let echo = servers::tcp(&topo.server, topo.server_addr(false, 0), Mode::Echo).expect("echo");
    // What the floods aim at: a server that accepts and holds, on one port
    // of both families (apart from the echo server, whose own accept
    // queue is not what is measured).
    let target6 =
        servers::tcp(&topo.server, topo.server_addr(true, 0), Mode::Hold).expect("target");
    let port = target6.addr.port();
    let _target4 =
        servers::tcp(&topo.server, topo.server_addr(false, port), Mode::Hold).expect("target");
    topo.client.enter().expect("enter client ns");
    let mut cfg = config(&topo, stack, platform);
    tweak(&mut cfg);
    // What the budgets in force allow the engine to hold (docs/reliability.md,
    // "Memory budgets").
    let worst_case: usize = Budget::resolve(&cfg.budget)
        .worst_case(cfg.tun.mtu)
        .iter()
        .map(|(_, bytes)| bytes)
        .sum();
    let engine = Engine::start(cfg, TunSource::Create, None).expect("engine");
    let tun = engine.tun_name().expect("tun name");
    topo.route_via_tun(&tun).expect("routes");
    fresh_connection(echo.addr).expect("warm-up");
    let live = Live::start(echo.addr);
    let prepared = prepare(&topo);
    std::thread::sleep(Duration::from_millis(100));
    let idle = engine.stats();
    let (fds0, rss0) = (count_fds(), rss_kib());
    let dropped0 = tx_dropped(&topo, &tun);

    let started = Instant::now();
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        std::thread::spawn(move || {
            let (mut fds, mut rss) = (0, 0);
            while sampling.load(Ordering::Relaxed) {
                fds = fds.max(count_fds());
                rss = rss.max(rss_kib());
                std::thread::sleep(Duration::from_millis(10));
            }
            (fds, rss)
        })
    };
    let sent = match kind {
        Kind::Churn => churn(echo.addr, count),
        _ => inject(&topo, &tun, kind, count, port),
    };
    let took = started.elapsed();
    let reached = sent - (tx_dropped(&topo, &tun) - dropped0);
    sampling.store(false, Ordering::Relaxed);
    let (fds_peak, rss_peak) = sampler.join().expect("sampler");
    let fresh = fresh_connection(echo.addr);
    let settled = wait_until(settle, || {
        let s = engine.stats();
        count_fds() <= fds0 + 2
            && s.udp_flows_active <= idle.udp_flows_active
            && s.nat.half_open <= idle.nat.half_open
            && s.nat.active <= idle.nat.active + 1
    });
    let (trips, stall) = live.finish();
    let stats = engine.stats();
    eprintln!(
        "[flood] {} {} {:?}: {sent} sent in {:.1} s, {reached} reached; fds {fds0} -> peak {fds_peak} -> {}; \
         rss {rss0} -> {rss_peak} KiB; fresh connection {:?}; settled in {:?}; live stream {trips} round trips, \
         longest {stall:?}; udp flows {} opened, {} active (idle {}); nat {:?} (idle {:?}); drops {:?}",
        kind.arg(),
        stats.stack,
        platform,
        took.as_secs_f64(),
        count_fds(),
        fresh.as_ref().map_err(|e| e.to_string()),
        settled,
        stats.udp_flows_total,
        stats.udp_flows_active,
        idle.udp_flows_active,
        stats.nat,
        idle.nat,
        stats.drops,
    );
    assert!(engine.is_running(), "engine survived: {:?}", engine.error());
    let fresh = fresh.expect("a fresh connection right after the flood");
    assert!(
        fresh < Duration::from_secs(1),
        "fresh connection took {fresh:?}"
    );
    assert!(
        settled.is_some(),
        "back to idle within {settle:?}: {stats:?}"
    );
    // This process's growth holds the engine's and the flood's own threads
    // and buffers: an upper bound on the engine's.
    let grown = usize::try_from(rss_peak.saturating_sub(rss0) * 1024).unwrap_or(usize::MAX);
    if platform == Platform::Ios {
        assert!(
            grown <= worst_case,
            "peak RSS grew {grown} B, over the iOS budget's worst case {worst_case} B"
        );
    }
    assert!(trips > 0, "the live stream moved");
    assert!(
        stall < Duration::from_secs(2),
        "live stream stalled {stall:?}"
    );
    check(
        &Outcome {
            stats,
            reached,
            fds: (fds0, fds_peak),
            engine: &engine,
        },
        prepared,
    );
}

/// Malformed L4 (bad checksums, invalid flag combinations, bad UDP
/// lengths, both families) is counted and creates no flow, socket or
/// descriptor.
fn malformed(stack: StackKind, platform: Platform) {
    const COUNT: usize = 20_000;
    run(
        Kind::Malformed,
        stack,
        platform,
        COUNT,
        Duration::from_secs(5),
        |_| {},
        |_| (),
        |o, ()| {
            let s = &o.stats;
            assert_eq!(s.udp_flows_total, 0, "no UDP flow opened: {s:?}");
            assert_eq!(
                s.tcp_sessions_total, 3,
                "only the warm-up, the live stream and the fresh connection: {s:?}"
            );
            let n = counted(
                s,
                &[
                    "tcp_bad_checksum",
                    "tcp_bad_flags",
                    "udp_bad_checksum",
                    "udp_bad_length",
                ],
            );
            assert!(
                n * 100 >= o.reached * 99,
                "{n} of {} malformed packets counted: {s:?}",
                o.reached
            );
        },
    );
}

/// Datagrams to 5000 ports that nobody answers, while one flow that was
/// answered sits idle: the flood recycles its own (unreplied) flows, never
/// evicts the answered one, and its flows close after the unreplied
/// timeout (2 s here) instead of the idle one (60 s).
fn udp_to_many_ports(stack: StackKind, platform: Platform) {
    const COUNT: usize = 5_000;
    let unreplied = Duration::from_secs(2);
    run(
        Kind::Udp,
        stack,
        platform,
        COUNT,
        unreplied + Duration::from_secs(3),
        |c| {
            c.timeouts.udp_unreplied_s = unreplied.as_secs();
            // Small enough that the flood fills it on every platform.
            c.budget.udp_flows = Some(256);
            // A flow per destination: the flood comes from one source
            // port, which endpoint-independent mapping makes one flow
            // (core/tests/udp_nat.rs).
            c.direct.udp_nat = kerntun::config::UdpNat::Connected;
        },
        |topo| {
            let srv =
                servers::udp_echo(&topo.server, topo.server_addr(false, 0)).expect("udp echo");
            let sock = std::net::UdpSocket::bind("0.0.0.0:0").expect("udp");
            sock.connect(srv.addr).expect("connect");
            sock.set_read_timeout(Some(Duration::from_secs(1)))
                .expect("timeout");
            round_trip(&sock).expect("the answered flow's first round trip");
            (srv, sock)
        },
        |o, (_srv, sock)| {
            let s = &o.stats;
            assert!(s.udp_flows_evicted > 0, "the flood filled the table: {s:?}");
            // One socket per flow, 256 flows; the flows one drain evicted
            // (32 packets) close before the next drain; the test's own
            // sockets and the live stream, a few more.
            let (fds0, peak) = o.fds;
            let bound = 256 + 32 + 64;
            assert!(
                peak <= fds0 + bound,
                "descriptors during the flood: {fds0} -> {peak} (bound {bound})"
            );
            // The answered flow is still the same flow: this round trip
            // opens none.
            let opened = s.udp_flows_total;
            round_trip(&sock).expect("the answered flow after the flood");
            let s = o.engine_stats();
            assert_eq!(
                s.udp_flows_total, opened,
                "the answered flow was never evicted: {s:?}"
            );
            assert_eq!(
                s.udp_flows_active, 1,
                "only the answered flow is left: {s:?}"
            );
        },
    );
}

/// SYNs from spoofed sources that never answer the handshake, to the
/// echo server's port (open, so each admitted SYN connects an outbound):
/// the engine holds a bounded number of half-open connections and
/// outbound sockets, evicting the oldest, and the next real connection is
/// admitted at once.
fn syn_flood(stack: StackKind, platform: Platform) {
    const COUNT: usize = 4_000;
    run(
        Kind::Syn,
        stack,
        platform,
        COUNT,
        Duration::from_secs(5),
        |_| {},
        |_| (),
        |o, ()| {
            let s = &o.stats;
            let (fds0, peak) = o.fds;
            // A half-open connection holds one outbound socket (the target
            // server, in this process, one more): 512 at most on desktop,
            // half the admission limit (32) on iOS; a third for the ones
            // closing after eviction.
            let cap = if s.admission_limit <= 64 { 32 } else { 512 };
            let bound = 3 * cap + 64;
            assert!(
                peak <= fds0 + bound,
                "descriptors during the flood: {fds0} -> {peak} (bound {bound})"
            );
            assert!(
                s.drop_count("half_open_evicted") > 0,
                "the flood went past the half-open bound: {s:?}"
            );
        },
    );
}

/// `count` real connections from 4 threads, each ending one of three ways
/// in turn: a normal close after an echo, a reset (SO_LINGER 0) right
/// after writing, a half-close answered by the server's trailer. Returns
/// how many completed as expected.
fn churn(addr: SocketAddr, count: usize) -> u64 {
    let threads: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let mut ok = 0u64;
                for i in (t..count).step_by(4) {
                    if one_churn(addr, i % 3).is_ok() {
                        ok += 1;
                    }
                }
                ok
            })
        })
        .collect();
    threads.into_iter().map(|h| h.join().expect("churn")).sum()
}

fn one_churn(addr: SocketAddr, how: usize) -> io::Result<()> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(b"churn")?;
    match how {
        0 => {
            let mut buf = [0u8; 5];
            s.read_exact(&mut buf)
        }
        1 => {
            socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO))?;
            Ok(())
        }
        _ => {
            s.shutdown(std::net::Shutdown::Write)?;
            let mut got = Vec::new();
            s.read_to_end(&mut got)?;
            if got.ends_with(servers::TRAILER) {
                Ok(())
            } else {
                Err(io::Error::other("no trailer after the half-close"))
            }
        }
    }
}

/// Connection churn, resets and half-closes at full speed: sessions end,
/// NAT entries or sockets drain, nothing is left behind.
fn churn_resets_half_closes(stack: StackKind, platform: Platform) {
    const COUNT: usize = 1_500;
    run(
        Kind::Churn,
        stack,
        platform,
        COUNT,
        Duration::from_secs(5),
        |_| {},
        |_| (),
        |o, ()| {
            assert!(
                o.reached * 100 >= COUNT as u64 * 99,
                "{} of {COUNT} connections completed: {:?}",
                o.reached,
                o.stats
            );
        },
    );
}

/// One datagram and its echo on a connected socket.
fn round_trip(sock: &std::net::UdpSocket) -> io::Result<()> {
    sock.send(b"answered")?;
    let mut buf = [0u8; 16];
    let n = kerntun_testkit::uninterrupted(|| sock.recv(&mut buf))?;
    if &buf[..n] != b"answered" {
        return Err(io::Error::other("bad echo"));
    }
    Ok(())
}

macro_rules! floods {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use kerntun::budget::Platform;
            use kerntun::config::StackKind;
            #[test]
            fn system_desktop() {
                crate::require_root!();
                crate::$name(StackKind::System, Platform::Desktop);
            }
            #[test]
            fn system_ios() {
                crate::require_root!();
                crate::$name(StackKind::System, Platform::Ios);
            }
            #[test]
            fn smoltcp_desktop() {
                crate::require_root!();
                crate::$name(StackKind::Smoltcp, Platform::Desktop);
            }
            #[test]
            fn smoltcp_ios() {
                crate::require_root!();
                crate::$name(StackKind::Smoltcp, Platform::Ios);
            }
        }
    )*};
}

floods!(
    malformed,
    udp_to_many_ports,
    syn_flood,
    churn_resets_half_closes
);
