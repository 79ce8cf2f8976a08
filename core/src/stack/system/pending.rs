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
use std::net::IpAddr;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::task::AbortHandle;

use crate::budget::OwnedPermit;
use crate::dispatch::Next;

/// One admitted connection waiting for the kernel to accept the app's side.
#[derive(Debug)]
pub(super) enum Pending {
    /// The outbound connect is in flight; the app's SYN is held. The task
    /// and the admission permit are attached once spawned ([`PendingMap::
    /// attach`]): the permit waits here, not in the task, so an eviction
    /// hands it back at once (an aborted task drops what it holds later).
    Connecting {
        source: IpAddr,
        since: Instant,
        task: Option<AbortHandle>,
        permit: Option<OwnedPermit>,
    },
    /// The SYN went to the kernel; the accepted connection goes on to
    /// `next`. Expires if never accepted.
    Ready {
        next: Next,
        permit: OwnedPermit,
        source: IpAddr,
        since: Instant,
    },
}

impl Pending {
    /// The app's address and when the entry was made (`Ready`: when the SYN
    /// went to the kernel).
    fn origin(&self) -> (IpAddr, Instant) {
        match self {
            Pending::Connecting { source, since, .. } | Pending::Ready { source, since, .. } => {
                (*source, *since)
            }
        }
    }

    /// Stop what the entry holds: abort its connect, reset its outbound.
    /// Its permit goes with it.
    pub(super) fn close(self) {
        match self {
            Pending::Connecting { task, .. } => {
                if let Some(t) = task {
                    t.abort();
                }
            }
            Pending::Ready { next, .. } => {
                if let Next::Relay(out) = &next {
                    crate::outbound::reset_on_close(&out.stream);
                }
            }
        }
    }
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
    pub fn connecting(&self, port: u16, generation: u64, source: IpAddr, now: Instant) {
        let p = Pending::Connecting {
            source,
            since: now,
            task: None,
            permit: None,
        };
        if let Some((_, old)) = self.by_port.lock().insert(port, (generation, p)) {
            old.close();
        }
    }

    /// The connect task and admission permit of flow `generation`, once
    /// spawned. If the port no longer holds that flow's connect (evicted
    /// meanwhile), the task is aborted and the permit dropped now.
    pub fn attach(
        &self,
        port: u16,
        generation: u64,
        task: Option<AbortHandle>,
        permit: OwnedPermit,
    ) {
        let mut map = self.by_port.lock();
        match map.get_mut(&port) {
            Some((
                g,
                Pending::Connecting {
                    task: t, permit: p, ..
                },
            )) if *g == generation => {
                *t = task;
                *p = Some(permit);
            }
            _ => {
                if let Some(t) = task {
                    t.abort();
                }
            }
        }
    }

    /// The half-open bounds for a new SYN from `source`: past `per_source`
    /// entries of that source, or `cap` in all, the oldest entry (of that
    /// source, or of all) is taken out and returned, for the caller to
    /// close and to end its NAT entry. One pass over a map the bounds keep
    /// small.
    pub fn evict_for(
        &self,
        source: IpAddr,
        cap: usize,
        per_source: usize,
    ) -> Option<(u16, u64, Pending)> {
        let mut map = self.by_port.lock();
        if map.len() < per_source.min(cap) {
            return None;
        }
        let (mut mine, mut oldest_mine, mut oldest) = (0usize, None, None);
        for (&port, (_, p)) in map.iter() {
            let (src, since) = p.origin();
            let older = |o: &Option<(u16, Instant)>| o.is_none_or(|(_, t)| since < t);
            if src == source {
                mine += 1;
                if older(&oldest_mine) {
                    oldest_mine = Some((port, since));
                }
            }
            if older(&oldest) {
                oldest = Some((port, since));
            }
        }
        let victim = if mine >= per_source {
            oldest_mine
        } else if map.len() >= cap {
            oldest
        } else {
            None
        };
        let (port, _) = victim?;
        map.remove(&port).map(|(g, p)| (port, g, p))
    }

    /// A new flow with nothing to connect first (DNS, sniffing), from the
    /// driver: ready for the kernel's accept at once.
    pub fn ready_now(
        &self,
        port: u16,
        generation: u64,
        source: IpAddr,
        (next, permit): (Next, OwnedPermit),
        now: Instant,
    ) {
        let ready = Pending::Ready {
            next,
            permit,
            source,
            since: now,
        };
        if let Some((_, old)) = self.by_port.lock().insert(port, (generation, ready)) {
            old.close();
        }
    }

