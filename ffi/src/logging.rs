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

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

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

/// Forwards an engine's events to its [`PlatformHooks::log`].
struct HookLayer {
    hooks: Arc<dyn PlatformHooks>,
    max: u8,
}

impl<S: Subscriber> Layer<S> for HookLayer {
    fn enabled(&self, metadata: &Metadata<'_>, _: Context<'_, S>) -> bool {
        rank(metadata.level()) <= self.max
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let level = level_of(event.metadata().level());
        let message = format_event(event);
        // The hook is foreign code: whatever it does, the engine goes on.
        let hooks = &self.hooks;
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = hooks.log(level, message);
        }));
    }
}

/// The dispatcher of an engine that logs to its hooks.
pub(crate) fn hook_dispatch(hooks: Arc<dyn PlatformHooks>, max: LogLevel) -> tracing::Dispatch {
    let subscriber = tracing_subscriber::registry().with(HookLayer {
        hooks,
        max: max as u8,
    });
    tracing::Dispatch::new(subscriber)
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
    fn hook_dispatch_filters_by_level_and_formats_fields() {
        let sink = Arc::new(Sink::default());
        let d = hook_dispatch(sink.clone(), LogLevel::Info);
        tracing::dispatcher::with_default(&d, || {
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
    }
}
