//! Start/stop hygiene: its own test binary, so no other test's threads or
//! descriptors disturb the counts. Also sleep and wake (`Engine::sleep`):
//! the periodic ticks stand still while asleep, connections do not.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kerntun::config::{DriverMode, StackKind};
use kerntun::{Engine, SleepError};
use kerntun_testkit::rig::Rig;
use kerntun_testkit::servers::{self, Mode};
use kerntun_testkit::{
    Topology, client, count_fds, count_threads, require_root, serial, serial_topology,
};

// The tests in this binary count process-wide descriptors and threads, so
// they run one at a time (`serial`).

#[test]
fn twenty_start_stop_cycles_with_traffic_leave_nothing_behind() {
    let (_serial, topo) = serial_topology!();
    let srv = topo.tcp_server(false, Mode::Echo);
    let udp = topo.udp_echo(false);

    // Warm-up cycle: lazily created process-wide state (e.g. the tracing
    // dispatcher, glibc's resolver) must not count as a leak.
    let run_cycle = |i: u64, stack: StackKind, driver: DriverMode, stop_during_traffic: bool| {
        let mut engine = Rig::builder()
            .stack(stack)
            .driver(driver)
            .ipv4_only()
            .engine_in(&topo);
        let want = match stack {
            StackKind::Smoltcp => "smoltcp",
            _ => "system",
        };
        assert_eq!(engine.stats().stack, want, "cycle {i}");
        client::echo_transfer(srv.addr, i, 256 * 1024, false).expect("traffic");
        assert_eq!(client::udp_round_trips(udp.addr, 5, 100).expect("udp"), 5);
        if stop_during_traffic {
            let took = stop_under_traffic(&mut engine, srv.addr, 99);
            assert!(
                took < Duration::from_secs(1),
                "the app saw the stop promptly (reset), not by timeout: {took:?}"
            );
        }
        engine.stop();
        engine.stop(); // idempotent
        assert!(!engine.is_running());
    };
    // One warm-up per stack: each may create process-wide state once.
    run_cycle(0, StackKind::System, DriverMode::PerPacket, false);
    run_cycle(0, StackKind::Smoltcp, DriverMode::PerPacket, false);
    std::thread::sleep(Duration::from_millis(200));
    let (fds, threads) = (count_fds(), count_threads());
    let fd_targets = open_fds();
    for i in 1..=20u64 {
        let driver = if i % 2 == 0 {
            DriverMode::Batch
        } else {
            DriverMode::PerPacket
        };
        // Both stacks with both drivers: i % 4 walks the four pairs.
        let stack = if i % 4 < 2 {
            StackKind::System
        } else {
            StackKind::Smoltcp
        };
        run_cycle(i, stack, driver, i % 5 == 0);
    }
    std::thread::sleep(Duration::from_millis(300));
    let (fds_after, threads_after) = (count_fds(), count_threads());
    let leaked: Vec<_> = open_fds().difference(&fd_targets).cloned().collect();
    assert_eq!(
        fds_after, fds,
        "descriptors leaked over 20 cycles: {leaked:?}"
    );
    assert_eq!(threads_after, threads, "threads leaked over 20 cycles");
}

/// The per-packet driver's reader thread (`tun.read_ring`) runs while the
/// engine does and is joined by `stop`, also when stopped under traffic;
/// with `read_ring = 0` there is none.
#[test]
fn the_reader_thread_lives_exactly_as_long_as_the_engine() {
    let (_serial, topo) = serial_topology!();
    let srv = topo.tcp_server(false, Mode::Echo);
    assert_eq!(reader_threads(), 0, "none before");
    for ring in [64, 0] {
        let mut engine = Rig::builder()
            .stack(StackKind::System)
            .driver(DriverMode::PerPacket)
            .ipv4_only()
            .config(|_, c| c.tun.read_ring = Some(ring))
            .engine_in(&topo);
        client::echo_transfer(srv.addr, 1, 1 << 20, false).expect("traffic");
        assert_eq!(reader_threads(), usize::from(ring > 0), "ring {ring}");
        stop_under_traffic(&mut engine, srv.addr, 2);
        assert_eq!(reader_threads(), 0, "joined by stop (ring {ring})");
    }
}

