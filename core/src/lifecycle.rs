//! The engine's phase, watched by every loop and session, the fatal error
//! that ended it early, and the supervision of the engine's own tasks.
//!
//! Running, then draining (sessions reset their connections and accept
//! loops end while the driver still runs, so the kernel's RSTs are
//! translated and reach the apps at once), then stopped (everything ends).
//!
//! Every task the engine cannot run without (the TUN driver, the accept
//! loops, the smoltcp poller) and every hijacked DNS query runs inside
//! [`supervised`]: a panic, or the end of a loop while the engine is still
//! running, fails the engine with the reason ([`Lifecycle::fail`]), so
//! `Engine::is_running` turns false and `Engine::error` says why, instead
//! of a tunnel whose device nobody reads any more.
//!
//! The host may also be told: an [`EventSink`] set on the engine hears
//! each change of state ([`EngineEvent`]) once, from whichever thread made
//! it, and must return at once (the FFI queues them for a thread of its
//! own).
//!
//! Apart from the phase, the host can put a running engine to sleep
//! (`Engine::sleep`, iOS's `sleep(completionHandler:)`) and wake it: every
//! periodic tick of the engine is a [`Ticker`], which drops its timer while
//! the engine sleeps and ticks once at once on wake, so expiry catches up.
//! Connections, and the timers that belong to them (their idle timeouts,
//! smoltcp's retransmissions), are not touched.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::Poll;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::{Interval, MissedTickBehavior};

use crate::network::NetworkWatch;

/// Where the engine is in its life. Ordered: a phase only ever moves forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Phase {
    Running,
    Draining,
    Stopped,
}

/// A change in an engine's state, as its host hears it ([`EventSink`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineEvent {
    /// The engine runs (said once, when a sink is set on a running engine).
    Running,
    /// A fatal error ended the engine's loops; `Engine::error` says the
    /// same. Said once, for the first failure.
    Failed { reason: String },
    /// `Engine::stop` finished (after `Failed`, if the engine had failed).
    Stopped,
    /// The host reported a new network (`Engine::network_changed`): new
    /// direct sockets bind to `interface` (`None`: no network), and the
    /// connections the old one stranded are being reset.
    NetworkChanged { interface: Option<String> },
    /// `Engine::reload` replaced the rules, outbounds, groups, DNS and
    /// sniffing settings: new flows follow them; `closed` running
    /// connections were closed because their outbound is gone.
    Reloaded { closed: u64 },
    /// New flows sent to `group` now take `member`: the host selected it
    /// (`Engine::select`), or the group's probes moved it (`url-test`,
    /// `fallback`).
    GroupSelected { group: String, member: String },
    /// A probe of `group` found `member` healthy (with its latency) or not,
    /// when that changed (`core/src/outbound/group.rs`).
    OutboundHealth {
        group: String,
        member: String,
        healthy: bool,
        latency_ms: Option<u32>,
    },
}

/// Where an engine tells its host of [`EngineEvent`]s. Called on the
/// engine's own threads (or the thread that calls `stop`), never on the
/// packet path; it must not block.
pub trait EventSink: Send + Sync {
    fn event(&self, event: EngineEvent);
}

/// The phase and the first fatal error, shared by everything the engine runs.
pub(crate) struct Lifecycle {
    phase: watch::Sender<Phase>,
    fatal: Mutex<Option<String>>,
    /// The host's sink, if it set one. Taken for each event, which happen a
    /// few times in an engine's life.
    sink: Mutex<Option<Arc<dyn EventSink>>>,
    /// The network the host reported last (`network.rs`), heard by every
    /// relay and the UDP flow table.
    network: NetworkWatch,
    /// Whether the host put the engine to sleep (`Engine::sleep`); every
    /// [`Ticker`] watches it.
    asleep: watch::Sender<bool>,
    /// Ticks of every [`Ticker`] since start (`timer_ticks` in the stats).
    ticks: AtomicU64,
    /// The test-only fault hook (`Engine::inject_fault`).
    #[cfg(any(test, feature = "fault-injection"))]
    fault: watch::Sender<Option<(EngineTask, Fault)>>,
}

