//! Memory given back after load. glibc keeps freed memory in its arenas
//! for reuse: after 20,000 connections of churn the smoltcp engine's RSS
//! stayed at 114 MB (7.8 MB before), the system stack's at 13 MB (7.6),
//! long after every session had ended (`core/tests/stress.rs` measures
//! it). A low-frequency tick ([`TICK`]) looks at the engine's event
//! counters (sessions and flows opened, packets and flows dropped or
//! refused); after [`LOAD_EVENTS`] of them, the first tick that saw fewer
//! than [`QUIET_EVENTS`] shrinks the flow table (`Stack::shrink`) and
//! trims the heap ([`crate::sys::trim_heap`], off the runtime's workers).
//! Flows the load left end later and free what they held after that
//! trim, so for [`ENDING_TICKS`] more ticks a quiet one that finds fewer
//! flows live trims again; then it waits for the next load. Never on the
//! packet path, never while load goes on. A trickle is quiet: after a SYN flood the kernel
//! retransmits its SYN-ACKs to the spoofed sources for a minute, each a
//! counted drop (measured in `core/tests/stress.rs`: 7 in 5 s). The
//! trim itself took 0.8-5 ms there (after a SYN flood: 27.6 to 16.9 MB
//! on the system stack, 122.6 to 38.2 MB on smoltcp).
//!
//! Linux with glibc only: the other allocators the engine runs on (bionic's
//! on Android, libmalloc on Darwin) give free pages back by themselves.
//! While the engine sleeps (`Engine::sleep`) the tick keeps no timer
//! ([`Ticker`]).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use crate::lifecycle::{Lifecycle, Phase, Ticker};
use crate::stack::Stack;
use crate::stats::Stats;

/// How often the engine looks for quiet: a trim follows the end of load
/// within two ticks.
pub(crate) const TICK: Duration = Duration::from_secs(2);

/// Fewer events than this in a tick is quiet (32 a second).
pub(crate) const QUIET_EVENTS: u64 = 64;

/// Events since the last trim that make the next quiet tick trim: load,
/// not a browsing app's few connections a minute.
pub(crate) const LOAD_EVENTS: u64 = 256;

/// What load leaves in the counters: sessions and flows opened, packets
/// and flows dropped or refused. Bytes moving on live sessions are not
/// load here: a long download allocates nothing new.
fn events(stats: &Stats) -> u64 {
    let sum = |c: &[std::sync::atomic::AtomicU64]| -> u64 {
        c.iter().map(|a| a.load(Relaxed)).fold(0, u64::wrapping_add)
    };
    stats
        .tcp_sessions_total
        .load(Relaxed)
        .wrapping_add(stats.udp_flows_total.load(Relaxed))
        .wrapping_add(stats.admission_refused.load(Relaxed))
        .wrapping_add(sum(&stats.drops.0))
        .wrapping_add(sum(&stats.rejects))
}

/// Ticks after a load's trim during which flows that load left still end
/// (half-open connects timing out, sockets closing): each quiet one that
/// finds fewer live flows than the trim before it trims again, since what
/// those flows held was freed after that trim.
pub(crate) const ENDING_TICKS: u8 = 8;

/// When to trim: the first quiet tick after load, then each quiet tick of
/// the next [`ENDING_TICKS`] that finds fewer flows live than the last
/// trim did.
#[derive(Debug, Default)]
struct Quiet {
    last: u64,
    /// Events since the last trim.
    load: u64,
    /// After a load's trim: the flows live at the last trim and the ticks
    /// left in which their ending trims again.
    ending: Option<(u64, u8)>,
}

impl Quiet {
    /// The counters and the live flows at a tick: whether to trim now.
    fn tick(&mut self, events: u64, live: u64) -> bool {
        let new = events.wrapping_sub(self.last);
        self.last = events;
        self.load = self.load.saturating_add(new);
        let ending = self.ending.take();
        if new >= QUIET_EVENTS {
            self.ending = ending.and_then(|(at, left)| (left > 1).then_some((at, left - 1)));
            return false;
        }
        if self.load >= LOAD_EVENTS {
            self.load = 0;
            self.ending = Some((live, ENDING_TICKS));
            return true;
        }
        let Some((at, left)) = ending else {
            return false;
        };
        let trim = live < at;
        self.ending = (left > 1).then_some((if trim { live } else { at }, left - 1));
        trim
    }
}

/// Flows live now: sessions, UDP flows and the stack's own (half-open,
/// lingering), what a flow that ends gives back.
fn live(stats: &Stats, stack: &Stack) -> u64 {
    let c = stack.counts();
    stats.tcp_sessions_active.load(Relaxed)
        + stats.udp_flows_active.load(Relaxed)
        + c.half_open
        + c.active
        + c.closing
}

