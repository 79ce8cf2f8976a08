//! The engine's phase, watched by every loop and session, and the fatal
//! error that ended it early.
//!
//! Running, then draining (sessions reset their connections and accept
//! loops end while the driver still runs, so the kernel's RSTs are
//! translated and reach the apps at once), then stopped (everything ends).

use parking_lot::Mutex;
use tokio::sync::watch;

/// Where the engine is in its life. Ordered: a phase only ever moves forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Phase {
    Running,
    Draining,
    Stopped,
}

/// The phase and the first fatal error, shared by everything the engine runs.
#[derive(Debug)]
pub(crate) struct Lifecycle {
    phase: watch::Sender<Phase>,
    fatal: Mutex<Option<String>>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            phase: watch::Sender::new(Phase::Running),
            fatal: Mutex::new(None),
        }
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

    /// Record a fatal error (the first one wins) and stop every loop.
    pub fn fail(&self, what: String) {
        tracing::error!("kerntun stopping: {what}");
        self.fatal.lock().get_or_insert(what);
        self.advance(Phase::Stopped);
    }

    /// The fatal error, if one ended the engine.
    pub fn fatal(&self) -> Option<String> {
        self.fatal.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn reached_resolves_for_a_phase_already_passed() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
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
