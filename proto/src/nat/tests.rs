//! The flow table's tests: transitions, timeouts, budget and ports, a
//! random operation model, and a concurrent stress test.
#![allow(clippy::unwrap_used)]

use super::shard::Mapping;
use super::*;
use std::net::SocketAddr;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::thread;

const SEC: Duration = Duration::from_secs(1);

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn flow(cport: u16) -> FlowKey {
    FlowKey::new(sa(&format!("10.0.0.9:{cport}")), sa("1.1.1.1:443"))
}

fn flow6(cport: u16) -> FlowKey {
    FlowKey::new(
        sa(&format!("[fd00::9]:{cport}")),
        sa("[2606:4700::1111]:443"),
    )
}

fn cfg() -> NatConfig {
    NatConfig::default()
}

fn table(cfg: NatConfig) -> (Arc<TestClock>, Arc<Table>) {
    table_of(cfg)
}

/// A table whose half-open flows carry a `P`.
fn table_of<P>(cfg: NatConfig) -> (Arc<TestClock>, Arc<Table<P>>) {
    let clock = Arc::new(TestClock::new());
    let t = Arc::new(Table {
        t: NatTable::new(cfg, clock.now()),
        clock: Arc::clone(&clock),
    });
    (clock, t)
}

/// A clock that only moves when told to, shared by the threads of a test.
/// Saturates instead of overflowing: an advance that would leave
/// `Instant`'s range (or 584 years of offset) is ignored.
struct TestClock {
    base: Instant,
    offset_ns: AtomicU64,
}

impl TestClock {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            offset_ns: AtomicU64::new(0),
        }
    }

    fn advance(&self, by: Duration) {
        let by_ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self.offset_ns.fetch_update(SeqCst, SeqCst, |cur| {
            let next = cur.checked_add(by_ns)?;
            self.base.checked_add(Duration::from_nanos(next))?;
            Some(next)
        });
    }

    fn now(&self) -> Instant {
        let offset = Duration::from_nanos(self.offset_ns.load(SeqCst));
        self.base.checked_add(offset).unwrap_or(self.base)
    }
}

/// A table and the clock its guards read.
struct Table<P = ()> {
    t: NatTable<P>,
    clock: Arc<TestClock>,
}

impl<P> std::ops::Deref for Table<P> {
    type Target = NatTable<P>;
    fn deref(&self) -> &NatTable<P> {
        &self.t
    }
}

impl<P> Table<P> {
    /// A session's hold on its accepted entry, as the engine's: dropping
    /// it (normally or while a panic unwinds) marks the entry Closing at
    /// the clock's time.
    #[must_use = "dropping the guard marks the entry Closing at once"]
    fn guard(self: &Arc<Self>, accepted: &Accepted<P>) -> Guard<P> {
        Guard {
            table: Arc::clone(self),
            port: accepted.port,
            generation: accepted.generation,
            opened: accepted.opened,
        }
    }
}

struct Guard<P = ()> {
    table: Arc<Table<P>>,
    port: u16,
    generation: u64,
    opened: u64,
}

impl<P> Guard<P> {
    /// The generation of the SYN that opened the accepted entry.
    fn opened(&self) -> u64 {
        self.opened
    }

    fn port(&self) -> u16 {
        self.port
    }

    fn generation(&self) -> u64 {
        self.generation
    }
}

impl<P> Drop for Guard<P> {
    fn drop(&mut self) {
        let now = self.table.clock.now();
        self.table.mark_closing(self.port, self.generation, now);
    }
}

/// An existing entry's uplink result.
fn existing(port: u16, generation: u64) -> Uplink {
    Uplink::existing(port, generation, false)
}

fn ok(t: &NatTable) {
    t.check_invariants().unwrap();
}

/// The table's entries by phase: (half-open, active, closing).
fn phases(t: &NatTable) -> (usize, usize, usize) {
    let c = t.counts();
    (c.half_open, c.active, c.closing)
}

/// SYN, accept and guard for `key`.
fn open(t: &Arc<Table>, key: &FlowKey, now: Instant) -> Guard {
    let u = t.uplink(key, Some(0), now).unwrap();
    assert!(u.created);
    t.guard(&t.accept(u.port, now).unwrap())
}

/// A SYN with another ISN on a live connection (the app sent neither FIN
/// nor RST) is the old connection's segment: same port, nothing created,
/// the entry stays Active and is not refreshed; the old connection's
/// kernel socket answers it with a challenge ACK. A spoofed SYN on a live
/// 4-tuple cannot end the connection.
#[test]
fn syn_with_a_new_isn_on_a_live_active_entry_goes_to_the_old_connection() {
    let (clock, t) = table(NatConfig::default());
    let now = clock.now();
    let k = flow(40002);
    let first = t.uplink(&k, Some(1000), now).expect("syn");
    let acc = t.accept(first.port, now).expect("accept");
    let _guard = t.guard(&acc);
    for isn in [1u32, 777, 0xFFFF_FFFF] {
        let spoofed = t.uplink(&k, Some(isn), now + SEC).expect("spoofed");
        assert_eq!(spoofed, existing(first.port, acc.generation));
    }
    assert_eq!(t.state(first.port), Some(NatState::Active));
    assert_eq!((t.counts().active, t.counts().half_open), (1, 0));
    assert_eq!(t.error_counts().syn_on_active, 3);
    // Not refreshed by the spoofed SYNs: idle since `now`.
    t.cleanup(now + 2 * SEC);
    assert_eq!(t.state(first.port), Some(NatState::Active));
    t.check_invariants().expect("invariants");
}

#[test]
fn syn_with_a_new_isn_after_the_apps_fin_is_a_new_connection() {
    for app_closing in ["FIN", "RST"] {
        let (clock, t) = table(NatConfig::default());
        let now = clock.now();
        let k = flow(40000);
        let first = t.uplink(&k, Some(1000), now).expect("syn");
        let acc = t.accept(first.port, now).expect("accept");
        let guard = t.guard(&acc);
        // Retransmit of the original SYN: same ISN, same port.
        let again = t.uplink(&k, Some(1000), now).expect("retransmit");
        assert_eq!((again.port, again.created), (first.port, false));
        // The app closes its side ...
        let fin = t.uplink_segment(&k, None, true, now).expect(app_closing);
        assert_eq!(fin, existing(first.port, acc.generation));
        // ... and reuses the 4-tuple for a new connection before the old
        // session ended: another ISN gets a different port.
        let second = t.uplink(&k, Some(777), now).expect("new connection");
        assert!(second.created, "{app_closing}");
        assert_ne!(second.port, first.port);
        assert_eq!(t.state(first.port), None, "old mapping retired");
        assert_eq!(t.counts().active, 0);
        assert_eq!(t.counts().half_open, 1);
        assert_eq!(t.error_counts().syn_on_active, 0);
        // The old session's guard cannot touch the new entry.
        drop(guard);
        assert_eq!(t.state(second.port), Some(NatState::HalfOpen(Stage::New)));
        assert_eq!(t.len(), 1, "the replacement took over the budget slot");
        t.check_invariants().expect("invariants");
    }
}

#[test]
fn syn_with_a_new_isn_on_a_half_open_entry_replaces_it() {
    let (clock, t) = table(NatConfig::default());
    let now = clock.now();
    let k = flow(40001);
    let first = t.uplink(&k, Some(5), now).expect("syn");
    let second = t.uplink(&k, Some(6), now).expect("new attempt");
    assert!(second.created && second.port != first.port);
    assert_eq!(t.accept(first.port, now), Err(NatError::NoMapping));
    assert!(t.accept(second.port, now).is_ok());
    t.check_invariants().expect("invariants");
}