/// The trim loop, until the engine drains. Before each trim it gives back
/// what load grew the flow table to (`Stack::shrink`), so that the trim
/// finds whole free pages.
pub(crate) async fn run(stats: Arc<Stats>, life: Arc<Lifecycle>, stack: Stack) {
    let mut tick = Ticker::new(TICK, &life);
    let mut quiet = Quiet {
        last: events(&stats),
        ..Quiet::default()
    };
    loop {
        tokio::select! {
            () = tick.tick(true) => {}
            () = life.reached(Phase::Draining) => return,
        }
        if !quiet.tick(events(&stats), live(&stats, &stack)) {
            continue;
        }
        // Off the workers: the walk takes each arena's lock in turn.
        let stack = stack.clone();
        let took = tokio::task::spawn_blocking(move || {
            let t = Instant::now();
            let shrunk = stack.shrink();
            let released = crate::sys::trim_heap();
            (shrunk, released, t.elapsed())
        })
        .await;
        if let Ok((shrunk, released, took)) = took {
            tracing::debug!(
                "flow table shrunk by {shrunk} B and heap trimmed after load in {took:?} (released: {released})"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One trim per quiet spell after load: none while load goes on, none
    /// for a trickle, none while the engine idles before any load or after
    /// the trim.
    #[test]
    fn trims_once_when_load_stops() {
        let mut q = Quiet::default();
        // Idle, a trickle, load over two ticks, a trickle after it (a
        // SYN flood's retransmitted SYN-ACKs), idle, load again.
        let ticks = [0, 0, 5, 3000, 6000, 6007, 6014, 6014, 6200, 6400, 6400];
        let trims: Vec<bool> = ticks.iter().map(|&e| q.tick(e, 0)).collect();
        assert_eq!(
            trims,
            [
                false, false, false, false, false, true, false, false, false, false, true
            ]
        );
        // A browsing app: 20 connections a tick trim once per 13 ticks.
        let mut q = Quiet::default();
        let trims = (1..=26).filter(|i| q.tick(i * 20, 5)).count();
        assert_eq!(trims, 2);
    }

    /// After a load's trim, flows that load left still end: a quiet tick
    /// that finds fewer live trims again, one that finds as many or more
    /// does not, and none after [`ENDING_TICKS`].
    #[test]
    fn trims_again_while_the_loads_flows_end() {
        let mut q = Quiet::default();
        // (events, live): load with 500 flows live, a quiet tick (trim),
        // flows ending over quiet ticks, a busy tick, more ending.
        let ticks = [
            (1000, 500),
            (1000, 500),
            (1000, 200),
            (1000, 200),
            (1010, 10),
            (1200, 5),
            (1200, 2),
            (1200, 2),
        ];
        let trims: Vec<bool> = ticks.iter().map(|&(e, l)| q.tick(e, l)).collect();
        assert_eq!(trims, [false, true, true, false, true, false, true, false]);
        // The window closes: flows ending later do not trim.
        let mut q = Quiet::default();
        assert!(!q.tick(1000, 100));
        assert!(q.tick(1000, 100));
        for _ in 0..ENDING_TICKS {
            assert!(!q.tick(1000, 100));
        }
        assert!(!q.tick(1000, 1), "past the window");
    }

    /// What a trim costs and gives back, measured here (the engine runs it
    /// on a blocking thread, never a worker): 4 threads each allocate 64 MiB
    /// in 4 KiB blocks and free three of every four, the rest pinning the
    /// holes in their arenas, which only a trim gives back. Prints the RSS
    /// and the time (`cargo test -p kerntun --lib housekeeping -- --nocapture`).
    #[test]
    fn a_trim_releases_the_holes_threads_left() {
        fn rss_kib() -> u64 {
            let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
            let pages: u64 = s
                .split_whitespace()
                .nth(1)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            pages * 4
        }
        let kept: Vec<Vec<Vec<u8>>> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    let blocks: Vec<Vec<u8>> = (0..16_384).map(|i| vec![i as u8; 4096]).collect();
                    blocks
                        .into_iter()
                        .enumerate()
                        .filter_map(|(i, b)| (i % 4 == 0).then_some(b))
                        .collect()
                })
            })
            .map(|t| t.join().expect("allocating thread"))
            .collect();
        let before = rss_kib();
        let t = Instant::now();
        let released = crate::sys::trim_heap();
        let took = t.elapsed();
        let after = rss_kib();
        eprintln!("[trim] rss {before} -> {after} KiB in {took:?}, released: {released}");
        assert!(released, "the freed blocks' pages went back");
        drop(kept);
    }
}
