//! Rings on loan. A socket starts on two small rings ([`Loans::small`]
//! bytes each, charged with its session: `budget::SMOLTCP_SMALL_RING`) and
//! borrows a pair of full rings (`budget.smoltcp_buffer` each) from the
//! engine's pool (`Memory::smoltcp_rings`) once data fills one of its
//! small rings past half. It hands the pair back once its session moved no
//! data for [`RING_QUIET`] and both rings are empty, and goes on with its
//! small rings. While every pair is lent, a socket that asks stays on its
//! small rings: it still moves data, a small window at a time, and asks
//! again the next time a ring fills (the refusal is counted:
//! `smoltcp_ring_loans_refused`). Under memory pressure the pool lends a
//! half or a quarter of its pairs, as every budget does for new charges;
//! loans already made stay until they come back.
//!
//! A pair handed back keeps no pages (`sys::pages::discard`; the pool owns
//! it then, smoltcp holds no borrow of it), so what is resident beyond the
//! sockets' state and small rings is what the sockets on loan hold, at
//! most the pool (docs/architecture.md, "The smoltcp stack", "Rings on
//! loan").

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use managed::ManagedSlice;
use smoltcp::socket::tcp;

use super::sockets::{Id, Inner};
use crate::budget::{Pressure, tiers};
use crate::sys::pages;

/// A socket on loan whose session moved no data for this long, with both
/// rings empty, hands its full rings back.
pub(super) const RING_QUIET: Duration = Duration::from_secs(1);

/// The pool of full ring pairs, and the sockets holding one.
#[derive(Debug)]
pub(super) struct Loans {
    /// Bytes of each small ring.
    pub(super) small: usize,
    /// Bytes of each full ring.
    full: usize,
    /// Pairs the pool may lend at once, at each pressure tier.
    max: [usize; 3],
    /// The host's memory pressure (`None`: always normal).
    pressure: Option<Arc<Pressure>>,
    /// Pairs lent now.
    pub(super) lent: usize,
    /// Pairs handed back, their pages discarded (at most `max - lent`).
    spare: Vec<Pair>,
    /// Sockets on loan with when they were filed, oldest first: the poller
    /// takes back the pairs of those quiet for [`RING_QUIET`].
    pub(super) quiet: VecDeque<(Id, Instant)>,
    /// Loans asked for while every pair was lent, not yet published.
    pub(super) refused: u64,
}

/// A socket's loan: when its session last moved data, and its small rings
/// (receive, send), kept for its return.
#[derive(Debug)]
pub(super) struct Loan {
    pub(super) at: Instant,
    small: Pair,
}

impl Loans {
    /// `max` pairs of `full`-byte rings (at normal pressure) for sockets
    /// that start on `small`-byte rings. With `small >= full` there is
    /// nothing to lend: sockets start on full rings.
    pub(super) fn new(
        small: usize,
        full: usize,
        max: usize,
        pressure: Option<Arc<Pressure>>,
    ) -> Self {
        Loans {
            small: small.min(full),
            full,
            max: if small >= full || max == 0 {
                [0; 3]
            } else {
                tiers(max)
            },
            pressure,
            lent: 0,
            spare: Vec::new(),
            quiet: VecDeque::new(),
            refused: 0,
        }
    }

    /// A full pair for a loan: a spare one, or a new one while fewer than
    /// `max` are lent. The rings of a new pair are handed back page by
    /// page at once: `calloc` clears a chunk it reuses (in a runtime
    /// thread's arena, every chunk), which would make both resident in
    /// full before data fills them.
    fn take(&mut self, now: Instant) -> Option<Pair> {
        let tier = self.pressure.as_ref().map_or(0, |p| p.level(now) as usize);
        if self.lent >= self.max[tier] {
            self.refused += 1;
            return None;
        }
        self.lent += 1;
        let full = self.full;
        Some(self.spare.pop().unwrap_or_else(|| {
            let ring = || {
                let mut v = vec![0u8; full];
                pages::discard(&mut v);
                v
            };
            (ring(), ring())
        }))
    }

    /// Whether there is anything to lend at all.
    pub(super) fn lends(&self) -> bool {
        self.max[0] > 0
    }

    /// A pair back from a loan: its pages are handed back, the pair kept
    /// for the next loan (at most as many as the pool lends at normal
    /// pressure, less those lent).
    fn put(&mut self, mut pair: Pair) {
        self.lent = self.lent.saturating_sub(1);
        if pair.0.len() == self.full && pair.1.len() == self.full {
            pages::discard(&mut pair.0);
            pages::discard(&mut pair.1);
            if self.spare.len() + self.lent < self.max[0] {
                self.spare.push(pair);
            }
        }
    }
}