    /// The connect of flow `generation` succeeded: ready for the accept
    /// (with the permit the entry holds), if the port still holds that
    /// flow's connect. Otherwise the outbound comes back, for the caller to
    /// close: the flow is gone (evicted, expired) and its SYN must not
    /// reach the kernel.
    pub fn connected(
        &self,
        port: u16,
        generation: u64,
        next: Next,
        now: Instant,
    ) -> Result<(), Next> {
        let mut map = self.by_port.lock();
        let Some((g, p)) = map.get_mut(&port) else {
            return Err(next);
        };
        let Pending::Connecting { source, permit, .. } = p else {
            return Err(next);
        };
        if *g != generation {
            return Err(next);
        }
        let (source, Some(permit)) = (*source, permit.take()) else {
            return Err(next);
        };
        *p = Pending::Ready {
            next,
            permit,
            source,
            since: now,
        };
        Ok(())
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
            Some((_, Pending::Connecting { .. }))
        )
    }

    pub fn is_empty(&self) -> bool {
        self.by_port.lock().is_empty()
    }

    /// Take out outbounds whose SYN went to the kernel `timeout` ago and
    /// was never accepted, for the caller to close and to end their NAT
    /// entries.
    pub fn expire(&self, now: Instant, timeout: Duration) -> Vec<(u16, u64, Pending)> {
        let mut map = self.by_port.lock();
        let ports: Vec<u16> = map
            .iter()
            .filter(|(_, (_, p))| {
                matches!(p, Pending::Ready { since, .. }
                    if now.saturating_duration_since(*since) >= timeout)
            })
            .map(|(&port, _)| port)
            .collect();
        ports
            .into_iter()
            .filter_map(|port| map.remove(&port).map(|(g, p)| (port, g, p)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::budget::Admission;

    const SRC: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 9));

    /// Past the total bound the oldest entry goes, past the per-source
    /// bound the oldest of that source; a newer flow is never refused, and
    /// an evicted entry's permit is back at once.
    #[test]
    fn evict_for_takes_the_oldest_of_the_source_then_of_all() {
        let a = Arc::new(Admission::new([8, 8, 8]));
        let m = PendingMap::default();
        let t0 = Instant::now();
        let other = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 10));
        for (i, src) in [(1u16, other), (2, SRC), (3, SRC)] {
            m.connecting(
                i,
                u64::from(i),
                src,
                t0 + Duration::from_millis(u64::from(i)),
            );
            m.attach(i, u64::from(i), None, permit(&a));
        }
        assert_eq!(a.active(), 3);
        assert!(m.evict_for(SRC, 4, 4).is_none(), "room left");
        // Per source (2 from SRC): SRC's oldest, port 2, not the older 1.
        let (port, g, p) = m.evict_for(SRC, 4, 2).expect("evicted");
        assert_eq!((port, g), (2, 2));
        p.close();
        assert_eq!(a.active(), 2, "its permit is back at once");
        // In total (cap 2): the oldest of all, port 1.
        let (port, _, p) = m.evict_for(other, 2, 2).expect("evicted");
        assert_eq!(port, 1);
        drop(p);
        assert_eq!(a.active(), 1);
        assert!(
            m.connected(2, 2, Next::Dns, t0).is_err(),
            "an evicted connect is refused"
        );
    }

    fn permit(a: &Arc<Admission>) -> OwnedPermit {
        a.try_acquire_owned(Instant::now()).expect("permit")
    }

    /// Flow A (generation 1) connects on port 7; its entry expires and flow
    /// B (generation 2) reuses the port before A's connect reports back.
    fn reused() -> (PendingMap, Arc<Admission>) {
        let a = Arc::new(Admission::new([8, 8, 8]));
        let m = PendingMap::default();
        let now = Instant::now();
        m.connecting(7, 1, SRC, now);
        m.attach(7, 1, None, permit(&a));
        m.connecting(7, 2, SRC, now);
        m.attach(7, 2, None, permit(&a));
        (m, a)
    }

    #[test]
    fn a_stale_connect_cannot_hand_its_outbound_to_a_newer_flow() {
        let (m, a) = reused();
        let now = Instant::now();
        // A connected: refused, the outbound and permit come back to close.
        assert!(m.connected(7, 1, Next::Dns, now).is_err());
        assert!(m.is_connecting(7), "B still waits for its own connect");
        assert!(m.take_ready(7, 1).is_none());
        assert!(m.take_ready(7, 2).is_none(), "B has not sent its SYN yet");
        // B connects: its accept finds its own outbound.
        assert!(m.connected(7, 2, Next::Sniff, now).is_ok());
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
        m.connecting(1, 1, SRC, t0);
        m.ready_now(2, 2, SRC, (Next::Dns, permit(&a)), t0);
        assert!(
            m.expire(t0 + Duration::from_secs(29), Duration::from_secs(30))
                .is_empty()
        );
        assert!(m.take_ready(2, 2).is_some());
        m.ready_now(2, 3, SRC, (Next::Dns, permit(&a)), t0);
        let expired = m.expire(t0 + Duration::from_secs(30), Duration::from_secs(30));
        assert_eq!(expired.len(), 1);
        drop(expired);
        assert!(m.take_ready(2, 3).is_none(), "expired");
        assert!(m.is_connecting(1));
        assert_eq!(a.active(), 0);
    }
}
