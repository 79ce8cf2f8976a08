//! Admitted connections between the app's SYN and the kernel's accept,
//! keyed by NAT port *and* the generation the NAT table stamped on the
//! flow's entry ([`crate::nat::Uplink::generation`]).
//!
//! A NAT port is reused once its entry expires. An outbound connect that
//! outlives its flow's entry (a slow proxy, a connect that was never
//! answered) must then not touch the newer flow on the same port: it may
//! neither hand its outbound to that flow's accept, nor remove the newer
//! flow's state, nor send its own SYN to the kernel. Every operation of a
//! connect task therefore names its generation and is refused for another.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::budget::OwnedPermit;
use crate::dispatch::Next;

/// One admitted connection waiting for the kernel to accept the app's side.
#[derive(Debug)]
pub(super) enum Pending {
    /// The outbound connect is in flight; the app's SYN is held.
    Connecting,
    /// The SYN went to the kernel; the accepted connection goes on to
    /// `next`. Expires if never accepted.
    Ready {
        next: Next,
        permit: OwnedPermit,
        since: Instant,
    },
}

/// The pending connections of one system stack.
#[derive(Debug, Default)]
pub(super) struct PendingMap {
    by_port: Mutex<HashMap<u16, (u64, Pending)>>,
}

impl PendingMap {
    /// A new flow's SYN (driver): its connect starts. Whatever an older
    /// flow left on the port is replaced; that flow's task finds out when
    /// it reports back.
    pub fn connecting(&self, port: u16, generation: u64) {
        self.by_port
            .lock()
            .insert(port, (generation, Pending::Connecting));
    }

    /// A new flow with nothing to connect first (DNS, sniffing), from the
    /// driver: ready for the kernel's accept at once.
    pub fn ready_now(
        &self,
        port: u16,
        generation: u64,
        next: Next,
        permit: OwnedPermit,
        now: Instant,
    ) {
        let ready = Pending::Ready {
            next,
            permit,
            since: now,
        };
        self.by_port.lock().insert(port, (generation, ready));
    }

    /// The connect of flow `generation` succeeded: ready for the accept, if
    /// the port still holds that flow's connect. Otherwise the outbound and
    /// the permit come back, for the caller to close: the flow is gone and
    /// its SYN must not reach the kernel.
    pub fn connected(
        &self,
        port: u16,
        generation: u64,
        next: Next,
        permit: OwnedPermit,
        now: Instant,
    ) -> Result<(), (Next, OwnedPermit)> {
        let mut map = self.by_port.lock();
        match map.get_mut(&port) {
            Some((g, p @ Pending::Connecting)) if *g == generation => {
                *p = Pending::Ready {
                    next,
                    permit,
                    since: now,
                };
                Ok(())
            }
            _ => Err((next, permit)),
        }
    }

    /// Forget flow `generation` (its connect failed, or its SYN could not be
    /// handed to the kernel). True if the port still held that flow, i.e.
    /// the caller still speaks for it (aborts its NAT entry, resets the app).
    pub fn forget(&self, port: u16, generation: u64) -> bool {
        let mut map = self.by_port.lock();
        match map.get(&port) {
            Some((g, _)) if *g == generation => map.remove(&port).is_some(),
            _ => false,
        }
    }

    /// The kernel accepted the entry that flow `opened` created
    /// ([`crate::nat::Accepted::opened`]): its pending state, if that is
    /// what the port holds. A Connecting flow has not sent its SYN yet, so
    /// its state is left for its task.
    pub fn take_ready(&self, port: u16, opened: u64) -> Option<(Next, OwnedPermit)> {
        let mut map = self.by_port.lock();
        match map.get(&port) {
            Some((g, Pending::Ready { .. })) if *g == opened => match map.remove(&port) {
                Some((_, Pending::Ready { next, permit, .. })) => Some((next, permit)),
                _ => None,
            },
            _ => None,
        }
    }

    /// Whether the SYN of the flow at `port` is held by its connect (a SYN
    /// retransmit is then absorbed). Per SYN only, never per segment.
    pub fn is_connecting(&self, port: u16) -> bool {
        matches!(
            self.by_port.lock().get(&port),
            Some((_, Pending::Connecting))
        )
    }

    pub fn is_empty(&self) -> bool {
        self.by_port.lock().is_empty()
    }

    /// Drop outbounds whose SYN went to the kernel `timeout` ago and was
    /// never accepted.
    pub fn expire(&self, now: Instant, timeout: Duration) {
        self.by_port.lock().retain(|_, (_, p)| match p {
            Pending::Connecting => true,
            Pending::Ready { since, .. } => now.saturating_duration_since(*since) < timeout,
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::budget::Admission;

    fn permit(a: &Arc<Admission>) -> OwnedPermit {
        a.try_acquire_owned(Instant::now()).expect("permit")
    }

    /// Flow A (generation 1) connects on port 7; its entry expires and flow
    /// B (generation 2) reuses the port before A's connect reports back.
    fn reused() -> (PendingMap, Arc<Admission>) {
        let a = Arc::new(Admission::new([8, 8, 8]));
        let m = PendingMap::default();
        m.connecting(7, 1);
        m.connecting(7, 2);
        (m, a)
    }

    #[test]
    fn a_stale_connect_cannot_hand_its_outbound_to_a_newer_flow() {
        let (m, a) = reused();
        let now = Instant::now();
        // A connected: refused, the outbound and permit come back to close.
        assert!(m.connected(7, 1, Next::Dns, permit(&a), now).is_err());
        assert!(m.is_connecting(7), "B still waits for its own connect");
        assert!(m.take_ready(7, 1).is_none());
        assert!(m.take_ready(7, 2).is_none(), "B has not sent its SYN yet");
        // B connects: its accept finds its own outbound.
        assert!(m.connected(7, 2, Next::Sniff, permit(&a), now).is_ok());
        assert!(
            m.take_ready(7, 1).is_none(),
            "an accept of A's entry gets nothing"
        );
        assert!(matches!(m.take_ready(7, 2), Some((Next::Sniff, _))));
        assert!(m.is_empty());
        assert_eq!(a.active(), 0, "every permit came back");
    }

    #[test]
    fn a_stale_failure_leaves_the_newer_flow_pending() {
        let (m, _a) = reused();
        assert!(!m.forget(7, 1), "A no longer speaks for the port");
        assert!(m.is_connecting(7));
        assert!(m.forget(7, 2));
        assert!(m.is_empty());
    }

    #[test]
    fn ready_entries_expire_connecting_ones_wait_for_their_task() {
        let a = Arc::new(Admission::new([8, 8, 8]));
        let m = PendingMap::default();
        let t0 = Instant::now();
        m.connecting(1, 1);
        m.ready_now(2, 2, Next::Dns, permit(&a), t0);
        m.expire(t0 + Duration::from_secs(29), Duration::from_secs(30));
        assert!(m.take_ready(2, 2).is_some());
        m.ready_now(2, 3, Next::Dns, permit(&a), t0);
        m.expire(t0 + Duration::from_secs(30), Duration::from_secs(30));
        assert!(m.take_ready(2, 3).is_none(), "expired");
        assert!(m.is_connecting(1));
        assert_eq!(a.active(), 0);
    }
}