impl std::fmt::Debug for Lifecycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lifecycle")
            .field("phase", &self.phase())
            .field("fatal", &self.fatal())
            .field("sink", &self.sink.lock().is_some())
            .finish_non_exhaustive()
    }
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            phase: watch::Sender::new(Phase::Running),
            fatal: Mutex::new(None),
            sink: Mutex::new(None),
            network: NetworkWatch::default(),
            asleep: watch::Sender::new(false),
            ticks: AtomicU64::new(0),
            #[cfg(any(test, feature = "fault-injection"))]
            fault: watch::Sender::new(None),
        }
    }
}

/// A task of the engine, as failure reasons name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineTask {
    /// The TUN read loop.
    Driver,
    /// A system-stack accept loop (one per address family).
    AcceptLoop,
    /// The smoltcp poller.
    Poller,
    /// A hijacked DNS query being answered (one task per query).
    Dns,
    /// The heap trim after load (`housekeeping.rs`; Linux with glibc, the
    /// only platform that runs it).
    #[cfg_attr(not(all(target_os = "linux", target_env = "gnu")), allow(dead_code))]
    Housekeeping,
}

impl EngineTask {
    /// How failure reasons name the task.
    pub fn name(self) -> &'static str {
        match self {
            EngineTask::Driver => "TUN driver",
            EngineTask::AcceptLoop => "accept loop",
            EngineTask::Poller => "smoltcp poller",
            EngineTask::Dns => "DNS query task",
            EngineTask::Housekeeping => "housekeeping",
        }
    }

    /// Whether the task runs for the engine's whole life, so that its end
    /// while the engine is still running is a failure. A DNS query task
    /// ends when its answer is written.
    fn runs_until_stop(self) -> bool {
        !matches!(self, EngineTask::Dns)
    }

    /// Whether a panic ends only this task: one query, whose bytes came
    /// from the app (the DNS decoder meets them), not the engine. Its
    /// caller counts it ([`Panicked`]).
    fn isolated(self) -> bool {
        matches!(self, EngineTask::Dns)
    }
}

/// A supervised task panicked; its message. For an isolated task (a DNS
/// query) the engine keeps running and the caller counts it.
#[derive(Debug)]
pub(crate) struct Panicked(pub(crate) String);

/// What the test-only fault hook does to a task.
#[cfg(any(test, feature = "fault-injection"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The task panics.
    Panic,
    /// The task returns as if its loop had ended.
    End,
}

/// Run `task`'s future under supervision: a panic inside it, or its end
/// while the engine is still running (for a task that runs until stop),
/// fails the engine with the reason; a panic of an isolated task (a DNS
/// query) ends only that task and comes back as [`Panicked`]. The cost is
/// a landing pad around each poll of the task, not of each packet: no
/// allocation, no lock, no clock.
pub(crate) async fn supervised<F>(
    life: Arc<Lifecycle>,
    task: EngineTask,
    fut: F,
) -> Result<(), Panicked>
where
    F: Future<Output = ()>,
{
    #[cfg(any(test, feature = "fault-injection"))]
    let fut = life.clone().faulty(task, fut);
    let mut fut = std::pin::pin!(fut);
    // `AssertUnwindSafe`: after a panic the future is dropped, never polled
    // again, so no state it left half-changed is observed; what it shares
    // with the rest of the engine sits behind parking_lot locks (which do
    // not poison) and atomics.
    let panicked = std::future::poll_fn(|cx| {
        match std::panic::catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(())) => Poll::Ready(None),
            Err(payload) => Poll::Ready(Some(payload)),
        }
    })
    .await;
    match panicked {
        Some(payload) => {
            let why = panic_message(payload.as_ref());
            if !task.isolated() {
                life.fail(format!("{} panicked: {why}", task.name()));
            }
            return Err(Panicked(why));
        }
        None if task.runs_until_stop() && life.phase() == Phase::Running => {
            life.fail(format!("{} ended unexpectedly", task.name()))
        }
        None => {}
    }
    Ok(())
}

/// The message of a panic payload (`panic!` with a literal or a format).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

impl Lifecycle {
    /// The current phase.
    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// Move forward to `to` (never back). True if the phase changed.
    pub fn advance(&self, to: Phase) -> bool {
        self.phase.send_if_modified(|p| {
            let was = *p;
            *p = was.max(to);
            was != *p
        })
    }

    /// Resolves once the phase reaches `at` (at once if it already has).
    pub async fn reached(&self, at: Phase) {
        let mut rx = self.phase.subscribe();
        // The sender lives as long as `self`: the wait cannot fail.
        let _ = rx.wait_for(|p| *p >= at).await;
    }

