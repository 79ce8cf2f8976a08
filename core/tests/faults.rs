//! A dead engine task ends the engine visibly: for each task the engine
//! runs for its whole life (the TUN driver, the system stack's accept
//! loops, the smoltcp poller), a panic or an early end injected through
//! the test-only fault hook (`Engine::inject_fault`, cargo feature
//! `fault-injection`) turns `is_running()` false and sets `error()` to a
//! reason that names the task. A hijacked DNS query's task, which decodes
//! the app's bytes, panics alone: the query is dropped and counted
//! (`dns_task_panic`), and the engine keeps running.
//!
//! `cargo test -p kerntun --features fault-injection --test faults`
//! (scripts/test.sh runs it). Needs root for the TUN; each test runs its
//! engine in a topology of its own, deleted on drop.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use kerntun::config::StackKind;
use kerntun::{EngineTask, Fault};
use kerntun_testkit::require_root;
use kerntun_testkit::rig::{RESOLVER, Rig};

/// Start an engine (IPv4 only), inject `fault` into `task`, and return
/// the engine's error once it stopped running.
fn failure(stack: StackKind, task: EngineTask, fault: Fault) -> String {
    let mut rig = Rig::builder().stack(stack).ipv4_only().start();
    let engine = &mut rig.engine;
    assert!(engine.is_running() && engine.error().is_none());
    engine.inject_fault(task, fault);
    let _ = kerntun_testkit::within(Duration::from_secs(3), || !engine.is_running());
    assert!(!engine.is_running(), "{task:?} {fault:?}: still running");
    let why = engine.error();
    // The failed engine still stops cleanly.
    let stopped = Instant::now();
    engine.stop();
    assert!(stopped.elapsed() < Duration::from_secs(4));
    why.unwrap_or_else(|| panic!("{task:?} {fault:?}: no error reported"))
}

/// Each task the engine runs for its whole life, with a panic and with an
/// early end: the engine stops, and its error names the task (a panic's
/// message goes on after the words here).
#[test]
fn a_dead_engine_task_fails_the_engine() {
    require_root!();
    for (stack, task, fault, want) in [
        (
            StackKind::System,
            EngineTask::Driver,
            Fault::Panic,
            "TUN driver panicked: fault injected",
        ),
        (
            StackKind::Smoltcp,
            EngineTask::Driver,
            Fault::End,
            "TUN driver ended unexpectedly",
        ),
        (
            StackKind::System,
            EngineTask::AcceptLoop,
            Fault::Panic,
            "accept loop panicked: fault injected",
        ),
        (
            StackKind::System,
            EngineTask::AcceptLoop,
            Fault::End,
            "accept loop ended unexpectedly",
        ),
        (
            StackKind::Smoltcp,
            EngineTask::Poller,
            Fault::Panic,
            "smoltcp poller panicked: fault injected",
        ),
    ] {
        let why = failure(stack, task, fault);
        match fault {
            Fault::Panic => assert!(why.starts_with(want), "{why}"),
            _ => assert_eq!(why, want),
        }
    }
}

#[test]
fn a_panicking_dns_query_task_is_counted_and_the_engine_keeps_running() {
    require_root!();
    let mut rig = Rig::builder()
        .ipv4_only()
        .dns(["udp://127.0.0.1:53"])
        .start();
    rig.engine.inject_fault(EngineTask::Dns, Fault::Panic);
    let s = UdpSocket::bind("0.0.0.0:0").expect("udp");
    // The fault stays armed: each query's task panics, alone.
    for n in 1..=3u64 {
        s.send_to(&[0u8; 12], RESOLVER).expect("query");
        rig.wait_until("the panic counted", Duration::from_secs(3), |st| {
            st.drop_count("dns_task_panic") >= n
        });
        assert!(
            rig.engine.is_running(),
            "query {n}: {:?}",
            rig.engine.error()
        );
        assert_eq!(rig.engine.error(), None);
    }
    let stopped = Instant::now();
    rig.engine.stop();
    assert!(stopped.elapsed() < Duration::from_secs(4));
}