#[test]
#[cfg(target_pointer_width = "64")]
fn entry_size_is_within_the_design_target() {
    use std::mem::size_of;
    assert_eq!(size_of::<PackedKey>(), 38);
    assert_eq!(size_of::<Mapping>(), 72);
    assert_eq!(size_of::<(u16, Mapping)>(), 80);
    assert_eq!(size_of::<(PackedKey, u16)>(), 40);
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "NAT lock order violated")]
fn lock_order_check_catches_reverse_before_forward() {
    let (_clock, t) = table(cfg());
    let _rev = t.reverse_shard(1).read();
    let _fwd = t.forward[0].read();
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "NAT lock order violated")]
fn lock_order_check_catches_two_reverse_shards() {
    let (_clock, t) = table(cfg());
    let _a = t.reverse_shard(1).read();
    let _b = t.reverse_shard(2).read();
}

#[test]
fn syn_allocates_and_downlink_restores() {
    let (clock, t) = table(cfg());
    let now = clock.now();
    let k = flow(12345);
    let u = t.uplink(&k, Some(0), now).unwrap();
    assert!(u.created);
    assert!(t.config().port_range.contains(&u.port));
    assert_eq!(t.downlink(u.port, now), Some(k));
    assert_eq!(t.lookup(&k), Some(u.port));
    assert_eq!(t.state(u.port), Some(NatState::HalfOpen(Stage::New)));
    // The ACK of the handshake and later segments find the same port.
    assert_eq!(
        t.uplink(&k, None, now).unwrap(),
        existing(u.port, u.generation)
    );
    assert_eq!(phases(&t), (1, 0, 0));
    assert_eq!(t.len(), 1);
    ok(&t);
}

#[test]
fn syn_retransmit_reuses_half_open() {
    let (clock, t) = table(cfg());
    let k = flow(1);
    let first = t.uplink(&k, Some(0), clock.now()).unwrap();
    clock.advance(SEC);
    let again = t.uplink(&k, Some(0), clock.now()).unwrap();
    assert_eq!(again, existing(first.port, first.generation));
    assert_eq!(t.len(), 1);
    ok(&t);
}

#[test]
fn stray_segment_never_allocates() {
    let (clock, t) = table(cfg());
    assert_eq!(
        t.uplink(&flow(1), None, clock.now()),
        Err(NatError::NoMapping.into())
    );
    assert!(t.is_empty());
    assert_eq!(t.error_counts().no_mapping, 1);
    assert_eq!(t.error_counts().downlink_no_mapping, 0);
    ok(&t);
}

#[test]
fn unmapped_downlink_is_dropped_and_counted() {
    let (clock, t) = table(cfg());
    let u = t.uplink(&flow(1), Some(0), clock.now()).unwrap();
    let other = if u.port == 10000 { 10001 } else { 10000 };
    assert_eq!(t.downlink(other, clock.now()), None);
    assert_eq!(t.downlink(0, clock.now()), None);
    let e = t.error_counts();
    assert_eq!((e.no_mapping, e.downlink_no_mapping), (2, 2));
}

#[test]
fn accept_marks_active_with_strictly_increasing_generations() {
    let (clock, t) = table(cfg());
    let now = clock.now();
    let mut last = 0;
    for i in 0..16 {
        let k = if i % 2 == 0 { flow(i) } else { flow6(i) };
        let u = t.uplink(&k, Some(0), now).unwrap();
        let a = t.accept(u.port, now).unwrap();
        assert_eq!((a.key, a.port), (k, u.port));
        assert!(a.generation > last, "{} after {last}", a.generation);
        last = a.generation;
        assert_eq!(t.state(u.port), Some(NatState::Active));
    }
    assert_eq!(phases(&t), (0, 16, 0));
    ok(&t);
}

#[test]
fn accept_refuses_unknown_accepted_and_closing_ports() {
    let (clock, t) = table(cfg());
    let now = clock.now();
    assert_eq!(t.accept(10000, now), Err(NatError::NoMapping));
    let u = t.uplink(&flow(1), Some(0), now).unwrap();
    let a = t.accept(u.port, now).unwrap();
    assert_eq!(t.accept(u.port, now), Err(NatError::NotHalfOpen));
    assert!(t.mark_closing(u.port, a.generation, now));
    assert_eq!(t.accept(u.port, now), Err(NatError::NotHalfOpen));
    assert_eq!(t.error_counts().accept_refused, 3);
    assert_eq!(t.state(u.port), Some(NatState::Closing { since: now }));
    ok(&t);
}

/// A connection whose SYN is not the one that opened the entry (another
/// ISN) is refused and changes nothing: the app's own SYN is accepted
/// afterwards, with the generation it opened.
#[test]
fn accept_with_another_syn_is_refused_and_leaves_the_entry() {
    let (clock, t) = table(cfg());
    let now = clock.now();
    let u = t.uplink(&flow(1), Some(0x1234_5678), now).unwrap();
    assert_eq!(
        t.accept_syn(u.port, Some(0x1234_5679), now),
        Err(NatError::IsnMismatch)
    );
    assert_eq!(t.state(u.port), Some(NatState::HalfOpen(Stage::New)));
    assert_eq!(t.error_counts().accept_refused, 1);
    let a = t.accept_syn(u.port, Some(0x1234_5678), now).unwrap();
    assert_eq!(a.opened, u.generation);
    assert_eq!(t.state(u.port), Some(NatState::Active));
    // Without a saved SYN the address is all there is to check.
    let v = t.uplink(&flow(2), Some(9), now).unwrap();
    assert!(t.accept_syn(v.port, None, now).is_ok());
    ok(&t);
}

#[test]
fn new_syn_on_closing_takes_another_port_and_old_marks_cannot_touch_it() {
    // Two ports only, so the old port is certain to be handed out again
    // while stale references to it (guard, cleanup candidate) exist.
    let (clock, t) = table(NatConfig {
        port_range: 20000..=20001,
        ..cfg()
    });
    let k = flow(7);
    let u1 = t.uplink(&k, Some(0), clock.now()).unwrap();
    let a1 = t.accept(u1.port, clock.now()).unwrap();
    let old_guard = t.guard(&a1);
    // Admission refused the session: Closing while the guard still lives.
    assert!(t.mark_closing(u1.port, a1.generation, clock.now()));
    clock.advance(10 * SEC);
    let stale = t.collect_expired(clock.now());
    assert_eq!(stale.len(), 1);

    // The app reuses the 4-tuple: a different port, the old entry gone.
    let u2 = t.uplink(&k, Some(0), clock.now()).unwrap();
    assert!(u2.created);
    assert_ne!(u2.port, u1.port);
    assert_eq!(t.lookup(&k), Some(u2.port));
    assert_eq!(t.state(u1.port), None);
    assert_eq!(phases(&t), (1, 0, 0));
    ok(&t);
    let a2 = t.accept(u2.port, clock.now()).unwrap();

    // Another flow now takes the old port.
    let other = flow(8);
    let u3 = t.uplink(&other, Some(0), clock.now()).unwrap();
    assert_eq!(u3.port, u1.port);

    // The old linger candidate and the old guard touch nothing.
    assert_eq!(t.remove_if_expired(&stale, clock.now()).total(), 0);
    drop(old_guard);
    assert_eq!(t.state(u2.port), Some(NatState::Active));
    assert_eq!(t.state(u1.port), Some(NatState::HalfOpen(Stage::New)));
    assert_eq!(t.downlink(u2.port, clock.now()), Some(k));
    assert_eq!(t.downlink(u1.port, clock.now()), Some(other));
    clock.advance(10 * SEC);
    assert_eq!(t.cleanup(clock.now()).removed.active, 0);
    assert_eq!(t.lookup(&k), Some(u2.port));
    assert!(t.mark_closing(u2.port, a2.generation, clock.now()));
    ok(&t);
}