/// Stop `engine` under an echo transfer to `addr` (of `pattern(seed)`)
/// that is really moving bytes, and check that the stop cut it: how long
/// the app's transfer took to end after the stop began.
fn stop_under_traffic(engine: &mut Engine, addr: SocketAddr, seed: u64) -> Duration {
    let before = engine.stats().tcp_bytes_up;
    let t = std::thread::spawn(move || client::echo_transfer(addr, seed, 64 << 20, false));
    kerntun_testkit::wait_until("the transfer moving", Duration::from_secs(20), || {
        engine.stats().tcp_bytes_up >= before + (1 << 20)
    });
    let stopped = Instant::now();
    engine.stop();
    assert!(t.join().expect("join").is_err(), "transfer cut by stop");
    stopped.elapsed()
}

/// Threads of this process named as the TUN reader thread.
fn reader_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("proc")
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim() == "kerntun-reader")
        })
        .count()
}

#[test]
fn two_engines_run_side_by_side_in_one_process() {
    require_root!();
    let _serial = serial();
    let a = Topology::new().expect("topology a");
    let b = Topology::new().expect("topology b");
    let run = |topo: &Topology| -> (Engine, servers::Server) {
        let e = Rig::builder().ipv4_only().engine_in(topo);
        let s = topo.tcp_server(false, Mode::Echo);
        (e, s)
    };
    let (ea, sa) = run(&a);
    let (eb, sb) = run(&b);
    // This thread is now in b's client namespace.
    client::echo_transfer(sb.addr, 1, 1 << 20, false).expect("engine b");
    a.client.enter().expect("back to a");
    client::echo_transfer(sa.addr, 2, 1 << 20, false).expect("engine a");
    assert_eq!(ea.stats().tcp_sessions_total, 1);
    assert_eq!(eb.stats().tcp_sessions_total, 1);
}

/// While the engine sleeps its periodic ticks (`timer_ticks`: the driver's
/// cleanup, once a second while a flow is open, and the heap-trim tick,
/// every 2 s on Linux with glibc) stand still for 2.6 s, more than two
/// periods of each, while a TCP connection opened before keeps echoing
/// and a UDP flow keeps answering; on wake a tick comes at once (well
/// before a period). Sleep and wake twice are no-ops; an engine stopped
/// while asleep stops promptly; both are typed errors once it stopped.
#[test]
fn sleep_stops_the_periodic_ticks_and_wake_resumes_them() {
    let (_serial, topo) = serial_topology!();
    let srv = topo.tcp_server(false, Mode::Echo);
    let udp = topo.udp_echo(false);
    let mut engine = Rig::builder().ipv4_only().engine_in(&topo);
    let ticks = || engine.stats().timer_ticks;
    let mut conn = std::net::TcpStream::connect_timeout(&srv.addr, Duration::from_secs(3))
        .expect("connect through the tunnel");
    conn.set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    let mut echo = |round: u8| {
        let out = [round; 1000];
        conn.write_all(&out).expect("write");
        let mut back = [0u8; 1000];
        conn.read_exact(&mut back).expect("echoed");
        assert_eq!(back, out, "round {round}");
    };
    echo(1);
    assert_eq!(client::udp_round_trips(udp.addr, 3, 100).expect("udp"), 3);
    // Awake: ticks come (the first at start, then every period).
    kerntun_testkit::wait_until("ticks while awake", Duration::from_secs(4), || ticks() >= 3);

    assert!(engine.sleep().expect("running"), "was awake");
    assert!(!engine.sleep().expect("running"), "asleep already");
    std::thread::sleep(Duration::from_millis(100));
    let asleep_at = ticks();
    echo(2);
    assert_eq!(client::udp_round_trips(udp.addr, 3, 100).expect("udp"), 3);
    std::thread::sleep(Duration::from_millis(2_600));
    echo(3);
    assert_eq!(ticks(), asleep_at, "no tick in 2.6 s asleep");
    assert!(engine.is_running());

    assert!(engine.wake().expect("running"), "was asleep");
    let woke = Instant::now();
    assert!(!engine.wake().expect("running"), "awake already");
    kerntun_testkit::wait_until("a tick at once on wake", Duration::from_millis(500), || {
        ticks() > asleep_at
    });
    assert!(
        woke.elapsed() < Duration::from_millis(900),
        "{:?}",
        woke.elapsed()
    );
    echo(4);
    let s = engine.stats();
    assert_eq!(
        s.tcp_sessions_total, 1,
        "the one connection throughout: {s:?}"
    );
    assert_eq!(s.sessions_reset_on_network_change, 0);

    // An engine stopped while asleep stops as promptly as an awake one.
    assert!(engine.sleep().expect("running"));
    let stopping = Instant::now();
    engine.stop();
    assert!(
        stopping.elapsed() < Duration::from_secs(2),
        "stopped asleep in {:?}",
        stopping.elapsed()
    );
    assert!(!engine.is_running());
    assert!(matches!(engine.sleep(), Err(SleepError::NotRunning)));
    assert!(matches!(engine.wake(), Err(SleepError::NotRunning)));
}