    /// A receiver to wait on in a loop (`wait_for(|p| *p >= ...)`), without
    /// subscribing again on every turn.
    pub fn subscribe(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }

    /// Record a fatal error (the first one wins, and is the one the sink
    /// hears) and stop every loop.
    pub fn fail(&self, what: String) {
        tracing::error!("kerntun stopping: {what}");
        let first = {
            let mut fatal = self.fatal.lock();
            let first = fatal.is_none();
            fatal.get_or_insert_with(|| what.clone());
            first
        };
        self.advance(Phase::Stopped);
        if first {
            self.emit(EngineEvent::Failed { reason: what });
        }
    }

    /// Set (or, with `None`, remove) the host's sink. A new sink hears the
    /// state the engine is in now: `Running`, or `Failed` with the reason
    /// (the engine's `stop` says `Stopped` later).
    pub fn set_sink(&self, sink: Option<Arc<dyn EventSink>>) {
        let now = match self.fatal() {
            Some(reason) => EngineEvent::Failed { reason },
            None => EngineEvent::Running,
        };
        if let Some(s) = &sink {
            s.event(now);
        }
        *self.sink.lock() = sink;
    }

    /// Tell the sink, if there is one (called outside the sink's lock, so
    /// a sink that calls back into the engine cannot deadlock).
    pub fn emit(&self, event: EngineEvent) {
        let sink = self.sink.lock().clone();
        if let Some(s) = sink {
            s.event(event);
        }
    }

    /// The network the host reported last, and where its changes are heard.
    pub fn network(&self) -> &NetworkWatch {
        &self.network
    }

    /// The fatal error, if one ended the engine.
    pub fn fatal(&self) -> Option<String> {
        self.fatal.lock().clone()
    }

    /// Put the engine to sleep (`true`) or wake it: every [`Ticker`]
    /// drops its timer, or ticks at once. True if the state changed.
    pub fn set_asleep(&self, asleep: bool) -> bool {
        self.asleep
            .send_if_modified(|a| std::mem::replace(a, asleep) != asleep)
    }

    /// Ticks of every [`Ticker`] since start.
    pub fn timer_ticks(&self) -> u64 {
        self.ticks.load(Relaxed)
    }

    /// Test-only fault hook: make `task` fail as `fault` says. A task that
    /// runs until stop fails at once; the next DNS query task fails when
    /// it starts (the fault stays armed until another is injected).
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn inject(&self, task: EngineTask, fault: Fault) {
        self.fault.send_replace(Some((task, fault)));
    }

    /// `fut`, unless a fault for `task` is injected first.
    #[cfg(any(test, feature = "fault-injection"))]
    async fn faulty<F: Future<Output = ()>>(self: Arc<Self>, task: EngineTask, fut: F) {
        let mut rx = self.fault.subscribe();
        let fired = async move {
            let fault = rx
                .wait_for(|f| matches!(f, Some((t, _)) if *t == task))
                .await
                .ok()
                .and_then(|f| (*f).map(|(_, fault)| fault));
            match fault {
                Some(fault) => fault,
                // The sender lives in `self`: cannot happen.
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            fault = fired => if fault == Fault::Panic {
                panic!("fault injected into the {}", task.name());
            },
            () = fut => {}
        }
    }
}

/// A periodic tick that keeps no timer while the engine sleeps
/// ([`Lifecycle::set_asleep`]): its timer is dropped at once (not left to
/// fire), and on wake it ticks at once, then every `period`. Each tick is
/// counted ([`Lifecycle::timer_ticks`]). Like `tokio::time::interval`, the
/// first tick is at once; a late tick delays the next ones.
pub(crate) struct Ticker {
    period: Duration,
    /// `None` while asleep, and until the first tick is asked for.
    interval: Option<Interval>,
    asleep: watch::Receiver<bool>,
    life: Arc<Lifecycle>,
}

impl Ticker {
    pub fn new(period: Duration, life: &Arc<Lifecycle>) -> Ticker {
        Ticker {
            period,
            interval: None,
            asleep: life.asleep.subscribe(),
            life: life.clone(),
        }
    }

