//! The FFI surface driven from Rust, as root in namespaces (testkit): the
//! same calls the Kotlin and Swift bindings make, so `cargo test` guards
//! them too. The JVM test (`ffi/tests/kotlin/run.sh`) covers the bindings.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kerntun_ffi::{
    DirectOptions, Engine, EngineConfig, HookError, KerntunError, LogLevel, MemoryPressure,
    PlatformHooks, RuleAction, RuleOptions, Stack, TunOptions,
};
use kerntun_testkit::servers::Mode;
use kerntun_testkit::{CLIENT_VETH, client, root_topology};
use parking_lot::Mutex;

#[derive(Default)]
struct Hooks {
    protected: AtomicUsize,
    refuse: std::sync::atomic::AtomicBool,
    logs: Mutex<Vec<String>>,
}

impl PlatformHooks for Hooks {
    fn protect(&self, _fd: i32) -> Result<(), HookError> {
        self.protected.fetch_add(1, Ordering::Relaxed);
        if self.refuse.load(Ordering::Relaxed) {
            return Err(HookError::Refused {
                reason: "refused by the test".into(),
            });
        }
        Ok(())
    }

    fn log(&self, level: LogLevel, message: String) -> Result<(), HookError> {
        self.logs.lock().push(format!("{level:?} {message}"));
        Ok(())
    }
}

fn config(tun: &str) -> EngineConfig {
    EngineConfig {
        tun: TunOptions {
            name: tun.into(),
            ipv6: Some("fd00:18::1/64".into()),
            ..Default::default()
        },
        direct: DirectOptions {
            interface: Some(CLIENT_VETH.into()),
            ..Default::default()
        },
        rules: vec![RuleOptions {
            cidr: None,
            ports: Some("9".into()),
            action: RuleAction::Reject,
            ..Default::default()
        }],
        log_level: Some(LogLevel::Debug),
        ..Default::default()
    }
}