/// The vector a ring was built on (every ring here is built on one).
fn into_vec(ring: tcp::SocketBuffer<'static>) -> Vec<u8> {
    match ring.into_storage() {
        ManagedSlice::Owned(v) => v,
        ManagedSlice::Borrowed(_) => Vec::new(),
    }
}

/// A ring pair (receive, send) as vectors.
type Pair = (Vec<u8>, Vec<u8>);

/// Move `s` onto the rings `pair`: its old rings, or (refused: they
/// cannot hold its data) `pair` back.
fn swap(s: &mut tcp::Socket<'static>, pair: Pair) -> Result<Pair, Pair> {
    let ring = tcp::SocketBuffer::new;
    match s.replace_buffers(ring(pair.0), ring(pair.1)) {
        Ok((rx, tx)) => Ok((into_vec(rx), into_vec(tx))),
        Err((rx, tx)) => Err((into_vec(rx), into_vec(tx))),
    }
}

impl Inner {
    /// Whether socket `id` is on small rings and data fills one past half:
    /// the receive ring from the app, or the send ring with `sending` more
    /// bytes. Cheap: for every packet of a flow.
    pub(super) fn wants_loan(&self, id: Id, sending: usize) -> bool {
        let Some(slot) = self.slots.get(id as usize).and_then(Option::as_ref) else {
            return false;
        };
        if slot.loan.is_some() || !self.loans.lends() {
            return false;
        }
        let s = slot.set.get::<tcp::Socket>(slot.h);
        let half = self.loans.small / 2;
        s.recv_queue() > half || s.send_queue() + sending > half
    }

    /// Move socket `id` onto a full pair from the pool; false if the pool
    /// has lent every pair (counted) or the socket's data did not fit.
    pub(super) fn lend(&mut self, id: Id, now: Instant) -> bool {
        let Inner { slots, loans, .. } = self;
        let Some(slot) = slots.get_mut(id as usize).and_then(Option::as_mut) else {
            return false;
        };
        if slot.loan.is_some() {
            return true;
        }
        let Some(full) = loans.take(now) else {
            return false;
        };
        match swap(slot.set.get_mut::<tcp::Socket>(slot.h), full) {
            Ok(small) => {
                slot.loan = Some(Loan { at: now, small });
                loans.quiet.push_back((id, now));
                true
            }
            Err(full) => {
                // Not reached: full rings hold whatever small ones do.
                loans.put(full);
                false
            }
        }
    }

    /// The session of socket `id` moved data at `now`.
    pub(super) fn moved(&mut self, id: Id, now: Instant) {
        if let Some(loan) = self
            .slots
            .get_mut(id as usize)
            .and_then(Option::as_mut)
            .and_then(|s| s.loan.as_mut())
        {
            loan.at = now;
        }
    }

    /// Take back the pairs of the sockets on loan that have been quiet for
    /// [`RING_QUIET`] with both rings empty; the earliest time another may
    /// be due.
    pub(super) fn return_quiet(&mut self, now: Instant) -> Option<Instant> {
        let Inner { slots, loans, .. } = self;
        while let Some(&(id, at)) = loans.quiet.front() {
            if now.saturating_duration_since(at) < RING_QUIET {
                return Some(at + RING_QUIET);
            }
            loans.quiet.pop_front();
            let Some(slot) = slots.get_mut(id as usize).and_then(Option::as_mut) else {
                continue;
            };
            let Some(last) = slot.loan.as_ref().map(|l| l.at) else {
                continue;
            };
            if now.saturating_duration_since(last) < RING_QUIET {
                loans.quiet.push_back((id, last));
                continue;
            }
            let s = slot.set.get_mut::<tcp::Socket>(slot.h);
            if s.recv_queue() > 0 || s.send_queue() > 0 {
                // Data waits in a ring (unread, or not acknowledged by the
                // app yet): look again after another while.
                loans.quiet.push_back((id, now));
                continue;
            }
            let Some(loan) = slot.loan.take() else {
                continue;
            };
            match swap(s, loan.small) {
                Ok(full) => loans.put(full),
                Err(small) => {
                    // Out-of-order data waits in the receive ring.
                    slot.loan = Some(Loan { at: now, small });
                    loans.quiet.push_back((id, now));
                }
            }
        }
        None
    }

    /// Socket `id` is being removed with `sock`, its socket: a loan it
    /// holds goes back to the pool.
    pub(super) fn end_loan(&mut self, sock: tcp::Socket<'static>, loan: Option<Loan>) {
        if loan.is_some() {
            let (rx, tx) = sock.into_buffers();
            self.loans.put((into_vec(rx), into_vec(tx)));
        }
    }
}
