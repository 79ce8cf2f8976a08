//! A flow between its SYN and the kernel's accept: admission (with the
//! half-open bounds), the outbound connect's outcome, and the accept.

use std::net::IpAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use super::shard::{Held, Phase, Ports};
use super::{Aborted, Accepted, Evicted, NatError, NatTable, Stage};

/// Half-open connections (between a new SYN and the end of its handshake:
/// connect in flight, or SYN answered and not yet completed by the app) at
/// most, whatever the admission limit; both stacks also keep them to half
/// the admission limit ([`half_open_bounds`]), so they never take the
/// permits answered connections need.
pub const HALF_OPEN_MAX: usize = 512;

/// Half-open connections one source address may hold: a bound on the
/// outbound connects one app (a port scanner, a flood) keeps in flight.
pub const HALF_OPEN_PER_SOURCE: usize = 256;

/// How long the app may take to complete a handshake the kernel answered.
/// The app's side is local (the SYN-ACK crosses the TUN, not a network), so
/// a real app answers within milliseconds; 3 s allows for its stack
/// retransmitting a lost ACK once (Linux's initial RTO is 1 s).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// The half-open bounds under admission limit `limit`: `(in total, per
/// source)`. In total [`HALF_OPEN_MAX`] and never more than half the
/// limit (at least one); per source [`HALF_OPEN_PER_SOURCE`], within that.
pub fn half_open_bounds(limit: usize) -> (usize, usize) {
    let cap = HALF_OPEN_MAX.min(limit / 2).max(1);
    (cap, HALF_OPEN_PER_SOURCE.min(cap))
}

/// The oldest held flow found so far: (port, generation, since).
type Oldest = Option<(u16, u64, Instant)>;

impl<P> NatTable<P> {
    /// Room for a new flow from `source`, before it is admitted, under
    /// admission limit `admission_limit` ([`half_open_bounds`]): past the
    /// per-source bound, the oldest admitted half-open flow of `source` is
    /// evicted; past the bound in total, the oldest of all. Never the
    /// newcomer (it is not admitted yet). The evicted flow lingers Closing
    /// (so the kernel's answer to a SYN it already has is still
    /// translated); its attachment comes back for the engine to close.
    ///
    /// One pass over the side maps, one reverse shard at a time, and only
    /// once a bound is reached (a counter says so): the bounds keep the
    /// pass short.
    pub fn make_room(
        &self,
        source: IpAddr,
        admission_limit: usize,
        now: Instant,
    ) -> Option<Evicted<P>> {
        self.make_room_within(source, half_open_bounds(admission_limit), now)
    }

    /// [`NatTable::make_room`] with the bounds `(cap, per_source)` given.
    fn make_room_within(
        &self,
        source: IpAddr,
        (cap, per_source): (usize, usize),
        now: Instant,
    ) -> Option<Evicted<P>> {
        if self.held.load(Relaxed) < per_source.min(cap) {
            return None;
        }
        let (mut total, mut mine) = (0usize, 0usize);
        let (mut oldest, mut oldest_mine): (Oldest, Oldest) = (None, None);
        for shard in self.reverse.iter() {
            let rev = shard.read();
            for (&port, h) in &rev.held {
                let Some(m) = rev.map.get(&port) else {
                    continue; // never: check_invariants
                };
                total += 1;
                let older = |o: &Oldest| o.is_none_or(|(_, _, t)| h.since < t);
                if m.key.client_ip() == source {
                    mine += 1;
                    if older(&oldest_mine) {
                        oldest_mine = Some((port, m.generation, h.since));
                    }
                }
                if older(&oldest) {
                    oldest = Some((port, m.generation, h.since));
                }
            }
        }
        let victim = if mine >= per_source {
            oldest_mine
        } else if total >= cap {
            oldest
        } else {
            None
        };
        let (port, generation, _) = victim?;
        // Gone or moved on since the pass: it left the half-open flows by
        // itself, which made the room.
        let payload = self.close_if(port, generation, now, Phase::is_held)?;
        Some(Evicted { port, payload })
    }

