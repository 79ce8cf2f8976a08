//! Logging, only where the app asks for it.
//!
//! * [`init_logging`] installs the process-wide logger: the unified log
//!   (`os_log`, subsystem `kerntun`) on Apple platforms, logcat (tag
//!   `kerntun`) on Android, stderr elsewhere. Calling it again changes the
//!   level. Without it the engine logs nowhere: the library never installs a
//!   global logger on its own.
//! * An engine started with `EngineConfig.log_level` set logs instead to its
//!   own [`PlatformHooks::log`], on every thread of its runtime, so several
//!   engines in one process keep their logs apart.
//! * Every engine keeps its last [`RING_LINES`] lines at its level (the
//!   config's, else info) in memory, for the app to show after the fact
//!   (`Engine::recent_logs`); `Engine::set_log_level` changes the level
//!   of the ring and the hook while it runs.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

use crate::config::LogLevel;
use crate::error::KerntunError;
use crate::hooks::PlatformHooks;

/// The level of the process-wide logger, changeable after installation.
static GLOBAL_LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Info as u8);
/// Set once the process-wide logger is ours.
static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();

fn rank(l: &Level) -> u8 {
    // Same order as LogLevel: Error = 0 ... Trace = 4.
    match *l {
        Level::ERROR => 0,
        Level::WARN => 1,
        Level::INFO => 2,
        Level::DEBUG => 3,
        Level::TRACE => 4,
    }
}

fn level_of(l: &Level) -> LogLevel {
    match *l {
        Level::ERROR => LogLevel::Error,
        Level::WARN => LogLevel::Warn,
        Level::INFO => LogLevel::Info,
        Level::DEBUG => LogLevel::Debug,
        Level::TRACE => LogLevel::Trace,
    }
}

/// One log line: the message, then `key=value` for the other fields.
#[derive(Default)]
struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let rest = std::mem::take(&mut self.0);
            let _ = write!(self.0, "{value:?}");
            if !rest.is_empty() {
                self.0.push(' ');
                self.0.push_str(&rest);
            }
        } else {
            if !self.0.is_empty() {
                self.0.push(' ');
            }
            let _ = write!(self.0, "{}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.record_debug(field, &format_args!("{value}"));
        } else {
            if !self.0.is_empty() {
                self.0.push(' ');
            }
            let _ = write!(self.0, "{}={value}", field.name());
        }
    }
}

fn format_event(event: &Event<'_>) -> String {
    let mut line = Line::default();
    event.record(&mut line);
    line.0
}

/// Lines an engine's ring keeps: the newest, the oldest make room.
pub const RING_LINES: usize = 256;

/// Bytes of a line the ring keeps (longer ones are cut at a character
/// boundary), so the ring holds at most about 256 x 512 bytes = 128 KiB.
pub const RING_LINE_MAX: usize = 512;

/// One line of an engine's log, as [`crate::Engine::recent_logs`] returns it.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Serialize)]
pub struct LogRecord {
    /// Wall-clock time, milliseconds since the Unix epoch.
    pub unix_ms: u64,
    pub level: LogLevel,
    /// `target: message key=value ...`
    pub message: String,
}

/// An engine's last lines. Logging is never on the packet path (the
/// engine rate-limits its warnings), so a lock per line is cheap.
#[derive(Debug, Default)]
pub(crate) struct LogRing(Mutex<VecDeque<LogRecord>>);

impl LogRing {
    fn push(&self, level: LogLevel, target: &str, message: &str) {
        let mut text = String::with_capacity((target.len() + 2 + message.len()).min(RING_LINE_MAX));
        text.push_str(target);
        text.push_str(": ");
        text.push_str(message);
        if text.len() > RING_LINE_MAX {
            let mut cut = RING_LINE_MAX;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut lines = self.0.lock();
        if lines.len() == RING_LINES {
            lines.pop_front();
        }
        lines.push_back(LogRecord {
            unix_ms,
            level,
            message: text,
        });
    }

    /// The lines kept, oldest first.
    pub(crate) fn lines(&self) -> Vec<LogRecord> {
        self.0.lock().iter().cloned().collect()
    }
}

/// An engine's one layer: the ring and the hook at the engine's level,
/// and, for an engine without a hook, the process-wide logger at its own.
/// One layer with one filter (`enabled`) rather than a filter per sink:
/// tracing-subscriber keeps per-layer filter state in a thread-local that
/// the host's own subscriber, called from here, may use too.
struct EngineLayer {
    ring: Arc<LogRing>,
    hooks: Option<Arc<dyn PlatformHooks>>,
    /// `Some` for an engine without hooks: the host's dispatcher when the
    /// engine started, if it had one, else this library's logger.
    forward: Option<Option<tracing::Dispatch>>,
    level: Arc<AtomicU8>,
}

impl EngineLayer {
    fn at_level(&self, meta: &Metadata<'_>) -> bool {
        rank(meta.level()) <= self.level.load(Ordering::Relaxed)
    }