#[test]
fn new_syn_on_closing_needs_no_extra_budget_but_a_free_port() {
    let (clock, t) = table(NatConfig {
        max_entries: 1,
        port_range: 30000..=30001,
        ..cfg()
    });
    let k = flow(1);
    let g = open(&t, &k, clock.now());
    drop(g);
    let u = t.uplink(&k, Some(0), clock.now()).unwrap();
    assert!(u.created);
    assert_eq!(t.len(), 1);
    ok(&t);

    // Range of one: the only port is the Closing entry's, so the new
    // connection is refused and the old entry keeps lingering.
    let (clock, t) = table(NatConfig {
        port_range: 30000..=30000,
        ..cfg()
    });
    drop(open(&t, &k, clock.now()));
    assert_eq!(
        t.uplink(&k, Some(0), clock.now()),
        Err(NatError::NoFreePort.into())
    );
    assert!(matches!(t.state(30000), Some(NatState::Closing { .. })));
    assert_eq!(t.uplink(&k, None, clock.now()).unwrap().port, 30000);
    ok(&t);
}

#[test]
fn late_segments_on_closing_are_translated_without_extending_linger() {
    let (clock, t) = table(cfg());
    let k = flow(1);
    let g = open(&t, &k, clock.now());
    let (port, generation) = (g.port(), g.generation());
    drop(g);
    clock.advance(9 * SEC);
    assert_eq!(
        t.uplink(&k, None, clock.now()).unwrap(),
        existing(port, generation)
    );
    assert_eq!(t.downlink(port, clock.now()), Some(k));
    clock.advance(SEC);
    let r = t.cleanup(clock.now()).removed;
    assert_eq!(
        r,
        CleanupReport {
            half_open: 0,
            active: 0,
            closing: 1
        }
    );
    assert_eq!(
        t.uplink(&k, None, clock.now()),
        Err(NatError::NoMapping.into())
    );
    assert_eq!(t.downlink(port, clock.now()), None);
    assert!(t.is_empty());
    ok(&t);
}

#[test]
fn guard_drop_marks_closing_with_the_table_clock() {
    let (clock, t) = table(cfg());
    let g = open(&t, &flow(1), clock.now());
    let port = g.port();
    clock.advance(5 * SEC);
    drop(g);
    assert_eq!(
        t.state(port),
        Some(NatState::Closing { since: clock.now() })
    );
    assert_eq!(phases(&t), (0, 0, 1));
    ok(&t);
}

#[test]
fn guard_dropped_during_a_panic_marks_closing() {
    let (clock, t) = table(cfg());
    let u = t.uplink(&flow(1), Some(0), clock.now()).unwrap();
    let a = t.accept(u.port, clock.now()).unwrap();
    let t2 = Arc::clone(&t);
    let result = panic::catch_unwind(AssertUnwindSafe(move || {
        let _guard = t2.guard(&a);
        panic!("session task failed (expected by this test)");
    }));
    assert!(result.is_err());
    assert!(matches!(t.state(u.port), Some(NatState::Closing { .. })));
    assert_eq!(t.counts().active, 0);
    ok(&t);
}

#[test]
fn mark_closing_needs_the_current_generation_and_does_not_restamp() {
    let (clock, t) = table(cfg());
    let now = clock.now();
    let u = t.uplink(&flow(1), Some(0), now).unwrap();
    let a = t.accept(u.port, now).unwrap();
    assert!(!t.mark_closing(u.port, a.generation + 1, now));
    assert!(!t.mark_closing(u.port.wrapping_add(1), a.generation, now));
    assert_eq!(t.state(u.port), Some(NatState::Active));
    assert!(t.mark_closing(u.port, a.generation, now));
    clock.advance(5 * SEC);
    assert!(!t.mark_closing(u.port, a.generation, clock.now()));
    assert_eq!(t.state(u.port), Some(NatState::Closing { since: now }));
    ok(&t);
}

#[test]
fn abort_half_open_only_closes_half_open() {
    let (clock, t) = table(cfg());
    let now = clock.now();
    let u = t.uplink(&flow(1), Some(0), now).unwrap();
    assert!(t.abort_half_open(u.port, u.generation + 1, now).is_none());
    assert!(t.abort_half_open(u.port, u.generation, now).is_some());
    assert!(t.abort_half_open(u.port, u.generation, now).is_none());
    assert!(matches!(t.state(u.port), Some(NatState::Closing { .. })));
    let g = open(&t, &flow(2), now);
    assert!(t.abort_half_open(g.port(), g.generation(), now).is_none());
    assert!(t.abort_half_open(g.port(), g.opened(), now).is_none());
    assert!(t.abort_half_open(1, 0, now).is_none());
    assert_eq!(phases(&t), (0, 1, 1));
    ok(&t);
}

#[test]
fn a_stale_abort_leaves_a_newer_flow_on_the_same_port_alone() {
    // One port, so the second flow must reuse the first one's.
    let (clock, t) = table(NatConfig {
        port_range: 40000..=40000,
        ..cfg()
    });
    let a = t.uplink(&flow(1), Some(0), clock.now()).unwrap();
    // A's connect outlives its HalfOpen entry, which expires...
    clock.advance(t.config().half_open_timeout);
    assert_eq!(t.cleanup(clock.now()).removed.half_open, 1);
    // ...and a new flow gets the same port.
    let b = t.uplink(&flow(2), Some(0), clock.now()).unwrap();
    assert_eq!((b.port, b.created), (a.port, true));
    assert_ne!(b.generation, a.generation);
    // A's connect now fails: its abort must not close B.
    assert!(
        t.abort_half_open(a.port, a.generation, clock.now())
            .is_none()
    );
    assert_eq!(t.state(b.port), Some(NatState::HalfOpen(Stage::New)));
    let acc = t.accept(b.port, clock.now()).unwrap();
    assert_eq!((acc.key, acc.opened), (flow(2), b.generation));
    ok(&t);
}

#[test]
fn idle_left_counts_down_from_the_last_packet_and_ends_with_the_entry() {
    let (clock, t) = table(NatConfig {
        idle_timeout: 10 * SEC,
        ..cfg()
    });
    let k = flow(1);
    let g = open(&t, &k, clock.now());
    let (port, generation) = (g.port(), g.generation());
    assert_eq!(t.idle_left(port, generation, clock.now()), Some(10 * SEC));
    clock.advance(4 * SEC);
    assert_eq!(t.idle_left(port, generation, clock.now()), Some(6 * SEC));
    // A packet in either direction restarts the count.
    t.downlink(port, clock.now());
    assert_eq!(t.idle_left(port, generation, clock.now()), Some(10 * SEC));
    clock.advance(10 * SEC);
    assert_eq!(
        t.idle_left(port, generation, clock.now()),
        Some(Duration::ZERO)
    );
    // Another generation, an expired or a Closing entry: nothing to wait for.
    assert_eq!(t.idle_left(port, generation + 1, clock.now()), None);
    assert_eq!(t.cleanup(clock.now()).removed.active, 1);
    assert_eq!(t.idle_left(port, generation, clock.now()), None);
    let g2 = open(&t, &flow(2), clock.now());
    let (p2, gen2) = (g2.port(), g2.generation());
    drop(g2);
    assert_eq!(t.idle_left(p2, gen2, clock.now()), None);
    drop(g);
    ok(&t);
}

