//! State events for the app: one listener per engine hears that the engine
//! runs, failed (with the reason) or stopped, so the platform glue needs no
//! polling.
//!
//! The engine never waits for the app: an event is put in a bounded queue
//! ([`QUEUE`]) from whichever engine thread made it, and a thread of the
//! listener's own calls [`EngineListener::on_event`]. A listener that has
//! not taken [`QUEUE`] events yet loses the newer ones, counted
//! ([`crate::Engine::events_dropped`]); an engine says a few events in its
//! life, so only a listener stuck for good gets there.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, SyncSender, TrySendError};

/// A change in an engine's state.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Enum)]
pub enum EngineEvent {
    /// The engine runs: said once, when a listener is set on a running
    /// engine.
    Running,
    /// A fatal error ended the engine (`error()` says the same): a device
    /// or listener failure, or an engine task that panicked or ended. Said
    /// once. The app should stop the engine and tell the user.
    Failed { reason: String },
    /// `stop()` finished (also said at once to a listener set on a stopped
    /// engine).
    Stopped,
    /// `networkChanged` moved the engine to a new network: direct sockets
    /// now bind to `interface_name` (`null`: no network), and the
    /// connections the old network stranded are being reset. The engine
    /// keeps running.
    NetworkChanged { interface_name: Option<String> },
    /// `reload` replaced the rules, outbounds, groups, DNS and sniffing
    /// settings: new connections follow them. `closed` running connections
    /// were closed because their outbound is not in the new configuration.
    Reloaded { closed: u64 },
    /// New flows sent to the group `group` now take `member`: `select`
    /// chose it, or the group's probes moved it (url-test, fallback).
    GroupSelected { group: String, member: String },
    /// A probe of the group `group` found `member` healthy (its latency in
    /// `latency_ms`) or not, when that changed.
    OutboundHealth {
        group: String,
        member: String,
        healthy: bool,
        latency_ms: Option<u32>,
    },
}

impl From<kerntun::EngineEvent> for EngineEvent {
    fn from(e: kerntun::EngineEvent) -> Self {
        match e {
            kerntun::EngineEvent::Running => Self::Running,
            kerntun::EngineEvent::Failed { reason } => Self::Failed { reason },
            kerntun::EngineEvent::NetworkChanged { interface } => Self::NetworkChanged {
                interface_name: interface,
            },
            kerntun::EngineEvent::Reloaded { closed } => Self::Reloaded { closed },
            kerntun::EngineEvent::GroupSelected { group, member } => {
                Self::GroupSelected { group, member }
            }
            kerntun::EngineEvent::OutboundHealth {
                group,
                member,
                healthy,
                latency_ms,
            } => Self::OutboundHealth {
                group,
                member,
                healthy,
                latency_ms,
            },
            // `kerntun::EngineEvent` is non-exhaustive; Stopped and anything
            // newer end the engine as far as the app is concerned.
            _ => Self::Stopped,
        }
    }
}

/// Implemented by the app and passed to `Engine.setListener`. Called on a
/// thread of its own (one per listener), one event at a time, in order.
#[uniffi::export(with_foreign)]
pub trait EngineListener: Send + Sync {
    fn on_event(&self, event: EngineEvent);
}

/// Events a listener may have waiting before newer ones are dropped.
pub const QUEUE: usize = 32;

/// The core engine's sink for one listener: the queue to its thread.
pub(crate) struct Delivery {
    tx: SyncSender<EngineEvent>,
    dropped: Arc<AtomicU64>,
}

impl Delivery {
    /// Start `listener`'s thread; it ends once the delivery is dropped and
    /// the queue is empty. Fails only if no thread can be made.
    pub(crate) fn start(
        listener: Arc<dyn EngineListener>,
        dropped: Arc<AtomicU64>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel::<EngineEvent>(QUEUE);
        std::thread::Builder::new()
            .name("kerntun-events".into())
            .spawn(move || {
                for event in rx {
                    // Foreign code: a panic in the binding layer ends
                    // neither this thread nor the engine.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        listener.on_event(event)
                    }));
                }
            })?;
        Ok(Self { tx, dropped })
    }

    pub(crate) fn send(&self, event: EngineEvent) {
        match self.tx.try_send(event) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Relaxed);
            }
        }
    }
}

impl kerntun::EventSink for Delivery {
    fn event(&self, event: kerntun::EngineEvent) {
        self.send(event.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::{Condvar, Mutex};
    use std::time::Duration;

    /// A listener that blocks until released, then records.
    #[derive(Default)]
    struct Slow {
        heard: Mutex<Vec<EngineEvent>>,
        open: Mutex<bool>,
        cv: Condvar,
    }

    impl EngineListener for Slow {
        fn on_event(&self, event: EngineEvent) {
            let mut open = self.open.lock();
            while !*open {
                self.cv.wait(&mut open);
            }
            self.heard.lock().push(event);
        }
    }

    #[test]
    fn a_stuck_listener_costs_the_engine_nothing_and_drops_are_counted() {
        let slow = Arc::new(Slow::default());
        let dropped = Arc::new(AtomicU64::new(0));
        let d = Delivery::start(slow.clone(), dropped.clone()).expect("thread");
        let sent = QUEUE + 10;
        let t = std::time::Instant::now();
        for i in 0..sent {
            d.send(EngineEvent::Failed {
                reason: i.to_string(),
            });
        }
        assert!(t.elapsed() < Duration::from_secs(1), "sending never waits");
        *slow.open.lock() = true;
        slow.cv.notify_all();
        drop(d);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        // The thread holds one event while blocked, the queue QUEUE more.
        let delivered = sent as u64 - dropped.load(Relaxed);
        while (slow.heard.lock().len() as u64) < delivered && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let heard = slow.heard.lock().clone();
        assert_eq!(heard.len() as u64, delivered);
        assert!(
            (QUEUE..=QUEUE + 1).contains(&heard.len()),
            "{}",
            heard.len()
        );
        // In order, the oldest first.
        assert_eq!(heard[0], EngineEvent::Failed { reason: "0".into() });
        assert_eq!(dropped.load(Relaxed), (sent - heard.len()) as u64);
    }
}
