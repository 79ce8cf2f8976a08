//! A dead engine task ends the engine visibly: for each task the engine
//! runs (the TUN driver, the system stack's accept loops, the smoltcp
//! poller, a hijacked DNS query), a panic or an early end injected through
//! the test-only fault hook (`Engine::inject_fault`, cargo feature
//! `fault-injection`) turns `is_running()` false and sets `error()` to a
//! reason that names the task.
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

/// Start an engine (IPv4 only; with `dns`, its DNS service on), inject
/// `fault` into `task` (for DNS, then send the query that starts a query
/// task), and return the engine's error once it stopped running.
fn failure(stack: StackKind, dns: bool, task: EngineTask, fault: Fault) -> String {
    let mut rig = Rig::builder().stack(stack).ipv4_only();
    if dns {
        rig = rig.dns(["udp://127.0.0.1:53"]);
    }
    let mut rig = rig.start();
    let engine = &mut rig.engine;
    assert!(engine.is_running() && engine.error().is_none());
    engine.inject_fault(task, fault);
    if task == EngineTask::Dns {
        // A query to the hijacked address starts a query task, which meets
        // the fault.
        let s = UdpSocket::bind("0.0.0.0:0").expect("udp");
        s.send_to(&[0u8; 12], RESOLVER).expect("query");
    }
    let _ = kerntun_testkit::within(Duration::from_secs(3), || !engine.is_running());
    assert!(!engine.is_running(), "{task:?} {fault:?}: still running");
    let why = engine.error();
    // The failed engine still stops cleanly.
    let stopped = Instant::now();
    engine.stop();
    assert!(stopped.elapsed() < Duration::from_secs(4));
    why.unwrap_or_else(|| panic!("{task:?} {fault:?}: no error reported"))
}

#[test]
fn a_panicking_driver_fails_the_engine() {
    require_root!();
    let why = failure(StackKind::System, false, EngineTask::Driver, Fault::Panic);
    assert!(
        why.starts_with("TUN driver panicked: fault injected"),
        "{why}"
    );
}

#[test]
fn a_driver_that_ends_fails_the_engine() {
    require_root!();
    let why = failure(StackKind::Smoltcp, false, EngineTask::Driver, Fault::End);
    assert_eq!(why, "TUN driver ended unexpectedly");
}

#[test]
fn a_panicking_accept_loop_fails_the_engine() {
    require_root!();
    let why = failure(
        StackKind::System,
        false,
        EngineTask::AcceptLoop,
        Fault::Panic,
    );
    assert!(
        why.starts_with("accept loop panicked: fault injected"),
        "{why}"
    );
}

#[test]
fn an_accept_loop_that_ends_fails_the_engine() {
    require_root!();
    let why = failure(StackKind::System, false, EngineTask::AcceptLoop, Fault::End);
    assert_eq!(why, "accept loop ended unexpectedly");
}

#[test]
fn a_panicking_smoltcp_poller_fails_the_engine() {
    require_root!();
    let why = failure(StackKind::Smoltcp, false, EngineTask::Poller, Fault::Panic);
    assert!(
        why.starts_with("smoltcp poller panicked: fault injected"),
        "{why}"
    );
}

#[test]
fn a_panicking_dns_query_task_fails_the_engine() {
    require_root!();
    let why = failure(StackKind::System, true, EngineTask::Dns, Fault::Panic);
    assert!(
        why.starts_with("DNS query task panicked: fault injected"),
        "{why}"
    );
}