#[test]
fn budget_of_one_refuses_counts_and_recovers_after_cleanup() {
    let (clock, t) = table(NatConfig {
        max_entries: 1,
        ..cfg()
    });
    let g = open(&t, &flow(1), clock.now());
    assert_eq!(
        t.uplink(&flow(2), Some(0), clock.now()),
        Err(NatError::TableFull.into())
    );
    assert_eq!(t.error_counts().table_full, 1);
    assert_eq!(t.len(), 1);
    ok(&t);
    drop(g);
    // Lingering entries still count against the budget.
    assert_eq!(
        t.uplink(&flow(2), Some(0), clock.now()),
        Err(NatError::TableFull.into())
    );
    clock.advance(10 * SEC);
    assert_eq!(t.cleanup(clock.now()).removed.closing, 1);
    assert!(t.uplink(&flow(2), Some(0), clock.now()).unwrap().created);
    assert_eq!(t.error_counts().table_full, 2);
    ok(&t);
}

/// A full table of unanswered entries (HalfOpen, or Closing after a
/// failed connect) evicts its oldest for a newcomer; accepted entries
/// are never evicted, so a table full of them still refuses.
#[test]
fn full_table_evicts_the_oldest_unanswered_never_an_accepted_one() {
    let (clock, t) = table(NatConfig {
        max_entries: 3,
        ..cfg()
    });
    let now = clock.now();
    let g = open(&t, &flow(1), now);
    let a = t.uplink(&flow(2), Some(0), now).unwrap();
    let b = t.uplink(&flow(3), Some(0), now).unwrap();
    assert!(
        t.abort_half_open(b.port, b.generation, now).is_some(),
        "b's connect failed"
    );
    // Full: the oldest unanswered (a, HalfOpen) goes first, then b.
    let c = t.uplink(&flow(4), Some(0), now).unwrap();
    assert!(c.created && c.evicted.is_some());
    assert_eq!(t.state(a.port), None);
    assert_eq!(t.lookup(&flow(2)), None);
    let d = t.uplink(&flow(5), Some(0), now).unwrap();
    assert!(d.created && d.evicted.is_some());
    assert_eq!(t.state(b.port), None);
    ok(&t);
    // c and d answered: now the table holds only accepted entries.
    t.accept(c.port, now).unwrap();
    t.accept(d.port, now).unwrap();
    assert_eq!(
        t.uplink(&flow(6), Some(0), now),
        Err(NatError::TableFull.into())
    );
    assert_eq!(t.lookup(&flow(1)), Some(g.port()));
    assert_eq!(t.error_counts().evicted, 2);
    assert_eq!(t.len(), 3);
    ok(&t);
}

/// A long flood of never-answered SYNs through a small table: every
/// newcomer gets an entry, the eviction queue stays bounded, and the
/// table stays consistent.
#[test]
fn unanswered_flood_recycles_its_own_entries() {
    let (clock, t) = table(NatConfig {
        max_entries: 16,
        ..cfg()
    });
    let now = clock.now();
    let live = open(&t, &flow(1), now);
    // Far past the budget either way; Miri (CI) runs fewer rounds.
    for i in 0..if cfg!(miri) { 100u16 } else { 2_000 } {
        let u = t.uplink(&flow6(i), Some(u32::from(i)), now).unwrap();
        assert!(u.created, "SYN {i} refused");
        if i < 6 {
            // Some are answered: never evicted after.
            t.accept(u.port, now).unwrap();
        }
        assert!(t.unanswered.lock().len() <= 2 * 16 + 1);
    }
    ok(&t);
    assert_eq!(t.lookup(&flow(1)), Some(live.port()));
    assert_eq!(t.len(), 16);
}

#[test]
fn zero_budget_refuses_everything() {
    let (clock, t) = table(NatConfig {
        max_entries: 0,
        ..cfg()
    });
    assert_eq!(
        t.uplink(&flow(1), Some(0), clock.now()),
        Err(NatError::TableFull.into())
    );
    ok(&t);
}

#[test]
fn exhausted_port_range_is_an_error_not_a_spin() {
    let (clock, t) = table(NatConfig {
        port_range: 20000..=20003,
        ..cfg()
    });
    let now = clock.now();
    let mut ports: Vec<u16> = (0..4)
        .map(|i| t.uplink(&flow(i), Some(0), now).unwrap().port)
        .collect();
    ports.sort_unstable();
    assert_eq!(ports, [20000, 20001, 20002, 20003]);
    assert_eq!(
        t.uplink(&flow(4), Some(0), now),
        Err(NatError::NoFreePort.into())
    );
    assert_eq!(
        t.uplink(&flow6(4), Some(0), now),
        Err(NatError::NoFreePort.into())
    );
    assert_eq!(t.error_counts().no_free_port, 2);
    // The failed allocations gave their budget reservation back.
    assert_eq!(t.len(), 4);
    ok(&t);
}

#[test]
fn probe_limit_bounds_allocation() {
    let (clock, t) = table(NatConfig {
        max_probes: 0,
        ..cfg()
    });
    assert_eq!(
        t.uplink(&flow(1), Some(0), clock.now()),
        Err(NatError::NoFreePort.into())
    );
    // 3 probes over a range of 8 with 6 taken: the 3 candidates after
    // the cursor are all taken, and the free ports are beyond the limit.
    let (clock, t) = table(NatConfig {
        port_range: 100..=107,
        max_probes: 3,
        ..cfg()
    });
    for i in 0..6 {
        t.uplink(&flow(i), Some(0), clock.now()).unwrap();
    }
    t.cursor.store(0, Relaxed);
    assert_eq!(
        t.uplink(&flow(9), Some(0), clock.now()),
        Err(NatError::NoFreePort.into())
    );
    // Exactly three candidates were examined.
    assert_eq!(t.cursor.load(Relaxed), 3);
    t.cursor.store(4, Relaxed);
    assert_eq!(t.uplink(&flow(9), Some(0), clock.now()).unwrap().port, 106);
    ok(&t);
}

#[test]
#[allow(clippy::reversed_empty_ranges)]
fn port_range_edges() {
    // Top of the port space, a range of one.
    let (clock, t) = table(NatConfig {
        port_range: 65535..=65535,
        ..cfg()
    });
    assert_eq!(
        t.uplink(&flow(1), Some(0), clock.now()).unwrap().port,
        65535
    );
    assert_eq!(
        t.uplink(&flow(2), Some(0), clock.now()),
        Err(NatError::NoFreePort.into())
    );
    assert_eq!(t.downlink(65535, clock.now()), Some(flow(1)));
    ok(&t);
    // Port 0 is never handed out.
    let (clock, t) = table(NatConfig {
        port_range: 0..=1,
        ..cfg()
    });
    assert_eq!(t.uplink(&flow(1), Some(0), clock.now()).unwrap().port, 1);
    assert_eq!(
        t.uplink(&flow(2), Some(0), clock.now()),
        Err(NatError::NoFreePort.into())
    );
    ok(&t);
    let (clock, t) = table(NatConfig {
        port_range: 0..=0,
        ..cfg()
    });
    assert_eq!(
        t.uplink(&flow(1), Some(0), clock.now()),
        Err(NatError::NoFreePort.into())
    );
    // An empty range.
    let (clock, t) = table(NatConfig {
        port_range: 5..=4,
        ..cfg()
    });
    assert_eq!(
        t.uplink(&flow(1), Some(0), clock.now()),
        Err(NatError::NoFreePort.into())
    );
    assert!(t.is_empty());
    ok(&t);
    // The whole port space, wrapping the cursor past 65535.
    let (clock, t) = table(NatConfig {
        port_range: 0..=65535,
        ..cfg()
    });
    t.cursor.store(65534, Relaxed);
    let ports: Vec<u16> = (0..3)
        .map(|i| t.uplink(&flow(i), Some(0), clock.now()).unwrap().port)
        .collect();
    assert_eq!(ports, [65534, 65535, 1]);
    ok(&t);
}

