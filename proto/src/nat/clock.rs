//! Time sources for the NAT table.
//!
//! The table itself is sans-clock: every hot-path call takes `now`. The only
//! place it reads a clock is [`NatGuard`](super::NatGuard)'s `Drop`, which has
//! no caller to pass `now` in, so the table owns an `Arc<dyn Clock>`. The
//! real clock is the engine's to give (this crate reads none).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic time source.
pub trait Clock: Send + Sync + 'static {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// A clock that only moves when told to: deterministic tests of timeouts,
/// linger and guard drops (in the NAT table's tests and the engine's).
pub struct ManualClock {
    base: Instant,
    /// Nanoseconds since `base`. Atomic so a shared clock can be advanced by
    /// one thread while others read it (the stress test does).
    offset_ns: AtomicU64,
}

impl ManualClock {
    /// A clock standing at the current real instant (the one reading of the
    /// real clock in this crate: a test's starting point).
    #[allow(clippy::disallowed_methods)]
    pub fn new() -> Self {
        Self::starting_at(Instant::now())
    }

    /// A clock standing at `base`.
    pub fn starting_at(base: Instant) -> Self {
        Self {
            base,
            offset_ns: AtomicU64::new(0),
        }
    }

    /// Moves the clock forward by `by`. Saturates instead of overflowing:
    /// an advance that would leave `Instant`'s range (or 584 years of
    /// offset) is ignored, so `now()` can never panic.
    pub fn advance(&self, by: Duration) {
        let by_ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        // fetch_update only fails when the closure returns None: the clock
        // then stays where it is, which is the documented saturation.
        let _ = self
            .offset_ns
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                let next = cur.checked_add(by_ns)?;
                self.base.checked_add(Duration::from_nanos(next))?;
                Some(next)
            });
    }

    /// How far the clock has been advanced since it was created.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.offset_ns.load(Ordering::Acquire))
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        // `advance` only stores offsets for which this addition succeeds.
        self.base.checked_add(self.elapsed()).unwrap_or(self.base)
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManualClock")
            .field("elapsed", &self.elapsed())
            .finish()
    }
}
