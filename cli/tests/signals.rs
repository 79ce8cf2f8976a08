//! `kerntun run` stops cleanly on SIGTERM (what service managers send) as on
//! SIGINT: the engine is stopped, the final statistics line is printed and
//! the exit code is 0.
//!
//! Needs root (a TUN in a namespace the test creates); otherwise it prints
//! why it skipped.

mod common;

use std::time::Duration;

use common::{Running, stats_lines};
use kerntun_testkit::{Netns, require_root, within};
use nix::sys::signal::Signal;

fn stops_cleanly_on(sig: Signal, tag: &str) {
    require_root!();
    let ns = Netns::new(tag).expect("netns");
    let tun = format!("kt{tag}");
    let mut run = Running::in_netns(
        ns.name(),
        &["run", "--tun-name", &tun, "--stats-interval", "0"],
    );
    // Up once its TUN exists (the engine creates it during start).
    let up = within(Duration::from_secs(10), || {
        ns.ip(&["link", "show", &tun]).is_ok()
    })
    .is_some();
    run.assert_alive("while starting");
    assert!(up, "{tun} did not appear within 10 s");
    // The signal handler is installed right after the engine started.
    std::thread::sleep(Duration::from_millis(300));
    run.assert_alive("before the signal");
    run.signal(sig);
    let (status, out, err) = run.wait(Duration::from_secs(10));
    assert_eq!(
        status.code(),
        Some(0),
        "exit after {sig}: {status}\nstdout:\n{out}\nstderr:\n{err}"
    );
    let lines = stats_lines(&out);
    assert_eq!(
        lines.len(),
        1,
        "one final statistics line (interval 0), got stdout:\n{out}"
    );
    assert!(
        lines[0]["uptime_ms"].as_u64().is_some_and(|ms| ms >= 300),
        "final statistics cover the run: {}",
        lines[0]
    );
    assert!(
        err.contains("kerntun stopped"),
        "the engine was stopped, not abandoned:\n{err}"
    );
    assert!(
        ns.ip(&["link", "show", &tun]).is_err(),
        "{tun} is gone after the stop"
    );
}

#[test]
fn sigterm_stops_cleanly_with_final_statistics() {
    stops_cleanly_on(Signal::SIGTERM, "sigterm");
}

#[test]
fn sigint_stops_cleanly_with_final_statistics() {
    stops_cleanly_on(Signal::SIGINT, "sigint");
}