#[test]
fn cursor_rotates_instead_of_reusing_a_freed_port() {
    let (clock, t) = table(cfg());
    let u = t.uplink(&flow(1), Some(0), clock.now()).unwrap();
    assert!(
        t.abort_half_open(u.port, u.generation, clock.now())
            .is_some()
    );
    clock.advance(10 * SEC);
    assert_eq!(t.cleanup(clock.now()).removed.closing, 1);
    assert_ne!(
        t.uplink(&flow(2), Some(0), clock.now()).unwrap().port,
        u.port
    );
}

#[test]
fn ipv4_and_ipv6_share_one_port_space() {
    let (clock, t) = table(NatConfig {
        port_range: 40000..=40001,
        ..cfg()
    });
    let now = clock.now();
    let p4 = t.uplink(&flow(5), Some(0), now).unwrap().port;
    let p6 = t.uplink(&flow6(5), Some(0), now).unwrap().port;
    assert_ne!(p4, p6);
    assert_eq!(
        t.uplink(&flow(6), Some(0), now),
        Err(NatError::NoFreePort.into())
    );
    assert_eq!(t.downlink(p4, now), Some(flow(5)));
    assert_eq!(t.downlink(p6, now), Some(flow6(5)));
    ok(&t);
}

#[test]
fn cleanup_timeouts_per_state() {
    let (clock, t) = table(cfg());
    let start = clock.now();
    let half = t.uplink(&flow(1), Some(0), start).unwrap().port;
    let active = open(&t, &flow(2), start);
    let closing = open(&t, &flow(3), start);
    let closing_port = closing.port();
    drop(closing);
    let at = |d: Duration| start + d;
    let none = CleanupReport::default();
    assert_eq!(t.cleanup(at(Duration::from_millis(9_999))).removed, none);
    assert_eq!(
        t.cleanup(at(10 * SEC)).removed,
        CleanupReport { closing: 1, ..none }
    );
    assert_eq!(t.cleanup(at(Duration::from_millis(29_999))).removed, none);
    assert_eq!(
        t.cleanup(at(30 * SEC)).removed,
        CleanupReport {
            half_open: 1,
            ..none
        }
    );
    assert_eq!(t.cleanup(at(Duration::from_secs(7439))).removed, none);
    assert_eq!(
        t.cleanup(at(Duration::from_secs(7440))).removed,
        CleanupReport { active: 1, ..none }
    );
    assert!(t.is_empty());
    for port in [half, active.port(), closing_port] {
        assert_eq!(t.state(port), None);
    }
    // The idle entry is gone; its guard dropping later is harmless.
    drop(active);
    assert!(t.is_empty());
    ok(&t);
}

#[test]
fn traffic_keeps_entries_alive() {
    let (clock, t) = table(cfg());
    let k = flow(1);
    let g = open(&t, &k, clock.now());
    for _ in 0..3 {
        clock.advance(Duration::from_secs(7000));
        // Alternate directions: either refreshes.
        t.uplink(&k, None, clock.now()).unwrap();
        clock.advance(Duration::from_secs(7000));
        t.downlink(g.port(), clock.now()).unwrap();
        assert_eq!(t.cleanup(clock.now()).total(), 0);
    }
    let h = t.uplink(&flow(2), Some(0), clock.now()).unwrap().port;
    clock.advance(20 * SEC);
    t.uplink(&flow(2), Some(0), clock.now()).unwrap(); // SYN retransmit
    clock.advance(20 * SEC);
    assert_eq!(t.cleanup(clock.now()).total(), 0);
    assert_eq!(t.state(h), Some(NatState::HalfOpen(Stage::New)));
    ok(&t);
}

#[test]
fn packet_between_collect_and_remove_keeps_the_mapping() {
    let (clock, t) = table(cfg());
    let k = flow(1);
    let g = open(&t, &k, clock.now());
    let h = t.uplink(&flow(2), Some(0), clock.now()).unwrap().port;
    clock.advance(Duration::from_secs(7440));
    let now = clock.now();
    let expired = t.collect_expired(now);
    assert_eq!(expired.len(), 2);
    // Segments arrive after the scan, before the deletion.
    t.uplink(&k, None, now).unwrap();
    t.downlink(h, now).unwrap();
    assert_eq!(t.remove_if_expired(&expired, now).total(), 0);
    assert_eq!(t.state(g.port()), Some(NatState::Active));
    assert_eq!(t.state(h), Some(NatState::HalfOpen(Stage::New)));
    ok(&t);
    // Without traffic the same candidates are removed.
    let later = now + Duration::from_secs(7440);
    let expired = t.collect_expired(later);
    assert_eq!(t.remove_if_expired(&expired, later).total(), 2);
    assert!(t.is_empty());
    ok(&t);
}

#[test]
fn accept_between_collect_and_remove_keeps_the_mapping() {
    let (clock, t) = table(cfg());
    let u = t.uplink(&flow(1), Some(0), clock.now()).unwrap();
    clock.advance(30 * SEC);
    let expired = t.collect_expired(clock.now());
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].port(), u.port);
    // Accept stamps a new generation (and refreshes), so the candidate no
    // longer matches: the new session's entry survives.
    t.accept(u.port, clock.now()).unwrap();
    assert_eq!(t.remove_if_expired(&expired, clock.now()).total(), 0);
    assert_eq!(t.state(u.port), Some(NatState::Active));
    ok(&t);
}

#[test]
fn manual_clock_saturates_and_far_future_does_not_panic() {
    let (clock, t) = table(cfg());
    let g = open(&t, &flow(1), clock.now());
    clock.advance(Duration::MAX);
    clock.advance(Duration::from_secs(u64::MAX / 4));
    let far = clock.now();
    t.uplink(&flow(1), None, far).unwrap();
    drop(g);
    assert!(t.cleanup(far).total() <= 1);
    // A `now` before the table's epoch counts as the epoch.
    let early = t.epoch.checked_sub(SEC).unwrap_or(t.epoch);
    let _ = t.uplink(&flow(2), Some(0), early).unwrap();
    ok(&t);
}