    fn forwards(&self, meta: &Metadata<'_>) -> bool {
        match &self.forward {
            None => false,
            Some(Some(global)) => global.enabled(meta),
            Some(None) => {
                matches!(INSTALLED.get(), Some(Ok(())))
                    && rank(meta.level()) <= GLOBAL_LEVEL.load(Ordering::Relaxed)
            }
        }
    }
}

impl<S: Subscriber> Layer<S> for EngineLayer {
    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        self.at_level(meta) || self.forwards(meta)
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        if self.at_level(meta) {
            let level = level_of(meta.level());
            let message = format_event(event);
            self.ring.push(level, meta.target(), &message);
            if let Some(hooks) = &self.hooks {
                // The hook is foreign code: whatever it does, the engine
                // goes on.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let _ = hooks.log(level, message);
                }));
            }
        }
        if self.forwards(meta) {
            match &self.forward {
                Some(Some(global)) => global.event(event),
                _ => platform_write(level_of(meta.level()), meta.target(), &format_event(event)),
            }
        }
    }
}

/// An engine's logging: its dispatcher (set on every thread of its
/// runtime), its ring, and the level the ring and the hook keep.
pub(crate) struct EngineLog {
    pub(crate) dispatch: tracing::Dispatch,
    pub(crate) ring: Arc<LogRing>,
    level: Arc<AtomicU8>,
}

impl EngineLog {
    /// `hooks`: the engine logs to them (and not to the process-wide
    /// logger) at `level`; without, it keeps its ring at `level` and
    /// passes every event on to the process-wide logger, whose own level
    /// decides: the dispatcher the host had installed when the engine
    /// started, else this library's own ([`init_logging`], also when it is
    /// installed later).
    pub(crate) fn new(hooks: Option<Arc<dyn PlatformHooks>>, level: LogLevel) -> Self {
        let ring = Arc::new(LogRing::default());
        let max = Arc::new(AtomicU8::new(level as u8));
        let forward = hooks.is_none().then(|| {
            tracing::dispatcher::get_default(|d| {
                (!d.is::<tracing::subscriber::NoSubscriber>()).then(|| d.clone())
            })
        });
        let layer = EngineLayer {
            ring: ring.clone(),
            hooks,
            forward,
            level: max.clone(),
        };
        Self {
            dispatch: tracing::Dispatch::new(tracing_subscriber::registry().with(layer)),
            ring,
            level: max,
        }
    }

    /// Change the level of the ring and the hook.
    pub(crate) fn set_level(&self, level: LogLevel) {
        self.level.store(level as u8, Ordering::Relaxed);
        // Callsites cache "never" answers: re-ask them.
        tracing::callsite::rebuild_interest_cache();
    }
}

/// The process-wide sink: os_log, logcat or stderr.
struct PlatformLayer;

impl<S: Subscriber> Layer<S> for PlatformLayer {
    fn enabled(&self, metadata: &Metadata<'_>, _: Context<'_, S>) -> bool {
        rank(metadata.level()) <= GLOBAL_LEVEL.load(Ordering::Relaxed)
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        let message = format_event(event);
        platform_write(level_of(meta.level()), meta.target(), &message);
    }
}

#[cfg(any(target_os = "ios", target_os = "macos"))]
fn platform_write(level: LogLevel, target: &str, message: &str) {
    crate::sys::os_log(level, &format!("{target}: {message}"));
}

#[cfg(target_os = "android")]
fn platform_write(level: LogLevel, target: &str, message: &str) {
    static LOGCAT: OnceLock<android_logger::AndroidLogger> = OnceLock::new();
    let logger = LOGCAT.get_or_init(|| {
        android_logger::AndroidLogger::new(
            android_logger::Config::default()
                .with_tag("kerntun")
                .with_max_level(log::LevelFilter::Trace),
        )
    });
    let level = match level {
        LogLevel::Error => log::Level::Error,
        LogLevel::Warn => log::Level::Warn,
        LogLevel::Info => log::Level::Info,
        LogLevel::Debug => log::Level::Debug,
        LogLevel::Trace => log::Level::Trace,
    };
    log::Log::log(
        logger,
        &log::Record::builder()
            .level(level)
            .target(target)
            .module_path(Some(target))
            .args(format_args!("{message}"))
            .build(),
    );
}

#[cfg(not(any(target_os = "ios", target_os = "macos", target_os = "android")))]
fn platform_write(level: LogLevel, target: &str, message: &str) {
    use std::io::Write as _;
    let tag = match level {
        LogLevel::Error => "ERROR",
        LogLevel::Warn => " WARN",
        LogLevel::Info => " INFO",
        LogLevel::Debug => "DEBUG",
        LogLevel::Trace => "TRACE",
    };
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let _ = writeln!(
        std::io::stderr().lock(),
        "{}.{:03} {tag} {target}: {message}",
        since.as_secs(),
        since.subsec_millis()
    );
}