fn open_fds() -> std::collections::BTreeSet<String> {
    std::fs::read_dir("/proc/self/fd")
        .expect("proc")
        .flatten()
        .map(|e| {
            let target = std::fs::read_link(e.path()).map(|p| p.display().to_string());
            format!(
                "{}->{}",
                e.file_name().to_string_lossy(),
                target.unwrap_or_default()
            )
        })
        .collect()
}

/// This process's CPU time so far (user and system, every thread), in
/// clock ticks (`/proc/self/stat` fields 14 and 15).
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // The command name (field 2) is in parentheses and may hold spaces:
    // count fields from the last ')'.
    let rest = &stat[stat.rfind(')').expect("a command name") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3, so fields 14 and 15 are at 11 and 12.
    fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
}

/// `getconf CLK_TCK`: the unit of [`cpu_ticks`].
fn clock_ticks_per_second() -> u64 {
    let out = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .expect("getconf");
    let hz: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("CLK_TCK");
    hz.max(1)
}

/// The per-packet driver reads the device directly and goes through the
/// runtime's readiness check only when a read finds it empty
/// (`Tun::try_recv`), which must clear the readiness so that the driver
/// sleeps: after 4 MiB echoed through an engine in this process, two idle
/// seconds cost the whole process under 0.3 s of CPU. A driver that kept
/// finding the device readable would spin its runtime thread, about 2 s;
/// with the readiness left set after an empty read (tried), the transfer
/// itself fails, the spinning driver never yielding to the sessions.
/// Each driver, since both wait on the same readiness.
#[test]
fn an_engine_with_an_empty_device_sleeps() {
    let (_serial, topo) = serial_topology!();
    let srv = topo.tcp_server(false, Mode::Echo);
    for driver in [DriverMode::PerPacket, DriverMode::Batch] {
        let engine = Rig::builder().driver(driver).ipv4_only().engine_in(&topo);
        client::echo_transfer(srv.addr, 7, 4 << 20, false).expect("traffic");
        assert!(engine.stats().tun_reads > 0, "{driver:?}: the driver read");
        std::thread::sleep(Duration::from_millis(300));
        let (ticks, at) = (cpu_ticks(), Instant::now());
        std::thread::sleep(Duration::from_secs(2));
        let per_s = clock_ticks_per_second();
        let used_ms = (cpu_ticks() - ticks) * 1000 / per_s;
        assert!(
            used_ms < 300,
            "{driver:?}: {used_ms} ms of CPU in {:?} idle",
            at.elapsed()
        );
        drop(engine);
    }
}
