//! Connect-first on smoltcp: the connections between a new SYN and the end
//! of its handshake. A new flow's SYN is marked connecting ([`Sockets::syn`])
//! while its outbound connects, holding the connect task and the admission
//! permit; once connected it becomes a socket in SYN-RECEIVED until the app
//! completes the handshake. Both kinds are half-open and bounded together,
//! as the system stack bounds its own (`stack::system`, "Half-open
//! connections"): a SYN past a bound evicts the oldest, never the newcomer,
//! and a handshake the app does not complete within [`HANDSHAKE_TIMEOUT`] is
//! aborted.

use std::net::IpAddr;
use std::time::Instant;

use smoltcp::socket::tcp::{self, State};
use tokio::task::AbortHandle;

use super::sockets::{Inner, Sockets};
use crate::budget::OwnedPermit;
use crate::nat::FlowKey;
use crate::stack::{HALF_OPEN_PER_SOURCE, HANDSHAKE_TIMEOUT};

/// What to do with a connection request (SYN without ACK).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Syn {
    /// A retransmit for a connection smoltcp already has: feed it.
    Known,
    /// A retransmit while the outbound connect is in flight: absorb it.
    Connecting,
    /// A new connection, now marked connecting: route it and connect.
    New,
    /// The socket budget is spent: refuse (RST), counted as `smoltcp_sockets_full`.
    Full,
}

/// A connect in flight.
#[derive(Debug)]
pub(super) struct Connecting {
    since: Instant,
    task: Option<AbortHandle>,
    permit: Option<OwnedPermit>,
}

impl Inner {
    /// Abort the sockets whose app has not completed the handshake within
    /// [`HANDSHAKE_TIMEOUT`] (their sessions end and close the outbound),
    /// and forget those that moved on. The next deadline, if any.
    pub(super) fn expire_handshakes(&mut self, now: Instant) -> Option<Instant> {
        while let Some(&(_, id, since)) = self.handshaking.front() {
            let s = self.socket(id);
            if s.state() != State::SynReceived {
                self.handshaking.pop_front();
                continue;
            }
            if now.saturating_duration_since(since) < HANDSHAKE_TIMEOUT {
                return Some(since + HANDSHAKE_TIMEOUT);
            }
            s.abort();
            self.mark(id);
            self.timed_out += 1;
            self.handshaking.pop_front();
        }
        None
    }

    /// Half-open connections (connects in flight, sockets in SYN-RECEIVED).
    fn half_open(&self) -> usize {
        self.connecting.len() + self.handshaking.len()
    }

    /// Evict the oldest half-open connection (of `source` only, if given):
    /// abort its connect, or reset its socket (its session then ends).
    fn evict_oldest(&mut self, source: Option<IpAddr>) {
        let mine = |k: &FlowKey| source.is_none_or(|s| k.client.ip() == s);
        let connecting = self
            .connecting
            .iter()
            .filter(|(k, _)| mine(k))
            .min_by_key(|(_, c)| c.since)
            .map(|(k, c)| (*k, c.since));
        let handshaking = self
            .handshaking
            .iter()
            .enumerate()
            .find(|(_, (k, id, _))| mine(k) && self.socket_ref(*id).state() == State::SynReceived)
            .map(|(i, (_, _, since))| (i, *since));
        match (connecting, handshaking) {
            (Some((k, a)), Some((_, b))) if a <= b => self.evict_connecting(&k),
            (Some((k, _)), None) => self.evict_connecting(&k),
            (_, Some((i, _))) => {
                if let Some((_, id, _)) = self.handshaking.remove(i) {
                    self.socket(id).abort();
                    self.mark(id);
                    self.evicted += 1;
                }
            }
            (None, None) => {}
        }
    }

    fn evict_connecting(&mut self, key: &FlowKey) {
        if let Some(c) = self.connecting.remove(key) {
            if let Some(t) = c.task {
                t.abort();
            }
            self.evicted += 1;
        }
    }
}

impl Sockets {
    /// Classify a SYN (without ACK); a new one is marked connecting.
    pub(crate) fn syn(&self, key: FlowKey) -> Syn {
        let mut g = self.inner.lock();
        if let Some(&id) = g.flows.get(&key) {
            if !g.detached.iter().any(|d| d.1 == id) {
                return Syn::Known;
            }
            // The app reuses a port whose previous connection is still
            // closing here: drop the old socket, this is a new connection.
            g.detached.retain(|d| d.1 != id);
            g.handshaking.retain(|d| d.1 != id);
            g.remove(id);
            g.flows.remove(&key);
        }
        if g.connecting.contains_key(&key) {
            return Syn::Connecting;
        }
        if g.flows.len() + g.connecting.len() >= self.max_sockets {
            return Syn::Full;
        }
        // The half-open bounds: evict the oldest, never refuse the newcomer.
        let per_source = HALF_OPEN_PER_SOURCE.min(self.max_half_open);
        let source = key.client.ip();
        if g.half_open() >= per_source {
            // Count only sockets still in SYN-RECEIVED.
            let Inner {
                slots, handshaking, ..
            } = &mut *g;
            handshaking.retain(|e| {
                slots[e.1 as usize]
                    .as_ref()
                    .is_some_and(|s| s.set.get::<tcp::Socket>(s.h).state() == State::SynReceived)
            });
        }
        if g.half_open() >= per_source {
            let from_source = g
                .connecting
                .keys()
                .filter(|k| k.client.ip() == source)
                .count()
                + g.handshaking
                    .iter()
                    .filter(|e| e.0.client.ip() == source)
                    .count();
            if from_source >= per_source {
                g.evict_oldest(Some(source));
            } else if g.half_open() >= self.max_half_open {
                g.evict_oldest(None);
            }
        }
        // An evicted socket's RST goes out from the poller.
        let wake = !g.dirty.is_empty();
        let connecting = Connecting {
            since: Instant::now(),
            task: None,
            permit: None,
        };
        g.connecting.insert(key, connecting);
        drop(g);
        if wake {
            self.wake.notify_one();
        }
        Syn::New
    }

    /// The connect task and admission permit of a connection marked
    /// connecting: the task is aborted and the permit dropped if the
    /// connection is evicted (at once, if it already was).
    pub(crate) fn connecting_task(&self, key: &FlowKey, task: AbortHandle, permit: OwnedPermit) {
        match self.inner.lock().connecting.get_mut(key) {
            Some(c) => {
                c.task = Some(task);
                c.permit = Some(permit);
            }
            None => task.abort(),
        }
    }

    /// The admission permit of a connection still connecting (`None` if it
    /// was evicted).
    pub(crate) fn take_permit(&self, key: &FlowKey) -> Option<OwnedPermit> {
        self.inner
            .lock()
            .connecting
            .get_mut(key)
            .and_then(|c| c.permit.take())
    }

    /// A new connection was refused before connecting (rule, admission).
    pub(crate) fn unmark(&self, key: &FlowKey) {
        self.inner.lock().connecting.remove(key);
    }

    /// Drop a connecting mark after a failed connect.
    pub(crate) fn connect_failed(&self, key: &FlowKey) {
        self.unmark(key);
    }
}