/// Install the process-wide logger (os_log on Apple platforms, logcat on
/// Android, stderr elsewhere) at `level`, or change its level if it is
/// already installed. Fails with [`KerntunError::Logging`] when the host
/// already installed another global `tracing` subscriber.
#[uniffi::export]
pub fn init_logging(level: LogLevel) -> Result<(), KerntunError> {
    crate::error::guard(|| {
        GLOBAL_LEVEL.store(level as u8, Ordering::Relaxed);
        let installed = INSTALLED.get_or_init(|| {
            tracing::subscriber::set_global_default(
                tracing_subscriber::registry().with(PlatformLayer),
            )
            .map_err(|e| e.to_string())
        });
        // Levels are checked per event (`Layer::enabled`), but callsites
        // cache "never" answers: re-ask them after a change.
        tracing::callsite::rebuild_interest_cache();
        installed
            .clone()
            .map_err(|reason| KerntunError::Logging { reason })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::HookError;
    use parking_lot::Mutex;

    #[derive(Debug, Default)]
    struct Sink(Mutex<Vec<(LogLevel, String)>>);

    impl PlatformHooks for Sink {
        fn protect(&self, _fd: i32) -> Result<(), HookError> {
            Ok(())
        }
        fn log(&self, level: LogLevel, message: String) -> Result<(), HookError> {
            self.0.lock().push((level, message));
            Ok(())
        }
    }

    #[test]
    fn hook_and_ring_follow_the_engine_level_and_format_fields() {
        let sink = Arc::new(Sink::default());
        let log = EngineLog::new(Some(sink.clone()), LogLevel::Info);
        tracing::dispatcher::with_default(&log.dispatch, || {
            tracing::debug!("hidden");
            tracing::info!(port = 40000, "listener bound");
            tracing::warn!("careful");
        });
        let got = sink.0.lock().clone();
        assert_eq!(
            got,
            vec![
                (LogLevel::Info, "listener bound port=40000".to_string()),
                (LogLevel::Warn, "careful".to_string()),
            ]
        );
        let ring: Vec<_> = log
            .ring
            .lines()
            .into_iter()
            .map(|r| (r.level, r.message))
            .collect();
        let target = module_path!();
        assert_eq!(
            ring,
            vec![
                (
                    LogLevel::Info,
                    format!("{target}: listener bound port=40000")
                ),
                (LogLevel::Warn, format!("{target}: careful")),
            ]
        );
        // Down to debug at run time: both see it; up to error: neither
        // sees a warning.
        log.set_level(LogLevel::Debug);
        tracing::dispatcher::with_default(&log.dispatch, || tracing::debug!("now shown"));
        log.set_level(LogLevel::Error);
        tracing::dispatcher::with_default(&log.dispatch, || tracing::warn!("now hidden"));
        assert_eq!(sink.0.lock().len(), 3);
        assert_eq!(sink.0.lock()[2], (LogLevel::Debug, "now shown".to_string()));
        assert_eq!(log.ring.lines().len(), 3);
    }

    /// Collects what reaches it (the "host's" logger in the test below).
    struct Collect(Arc<Mutex<Vec<String>>>);

    impl<S: Subscriber> Layer<S> for Collect {
        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            self.0.lock().push(format_event(event));
        }
    }

    #[test]
    fn without_a_hook_the_host_logger_gets_every_event_at_its_own_level() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let host = tracing::Dispatch::new(tracing_subscriber::registry().with(
            Collect(seen.clone()).with_filter(tracing_subscriber::filter::LevelFilter::DEBUG),
        ));
        // The dispatcher in place when the engine starts is the host's.
        let log = tracing::dispatcher::with_default(&host, || EngineLog::new(None, LogLevel::Warn));
        tracing::dispatcher::with_default(&log.dispatch, || {
            tracing::trace!("below both");
            tracing::debug!("for the host");
            tracing::warn!("for both");
        });
        assert_eq!(*seen.lock(), ["for the host", "for both"]);
        let ring: Vec<_> = log.ring.lines().into_iter().map(|r| r.level).collect();
        assert_eq!(ring, [LogLevel::Warn]);
    }

    #[test]
    fn the_ring_keeps_the_newest_lines_each_cut_to_its_bound() {
        let log = EngineLog::new(None, LogLevel::Info);
        let long = "é".repeat(RING_LINE_MAX);
        tracing::dispatcher::with_default(&log.dispatch, || {
            for i in 0..RING_LINES + 10 {
                tracing::info!("line {i}");
            }
            tracing::warn!("{long}");
        });
        let lines = log.ring.lines();
        assert_eq!(lines.len(), RING_LINES);
        assert!(
            lines[0].message.ends_with("line 11"),
            "{}",
            lines[0].message
        );
        let last = &lines[RING_LINES - 1];
        assert_eq!(last.level, LogLevel::Warn);
        assert!(last.message.len() <= RING_LINE_MAX && last.message.len() > RING_LINE_MAX - 4);
        assert!(last.unix_ms > 1_600_000_000_000);
    }
}