    /// Admits the new flow at `port` (stamped `generation` by its SYN):
    /// `stage` [`Stage::Connecting`] while its outbound connects (the SYN is
    /// held), or [`Stage::Ready`] when its SYN goes to the kernel now, with
    /// `payload` attached. Refused, handing `payload` back, when the port no
    /// longer holds that flow in [`Stage::New`] (evicted or replaced since
    /// its SYN), or for `stage` New.
    pub fn admit(
        &self,
        port: u16,
        generation: u64,
        stage: Stage,
        payload: P,
        now: Instant,
    ) -> Result<(), P> {
        if stage == Stage::New {
            return Err(payload);
        }
        let mut guard = self.reverse_shard(port).write();
        let rev = &mut *guard;
        match rev.map.get_mut(&port) {
            Some(m) if m.generation == generation && m.phase == Phase::HalfOpen(Stage::New) => {
                self.count_out(m.phase);
                m.phase = Phase::HalfOpen(stage);
                self.count_in(m.phase);
                rev.held.insert(
                    port,
                    Held {
                        since: now,
                        payload,
                    },
                );
                Ok(())
            }
            _ => Err(payload),
        }
    }

    /// Runs `update` on the attachment of the Connecting flow `generation`
    /// at `port` (the engine adds its connect task once spawned). Returns
    /// whether that flow is still half-open and attached (Connecting, or
    /// Ready if its connect already succeeded: `update` is then not run);
    /// `false` means it ended, and whatever the engine meant to attach is
    /// its own to stop.
    pub fn attach(&self, port: u16, generation: u64, update: impl FnOnce(&mut P)) -> bool {
        let mut guard = self.reverse_shard(port).write();
        let rev = &mut *guard;
        match rev.map.get(&port) {
            Some(m) if m.generation == generation && m.phase.is_held() => {
                if m.phase == Phase::HalfOpen(Stage::Connecting)
                    && let Some(h) = rev.held.get_mut(&port)
                {
                    update(&mut h.payload);
                }
                true
            }
            _ => false,
        }
    }

    /// The outbound connect of flow `generation` at `port` succeeded:
    /// Connecting becomes Ready (the SYN goes to the kernel now; the
    /// handshake timeout starts), and `ready` turns the attachment and
    /// `next` (what the connect produced) into the Ready attachment, under
    /// the lock. Refused, handing `next` back, when the port no longer
    /// holds that flow Connecting: it was evicted, expired or replaced, and
    /// its SYN must not reach the kernel.
    pub fn connected<N>(
        &self,
        port: u16,
        generation: u64,
        now: Instant,
        next: N,
        ready: impl FnOnce(P, N) -> P,
    ) -> Result<(), N> {
        let mut guard = self.reverse_shard(port).write();
        let rev = &mut *guard;
        let Some(m) = rev.map.get_mut(&port) else {
            return Err(next);
        };
        if m.generation != generation || m.phase != Phase::HalfOpen(Stage::Connecting) {
            return Err(next);
        }
        let Some(h) = rev.held.remove(&port) else {
            return Err(next); // never: check_invariants
        };
        // Connecting and Ready count the same (half-open, held).
        m.phase = Phase::HalfOpen(Stage::Ready);
        rev.held.insert(
            port,
            Held {
                since: now,
                payload: ready(h.payload, next),
            },
        );
        Ok(())
    }

    /// Ends the half-open flow `generation` at `port` before any accept
    /// (admission refused it, its outbound connect failed, its SYN could
    /// not be handed to the kernel): it lingers Closing, so late segments
    /// are still translated. `None` when the port no longer holds that
    /// flow half-open (a connect that outlived its entry never closes a
    /// newer flow that reuses the port); otherwise the caller still speaks
    /// for the flow (answers the app's SYN) and gets its attachment back.
    pub fn abort_half_open(&self, port: u16, generation: u64, now: Instant) -> Option<Aborted<P>> {
        let payload = self.close_if(port, generation, now, |phase| {
            matches!(phase, Phase::HalfOpen(_))
        })?;
        Some(Aborted { payload })
    }

    /// Marks the entry `generation` at `port` Closing (stamped `now`) if its
    /// phase passes `which` (and is not Closing already); returns its
    /// attachment (`Some(None)`: closed, nothing attached), or `None` if
    /// nothing was closed.
    pub(super) fn close_if(
        &self,
        port: u16,
        generation: u64,
        now: Instant,
        which: impl FnOnce(Phase) -> bool,
    ) -> Option<Option<P>> {
        let mut guard = self.reverse_shard(port).write();
        let m = guard.map.get(&port)?;
        if m.generation != generation || m.phase == Phase::Closing || !which(m.phase) {
            return None;
        }
        self.close_locked(&mut guard, port, self.ms(now))
    }