mod model {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Debug, Clone)]
    enum Op {
        Uplink { flow: u8, syn: bool },
        Downlink { port: u16 },
        Accept { port: u16 },
        DropGuard { idx: u8 },
        Abort { port: u16 },
        Admit { port: u16, ready: bool },
        Connected { port: u16 },
        MakeRoom { flow: u8, limit: u8 },
        Advance { secs: u8 },
        Cleanup,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..6, any::<bool>()).prop_map(|(flow, syn)| Op::Uplink { flow, syn }),
            (50000u16..50005).prop_map(|port| Op::Downlink { port }),
            (50000u16..50005).prop_map(|port| Op::Accept { port }),
            any::<u8>().prop_map(|idx| Op::DropGuard { idx }),
            (50000u16..50005).prop_map(|port| Op::Abort { port }),
            (50000u16..50005, any::<bool>()).prop_map(|(port, ready)| Op::Admit { port, ready }),
            (50000u16..50005).prop_map(|port| Op::Connected { port }),
            (0u8..6, 0u8..8).prop_map(|(flow, limit)| Op::MakeRoom { flow, limit }),
            (0u8..20).prop_map(|secs| Op::Advance { secs }),
            Just(Op::Cleanup),
        ]
    }

    fn key(f: u8) -> FlowKey {
        if f % 2 == 0 {
            flow(u16::from(f))
        } else {
            flow6(u16::from(f))
        }
    }

    /// The attachments a test gave the table and has not had back, by
    /// token (the payload is a unique token). Each must come back once.
    #[derive(Default)]
    struct Attached(HashMap<u64, u16>);

    impl Attached {
        fn back(&mut self, token: u64) -> Result<u16, TestCaseError> {
            self.0.remove(&token).ok_or_else(|| {
                TestCaseError::fail(format!("token {token} back twice or never given"))
            })
        }

        /// An evicted flow's attachment is the one given to its port.
        fn evicted(&mut self, e: Option<Evicted<u64>>) -> Result<(), TestCaseError> {
            if let Some(Evicted {
                port,
                payload: Some(token),
            }) = e
            {
                prop_assert_eq!(self.back(token)?, port);
            }
            Ok(())
        }
    }

    proptest! {
        /// Random operation sequences on a table with 4 ports and a
        /// budget of 3 keep the maps consistent, never translate a port
        /// to a key other than the one it maps, and never allocate for a
        /// non-SYN segment. Every attachment given to a half-open flow
        /// comes back exactly once, from the transition that ended its
        /// stage, or at the end when every flow has expired.
        #[test]
        fn random_ops_keep_invariants(ops in proptest::collection::vec(op(), 1..120)) {
            let (clock, t) = table_of::<u64>(NatConfig {
                port_range: 50000..=50003,
                max_entries: 3,
                ..cfg()
            });
            let mut guards: Vec<Guard<u64>> = Vec::new();
            // The generation each port's latest SYN was given: what a
            // connect task would abort with.
            let mut opened = HashMap::new();
            let mut attached = Attached::default();
            let mut tokens = 0u64..;
            for op in ops {
                let now = clock.now();
                match op {
                    Op::Uplink { flow: f, syn } => {
                        let key = key(f);
                        let before = t.len();
                        match t.uplink(&key, syn.then_some(0), now) {
                            Ok(u) => {
                                prop_assert!(syn || !u.created);
                                prop_assert_eq!(t.downlink(u.port, now), Some(key));
                                if u.created {
                                    opened.insert(u.port, u.generation);
                                }
                                if u.held {
                                    prop_assert_eq!(t.state(u.port), Some(NatState::HalfOpen(Stage::Connecting)));
                                }
                                attached.evicted(u.evicted)?;
                                if let Some(token) = u.replaced {
                                    attached.back(token)?;
                                }
                            }
                            Err(Refused { evicted, .. }) => {
                                if evicted.is_none() {
                                    prop_assert_eq!(t.len(), before);
                                }
                                attached.evicted(evicted)?;
                            }
                        }
                    }
                    Op::Downlink { port } => {
                        if let Some(key) = t.downlink(port, now) {
                            prop_assert_eq!(t.lookup(&key), Some(port));
                        }
                    }
                    Op::Accept { port } => {
                        if let Ok(a) = t.accept(port, now) {
                            prop_assert_eq!(a.payload.is_some(), a.stage != Stage::New);
                            if let Some(token) = a.payload {
                                prop_assert_eq!(attached.back(token)?, port);
                            }
                            guards.push(t.guard(&a));
                        }
                    }
                    Op::DropGuard { idx } => {
                        if !guards.is_empty() {
                            let i = usize::from(idx) % guards.len();
                            drop(guards.swap_remove(i));
                        }
                    }
                    Op::Abort { port } => {
                        let generation = opened.get(&port).copied().unwrap_or(0);
                        if let Some(Aborted { payload: Some(token) }) = t.abort_half_open(port, generation, now) {
                            prop_assert_eq!(attached.back(token)?, port);
                        }
                    }
                    Op::Admit { port, ready } => {
                        let generation = opened.get(&port).copied().unwrap_or(0);
                        let stage = if ready { Stage::Ready } else { Stage::Connecting };
                        let token = tokens.next().unwrap_or(0);
                        let was = t.state(port);
                        match t.admit(port, generation, stage, token, now) {
                            Ok(()) => {
                                prop_assert_eq!(was, Some(NatState::HalfOpen(Stage::New)));
                                attached.0.insert(token, port);
                            }
                            Err(back) => prop_assert_eq!(back, token),
                        }
                    }
                    Op::Connected { port } => {
                        let generation = opened.get(&port).copied().unwrap_or(0);
                        let was = t.state(port);
                        // The connect's outcome replaces the token: the
                        // old one comes back through the merge.
                        let next = tokens.next().unwrap_or(0);
                        let mut merged = None;
                        match t.connected(port, generation, now, next, |old, new| {
                            merged = Some(old);
                            new
                        }) {
                            Ok(()) => {
                                prop_assert_eq!(was, Some(NatState::HalfOpen(Stage::Connecting)));
                                let old = merged.take().unwrap_or(u64::MAX);
                                prop_assert_eq!(attached.back(old)?, port);
                                attached.0.insert(next, port);
                            }
                            Err(back) => prop_assert_eq!(back, next),
                        }
                    }
                    Op::MakeRoom { flow: f, limit } => {
                        let source = key(f).client.ip();
                        if let Some(e) = t.make_room(source, usize::from(limit), now) {
                            prop_assert!(e.payload.is_some(), "only admitted flows count");
                            let closing = matches!(t.state(e.port), Some(NatState::Closing { .. }));
                            prop_assert!(closing, "an evicted flow lingers");
                            attached.evicted(Some(e))?;
                        }
                    }
                    Op::Advance { secs } => clock.advance(Duration::from_secs(u64::from(secs))),
                    Op::Cleanup => {
                        let done = t.cleanup(now);
                        for token in done.timed_out.into_iter().chain(done.expired) {
                            attached.back(token)?;
                        }
                    }
                }
                if let Err(e) = t.check_invariants() {
                    return Err(TestCaseError::fail(e));
                }
            }
            // Every flow ends: all that was attached has come back.
            drop(guards);
            let done = t.cleanup(clock.now() + Duration::from_secs(10_000));
            for token in done.timed_out.into_iter().chain(done.expired) {
                attached.back(token)?;
            }
            let done = t.cleanup(clock.now() + Duration::from_secs(20_000));
            prop_assert!(done.timed_out.is_empty() && done.expired.is_empty());
            prop_assert!(t.is_empty(), "{:?}", t.counts());
            prop_assert!(attached.0.is_empty(), "never came back: {:?}", attached.0);
        }
    }
}