    /// Resolves at the next tick; while `armed` is false it only follows
    /// sleep and wake (a caller with nothing to expire keeps its place in
    /// the period). Cancel-safe: a caller may drop it in a `select!` and
    /// call again without losing a tick or the wake-up one.
    pub async fn tick(&mut self, armed: bool) {
        loop {
            if *self.asleep.borrow_and_update() {
                self.interval = None;
                if self.asleep.wait_for(|a| !*a).await.is_err() {
                    // The sender lives as long as the lifecycle.
                    return std::future::pending().await;
                }
            }
            if !armed {
                if self.asleep.changed().await.is_err() {
                    return std::future::pending().await;
                }
                continue;
            }
            let period = self.period;
            let interval = self.interval.get_or_insert_with(|| {
                let mut i = tokio::time::interval(period);
                i.set_missed_tick_behavior(MissedTickBehavior::Delay);
                i
            });
            tokio::select! {
                _ = interval.tick() => {
                    self.life.ticks.fetch_add(1, Relaxed);
                    return;
                }
                r = self.asleep.changed() => if r.is_err() {
                    return std::future::pending().await;
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::runtime;

    #[test]
    fn phases_only_move_forward_and_the_first_failure_wins() {
        let l = Lifecycle::default();
        assert_eq!(l.phase(), Phase::Running);
        assert!(l.advance(Phase::Draining));
        assert!(!l.advance(Phase::Running));
        assert_eq!(l.phase(), Phase::Draining);
        l.fail("first".into());
        l.fail("second".into());
        assert_eq!(l.phase(), Phase::Stopped);
        assert_eq!(l.fatal().as_deref(), Some("first"));
    }

    /// A ticker ticks every period while awake, drops its timer and does
    /// not tick while asleep, ticks at once on wake; unarmed it never
    /// ticks but still follows sleep. Sleep and wake twice change nothing.
    #[test]
    fn a_ticker_keeps_no_timer_while_asleep_and_ticks_at_once_on_wake() {
        use std::time::Instant;
        const PERIOD: Duration = Duration::from_millis(20);
        let life = Arc::new(Lifecycle::default());
        runtime().block_on(async {
            let mut t = Ticker::new(PERIOD, &life);
            // The first tick at once, then one a period.
            let t0 = Instant::now();
            for _ in 0..4 {
                t.tick(true).await;
            }
            assert!(t0.elapsed() >= PERIOD * 3, "{:?}", t0.elapsed());
            assert_eq!(life.timer_ticks(), 4);
            assert!(life.set_asleep(true));
            assert!(!life.set_asleep(true), "asleep already");
            // Asleep: nothing for ten periods, and no timer held.
            let slept = tokio::time::timeout(PERIOD * 10, t.tick(true)).await;
            assert!(slept.is_err(), "no tick while asleep");
            assert!(t.interval.is_none(), "the timer was dropped");
            assert_eq!(life.timer_ticks(), 4);
            // Woken: a tick at once, well before a period.
            assert!(life.set_asleep(false));
            assert!(!life.set_asleep(false), "awake already");
            let t1 = Instant::now();
            t.tick(true).await;
            assert!(t1.elapsed() < PERIOD / 2, "{:?}", t1.elapsed());
            assert_eq!(life.timer_ticks(), 5);
            // Unarmed: no tick, and sleep still drops the timer.
            let idle = tokio::time::timeout(PERIOD * 3, t.tick(false)).await;
            assert!(idle.is_err());
            assert!(t.interval.is_some(), "kept while awake");
            life.set_asleep(true);
            let idle = tokio::time::timeout(PERIOD, t.tick(false)).await;
            assert!(idle.is_err());
            assert!(t.interval.is_none(), "dropped on sleep, armed or not");
            assert_eq!(life.timer_ticks(), 5);
        });
    }

    /// Spawn `fut` as `task` under supervision and wait for it to end.
    fn run_supervised(
        life: &Arc<Lifecycle>,
        task: EngineTask,
        fut: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), Panicked> {
        runtime().block_on(async {
            let h = tokio::spawn(supervised(life.clone(), task, fut));
            tokio::time::timeout(std::time::Duration::from_secs(5), h)
                .await
                .expect("the supervised task ends")
                .expect("the supervisor itself never panics")
        })
    }

    #[test]
    fn a_panicking_task_fails_the_engine_with_its_name_and_message() {
        for task in [
            EngineTask::Driver,
            EngineTask::AcceptLoop,
            EngineTask::Poller,
        ] {
            let life = Arc::new(Lifecycle::default());
            let panicked = run_supervised(&life, task, async { panic!("boom") });
            assert_eq!(life.phase(), Phase::Stopped, "{task:?}");
            let why = life.fatal().expect("a reason");
            assert!(why.contains(task.name()) && why.contains("boom"), "{why}");
            assert!(panicked.is_err());
        }
    }

    #[test]
    fn a_panicking_dns_query_ends_only_itself() {
        let life = Arc::new(Lifecycle::default());
        let panicked = run_supervised(&life, EngineTask::Dns, async { panic!("boom") });
        assert_eq!((life.phase(), life.fatal()), (Phase::Running, None));
        assert_eq!(panicked.expect_err("panicked").0, "boom");
    }

    #[test]
    fn a_loop_ending_while_running_fails_the_engine_a_dns_query_does_not() {
        let life = Arc::new(Lifecycle::default());
        run_supervised(&life, EngineTask::Dns, async {}).expect("no panic");
        assert_eq!((life.phase(), life.fatal()), (Phase::Running, None));
        run_supervised(&life, EngineTask::AcceptLoop, async {}).expect("no panic");
        assert_eq!(life.phase(), Phase::Stopped);
        assert_eq!(
            life.fatal().as_deref(),
            Some("accept loop ended unexpectedly")
        );
    }

    #[test]
    fn loops_that_end_because_the_engine_stops_are_no_failure() {
        let life = Arc::new(Lifecycle::default());
        life.advance(Phase::Draining);
        run_supervised(&life, EngineTask::AcceptLoop, async {}).expect("no panic");
        assert_eq!((life.phase(), life.fatal()), (Phase::Draining, None));
    }

    #[test]
    fn injected_faults_reach_the_task_they_name() {
        let life = Arc::new(Lifecycle::default());
        let l = life.clone();
        runtime().block_on(async move {
            let forever = || std::future::pending::<()>();
            let driver = tokio::spawn(supervised(l.clone(), EngineTask::Driver, forever()));
            let poller = tokio::spawn(supervised(l.clone(), EngineTask::Poller, forever()));
            tokio::task::yield_now().await;
            l.inject(EngineTask::Driver, Fault::End);
            tokio::time::timeout(std::time::Duration::from_secs(5), driver)
                .await
                .expect("the driver ends")
                .expect("no panic escapes")
                .expect("ended, no panic");
            assert!(!poller.is_finished(), "other tasks are left alone");
            poller.abort();
        });
        assert_eq!(
            life.fatal().as_deref(),
            Some("TUN driver ended unexpectedly")
        );
        // A DNS fault stays armed for the next query task, which panics
        // alone.
        let life = Arc::new(Lifecycle::default());
        life.inject(EngineTask::Dns, Fault::Panic);
        let why = run_supervised(&life, EngineTask::Dns, std::future::pending())
            .expect_err("panicked")
            .0;
        assert!(why.starts_with("fault injected"), "{why}");
        assert_eq!(life.fatal(), None);
    }

    #[derive(Default)]
    struct Heard(Mutex<Vec<EngineEvent>>);

    impl EventSink for Heard {
        fn event(&self, event: EngineEvent) {
            self.0.lock().push(event);
        }
    }

    #[test]
    fn a_sink_hears_the_current_state_then_the_first_failure_once() {
        let l = Lifecycle::default();
        let heard = Arc::new(Heard::default());
        l.set_sink(Some(heard.clone()));
        l.fail("first".into());
        l.fail("second".into());
        l.emit(EngineEvent::Stopped);
        assert_eq!(
            *heard.0.lock(),
            [
                EngineEvent::Running,
                EngineEvent::Failed {
                    reason: "first".into()
                },
                EngineEvent::Stopped
            ]
        );
        // A sink set after the failure hears it at once; a removed one
        // hears nothing more.
        let late = Arc::new(Heard::default());
        l.set_sink(Some(late.clone()));
        l.set_sink(None);
        l.emit(EngineEvent::Stopped);
        assert_eq!(
            *late.0.lock(),
            [EngineEvent::Failed {
                reason: "first".into()
            }]
        );
        assert_eq!(heard.0.lock().len(), 3);
    }

    #[test]
    fn reached_resolves_for_a_phase_already_passed() {
        let rt = runtime();
        let l = Lifecycle::default();
        l.advance(Phase::Stopped);
        rt.block_on(async {
            tokio::time::timeout(
                std::time::Duration::from_secs(1),
                l.reached(Phase::Draining),
            )
            .await
            .expect("resolves at once");
        });
    }
}