    /// Marks the entry at `port` of `rev` (a reverse shard held for
    /// writing) Closing since `now_ms`, unless it is Closing already, and
    /// takes its attachment out: as [`Self::close_if`].
    pub(super) fn close_locked(
        &self,
        rev: &mut Ports<P>,
        port: u16,
        now_ms: u64,
    ) -> Option<Option<P>> {
        let m = rev.map.get_mut(&port)?;
        if m.phase == Phase::Closing {
            return None;
        }
        let payload = if m.phase.is_held() {
            rev.held.remove(&port).map(|h| h.payload)
        } else {
            None
        };
        self.count_out(m.phase);
        m.phase = Phase::Closing;
        self.count_in(m.phase);
        // `store`, not `touch`: this is the linger's start.
        m.last_seen.store(now_ms, Relaxed);
        Some(payload)
    }

    /// Accept loop: looks the port up, marks it Active and stamps a new,
    /// strictly increasing generation, in one critical section, and hands
    /// back what was attached to the half-open flow. The generation the
    /// entry carried until then (stamped by the SYN that opened it,
    /// [`Uplink::generation`](super::Uplink::generation)) comes back as
    /// [`Accepted::opened`].
    ///
    /// [`NatError::NoMapping`] if the port is unknown, [`NatError::NotHalfOpen`]
    /// if it was already accepted or is closing. Both are counted.
    pub fn accept(&self, port: u16, now: Instant) -> Result<Accepted<P>, NatError> {
        self.accept_syn(port, None, now)
    }

