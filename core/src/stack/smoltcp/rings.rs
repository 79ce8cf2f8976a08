//! Rings on loan. A socket starts on two small rings ([`Loans::small`]
//! bytes each, charged with its session: `budget::SMOLTCP_SMALL_RING`) and
//! borrows a full ring (`budget.smoltcp_buffer`) from the engine's pool
//! (`Memory::smoltcp_rings`) for the direction whose small ring data fills
//! past half: the receive ring for the app's data, the send ring for its
//! session's. A download borrows only its send ring, an upload only its
//! receive ring, so the pool serves twice the transfers it would in pairs.
//! The poller takes a socket's full rings back once its session moved no
//! data for [`RING_QUIET`], each ring once it is empty, and the socket goes
//! on with its small rings. While every ring is lent, a socket that asks
//! stays on its small ring: it still moves data, a small window at a time,
//! and asks again the next time the ring fills (the refusal is counted:
//! `smoltcp_ring_loans_refused`). Under memory pressure the pool lends a
//! half or a quarter of its rings, as every budget does for new charges;
//! loans already made stay until they come back.
//!
//! On a short TUN queue the sockets on full receive rings also share a
//! window budget (`Sockets::with_window_budget`): each offers at most the
//! budget over their number, so that many uploads at once do not invite
//! more of the app's packets than the queue holds.
//!
//! A ring handed back keeps no pages (`sys::pages::discard`; the pool owns
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

/// A socket on loan whose session moved no data for this long hands back
/// each full ring that is empty.
pub(super) const RING_QUIET: Duration = Duration::from_secs(1);

/// The pool of full rings, and the sockets holding one.
#[derive(Debug)]
pub(super) struct Loans {
    /// Bytes of each small ring.
    pub(super) small: usize,
    /// Bytes of each full ring.
    full: usize,
    /// Rings the pool may lend at once, at each pressure tier.
    max: [usize; 3],
    /// The host's memory pressure (`None`: always normal).
    pressure: Option<Arc<Pressure>>,
    /// Rings lent now.
    pub(super) lent: usize,
    /// Rings handed back, their pages discarded (at most `max - lent`).
    spare: Vec<Vec<u8>>,
    /// Sockets on loan with when they were filed, oldest first: the poller
    /// takes back the rings of those quiet for [`RING_QUIET`].
    pub(super) quiet: VecDeque<(Id, Instant)>,
    /// Loans asked for while every ring was lent, not yet published.
    pub(super) refused: u64,
    /// Bytes of window every socket on a full receive ring may offer
    /// together (`Sockets::with_window_budget`); 0: no cap.
    pub(super) window_budget: usize,
    /// Full receive rings lent now.
    rx_lent: usize,
}

/// A socket's loans: when its session last moved data, and the small ring
/// each full one replaced (receive, send), kept for its return.
#[derive(Debug, Default)]
pub(super) struct Loan {
    pub(super) at: Option<Instant>,
    rx: Option<Vec<u8>>,
    tx: Option<Vec<u8>>,
}

impl Loan {
    /// Whether the socket holds a full ring.
    pub(super) fn any(&self) -> bool {
        self.rx.is_some() || self.tx.is_some()
    }
}

/// Which of a socket's rings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ring {
    Rx,
    Tx,
}

