//! Start/stop hygiene: its own test binary, so no other test's threads or
//! descriptors disturb the counts.

use std::time::Duration;

use kerntun::Engine;
use kerntun::config::{DriverMode, StackKind};
use kerntun_testkit::rig::Rig;
use kerntun_testkit::servers::{self, Mode};
use kerntun_testkit::{Topology, client, count_fds, count_threads, require_root, serial};

// The tests in this binary count process-wide descriptors and threads, so
// they run one at a time (`serial`).

#[test]
fn twenty_start_stop_cycles_with_traffic_leave_nothing_behind() {
    require_root!();
    let _serial = serial();
    let topo = Topology::new().expect("topology");
    let srv = servers::tcp(&topo.server, topo.server_addr(false, 0), Mode::Echo).expect("server");
    let udp = servers::udp_echo(&topo.server, topo.server_addr(false, 0)).expect("udp server");

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
            // Stop under a transfer that is really moving bytes.
            let before = engine.stats().tcp_bytes_up;
            let addr = srv.addr;
            let t = std::thread::spawn(move || client::echo_transfer(addr, 99, 64 << 20, false));
            kerntun_testkit::wait_until("the transfer moving", Duration::from_secs(20), || {
                engine.stats().tcp_bytes_up >= before + (1 << 20)
            });
            let stopped = std::time::Instant::now();
            engine.stop();
            assert!(t.join().expect("join").is_err(), "transfer cut by stop");
            assert!(
                stopped.elapsed() < Duration::from_secs(1),
                "the app saw the stop promptly (reset), not by timeout: {:?}",
                stopped.elapsed()
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

#[test]
fn two_engines_run_side_by_side_in_one_process() {
    require_root!();
    let _serial = serial();
    let a = Topology::new().expect("topology a");
    let b = Topology::new().expect("topology b");
    let run = |topo: &Topology| -> (Engine, servers::Server) {
        let e = Rig::builder().ipv4_only().engine_in(topo);
        let s = servers::tcp(&topo.server, topo.server_addr(false, 0), Mode::Echo).expect("srv");
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