    /// [`NatTable::accept`] for a connection whose SYN carried `isn` (when
    /// the kernel saved it): a SYN the entry did not record, from anything
    /// but the app's rewritten SYN, is refused with
    /// [`NatError::IsnMismatch`] (counted) and leaves the entry as it was,
    /// so the app's own connection can still be accepted.
    pub fn accept_syn(
        &self,
        port: u16,
        isn: Option<u32>,
        now: Instant,
    ) -> Result<Accepted<P>, NatError> {
        let mut guard = self.reverse_shard(port).write();
        let rev = &mut *guard;
        let result = match rev.map.get_mut(&port) {
            None => Err(NatError::NoMapping),
            Some(m) => match m.phase {
                Phase::HalfOpen(_) if isn.is_some_and(|isn| isn != m.isn) => {
                    Err(NatError::IsnMismatch)
                }
                was @ Phase::HalfOpen(stage) => {
                    let opened = m.generation;
                    self.count_out(was);
                    m.phase = Phase::Active;
                    self.count_in(m.phase);
                    m.generation = self.next_generation.fetch_add(1, Relaxed);
                    m.touch(self.ms(now));
                    let payload = if was.is_held() {
                        rev.held.remove(&port).map(|h| h.payload)
                    } else {
                        None
                    };
                    Ok(Accepted {
                        key: m.key.to_flow_key(),
                        port,
                        generation: m.generation,
                        opened,
                        stage,
                        payload,
                    })
                }
                Phase::Active | Phase::Closing => Err(NatError::NotHalfOpen),
            },
        };
        if result.is_err() {
            self.errors.accept_refused.fetch_add(1, Relaxed);
        }
        result
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    use super::*;
    use crate::nat::{Cleanup, FlowKey, NatConfig, NatState, Refused, Uplink};

    const SRC: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 9));
    const OTHER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 10));
    const MS: Duration = Duration::from_millis(1);

    /// Admission permits as the engine attaches them: each one counts
    /// itself live until dropped, so a test sees when one came back.
    #[derive(Debug, Default)]
    struct Permits(Arc<AtomicUsize>);

    #[derive(Debug)]
    struct Permit {
        live: Arc<AtomicUsize>,
        /// Which flow it was attached to, to check what comes back.
        tag: u16,
    }

    impl Permits {
        fn take(&self, tag: u16) -> Permit {
            self.0.fetch_add(1, SeqCst);
            Permit {
                live: Arc::clone(&self.0),
                tag,
            }
        }

        fn live(&self) -> usize {
            self.0.load(SeqCst)
        }
    }

    /// The connect's outcome: the same permit, tagged with what it made.
    fn retag(mut p: Permit, tag: u16) -> Permit {
        p.tag = tag;
        p
    }

    impl Drop for Permit {
        fn drop(&mut self) {
            self.live.fetch_sub(1, SeqCst);
        }
    }

    fn key(src: IpAddr, cport: u16) -> FlowKey {
        FlowKey::new(SocketAddr::new(src, cport), "1.1.1.1:443".parse().unwrap())
    }

    fn table(cfg: NatConfig, now: Instant) -> NatTable<Permit> {
        NatTable::new(cfg, now)
    }

    /// A SYN from `src:cport`, admitted in `stage` at `at` with a permit
    /// tagged `cport`.
    fn admitted(
        t: &NatTable<Permit>,
        permits: &Permits,
        src: IpAddr,
        cport: u16,
        stage: Stage,
        at: Instant,
    ) -> Uplink<Permit> {
        let u = t.uplink(&key(src, cport), Some(1), at).unwrap();
        assert!(u.created);
        t.admit(u.port, u.generation, stage, permits.take(cport), at)
            .unwrap();
        u
    }

    #[test]
    fn half_open_bounds_follow_the_admission_limit() {
        assert_eq!(half_open_bounds(8), (4, 4));
        assert_eq!(half_open_bounds(600), (300, 256));
        assert_eq!(
            half_open_bounds(100_000),
            (HALF_OPEN_MAX, HALF_OPEN_PER_SOURCE)
        );
        assert_eq!(half_open_bounds(1), (1, 1), "never zero");
    }

    /// Past the total bound the oldest admitted flow goes, past the
    /// per-source bound the oldest of that source; a newer flow is never
    /// refused, an evicted flow lingers Closing, and its permit is back at
    /// once.
    #[test]
    fn make_room_takes_the_oldest_of_the_source_then_of_all() {
        let t0 = Instant::now();
        let t = table(NatConfig::default(), t0);
        let permits = Permits::default();
        let mut flows = Vec::new();
        for (i, src) in [(1u16, OTHER), (2, SRC), (3, SRC)] {
            flows.push(admitted(
                &t,
                &permits,
                src,
                i,
                Stage::Connecting,
                t0 + u32::from(i) * MS,
            ));
        }
        // A New flow (not admitted) is not counted.
        t.uplink(&key(SRC, 4), Some(1), t0).unwrap();
        assert_eq!(permits.live(), 3);
        assert!(t.make_room_within(SRC, (4, 4), t0).is_none(), "room left");
        // Per source (2 from SRC): SRC's oldest, port 2's flow, not the
        // older one of OTHER.
        let e = t.make_room_within(SRC, (4, 2), t0).expect("evicted");
        assert_eq!(e.port, flows[1].port);
        assert_eq!(e.payload.as_ref().map(|p| p.tag), Some(2));
        drop(e);
        assert_eq!(permits.live(), 2, "its permit is back at once");
        assert!(matches!(
            t.state(flows[1].port),
            Some(NatState::Closing { .. })
        ));
        // In total (cap 2): the oldest of all.
        let e = t.make_room_within(OTHER, (2, 2), t0).expect("evicted");
        assert_eq!(e.port, flows[0].port);
        drop(e);
        assert_eq!(permits.live(), 1);
        // An evicted flow's connect reports back: refused.
        let late = t.connected(flows[1].port, flows[1].generation, t0, 7u8, |p, _| p);
        assert_eq!(late, Err(7), "an evicted connect is refused");
        // Through the admission limit: 4 -> room for 2 in all, 1 is left.
        assert!(t.make_room(SRC, 4, t0).is_none());
        t.check_invariants().unwrap();
    }

    /// Flow A connects on the only port; its entry expires (the app gave
    /// up) and flow B takes the port before A's connect reports back.
    fn reused(permits: &Permits) -> (NatTable<Permit>, Uplink<Permit>, Uplink<Permit>, Instant) {
        let t0 = Instant::now();
        let t = table(
            NatConfig {
                port_range: 7000..=7000,
                ..NatConfig::default()
            },
            t0,
        );
        let a = admitted(&t, permits, SRC, 1, Stage::Connecting, t0);
        let later = t0 + t.config().half_open_timeout;
        let Cleanup { expired, .. } = t.cleanup(later);
        assert_eq!(expired.len(), 1, "A's attachment comes back with its entry");
        drop(expired);
        let b = admitted(&t, permits, SRC, 2, Stage::Connecting, later);
        assert_eq!(a.port, b.port);
        (t, a, b, later)
    }

    #[test]
    fn a_stale_connect_cannot_hand_its_outbound_to_a_newer_flow() {
        let permits = Permits::default();
        let (t, a, b, now) = reused(&permits);
        // A connected: refused, its outbound comes back to close.
        let ready = retag;
        assert_eq!(
            t.connected(a.port, a.generation, now, 1, ready).err(),
            Some(1)
        );
        assert_eq!(
            t.state(b.port),
            Some(NatState::HalfOpen(Stage::Connecting)),
            "B still waits for its own connect"
        );
        // B connects: its accept finds its own outbound.
        assert!(t.connected(b.port, b.generation, now, 20, ready).is_ok());
        let acc = t.accept(b.port, now).unwrap();
        assert_eq!((acc.opened, acc.stage), (b.generation, Stage::Ready));
        assert_eq!(acc.payload.as_ref().map(|p| p.tag), Some(20));
        drop(acc);
        assert_eq!(permits.live(), 0, "every permit came back");
        t.check_invariants().unwrap();
    }

    #[test]
    fn a_stale_failure_leaves_the_newer_flow_pending() {
        let permits = Permits::default();
        let (t, a, b, now) = reused(&permits);
        assert!(
            t.abort_half_open(a.port, a.generation, now).is_none(),
            "A no longer speaks for the port"
        );
        assert_eq!(t.state(b.port), Some(NatState::HalfOpen(Stage::Connecting)));
        let aborted = t.abort_half_open(b.port, b.generation, now).unwrap();
        assert_eq!(aborted.payload.map(|p| p.tag), Some(2));
        assert_eq!(permits.live(), 0);
        assert!(matches!(t.state(b.port), Some(NatState::Closing { .. })));
        t.check_invariants().unwrap();
    }

    /// A Ready flow the kernel does not accept within the handshake time
    /// is closed (and lingers); a Connecting one waits for its task.
    #[test]
    fn ready_flows_time_out_connecting_ones_wait_for_their_task() {
        let t0 = Instant::now();
        let t = table(NatConfig::default(), t0);
        let permits = Permits::default();
        let c = admitted(&t, &permits, SRC, 1, Stage::Connecting, t0);
        let u = admitted(&t, &permits, SRC, 2, Stage::Ready, t0);
        let before = t0 + HANDSHAKE_TIMEOUT - MS;
        assert_eq!(t.cleanup(before).total(), 0);
        let done = t.cleanup(t0 + HANDSHAKE_TIMEOUT);
        assert_eq!(
            done.timed_out.iter().map(|p| p.tag).collect::<Vec<_>>(),
            [2]
        );
        assert_eq!(done.removed.total(), 0, "it lingers");
        drop(done);
        assert!(matches!(t.state(u.port), Some(NatState::Closing { .. })));
        assert_eq!(t.accept(u.port, t0).err(), Some(NatError::NotHalfOpen));
        assert_eq!(t.state(c.port), Some(NatState::HalfOpen(Stage::Connecting)));
        assert_eq!(permits.live(), 1);
        // A half-open timeout shorter than the handshake time is the limit.
        let short = table(
            NatConfig {
                half_open_timeout: Duration::from_secs(1),
                ..NatConfig::default()
            },
            t0,
        );
        admitted(&short, &permits, SRC, 3, Stage::Ready, t0);
        let done = short.cleanup(t0 + Duration::from_secs(1));
        assert_eq!((done.timed_out.len(), done.removed.half_open), (1, 1));
        t.check_invariants().unwrap();
    }

    /// Admission, attach and connected act only on their own flow in the
    /// stage they expect, and hand back what they could not place.
    #[test]
    fn transitions_refuse_another_generation_or_stage() {
        let t0 = Instant::now();
        let t = table(NatConfig::default(), t0);
        let permits = Permits::default();
        let u = t.uplink(&key(SRC, 1), Some(1), t0).unwrap();
        let (port, generation) = (u.port, u.generation);
        let back = |r: Result<(), Permit>| r.err().map(|p| p.tag);
        assert_eq!(
            back(t.admit(port, generation + 1, Stage::Connecting, permits.take(1), t0)),
            Some(1)
        );
        assert_eq!(
            back(t.admit(port, generation, Stage::New, permits.take(2), t0)),
            Some(2)
        );
        assert_eq!(
            back(t.admit(port + 1, generation, Stage::Ready, permits.take(3), t0)),
            Some(3)
        );
        assert!(!t.attach(port, generation, |_| {}), "nothing attached yet");
        assert_eq!(
            back(t.admit(port, generation, Stage::Connecting, permits.take(4), t0)),
            None
        );
        assert_eq!(
            back(t.admit(port, generation, Stage::Ready, permits.take(5), t0)),
            Some(5),
            "admitted once"
        );
        assert_eq!(permits.live(), 1);
        // The engine attaches its task: the update runs on the flow's own.
        assert!(t.attach(port, generation, |p| p.tag = 40));
        assert!(!t.attach(port, generation + 1, |_| panic!("another flow")));
        // A SYN retransmit is held while connecting.
        let again = t.uplink(&key(SRC, 1), Some(1), t0).unwrap();
        assert!(again.held && !again.created);
        assert!(
            !t.uplink(&key(SRC, 1), None, t0).unwrap().held,
            "only a SYN is"
        );
        t.connected(port, generation, t0, 41, retag).unwrap();
        // Ready: attach no longer updates but the flow lives on.
        assert!(t.attach(port, generation, |_| panic!("connect is over")));
        assert_eq!(t.connected(port, generation, t0, 42, |p, _| p), Err(42));
        assert!(!t.uplink(&key(SRC, 1), Some(1), t0).unwrap().held);
        let acc = t.accept(port, t0).unwrap();
        assert_eq!(acc.payload.map(|p| p.tag), Some(41));
        assert!(!t.attach(port, generation, |_| {}), "accepted");
        assert_eq!(permits.live(), 0);
        t.check_invariants().unwrap();
    }

    /// Whatever displaces a half-open flow hands back what was attached to
    /// it: a SYN with a new ISN (replaced), a full table (evicted, also when
    /// the newcomer is then refused for want of a port), an accept of a
    /// flow whose SYN was never released.
    #[test]
    fn displaced_flows_hand_back_their_attachments() {
        let t0 = Instant::now();
        let permits = Permits::default();
        let t = table(NatConfig::default(), t0);
        let old = admitted(&t, &permits, SRC, 1, Stage::Connecting, t0);
        let new = t.uplink(&key(SRC, 1), Some(2), t0).unwrap();
        assert!(new.created && new.port != old.port);
        assert_eq!(new.replaced.map(|p| p.tag), Some(1));
        assert_eq!(t.state(old.port), None);
        // Accepted while still connecting: not the app's connection (its
        // SYN is held), and the attachment comes back with the stage.
        t.admit(
            new.port,
            new.generation,
            Stage::Connecting,
            permits.take(5),
            t0,
        )
        .unwrap();
        let acc = t.accept(new.port, t0).unwrap();
        assert_eq!(acc.stage, Stage::Connecting);
        assert_eq!(acc.payload.map(|p| p.tag), Some(5));
        assert_eq!(permits.live(), 0);
        t.check_invariants().unwrap();

        // Two entries in 8 ports, one probe per allocation.
        let t = table(
            NatConfig {
                port_range: 100..=107,
                max_entries: 2,
                max_probes: 1,
                ..NatConfig::default()
            },
            t0,
        );
        let a = admitted(&t, &permits, SRC, 1, Stage::Connecting, t0);
        let b = t.uplink(&key(SRC, 2), Some(1), t0).unwrap();
        let c = t.uplink(&key(SRC, 3), Some(1), t0).unwrap();
        let evicted = c.evicted.expect("the full table evicted");
        assert_eq!(
            (evicted.port, evicted.payload.map(|p| p.tag)),
            (a.port, Some(1))
        );
        assert_eq!(permits.live(), 0);
        // Full again (b, c): b, unanswered, is evicted, but the one probe
        // lands on c's port and the newcomer is refused all the same.
        let probe_c = u32::from(c.port - 100);
        t.cursor.store(probe_c, Relaxed);
        t.admit(b.port, b.generation, Stage::Ready, permits.take(2), t0)
            .unwrap();
        let Err(Refused { error, evicted }) = t.uplink(&key(SRC, 4), Some(1), t0) else {
            panic!("refused");
        };
        assert_eq!(error, NatError::NoFreePort);
        let evicted = evicted.expect("evicted before the refusal");
        assert_eq!(
            (evicted.port, evicted.payload.map(|p| p.tag)),
            (b.port, Some(2))
        );
        assert_eq!(permits.live(), 0);
        assert_eq!(t.len(), 1);
        t.check_invariants().unwrap();
    }
}