#[test]
fn engine_through_the_ffi_moves_bytes_counts_and_stops() {
    let topo = root_topology!();
    let srv = topo.tcp_server(false, Mode::Echo);
    let srv6 = topo.tcp_server(true, Mode::Echo);
    topo.client.enter().expect("enter client namespace");

    // Round 0 leaves the stack unset (the system stack), round 1 asks for
    // smoltcp: the FFI surface behaves the same on both.
    for (round, stack, want) in [(0, None, "system"), (1, Some(Stack::Smoltcp), "smoltcp")] {
        let tun = format!("ktffi{round}");
        let hooks = Arc::new(Hooks::default());
        let cfg = EngineConfig {
            stack,
            ..config(&tun)
        };
        let engine = Engine::start(cfg, -1, hooks.clone()).expect("start");
        assert!(engine.is_running());
        assert_eq!(engine.stats().stack, want, "round {round}");
        assert_eq!(engine.tun_name().as_deref(), Some(tun.as_str()));
        topo.route_via_tun(&tun).expect("route");

        let len = 2 << 20;
        client::echo_transfer(srv.addr, round, len, false).expect("echo over IPv4");
        client::echo_transfer(srv6.addr, round + 10, len, false).expect("echo over IPv6");
        assert!(
            hooks.protected.load(Ordering::Relaxed) >= 2,
            "protect is called for every outbound socket"
        );

        hooks.refuse.store(true, Ordering::Relaxed);
        assert!(
            client::echo_transfer(srv.addr, 99, 1000, false).is_err(),
            "a refused protect aborts the connection"
        );
        hooks.refuse.store(false, Ordering::Relaxed);

        let s = engine.stats();
        assert!(s.tcp_bytes_up >= 2 * len as u64, "{s:?}");
        assert!(s.tcp_bytes_down >= 2 * len as u64, "{s:?}");
        assert!(s.tcp_connect_failed >= 1, "{s:?}");
        assert_eq!(s.total_drops, s.drops.iter().map(|d| d.count).sum::<u64>());
        assert_eq!(s.memory_pressure, Some(MemoryPressure::Normal));
        engine.set_memory_pressure(MemoryPressure::Critical);
        let p = engine.stats();
        assert_eq!(p.memory_pressure, Some(MemoryPressure::Critical));
        assert!(p.admission_limit < s.admission_limit);

        let logs = hooks.logs.lock().clone();
        assert!(
            logs.iter().any(|l| l.contains("kerntun started")),
            "{logs:?}"
        );
        assert!(
            logs.iter()
                .any(|l| l.starts_with("Debug") && l.contains("refused by the test")),
            "session-task logs reach the engine's hook: {logs:?}"
        );

        match Engine::start(
            EngineConfig {
                tun: TunOptions {
                    name: "ktffibad".into(),
                    ipv4: Some("198.18.0.1/31".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
            -1,
            hooks.clone(),
        ) {
            Err(KerntunError::Config { field, .. }) => assert_eq!(field, "tun.ipv4"),
            other => panic!("expected a config error, got {:?}", other.map(|_| ())),
        }

        engine.stop();
        engine.stop();
        assert!(!engine.is_running());
        assert!(engine.stats().tcp_bytes_up >= s.tcp_bytes_up);
    }
}

/// `stop` drains sessions and joins the runtime, which takes a while when
/// the device is busy; `stats()` and `is_running()` from another thread (the
/// app's main thread, a stats timer) must answer at once meanwhile, and
/// after. Dropping a running engine (Kotlin `close()`, Swift `deinit`) must
/// not wait for the stop either.
#[test]
fn calls_answer_at_once_while_stop_runs_and_drop_does_not_wait() {
    use std::net::UdpSocket;
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    /// The bound on one call. Today's stop takes hundreds of milliseconds
    /// on a busy device (the drain's deadline); a call that waits for it
    /// shows up as that long.
    const CALL_BOUND: Duration = Duration::from_millis(50);

    let topo = root_topology!();
    let udp = topo.udp_echo(false);
    topo.client.enter().expect("enter client namespace");
    let tun = "ktffistop";
    let cfg = EngineConfig {
        stack: Some(Stack::System),
        ..config(tun)
    };
    let engine = Engine::start(cfg, -1, Arc::new(Hooks::default())).expect("start");
    topo.route_via_tun(tun).expect("route");

    // Keep the device busy, so stop's drain runs until its deadline
    // instead of finishing on the first quiet 20 ms.
    let busy = Arc::new(AtomicBool::new(true));
    let flood = {
        let busy = busy.clone();
        std::thread::spawn(move || {
            let s = UdpSocket::bind("0.0.0.0:0").expect("udp socket");
            while busy.load(Ordering::Relaxed) {
                for _ in 0..10 {
                    let _ = s.send_to(&[0u8; 64], udp.addr);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    assert!(engine.stats().udp_packets_up > 0, "the flood goes through");

    // The prober: (when the call began, how long it took, is_running).
    let done = Arc::new(AtomicBool::new(false));
    let prober = {
        let (engine, done) = (engine.clone(), done.clone());
        std::thread::spawn(move || {
            let mut calls = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let t = Instant::now();
                let s = engine.stats();
                let running = engine.is_running();
                calls.push((t, t.elapsed(), running, s.tcp_bytes_up));
                std::thread::sleep(Duration::from_millis(2));
            }
            calls
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let stop_began = Instant::now();
    engine.stop();
    let stop_took = stop_began.elapsed();
    std::thread::sleep(Duration::from_millis(50));
    done.store(true, Ordering::Relaxed);
    let calls = prober.join().expect("prober");
    busy.store(false, Ordering::Relaxed);
    flood.join().expect("flood");

    assert!(
        stop_took >= Duration::from_millis(100),
        "the busy device kept stop draining ({stop_took:?}): the test needs a slow stop"
    );
    let during: Vec<_> = calls
        .iter()
        .filter(|(t, ..)| *t >= stop_began && *t < stop_began + stop_took)
        .collect();
    let slowest = calls.iter().map(|c| c.1).max().unwrap_or_default();
    eprintln!(
        "stop took {stop_took:?}; {} calls, {} during stop, slowest {slowest:?}",
        calls.len(),
        during.len()
    );
    assert!(
        slowest < CALL_BOUND,
        "stats() + is_running() took {slowest:?} (stop took {stop_took:?})"
    );
    assert!(
        during.len() >= 10,
        "calls made while stop ran: {} in {stop_took:?}",
        during.len()
    );
    assert!(
        during.iter().all(|c| !c.2),
        "is_running() is false as soon as stop began"
    );
    assert!(!engine.is_running());
    assert!(engine.stats().udp_packets_up > 0, "final counts after stop");
    assert_eq!(engine.tun_name(), None);
    assert_eq!(engine.error(), None);

    // Dropping a running engine returns at once; the stop happens on a
    // thread of its own and the device goes away shortly after.
    let tun2 = "ktffidrop";
    let engine = Engine::start(config(tun2), -1, Arc::new(Hooks::default())).expect("start");
    assert!(engine.is_running());
    let t = Instant::now();
    drop(engine);
    let drop_took = t.elapsed();
    assert!(drop_took < CALL_BOUND, "drop took {drop_took:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::path::Path::new(&format!("/sys/class/net/{tun2}")).exists() {
        assert!(
            Instant::now() < deadline,
            "{tun2} still exists 5 s after the drop"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
