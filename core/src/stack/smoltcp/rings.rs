//! When the pages of a socket's rings are handed back to the system
//! (`sys::pages::discard`), so that a quiet socket holds little more than
//! its state: the send ring once the session has been quiet for
//! [`RING_QUIET`] and the app acknowledged all of it, the receive ring
//! through the reads that consume it, at most every [`RX_GIVE_BACK_GAP`]
//! (docs/architecture.md, "The smoltcp stack", "Ring memory").

use std::time::{Duration, Instant};

use smoltcp::socket::tcp;

use super::sockets::{Id, Inner};
use crate::sys::pages;

/// A socket whose session queued nothing for the app for this long, and
/// whose transmit ring is empty (all acknowledged), gives the ring's pages
/// back (`sys::pages::discard`); they fill again, zeroed, when data comes.
pub(super) const RING_QUIET: Duration = Duration::from_secs(1);

/// The least time between two reads of one socket that hand back the pages
/// they consumed. A read that hands back pages costs a system call, and
/// the data after it a page fault and a zeroed page for each page it fills
/// again: in a bulk upload every page of the ring once per lap, which cost
/// the smoltcp stack 35-50 % of its upload throughput in the netns
/// benchmark (docs/notes.md, "smoltcp: receive pages handed back at most
/// every 100 ms"). Reads further apart than this hand back what they read.
pub(super) const RX_GIVE_BACK_GAP: Duration = Duration::from_millis(100);

impl Inner {
    /// The session of socket `id` queued data on its transmit ring at
    /// `now`: file it for [`Inner::give_back_quiet`] unless it is filed.
    pub(super) fn filled(&mut self, id: Id, now: Instant) {
        if let Some(slot) = self.slots.get_mut(id as usize).and_then(Option::as_mut)
            && slot.tx_at.replace(now).is_none()
        {
            self.filled.push_back((id, now));
        }
    }

    /// Whether a read of socket `id` at `now` hands back the pages it
    /// consumes: none did within [`RX_GIVE_BACK_GAP`].
    pub(super) fn rx_give_back_due(&self, id: Id, now: Instant) -> bool {
        self.slots
            .get(id as usize)
            .and_then(Option::as_ref)
            .is_some_and(|slot| {
                slot.rx_given
                    .is_none_or(|at| now.saturating_duration_since(at) >= RX_GIVE_BACK_GAP)
            })
    }

    /// A read of socket `id` handed back pages at `now`.
    pub(super) fn rx_given(&mut self, id: Id, now: Instant) {
        if let Some(slot) = self.slots.get_mut(id as usize).and_then(Option::as_mut) {
            slot.rx_given = Some(now);
        }
    }

    /// Give back the transmit rings of the sockets quiet for
    /// [`RING_QUIET`] whose rings are empty; the earliest time another
    /// may be due. smoltcp lends an empty ring whole through
    /// `tcp::Socket::send` (it rewinds an empty ring to its start), so the
    /// pages are dropped through that borrow.
    pub(super) fn give_back_quiet(&mut self, now: Instant) -> Option<Instant> {
        while let Some(&(id, at)) = self.filled.front() {
            if now.saturating_duration_since(at) < RING_QUIET {
                return Some(at + RING_QUIET);
            }
            self.filled.pop_front();
            let Some(slot) = self.slots.get_mut(id as usize).and_then(Option::as_mut) else {
                continue;
            };
            let Some(last) = slot.tx_at else {
                continue;
            };
            if now.saturating_duration_since(last) < RING_QUIET {
                self.filled.push_back((id, last));
                continue;
            }
            let s = slot.set.get_mut::<tcp::Socket>(slot.h);
            if s.send_queue() > 0 {
                // Not acknowledged yet: look again after another while.
                self.filled.push_back((id, now));
                continue;
            }
            slot.tx_at = None;
            // A socket that may not send any more is closing: its rings go
            // with it.
            let _ = s.send(|buf| (0, pages::discard(buf)));
        }
        None
    }
}