/// Per-thread state of the stress test: one slot per private flow.
#[derive(Default)]
struct Slot {
    guard: Option<Guard>,
    closed_port: Option<u16>,
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// One thread's work in one round. Returns its result for the round's
/// shared key, which every thread SYNs at once.
fn stress_round(
    t: &Arc<Table>,
    tid: u16,
    round: u16,
    slots: &mut [Slot],
    rng: &mut u64,
    now: Instant,
    barrier: &Barrier,
) -> Result<Uplink, Refused> {
    let shared = FlowKey::new(
        sa("10.9.9.9:1"),
        SocketAddr::new(sa("1.1.1.1:0").ip(), round),
    );
    let shared_result = t.uplink(&shared, Some(0), now);
    // Everyone has sent the SYN before it is closed: a SYN that met the
    // Closing entry would rightly get a new port.
    barrier.wait();
    if let Ok(u) = shared_result {
        if u.created {
            // Nobody accepts it: the creator aborts it, so it lingers.
            assert!(t.abort_half_open(u.port, u.generation, now).is_some());
        }
    }
    for _ in 0..3 {
        for (i, slot) in slots.iter_mut().enumerate() {
            let i = u16::try_from(i).unwrap();
            let key = if i % 2 == 0 {
                FlowKey::new(
                    SocketAddr::new(sa("10.0.0.1:0").ip(), 1000 * tid + i),
                    sa("8.8.8.8:443"),
                )
            } else {
                FlowKey::new(
                    SocketAddr::new(sa("[fd00::1]:0").ip(), 1000 * tid + i),
                    sa("[2001:db8::1]:443"),
                )
            };
            // Concurrent noise on ports other threads own.
            let probe = 30000 + u16::try_from(xorshift(rng) % 40).unwrap();
            if t.downlink(probe, now) == Some(key) {
                // Only this thread maps this key, to the port it knows.
                let mine = slot.guard.as_ref().map(Guard::port).or(slot.closed_port);
                assert_eq!(
                    Some(probe),
                    mine,
                    "a port translated to a flow it is not mapped to"
                );
            }
            if tid == 0 {
                t.cleanup(now);
            }
            match slot.guard.take() {
                None => match t.uplink(&key, Some(0), now) {
                    Ok(u) => {
                        assert!(u.created, "my flow had no live entry");
                        if let Some(old) = slot.closed_port.take() {
                            assert_ne!(u.port, old, "new SYN reused the Closing port");
                        }
                        let a = t.accept(u.port, now).expect("fresh HalfOpen must accept");
                        assert_eq!(a.key, key);
                        slot.guard = Some(t.guard(&a));
                    }
                    Err(Refused {
                        error: NatError::TableFull | NatError::NoFreePort,
                        ..
                    }) => {}
                    Err(e) => panic!("unexpected {e:?}"),
                },
                Some(g) => {
                    let port = g.port();
                    assert_eq!(
                        t.uplink(&key, None, now),
                        Ok(existing(port, g.generation()))
                    );
                    assert_eq!(t.downlink(port, now), Some(key));
                    match xorshift(rng) % 4 {
                        0 => {
                            drop(g);
                            // Late FIN/ACK still translated while lingering.
                            assert_eq!(t.uplink(&key, None, now).map(|u| u.port), Ok(port));
                            slot.closed_port = Some(port);
                        }
                        1 => {
                            // Closed under the guard's feet, then the
                            // 4-tuple is reused before the guard drops.
                            assert!(t.mark_closing(port, g.generation(), now));
                            match t.uplink(&key, Some(0), now) {
                                Ok(u) => {
                                    assert!(u.created);
                                    assert_ne!(u.port, port);
                                    let a =
                                        t.accept(u.port, now).expect("fresh HalfOpen must accept");
                                    drop(g);
                                    assert_eq!(
                                        t.state(u.port),
                                        Some(NatState::Active),
                                        "stale guard closed the new entry"
                                    );
                                    slot.guard = Some(t.guard(&a));
                                }
                                Err(Refused {
                                    error: NatError::NoFreePort,
                                    ..
                                }) => {
                                    drop(g);
                                    slot.closed_port = Some(port);
                                }
                                Err(e) => panic!("unexpected {e:?}"),
                            }
                        }
                        _ => slot.guard = Some(g),
                    }
                }
            }
        }
    }
    shared_result
}

/// A SYN with a new ISN replaces its flow's entry while that entry
/// changes phase under it: the session ends (Active to Closing) or the
/// listener accepts (HalfOpen to Active, a new generation). Whichever
/// comes first, the old entry leaves both maps and the counters follow
/// the phase it had when it left (not the one the SYN first saw: a
/// 50,000-connection churn once left `active` at -1 and `closing` at 1).
#[test]
fn replacing_syn_racing_a_phase_change_keeps_the_counters() {
    // Miri runs a few rounds (it explores interleavings of its own).
    const ROUNDS: u32 = if cfg!(miri) { 4 } else { 3000 };
    let (clock, t) = table(NatConfig::default());
    let now = clock.now();
    let key = flow(4000);
    let barrier = Barrier::new(2);
    for round in 0..ROUNDS {
        let isn = round * 2;
        let up = t.uplink(&key, Some(isn), now).unwrap();
        // Even rounds race the session's end, odd ones the accept.
        let accepted = if round % 2 == 0 {
            Some(t.accept(up.port, now).unwrap())
        } else {
            None
        };
        thread::scope(|s| {
            s.spawn(|| {
                barrier.wait();
                match accepted {
                    Some(a) => {
                        t.mark_closing(a.port, a.generation, now);
                    }
                    None => {
                        let _ = t.accept(up.port, now);
                    }
                }
            });
            let syn = s.spawn(|| {
                barrier.wait();
                t.uplink(&key, Some(isn + 1), now).unwrap()
            });
            let new = syn.join().expect("syn thread");
            // Before the session ended, or once accepted, the flow is live
            // (the app sent no FIN or RST): the SYN is the old connection's
            // (its session ends it: the racing thread in even rounds, here
            // in odd ones). Otherwise the SYN replaced the entry.
            if !new.created {
                assert_eq!(new.port, up.port, "round {round}");
                if round % 2 == 1 {
                    assert!(
                        t.mark_closing(new.port, new.generation, now),
                        "round {round}"
                    );
                }
            }
        });
        if let Err(e) = t.check_invariants() {
            panic!("round {round}: {e}");
        }
        // Leave the table empty for the next round.
        t.cleanup(now + 120 * SEC);
        assert!(t.is_empty(), "round {round}: {:?}", t.counts());
        clock.advance(Duration::from_millis(1));
    }
}

/// 4 threads x 300 rounds on 40 ports with a budget of 38 (so budget and
/// port exhaustion both happen), every round starting on a barrier:
/// same-flow SYN races, accepts, guard drops, stale guards after reuse,
/// cleanup and random downlinks interleave. After each round,
/// `check_invariants` (forward/reverse bijection, counters == scan,
/// budget) and the shared-SYN outcome (all threads got one port, exactly
/// one created it). A lock-order inversion deadlocks; the watchdog turns
/// that into a failure instead of a hung test run.
#[test]
fn concurrent_stress_keeps_invariants() {
    const THREADS: u16 = 4;
    const ROUNDS: u16 = 300;
    const FLOWS: usize = 8;
    let errors = watchdog(move || {
        let (clock, t) = table(NatConfig {
            port_range: 30000..=30039,
            max_entries: 38,
            half_open_timeout: 2 * SEC,
            linger: SEC,
            idle_timeout: 60 * SEC,
            ..cfg()
        });
        let mut states: Vec<(Vec<Slot>, u64)> = (0..THREADS)
            .map(|i| {
                (
                    (0..FLOWS).map(|_| Slot::default()).collect(),
                    0x9e37_79b9_7f4a_7c15 ^ u64::from(i + 1),
                )
            })
            .collect();
        let barrier = Barrier::new(usize::from(THREADS));
        let shared_results = Mutex::new(Vec::new());
        for round in 0..ROUNDS {
            let now = clock.now();
            shared_results.lock().unwrap().clear();
            thread::scope(|s| {
                for (tid, (slots, rng)) in states.iter_mut().enumerate() {
                    let (t, barrier, results) = (&t, &barrier, &shared_results);
                    let tid = u16::try_from(tid).unwrap();
                    s.spawn(move || {
                        barrier.wait();
                        let r = stress_round(t, tid, round, slots, rng, now, barrier);
                        results.lock().unwrap().push(r);
                    });
                }
            });
            if let Err(e) = t.check_invariants() {
                panic!("round {round}: {e}");
            }
            let results = shared_results.lock().unwrap();
            let ports: Vec<u16> = results
                .iter()
                .filter_map(|r| r.ok())
                .map(|u| u.port)
                .collect();
            assert!(
                ports.windows(2).all(|w| w[0] == w[1]),
                "round {round}: shared SYN got ports {ports:?}"
            );
            let created = results
                .iter()
                .filter(|r| r.is_ok_and(|u| u.created))
                .count();
            assert_eq!(
                created,
                usize::from(!ports.is_empty()),
                "round {round}: {results:?}"
            );
            drop(results);
            clock.advance(Duration::from_millis(100));
        }
        drop(states);
        t.cleanup(clock.now() + 120 * SEC);
        assert!(t.is_empty(), "{:?}", t.counts());
        t.check_invariants().unwrap();
        t.error_counts()
    });
    // The test is only worth something if it hit the limits: a full table
    // refuses, or evicts an entry nobody accepted.
    eprintln!("stress: {errors:?}");
    assert!(errors.table_full + errors.evicted > 0, "{errors:?}");
}

/// Runs `work` on a thread of its own and returns what it returns; its
/// panic is the test's. A lock-order inversion deadlocks: after 60 s the
/// test fails instead of hanging the run.
fn watchdog<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let worker = thread::spawn(move || {
        let _ = tx.send(work());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(done) => {
            worker.join().unwrap();
            done
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(p) => panic::resume_unwind(p),
            Ok(()) => panic!("the stress test's thread ended without a result"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("stress test stuck for 60 s: deadlock"),
    }
}

/// Tokens given to the table as attachments and had back, across threads.
#[derive(Default)]
struct Ledger {
    given: Mutex<std::collections::HashSet<u64>>,
    back: Mutex<Vec<u64>>,
}

impl Ledger {
    fn give(&self, token: u64) -> u64 {
        assert!(self.given.lock().unwrap().insert(token));
        token
    }

    fn back(&self, token: u64) {
        self.back.lock().unwrap().push(token);
    }

    fn evicted(&self, e: Option<Evicted<u64>>) {
        if let Some(token) = e.and_then(|e| e.payload) {
            self.back(token);
        }
    }
}

/// One thread's flows for one round of the half-open stress test: each
/// SYN is admitted (Connecting or at once Ready), connected, then accepted
/// and closed, aborted, or left to the handshake timeout, while the other
/// threads' SYNs fill the table (evicting), thread 0 cleans up and every
/// thread makes room under a small admission limit. Any step may find its
/// flow gone; what it tried to attach then comes back to it.
fn half_open_round(t: &Arc<Table<u64>>, tid: u64, round: u64, ledger: &Ledger, now: Instant) {
    let mut n = 0u64;
    let mut token = || {
        n += 1;
        ledger.give((tid << 48) | (round << 16) | n)
    };
    for i in 0..6u16 {
        let key = FlowKey::new(
            SocketAddr::new(
                sa("10.0.0.1:0").ip(),
                // A key comes back every 5th round (a new ISN: replaced).
                2000 + 1000 * u16::try_from(tid).unwrap()
                    + 10 * u16::try_from(round % 5).unwrap()
                    + i,
            ),
            sa("8.8.8.8:443"),
        );
        if tid == 0 {
            let done = t.cleanup(now);
            for p in done.timed_out.into_iter().chain(done.expired) {
                ledger.back(p);
            }
        }
        // Admission limit 12: at most 6 half-open flows.
        ledger.evicted(t.make_room(key.client.ip(), 12, now));
        let u = match t.uplink(&key, Some(u32::try_from(round).unwrap()), now) {
            Ok(u) => {
                ledger.evicted(u.evicted);
                if let Some(p) = u.replaced {
                    ledger.back(p);
                }
                u
            }
            Err(r) => {
                ledger.evicted(r.evicted);
                continue;
            }
        };
        if !u.created {
            continue;
        }
        let ready_now = (round + u64::from(i)) % 3 == 0;
        let stage = if ready_now {
            Stage::Ready
        } else {
            Stage::Connecting
        };
        if let Err(p) = t.admit(u.port, u.generation, stage, token(), now) {
            ledger.back(p);
            continue;
        }
        if !ready_now {
            t.attach(u.port, u.generation, |_| {});
            match t.connected(u.port, u.generation, now, token(), |old, new| {
                ledger.back(old);
                new
            }) {
                Ok(()) => {}
                Err(next) => {
                    ledger.back(next);
                    continue;
                }
            }
        }
        match (round + u64::from(i)) % 4 {
            0 => {
                if let Some(p) = t
                    .abort_half_open(u.port, u.generation, now)
                    .and_then(|a| a.payload)
                {
                    ledger.back(p);
                }
            }
            1 => {} // left for the handshake timeout
            _ => {
                if let Ok(a) = t.accept(u.port, now) {
                    if let Some(p) = a.payload {
                        ledger.back(p);
                    }
                    t.mark_closing(a.port, a.generation, now);
                }
            }
        }
    }
}

/// 4 threads x 200 rounds through admission, connect, accept and abort on
/// 40 ports with a budget of 38, against evictions (full table, half-open
/// bounds), handshake timeouts and cleanup: after each round the
/// invariants hold (exactly the admitted half-open flows have an
/// attachment, counters match a scan), and at the end every attachment
/// given to the table has come back exactly once. The watchdog turns a
/// lock-order deadlock into a failure.
#[test]
fn concurrent_stress_hands_back_every_attachment() {
    const THREADS: u64 = 4;
    const ROUNDS: u64 = 200;
    let (given, errors) = watchdog(move || {
        let (clock, t) = table_of::<u64>(NatConfig {
            port_range: 30000..=30039,
            max_entries: 38,
            linger: SEC,
            ..cfg()
        });
        let ledger = Ledger::default();
        let barrier = Barrier::new(usize::try_from(THREADS).unwrap());
        for round in 0..ROUNDS {
            let now = clock.now();
            thread::scope(|s| {
                for tid in 0..THREADS {
                    let (t, ledger, barrier) = (&t, &ledger, &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        half_open_round(t, tid, round, ledger, now);
                    });
                }
            });
            if let Err(e) = t.check_invariants() {
                panic!("round {round}: {e}");
            }
            clock.advance(Duration::from_millis(250));
        }
        let done = t.cleanup(clock.now() + 8000 * SEC);
        for p in done.timed_out.into_iter().chain(done.expired) {
            ledger.back(p);
        }
        t.cleanup(clock.now() + 16000 * SEC);
        assert!(t.is_empty(), "{:?}", t.counts());
        let mut back = std::mem::take(&mut *ledger.back.lock().unwrap());
        let given = ledger.given.lock().unwrap().len();
        back.sort_unstable();
        let returned = back.len();
        back.dedup();
        assert_eq!(back.len(), returned, "an attachment came back twice");
        assert_eq!(returned, given, "attachments lost");
        (given, t.error_counts())
    });
    eprintln!("half-open stress: {given} attachments, {errors:?}");
    assert!(errors.evicted > 0, "the table never filled: {errors:?}");
}

/// After a burst of half-open flows has expired, `shrink` gives the maps'
/// capacity back (the table keeps what a flood grew it to otherwise), once:
/// a second call finds nothing to give, and the table still works.
#[test]
fn shrink_gives_back_what_an_expired_burst_grew() {
    let (clock, t) = table(NatConfig::default());
    let now = clock.now();
    let burst = 3000u16;
    for i in 0..burst {
        let _ = t.uplink(&flow(10_000 + i), Some(u32::from(i)), now);
    }
    let capacity = |t: &NatTable| -> usize {
        t.forward.iter().map(|s| s.read().capacity()).sum::<usize>()
            + t.reverse
                .iter()
                .map(|s| s.read().map.capacity())
                .sum::<usize>()
    };
    let grown = capacity(&t);
    assert!(grown >= 2 * usize::from(burst), "capacity {grown}");
    t.cleanup(now + 60 * SEC);
    assert_eq!(t.counts().half_open, 0);
    let freed = t.shrink();
    assert!(freed > 0, "nothing given back");
    let after = capacity(&t);
    assert!(after * 4 <= grown, "capacity {grown} -> {after}");
    assert_eq!(t.shrink(), 0, "a second shrink finds nothing");
    t.check_invariants().expect("invariants");
    let k = flow(40_000);
    let syn = t
        .uplink(&k, Some(5), clock.now() + 61 * SEC)
        .expect("a new SYN");
    assert_eq!(t.lookup(&k), Some(syn.port));
}
