//! The log lines `/logs` streams: a tracing layer that hands each event
//! to a bounded broadcast channel. Sending never blocks (a slow reader
//! loses the oldest lines, which are counted), and nothing is formatted
//! while nobody reads.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use tokio::sync::broadcast;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// Lines buffered for each reader before the oldest are dropped.
const CAPACITY: usize = 256;

/// One line: its level and its text.
#[derive(Debug, Clone)]
pub struct LogLine {
    pub level: Level,
    pub text: Arc<str>,
}

/// The channel the layer feeds and `/logs` readers subscribe to.
#[derive(Debug, Clone)]
pub struct LogHub {
    tx: broadcast::Sender<LogLine>,
    dropped: Arc<AtomicU64>,
}

impl Default for LogHub {
    fn default() -> Self {
        LogHub {
            tx: broadcast::channel(CAPACITY).0,
            dropped: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl LogHub {
    pub fn subscribe(&self) -> broadcast::Receiver<LogLine> {
        self.tx.subscribe()
    }

    /// A reader fell behind and lost `n` lines.
    pub fn count_dropped(&self, n: u64) {
        self.dropped.fetch_add(n, Relaxed);
    }

    /// Lines lost by slow readers so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }

    /// The tracing layer feeding this hub.
    pub fn layer(&self) -> HubLayer {
        HubLayer { hub: self.clone() }
    }
}

/// See [`LogHub::layer`].
#[derive(Debug)]
pub struct HubLayer {
    hub: LogHub,
}

/// The message, then the other fields as ` name=value`.
#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }
}

impl<S: Subscriber> Layer<S> for HubLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if self.hub.tx.receiver_count() == 0 {
            return;
        }
        let meta = event.metadata();
        let mut t = Text::default();
        event.record(&mut t);
        let mut text = t.message;
        text.push_str(&t.fields);
        if !meta.target().starts_with("kerntun") {
            text = format!("[{}] {text}", meta.target());
        }
        // Fails only when every reader left meanwhile.
        let _ = self.hub.tx.send(LogLine {
            level: *meta.level(),
            text: text.into(),
        });
    }
}

/// Clash's level names: `debug`, `info`, `warning`, `error`, `silent`.
pub fn level_name(l: Level) -> &'static str {
    match l {
        Level::TRACE | Level::DEBUG => "debug",
        Level::INFO => "info",
        Level::WARN => "warning",
        Level::ERROR => "error",
    }
}

/// The most verbose level a `?level=` (or `log-level`) name lets through;
/// `None` for `silent`. Unknown names are an error.
pub fn parse_level(name: &str) -> Result<Option<Level>, String> {
    match name.to_ascii_lowercase().as_str() {
        "debug" => Ok(Some(Level::DEBUG)),
        "info" => Ok(Some(Level::INFO)),
        "warning" | "warn" => Ok(Some(Level::WARN)),
        "error" => Ok(Some(Level::ERROR)),
        "silent" => Ok(None),
        other => Err(format!(
            "level {other:?}: one of debug, info, warning, error, silent"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    /// A hub, and a reader subscribed before `log` ran with the hub's
    /// layer as the subscriber.
    fn logged(log: impl FnOnce()) -> (LogHub, broadcast::Receiver<LogLine>) {
        let hub = LogHub::default();
        let subscriber = tracing_subscriber::registry().with(hub.layer());
        let rx = hub.subscribe();
        tracing::subscriber::with_default(subscriber, log);
        (hub, rx)
    }

    #[test]
    fn events_reach_readers_and_slow_readers_lose_counted_lines() {
        let (hub, mut rx) = logged(|| {
            tracing::warn!(peer = 7, "hello {}", "there");
            for i in 0..CAPACITY + 10 {
                tracing::info!("line {i}");
            }
        });
        // The first line was overwritten: the reader lagged by 11.
        match rx.try_recv() {
            Err(broadcast::error::TryRecvError::Lagged(n)) => {
                assert_eq!(n, 11);
                hub.count_dropped(n);
            }
            other => panic!("expected a lag, got {other:?}"),
        }
        assert_eq!(hub.dropped(), 11);
        let next = rx.try_recv().expect("a line");
        assert_eq!(&*next.text, "line 10");
        assert_eq!(level_name(next.level), "info");
    }

    #[test]
    fn fields_are_written_after_the_message() {
        let (_hub, mut rx) = logged(|| tracing::warn!(peer = 7, "hello {}", "there"));
        let line = rx.try_recv().expect("a line");
        assert_eq!(level_name(line.level), "warning");
        assert!(line.text.ends_with("hello there peer=7"), "{}", line.text);
    }
}