impl Loans {
    /// `max` rings of `full` bytes (at normal pressure) for sockets that
    /// start on `small`-byte rings. With `small >= full` there is nothing
    /// to lend: sockets start on full rings.
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
            window_budget: 0,
            rx_lent: 0,
        }
    }

    /// What each socket on a full receive ring offers at most now.
    fn window_cap(&self) -> usize {
        match self.window_budget {
            0 => usize::MAX,
            b => (b / self.rx_lent.max(1)).clamp(self.small, self.full),
        }
    }

    /// Whether there is anything to lend at all.
    pub(super) fn lends(&self) -> bool {
        self.max[0] > 0
    }

    /// A full ring for a loan: a spare one, or a new one while fewer than
    /// the tier's rings are lent. The pages of a new ring are handed back
    /// at once: `calloc` clears a chunk it reuses (in a runtime thread's
    /// arena, every chunk), which would make it resident in full before
    /// data fills it.
    fn take(&mut self, now: Instant) -> Option<Vec<u8>> {
        let tier = self.pressure.as_ref().map_or(0, |p| p.level(now) as usize);
        if self.lent >= self.max[tier] {
            self.refused += 1;
            return None;
        }
        self.lent += 1;
        let full = self.full;
        Some(self.spare.pop().unwrap_or_else(|| {
            let mut v = vec![0u8; full];
            pages::discard(&mut v);
            v
        }))
    }

    /// A ring back from a loan: its pages are handed back, the ring kept
    /// for the next loan (at most as many as the pool lends at normal
    /// pressure, less those lent).
    fn put(&mut self, mut ring: Vec<u8>) {
        self.lent = self.lent.saturating_sub(1);
        if ring.len() == self.full && self.spare.len() + self.lent < self.max[0] {
            pages::discard(&mut ring);
            self.spare.push(ring);
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

/// Move `s`'s `which` ring onto `ring`: the old ring, or (refused: `ring`
/// cannot hold the data) `ring` back.
fn swap(s: &mut tcp::Socket<'static>, which: Ring, ring: Vec<u8>) -> Result<Vec<u8>, Vec<u8>> {
    let ring = tcp::SocketBuffer::new(ring);
    let r = match which {
        Ring::Rx => s.replace_rx_buffer(ring),
        Ring::Tx => s.replace_tx_buffer(ring),
    };
    r.map(into_vec).map_err(into_vec)
}

impl Inner {
    /// The ring of socket `id` that is small and that data fills past
    /// half, if any: the receive ring from the app, or the send ring with
    /// `sending` more bytes. Cheap: for every packet of a flow.
    pub(super) fn wants_loan(&self, id: Id, sending: usize) -> Option<Ring> {
        if !self.loans.lends() {
            return None;
        }
        let slot = self.slots.get(id as usize)?.as_ref()?;
        let s = slot.set.get::<tcp::Socket>(slot.h);
        let half = self.loans.small / 2;
        if slot.loan.rx.is_none() && s.recv_queue() > half {
            Some(Ring::Rx)
        } else if slot.loan.tx.is_none() && s.send_queue() + sending > half {
            Some(Ring::Tx)
        } else {
            None
        }
    }

    /// Move socket `id`'s `which` ring onto a full one from the pool;
    /// false if the pool has lent every ring (counted) or the socket's data
    /// did not fit.
    pub(super) fn lend(&mut self, id: Id, which: Ring, now: Instant) -> bool {
        let Inner { slots, loans, .. } = self;
        let Some(slot) = slots.get_mut(id as usize).and_then(Option::as_mut) else {
            return false;
        };
        let Some(full) = loans.take(now) else {
            return false;
        };
        match swap(slot.set.get_mut::<tcp::Socket>(slot.h), which, full) {
            Ok(small) => {
                let filed = slot.loan.any();
                match which {
                    Ring::Rx => slot.loan.rx = Some(small),
                    Ring::Tx => slot.loan.tx = Some(small),
                }
                slot.loan.at = Some(now);
                if !filed {
                    loans.quiet.push_back((id, now));
                }
                if which == Ring::Rx {
                    loans.rx_lent += 1;
                    self.cap_windows();
                }
                true
            }
            Err(full) => {
                // Not reached: a full ring holds whatever a small one does.
                loans.put(full);
                false
            }
        }
    }

    /// The session of socket `id` moved data at `now`.
    pub(super) fn moved(&mut self, id: Id, now: Instant) {
        if let Some(slot) = self.slots.get_mut(id as usize).and_then(Option::as_mut)
            && slot.loan.any()
        {
            slot.loan.at = Some(now);
        }
    }

    /// Take back the full rings of the sockets on loan that have been
    /// quiet for [`RING_QUIET`], each once it is empty; the earliest time
    /// another may be due.
    pub(super) fn return_quiet(&mut self, now: Instant) -> Option<Instant> {
        let mut recap = false;
        let due = self.return_quiet_rings(now, &mut recap);
        if recap {
            self.cap_windows();
        }
        due
    }

    /// [`Inner::return_quiet`]'s walk; `recap` set when a receive ring
    /// came back.
    fn return_quiet_rings(&mut self, now: Instant, recap: &mut bool) -> Option<Instant> {
        let Inner { slots, loans, .. } = self;
        loop {
            let Some(&(id, at)) = loans.quiet.front() else {
                break None;
            };
            if now.saturating_duration_since(at) < RING_QUIET {
                break Some(at + RING_QUIET);
            }
            loans.quiet.pop_front();
            let Some(slot) = slots.get_mut(id as usize).and_then(Option::as_mut) else {
                continue;
            };
            let Some(last) = slot.loan.at.filter(|_| slot.loan.any()) else {
                continue;
            };
            if now.saturating_duration_since(last) < RING_QUIET {
                loans.quiet.push_back((id, last));
                continue;
            }
            let s = slot.set.get_mut::<tcp::Socket>(slot.h);
            if s.recv_queue() == 0
                && let Some(small) = slot.loan.rx.take()
            {
                // Refused while out-of-order data waits in the ring.
                match swap(s, Ring::Rx, small) {
                    Ok(full) => {
                        loans.put(full);
                        loans.rx_lent -= 1;
                        s.set_window_cap(usize::MAX);
                        *recap = true;
                    }
                    Err(small) => slot.loan.rx = Some(small),
                }
            }
            if s.send_queue() == 0
                && let Some(small) = slot.loan.tx.take()
            {
                match swap(s, Ring::Tx, small) {
                    Ok(full) => loans.put(full),
                    Err(small) => slot.loan.tx = Some(small),
                }
            }
            if slot.loan.any() {
                // Data waits in a ring (unread, not acknowledged by the app
                // yet, or out of order): look again after another while.
                loans.quiet.push_back((id, now));
            }
        }
    }

    /// Tell every socket on a full receive ring what it may offer now
    /// (the window budget shared among them), and have the poller
    /// look at each: one whose offer grew owes its app an update.
    fn cap_windows(&mut self) {
        let cap = self.loans.window_cap();
        for i in 0..self.loans.quiet.len() {
            let id = self.loans.quiet[i].0;
            if let Some(slot) = self.slots.get_mut(id as usize).and_then(Option::as_mut)
                && slot.loan.rx.is_some()
            {
                slot.set.get_mut::<tcp::Socket>(slot.h).set_window_cap(cap);
                self.mark(id);
            }
        }
    }

    /// A socket is being removed with `loan`: its full rings, taken from
    /// `sock`, go back to the pool.
    pub(super) fn end_loan(&mut self, sock: tcp::Socket<'static>, loan: &Loan) {
        let (rx, tx) = sock.into_buffers();
        if loan.rx.is_some() {
            self.loans.put(into_vec(rx));
            self.loans.rx_lent -= 1;
            self.cap_windows();
        }
        if loan.tx.is_some() {
            self.loans.put(into_vec(tx));
        }
    }
}
