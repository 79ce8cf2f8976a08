//! [`NatGuard`]: a session's hold on its NAT entry.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Accepted, NatTable};

pub struct NatGuard {
    pub(super) table: Arc<NatTable>,
    pub(super) accepted: Accepted,
}

impl NatGuard {
    /// The accept this guard covers.
    pub fn accepted(&self) -> &Accepted {
        &self.accepted
    }

    /// The guarded NAT port.
    pub fn port(&self) -> u16 {
        self.accepted.port
    }

    /// The generation the guard will mark with.
    pub fn generation(&self) -> u64 {
        self.accepted.generation
    }

    /// How long the guarded entry may still go without a packet
    /// ([`NatTable::idle_left`]); `None` once it is gone or replaced.
    pub fn idle_left(&self, now: Instant) -> Option<Duration> {
        self.table
            .idle_left(self.accepted.port, self.accepted.generation, now)
    }
}

impl Drop for NatGuard {
    fn drop(&mut self) {
        // No panic path inside: parking_lot locks do not poison, so this is
        // safe during an unwind (a second panic would abort).
        let now = self.table.clock.now();
        self.table
            .mark_closing(self.accepted.port, self.accepted.generation, now);
    }
}

impl fmt::Debug for NatGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatGuard")
            .field("accepted", &self.accepted)
            .finish_non_exhaustive()
    }
}
