//! NAT table of the system netstack.
//!
//! The TUN driver rewrites each uplink TCP segment `client:cport ->
//! server:sport` to `NAT_ADDR:P -> GATEWAY:LISTEN_PORT` so the kernel's own
//! TCP accepts it on a local listener; `P` comes from this table. Downlink
//! segments `GATEWAY:LISTEN_PORT -> NAT_ADDR:P` are restored through the
//! reverse map, and the accept loop looks `P` up to learn the original tuple.
//! One table and one port space serve IPv4 and IPv6 flows.
//!
//! # Structure
//!
//! * forward map: flow key -> NAT port, 64 shards chosen by the key's hash;
//! * reverse map: NAT port -> `Mapping` (key, state, generation,
//!   last-seen), 64 shards chosen by `port % 64`. The allocator hands out
//!   consecutive ports, so the low bits spread them evenly with no hashing.
//!
//! Each shard is a `parking_lot::RwLock<HashMap>` padded to 128 bytes, not
//! `dashmap`: the rules below need a read guard on a forward shard to stay
//! held while a reverse shard is read (so the pair is consistent without
//! rechecking), and a write guard on a forward shard held across port probes
//! of the reverse map. Plain locks make that lock order explicit and keep
//! the dependency list short; `dashmap` hides its guards behind per-call
//! references and would add nothing here.
//!
//! # Lock order
//!
//! **Forward before reverse, always**, and never two shards of the same map
//! at once. Every path that changes *which* port a key maps to (insert,
//! replace, remove) holds the key's forward shard for writing; so holding it
//! for reading pins the forward/reverse pair. State changes that do not move
//! a mapping (`accept`, `mark_closing`, `abort_half_open`) take only the
//! port's reverse shard. `downlink` takes only the reverse shard.
//! Debug builds assert the order on every acquisition (module `order`), so
//! each test that runs a path also checks its lock order.
//!
//! # Hot path
//!
//! `uplink` of an existing flow takes two read locks, `downlink` one; neither
//! allocates. `last_seen` is an `AtomicU64` of milliseconds since the
//! table's epoch, bumped with `fetch_max` only when the millisecond changed,
//! so a burst of packets does not keep writing the entry's cache line.
//!
//! # Entry size
//!
//! Measured with `size_of` (asserted in the tests, 64-bit targets):
//! `Mapping` is 64 bytes (8 generation + 8 last-seen + 38 packed key + 1
//! state + 4 SYN sequence number, padded), the reverse bucket `(u16, Mapping)`
//! 72, the forward bucket `(PackedKey, u16)` 40; with hashbrown's one control
//! byte per bucket that is 114 bytes per connection at full load, about 130 to
//! 228 bytes across
//! hashbrown's 7/8 to 1/2 load range. `Closing { since }` reuses the
//! last-seen field: a Closing entry is never refreshed, so its last-seen is
//! the moment it was marked.
//!
//! # Time
//!
//! Every call takes `now`; the table reads its own [`Clock`] only in
//! [`NatGuard`]'s `Drop`. Nothing here sleeps, does I/O or logs.

mod clock;
mod guard;
mod key;
mod shard;
mod types;

use std::collections::hash_map::Entry as MapEntry;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

pub use clock::{Clock, ManualClock};
pub use guard::NatGuard;
use key::{KeyedBuild, PackedKey, shard_index};
use shard::{ErrorCounters, ForwardShard, Mapping, Phase, ReverseShard, Shard};
pub use types::*;

/// Shards per map. 64 keeps two threads on different flows off each other's
/// locks nearly always (1/64 collision) for 2 x 64 x 128 B = 16 KiB of locks.
pub(crate) const SHARDS: usize = 64;

/// The NAT table. Share it as `Arc<NatTable>`; every method takes `&self`.
pub struct NatTable {
    cfg: NatConfig,
    clock: Arc<dyn Clock>,
    epoch: Instant,
    half_open_ms: u64,
    linger_ms: u64,
    idle_ms: u64,
    range_start: u16,
    /// Ports in `port_range` (0 when empty; up to 65536, hence u32).
    range_len: u32,
    /// The table's random hash key: shard choice and both maps' buckets.
    hasher: KeyedBuild,
    forward: Box<[ForwardShard; SHARDS]>,
    reverse: Box<[ReverseShard; SHARDS]>,
    /// Rotating allocation cursor. Wrapping at 2^32 only makes one jump in
    /// the rotation. Rotation also keeps a just-freed port from being reused
    /// at once, while the kernel may still hold its old socket in TIME_WAIT.
    cursor: AtomicU32,
    next_generation: AtomicU64,
    /// (port, generation) of entries a SYN created, oldest first: the
    /// candidates a full table evicts for a newcomer. An accept stamps a new
    /// generation, so accepted entries stop matching and are skipped (and
    /// pruned, [`Self::note_unanswered`]); entries whose outbound connect
    /// failed (Closing, same generation) still match and go first in line.
    unanswered: Mutex<VecDeque<(u16, u64)>>,
    /// Entries plus in-flight reservations; the budget is enforced on it.
    len: AtomicUsize,
    half_open: AtomicUsize,
    active: AtomicUsize,
    closing: AtomicUsize,
    errors: ErrorCounters,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl NatTable {
    /// An empty table. `clock` is read only when a [`NatGuard`] drops; its
    /// current instant becomes the table's epoch.
    pub fn new(cfg: NatConfig, clock: Arc<dyn Clock>) -> Self {
        let (range_start, range_len) = if cfg.port_range.is_empty() {
            (0, 0)
        } else {
            let (s, e) = (*cfg.port_range.start(), *cfg.port_range.end());
            (s, u32::from(e) - u32::from(s) + 1)
        };
        let hasher = KeyedBuild::random();
        Self {
            epoch: clock.now(),
            half_open_ms: millis(cfg.half_open_timeout),
            linger_ms: millis(cfg.linger),
            idle_ms: millis(cfg.idle_timeout),
            range_start,
            range_len,
            hasher,
            forward: Box::new(std::array::from_fn(|_| {
                Shard(RwLock::new(HashMap::with_hasher(hasher)))
            })),
            reverse: Box::new(std::array::from_fn(|_| {
                Shard(RwLock::new(HashMap::with_hasher(hasher)))
            })),
            cursor: AtomicU32::new(0),
            next_generation: AtomicU64::new(1),
            unanswered: Mutex::new(VecDeque::new()),
            len: AtomicUsize::new(0),
            half_open: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            closing: AtomicUsize::new(0),
            errors: ErrorCounters::default(),
            clock,
            cfg,
        }
    }

    /// The configuration the table was built with.
    pub fn config(&self) -> &NatConfig {
        &self.cfg
    }

    /// Hot path, per uplink segment. `syn` is `Some(isn)` for a SYN without
    /// ACK (its initial sequence number), `None` for every other segment.
    ///
    /// * HalfOpen/Active entry: refresh it and return its port. A SYN with the
    ///   entry's ISN is a retransmit and reuses the mapping.
    /// * HalfOpen/Active entry, SYN with a *different* ISN: the app opened a
    ///   new connection on the same 4-tuple (its side of the old one is gone;
    ///   a passive closer keeps no TIME_WAIT) before the old session ended.
    ///   Handled like a Closing entry below; reusing the port would land the
    ///   SYN on the old connection's kernel socket, which in TIME_WAIT accepts
    ///   it as a second connection on the same NAT port.
    /// * Closing entry, SYN (a new connection reusing the 4-tuple): the old
    ///   entry is removed from both maps and a *different* port is allocated,
    ///   `created = true`.
    /// * Closing entry, not a SYN: its port (late FIN/ACK), without extending
    ///   the linger.
    /// * No entry, SYN: a new HalfOpen mapping, `created = true`.
    /// * No entry, not a SYN: [`NatError::NoMapping`], counted; a stray
    ///   segment never allocates.
    pub fn uplink(
        &self,
        key: &FlowKey,
        syn: Option<u32>,
        now: Instant,
    ) -> Result<Uplink, NatError> {
        let pk = PackedKey::new(key);
        let fshard = &self.forward[shard_index(self.hasher.hash_key(&pk))];
        let now_ms = self.ms(now);
        {
            let fwd = fshard.read();
            if let Some(&port) = fwd.get(&pk) {
                // Forward then reverse: the lock order.
                let rev = self.reverse_shard(port).read();
                if let Some(m) = rev.get(&port).filter(|m| m.key == pk) {
                    match m.phase {
                        Phase::HalfOpen | Phase::Active if syn.is_none_or(|isn| isn == m.isn) => {
                            m.touch(now_ms);
                            return Ok(Uplink {
                                port,
                                created: false,
                                generation: m.generation,
                                evicted: false,
                            });
                        }
                        Phase::HalfOpen | Phase::Active => {} // new ISN: replaced below
                        Phase::Closing if syn.is_none() => {
                            return Ok(Uplink {
                                port,
                                created: false,
                                generation: m.generation,
                                evicted: false,
                            });
                        }
                        Phase::Closing => {} // replaced below, under write locks
                    }
                }
                // A forward entry whose reverse side is missing or another
                // flow's breaks an invariant (check_invariants reports it);
                // never translate through it. A SYN repairs it below.
            }
        }
        let Some(isn) = syn else {
            self.errors.uplink_no_mapping.fetch_add(1, Relaxed);
            return Err(NatError::NoMapping);
        };
        // A full table makes room by evicting the oldest entry the kernel
        // never accepted, before the key's forward shard is locked (the
        // victim's may be another: one shard per map at a time). A flood
        // of SYNs that are never answered thus recycles its own entries
        // instead of locking out the next connection.
        let evicted = self.len.load(Relaxed) >= self.cfg.max_entries && self.evict_unanswered();
        let mut up = self.uplink_syn(pk, isn, fshard, now_ms)?;
        up.evicted = evicted;
        Ok(up)
    }

    /// Remove the oldest entry that a SYN created and no accept answered
    /// (HalfOpen, or Closing after its connect failed), from both maps.
    /// Returns whether one was removed (counted as `evicted`).
    #[cold]
    fn evict_unanswered(&self) -> bool {
        loop {
            let Some((port, generation)) = self.unanswered.lock().pop_front() else {
                return false;
            };
            let key = {
                let rev = self.reverse_shard(port).read();
                match rev.get(&port) {
                    Some(m) if m.generation == generation => m.key,
                    _ => continue, // accepted, replaced or expired since
                }
            };
            // Forward before reverse: the lock order.
            let mut fwd = self.forward[shard_index(self.hasher.hash_key(&key))].write();
            let mut rev = self.reverse_shard(port).write();
            let phase = match rev.entry(port) {
                MapEntry::Occupied(o) if o.get().generation == generation => o.remove().phase,
                _ => continue,
            };
            if fwd.get(&key) == Some(&port) {
                fwd.remove(&key);
            }
            self.len.fetch_sub(1, Relaxed);
            match phase {
                Phase::HalfOpen => self.half_open.fetch_sub(1, Relaxed),
                Phase::Active => self.active.fetch_sub(1, Relaxed),
                Phase::Closing => self.closing.fetch_sub(1, Relaxed),
            };
            self.errors.evicted.fetch_add(1, Relaxed);
            return true;
        }
    }

    /// Queue a new entry as an eviction candidate. The queue holds stale
    /// entries too (accepted or removed since); past twice the budget it
    /// is pruned to the live ones, so its length stays within a small
    /// multiple of the budget and the pruning costs O(1) per entry
    /// amortised. No other lock is held while pruning.
    fn note_unanswered(&self, port: u16, generation: u64) {
        let len = {
            let mut q = self.unanswered.lock();
            q.push_back((port, generation));
            q.len()
        };
        if len <= 2 * self.cfg.max_entries.max(1) {
            return;
        }
        let old = std::mem::take(&mut *self.unanswered.lock());
        let kept: VecDeque<(u16, u64)> = old
            .into_iter()
            .filter(|&(p, g)| {
                self.reverse_shard(p)
                    .read()
                    .get(&p)
                    .is_some_and(|m| m.generation == g)
            })
            .collect();
        let mut q = self.unanswered.lock();
        let newer = std::mem::replace(&mut *q, kept);
        q.extend(newer);
    }

    /// New-connection path: holds the key's forward shard for writing
    /// throughout, so concurrent SYNs of one flow agree on one port.
    #[cold]
    fn uplink_syn(
        &self,
        pk: PackedKey,
        isn: u32,
        fshard: &ForwardShard,
        now_ms: u64,
    ) -> Result<Uplink, NatError> {
        let mut fwd = fshard.write();
        // The port of the entry being replaced.
        let mut replacing = None;
        if let Some(&port) = fwd.get(&pk) {
            let rev = self.reverse_shard(port).read();
            if let Some(m) = rev.get(&port).filter(|m| m.key == pk) {
                if m.phase == Phase::Closing || m.isn != isn {
                    replacing = Some(port);
                } else {
                    // Another thread's SYN won the race, or a retransmit.
                    m.touch(now_ms);
                    return Ok(Uplink {
                        port,
                        created: false,
                        generation: m.generation,
                        evicted: false,
                    });
                }
            }
        }
        // A replacement takes over the old entry's budget slot.
        if replacing.is_none() && !self.reserve() {
            self.errors.table_full.fetch_add(1, Relaxed);
            return Err(NatError::TableFull);
        }
        // The old Closing entry stays in the reverse map while probing, so
        // its port is skipped like any other in use: the new connection gets
        // a different port, and the kernel never sees the new SYN land on the
        // old connection's socket.
        let Some((port, generation)) = self.allocate(pk, isn, now_ms) else {
            if replacing.is_none() {
                self.len.fetch_sub(1, Relaxed);
            }
            self.errors.no_free_port.fetch_add(1, Relaxed);
            return Err(NatError::NoFreePort);
        };
        if let Some(old) = replacing {
            // The old entry may have changed phase since it was read above
            // (its session ended: Closing; its accept came: Active, with a
            // new generation), but not flow: only holders of this forward
            // shard remove it. It goes whatever its phase, and is counted
            // out of the phase it has now.
            let mut rev = self.reverse_shard(old).write();
            let removed = match rev.entry(old) {
                MapEntry::Occupied(o) if o.get().key == pk => Some(o.remove().phase),
                _ => None,
            };
            match removed {
                Some(Phase::HalfOpen) => self.half_open.fetch_sub(1, Relaxed),
                Some(Phase::Active) => self.active.fetch_sub(1, Relaxed),
                Some(Phase::Closing) => self.closing.fetch_sub(1, Relaxed),
                // Cannot happen (see above), but the budget must stay exact
                // if it ever does: the new entry needs its own slot.
                None => self.len.fetch_add(1, Relaxed),
            };
        }
        fwd.insert(pk, port);
        Ok(Uplink {
            port,
            created: true,
            generation,
            evicted: false,
        })
    }

    /// Takes one budget slot, or returns false when none is left.
    fn reserve(&self) -> bool {
        let max = self.cfg.max_entries;
        self.len
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1))
            .is_ok()
    }

    /// Probes at most `max_probes` candidates from the rotating cursor and
    /// inserts a HalfOpen mapping on the first vacant one: its port and the
    /// generation stamped on it.
    fn allocate(&self, key: PackedKey, isn: u32, now_ms: u64) -> Option<(u16, u64)> {
        if self.range_len == 0 {
            return None;
        }
        let probes = self.cfg.max_probes.min(self.range_len);
        for _ in 0..probes {
            let offset = self.cursor.fetch_add(1, Relaxed) % self.range_len;
            // start + offset <= end <= 65535, so this conversion never fails.
            let Ok(port) = u16::try_from(u32::from(self.range_start) + offset) else {
                continue;
            };
            if port == 0 {
                continue;
            }
            let mut rev = self.reverse_shard(port).write();
            if let MapEntry::Vacant(v) = rev.entry(port) {
                let generation = self.next_generation.fetch_add(1, Relaxed);
                v.insert(Mapping {
                    generation,
                    last_seen: AtomicU64::new(now_ms),
                    key,
                    phase: Phase::HalfOpen,
                    isn,
                });
                self.half_open.fetch_add(1, Relaxed);
                drop(rev);
                self.note_unanswered(port, generation);
                return Some((port, generation));
            }
        }
        None
    }

    /// Hot path, per downlink segment: the original flow of NAT port `port`,
    /// refreshing it (Closing entries are translated but not refreshed).
    /// `None` (counted) means drop the segment: never forward a wrong tuple.
    pub fn downlink(&self, port: u16, now: Instant) -> Option<FlowKey> {
        let rev = self.reverse_shard(port).read();
        match rev.get(&port) {
            Some(m) => {
                m.touch(self.ms(now));
                Some(m.key.to_flow_key())
            }
            None => {
                self.errors.downlink_no_mapping.fetch_add(1, Relaxed);
                None
            }
        }
    }

    /// Accept loop: looks the port up, marks it Active and stamps a new,
    /// strictly increasing generation, in one critical section. The
    /// generation the entry carried until then (stamped by the SYN that
    /// opened it, [`Uplink::generation`]) comes back as
    /// [`Accepted::opened`], so the caller can match state it keyed by it.
    ///
    /// [`NatError::NoMapping`] if the port is unknown, [`NatError::NotHalfOpen`]
    /// if it was already accepted or is closing. Both are counted.
    pub fn accept(&self, port: u16, now: Instant) -> Result<Accepted, NatError> {
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
    ) -> Result<Accepted, NatError> {
        let mut rev = self.reverse_shard(port).write();
        let result = match rev.get_mut(&port) {
            None => Err(NatError::NoMapping),
            Some(m) if m.phase != Phase::HalfOpen => Err(NatError::NotHalfOpen),
            Some(m) if isn.is_some_and(|isn| isn != m.isn) => Err(NatError::IsnMismatch),
            Some(m) => {
                let opened = m.generation;
                m.phase = Phase::Active;
                m.generation = self.next_generation.fetch_add(1, Relaxed);
                m.touch(self.ms(now));
                self.half_open.fetch_sub(1, Relaxed);
                self.active.fetch_add(1, Relaxed);
                Ok(Accepted {
                    key: m.key.to_flow_key(),
                    port,
                    generation: m.generation,
                    opened,
                })
            }
        };
        if result.is_err() {
            self.errors.accept_refused.fetch_add(1, Relaxed);
        }
        result
    }

    /// Marks the entry at `port` Closing (since `now`) if it still carries
    /// `generation` and is not Closing already; a newer entry on the same
    /// port is left alone. Returns whether it marked.
    pub fn mark_closing(&self, port: u16, generation: u64, now: Instant) -> bool {
        self.close_if(port, now, |m| m.generation == generation)
    }

    /// Marks a HalfOpen entry Closing (the outbound connect for its SYN
    /// failed before any accept) if it still carries `generation`, the one
    /// [`Uplink::generation`] reported when the SYN created it: a connect
    /// that outlived its entry never closes a newer flow that reuses the
    /// port. Returns whether it marked.
    pub fn abort_half_open(&self, port: u16, generation: u64, now: Instant) -> bool {
        self.close_if(port, now, |m| {
            m.phase == Phase::HalfOpen && m.generation == generation
        })
    }

    /// How long the Active entry at `port` that carries `generation` may
    /// still go without a packet before it is idle for `idle_timeout` (zero
    /// once it is), or `None` when that entry is gone, replaced or no longer
    /// Active. A session polls this (through its [`NatGuard`]) to end when
    /// its connection went idle, instead of holding its sockets and permit
    /// after cleanup dropped the mapping.
    pub fn idle_left(&self, port: u16, generation: u64, now: Instant) -> Option<Duration> {
        let rev = self.reverse_shard(port).read();
        let m = rev
            .get(&port)
            .filter(|m| m.generation == generation && m.phase == Phase::Active)?;
        let idle = self.ms(now).saturating_sub(m.last_seen.load(Relaxed));
        Some(Duration::from_millis(self.idle_ms.saturating_sub(idle)))
    }

    fn close_if(&self, port: u16, now: Instant, pred: impl FnOnce(&Mapping) -> bool) -> bool {
        let mut rev = self.reverse_shard(port).write();
        let Some(m) = rev.get_mut(&port) else {
            return false;
        };
        if m.phase == Phase::Closing || !pred(m) {
            return false;
        }
        match m.phase {
            Phase::HalfOpen => self.half_open.fetch_sub(1, Relaxed),
            _ => self.active.fetch_sub(1, Relaxed),
        };
        self.closing.fetch_add(1, Relaxed);
        m.phase = Phase::Closing;
        // `store`, not `touch`: this is the linger's start.
        m.last_seen.store(self.ms(now), Relaxed);
        true
    }

    /// Periodic cleanup: [`collect_expired`](Self::collect_expired) then
    /// [`remove_if_expired`](Self::remove_if_expired). HalfOpen entries with
    /// no packet for `half_open_timeout`, Closing entries past `linger`,
    /// Active entries idle for `idle_timeout` are removed from both maps.
    pub fn cleanup(&self, now: Instant) -> CleanupReport {
        let expired = self.collect_expired(now);
        self.remove_if_expired(&expired, now)
    }

    /// First half of cleanup: scans each reverse shard under its read lock
    /// (one at a time) and returns the expired entries. Takes no write lock,
    /// so the hot path is never blocked by the scan.
    pub fn collect_expired(&self, now: Instant) -> Vec<Expired> {
        let now_ms = self.ms(now);
        let mut out = Vec::new();
        for shard in self.reverse.iter() {
            let rev = shard.read();
            out.extend(
                rev.iter()
                    .filter(|(_, m)| self.is_expired(m, now_ms))
                    .map(|(&port, m)| Expired {
                        port,
                        generation: m.generation,
                        key: m.key,
                    }),
            );
        }
        out
    }

    /// Second half of cleanup: for each candidate, under the key's forward
    /// and the port's reverse write locks, deletes it only if it is still
    /// the same entry (generation) and still expired at `now`. A segment
    /// that refreshed it after collection, an accept, or a replacement by a
    /// new SYN keeps the mapping.
    pub fn remove_if_expired(&self, expired: &[Expired], now: Instant) -> CleanupReport {
        let now_ms = self.ms(now);
        let mut report = CleanupReport::default();
        for e in expired {
            let mut fwd = self.forward[shard_index(self.hasher.hash_key(&e.key))].write();
            let mut rev = self.reverse_shard(e.port).write();
            let phase = match rev.entry(e.port) {
                MapEntry::Occupied(o)
                    if o.get().generation == e.generation && self.is_expired(o.get(), now_ms) =>
                {
                    o.remove().phase
                }
                _ => continue,
            };
            if fwd.get(&e.key) == Some(&e.port) {
                fwd.remove(&e.key);
            }
            self.len.fetch_sub(1, Relaxed);
            match phase {
                Phase::HalfOpen => {
                    self.half_open.fetch_sub(1, Relaxed);
                    report.half_open += 1;
                }
                Phase::Active => {
                    self.active.fetch_sub(1, Relaxed);
                    report.active += 1;
                }
                Phase::Closing => {
                    self.closing.fetch_sub(1, Relaxed);
                    report.closing += 1;
                }
            }
        }
        report
    }

    fn is_expired(&self, m: &Mapping, now_ms: u64) -> bool {
        let limit = match m.phase {
            Phase::HalfOpen => self.half_open_ms,
            Phase::Active => self.idle_ms,
            Phase::Closing => self.linger_ms,
        };
        now_ms.saturating_sub(m.last_seen.load(Relaxed)) >= limit
    }

    /// A guard for the session task: when it drops (normally or while a
    /// panic unwinds) it marks the accepted entry Closing, stamped with the
    /// table's clock.
    #[must_use = "dropping the guard marks the entry Closing at once"]
    pub fn guard(self: &Arc<Self>, accepted: &Accepted) -> NatGuard {
        NatGuard {
            table: Arc::clone(self),
            accepted: *accepted,
        }
    }

    /// The port mapped to `key`, without refreshing it.
    pub fn lookup(&self, key: &FlowKey) -> Option<u16> {
        let pk = PackedKey::new(key);
        self.forward[shard_index(self.hasher.hash_key(&pk))]
            .0
            .read()
            .get(&pk)
            .copied()
    }

    /// The state of the entry at `port`.
    pub fn state(&self, port: u16) -> Option<NatState> {
        let rev = self.reverse_shard(port).read();
        rev.get(&port).map(|m| match m.phase {
            Phase::HalfOpen => NatState::HalfOpen,
            Phase::Active => NatState::Active,
            Phase::Closing => NatState::Closing {
                since: self.instant(m.last_seen.load(Relaxed)),
            },
        })
    }

    /// Entries in the table (in-flight allocations included).
    pub fn len(&self) -> usize {
        self.len.load(Relaxed)
    }

    /// Whether the table has no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries per state, from counters maintained on every transition.
    pub fn counts(&self) -> NatCounts {
        NatCounts {
            half_open: self.half_open.load(Relaxed),
            active: self.active.load(Relaxed),
            closing: self.closing.load(Relaxed),
        }
    }

    /// Refusals and misses so far.
    pub fn error_counts(&self) -> NatErrorCounts {
        let e = &self.errors;
        let downlink = e.downlink_no_mapping.load(Relaxed);
        NatErrorCounts {
            table_full: e.table_full.load(Relaxed),
            no_free_port: e.no_free_port.load(Relaxed),
            no_mapping: e.uplink_no_mapping.load(Relaxed) + downlink,
            downlink_no_mapping: downlink,
            accept_refused: e.accept_refused.load(Relaxed),
            evicted: e.evicted.load(Relaxed),
        }
    }

    /// Checks forward/reverse consistency (a bijection between forward
    /// entries and reverse entries with matching keys, each in its own
    /// shard, ports inside the range) and that the counters equal a scan.
    /// Meaningful only while no other thread is using the table. For tests
    /// and fuzzing.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut forward_len = 0usize;
        for (i, shard) in self.forward.iter().enumerate() {
            let fwd = shard.read();
            for (k, &port) in fwd.iter() {
                forward_len += 1;
                if shard_index(self.hasher.hash_key(k)) != i {
                    return Err(format!("forward key for port {port} in wrong shard {i}"));
                }
                // Forward then reverse, one shard of each: the lock order.
                let rev = self.reverse_shard(port).read();
                match rev.get(&port) {
                    None => return Err(format!("forward -> {port} has no reverse entry")),
                    Some(m) if m.key != *k => {
                        return Err(format!("forward -> {port} but reverse holds another key"));
                    }
                    Some(_) => {}
                }
            }
        }
        // Every forward entry points at a distinct reverse entry holding its
        // key, so equal sizes make the two maps a bijection.
        let mut scan = NatCounts::default();
        for (i, shard) in self.reverse.iter().enumerate() {
            let rev = shard.read();
            for (&port, m) in rev.iter() {
                if usize::from(port) % SHARDS != i {
                    return Err(format!("port {port} in wrong reverse shard {i}"));
                }
                if port == 0 || !self.cfg.port_range.contains(&port) {
                    return Err(format!("port {port} outside the port range"));
                }
                match m.phase {
                    Phase::HalfOpen => scan.half_open += 1,
                    Phase::Active => scan.active += 1,
                    Phase::Closing => scan.closing += 1,
                }
            }
        }
        if scan.total() != forward_len {
            return Err(format!(
                "forward has {forward_len} entries, reverse {}",
                scan.total()
            ));
        }
        if scan != self.counts() {
            return Err(format!("counters {:?} != scan {scan:?}", self.counts()));
        }
        if self.len() != scan.total() {
            return Err(format!("len {} != scan {}", self.len(), scan.total()));
        }
        if scan.total() > self.cfg.max_entries {
            return Err(format!(
                "{} entries over budget {}",
                scan.total(),
                self.cfg.max_entries
            ));
        }
        Ok(())
    }

    #[inline]
    fn reverse_shard(&self, port: u16) -> &ReverseShard {
        &self.reverse[usize::from(port) % SHARDS]
    }

    #[inline]
    fn ms(&self, now: Instant) -> u64 {
        millis(now.saturating_duration_since(self.epoch))
    }

    fn instant(&self, ms: u64) -> Instant {
        self.epoch
            .checked_add(Duration::from_millis(ms))
            .unwrap_or(self.epoch)
    }
}

impl fmt::Debug for NatTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatTable")
            .field("cfg", &self.cfg)
            .field("counts", &self.counts())
            .field("errors", &self.error_counts())
            .finish_non_exhaustive()
    }
}

/// Owned by a session task. Dropping it (normally, on abort, or while a
/// panic unwinds) marks its entry Closing unless a newer entry holds the
/// port, so an `Active` entry is never leaked.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use std::panic::{self, AssertUnwindSafe};
    use std::sync::{Barrier, Mutex, mpsc};
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

    fn table(cfg: NatConfig) -> (Arc<ManualClock>, Arc<NatTable>) {
        let clock = Arc::new(ManualClock::new());
        let t = Arc::new(NatTable::new(cfg, Arc::clone(&clock) as Arc<dyn Clock>));
        (clock, t)
    }

    fn ok(t: &NatTable) {
        t.check_invariants().unwrap();
    }

    /// SYN, accept and guard for `key`.
    fn open(t: &Arc<NatTable>, key: &FlowKey, now: Instant) -> NatGuard {
        let u = t.uplink(key, Some(0), now).unwrap();
        assert!(u.created);
        t.guard(&t.accept(u.port, now).unwrap())
    }

    #[test]
    fn syn_with_a_new_isn_on_an_active_entry_is_a_new_connection() {
        let (clock, t) = table(NatConfig::default());
        let now = clock.now();
        let k = flow(40000);
        let first = t.uplink(&k, Some(1000), now).expect("syn");
        let acc = t.accept(first.port, now).expect("accept");
        let guard = t.guard(&acc);
        // Retransmit of the original SYN: same ISN, same port.
        let again = t.uplink(&k, Some(1000), now).expect("retransmit");
        assert_eq!((again.port, again.created), (first.port, false));
        // The app reused the 4-tuple for a new connection before the old
        // session ended: another ISN gets a different port.
        let second = t.uplink(&k, Some(777), now).expect("new connection");
        assert!(second.created);
        assert_ne!(second.port, first.port);
        assert_eq!(t.state(first.port), None, "old mapping retired");
        assert_eq!(t.counts().active, 0);
        assert_eq!(t.counts().half_open, 1);
        // The old session's guard cannot touch the new entry.
        drop(guard);
        assert_eq!(t.state(second.port), Some(NatState::HalfOpen));
        assert_eq!(t.len(), 1, "the replacement took over the budget slot");
        t.check_invariants().expect("invariants");
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
        assert_eq!(size_of::<Mapping>(), 64);
        assert_eq!(size_of::<(u16, Mapping)>(), 72);
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
        assert_eq!(t.state(u.port), Some(NatState::HalfOpen));
        // The ACK of the handshake and later segments find the same port.
        assert_eq!(
            t.uplink(&k, None, now).unwrap(),
            Uplink {
                port: u.port,
                created: false,
                generation: u.generation,
                evicted: false
            }
        );
        assert_eq!(
            t.counts(),
            NatCounts {
                half_open: 1,
                active: 0,
                closing: 0
            }
        );
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
        assert_eq!(
            again,
            Uplink {
                port: first.port,
                created: false,
                generation: first.generation,
                evicted: false
            }
        );
        assert_eq!(t.len(), 1);
        ok(&t);
    }

    #[test]
    fn stray_segment_never_allocates() {
        let (clock, t) = table(cfg());
        assert_eq!(
            t.uplink(&flow(1), None, clock.now()),
            Err(NatError::NoMapping)
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
        assert_eq!(
            t.counts(),
            NatCounts {
                half_open: 0,
                active: 16,
                closing: 0
            }
        );
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
        assert_eq!(t.state(u.port), Some(NatState::HalfOpen));
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
        assert_eq!(
            t.counts(),
            NatCounts {
                half_open: 1,
                active: 0,
                closing: 0
            }
        );
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
        assert_eq!(t.state(u1.port), Some(NatState::HalfOpen));
        assert_eq!(t.downlink(u2.port, clock.now()), Some(k));
        assert_eq!(t.downlink(u1.port, clock.now()), Some(other));
        clock.advance(10 * SEC);
        assert_eq!(t.cleanup(clock.now()).active, 0);
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
            Err(NatError::NoFreePort)
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
            Uplink {
                port,
                created: false,
                generation,
                evicted: false
            }
        );
        assert_eq!(t.downlink(port, clock.now()), Some(k));
        clock.advance(SEC);
        let r = t.cleanup(clock.now());
        assert_eq!(
            r,
            CleanupReport {
                half_open: 0,
                active: 0,
                closing: 1
            }
        );
        assert_eq!(t.uplink(&k, None, clock.now()), Err(NatError::NoMapping));
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
        assert_eq!(
            t.counts(),
            NatCounts {
                half_open: 0,
                active: 0,
                closing: 1
            }
        );
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
        assert!(!t.abort_half_open(u.port, u.generation + 1, now));
        assert!(t.abort_half_open(u.port, u.generation, now));
        assert!(!t.abort_half_open(u.port, u.generation, now));
        assert!(matches!(t.state(u.port), Some(NatState::Closing { .. })));
        let g = open(&t, &flow(2), now);
        assert!(!t.abort_half_open(g.port(), g.generation(), now));
        assert!(!t.abort_half_open(g.port(), g.accepted().opened, now));
        assert!(!t.abort_half_open(1, 0, now));
        assert_eq!(
            t.counts(),
            NatCounts {
                half_open: 0,
                active: 1,
                closing: 1
            }
        );
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
        assert_eq!(t.cleanup(clock.now()).half_open, 1);
        // ...and a new flow gets the same port.
        let b = t.uplink(&flow(2), Some(0), clock.now()).unwrap();
        assert_eq!((b.port, b.created), (a.port, true));
        assert_ne!(b.generation, a.generation);
        // A's connect now fails: its abort must not close B.
        assert!(!t.abort_half_open(a.port, a.generation, clock.now()));
        assert_eq!(t.state(b.port), Some(NatState::HalfOpen));
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
        assert_eq!(t.cleanup(clock.now()).active, 1);
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
            Err(NatError::TableFull)
        );
        assert_eq!(t.error_counts().table_full, 1);
        assert_eq!(t.len(), 1);
        ok(&t);
        drop(g);
        // Lingering entries still count against the budget.
        assert_eq!(
            t.uplink(&flow(2), Some(0), clock.now()),
            Err(NatError::TableFull)
        );
        clock.advance(10 * SEC);
        assert_eq!(t.cleanup(clock.now()).closing, 1);
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
            t.abort_half_open(b.port, b.generation, now),
            "b's connect failed"
        );
        // Full: the oldest unanswered (a, HalfOpen) goes first, then b.
        let c = t.uplink(&flow(4), Some(0), now).unwrap();
        assert!(c.created && c.evicted);
        assert_eq!(t.state(a.port), None);
        assert_eq!(t.lookup(&flow(2)), None);
        let d = t.uplink(&flow(5), Some(0), now).unwrap();
        assert!(d.created && d.evicted);
        assert_eq!(t.state(b.port), None);
        ok(&t);
        // c and d answered: now the table holds only accepted entries.
        t.accept(c.port, now).unwrap();
        t.accept(d.port, now).unwrap();
        assert_eq!(t.uplink(&flow(6), Some(0), now), Err(NatError::TableFull));
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
            Err(NatError::TableFull)
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
        assert_eq!(t.uplink(&flow(4), Some(0), now), Err(NatError::NoFreePort));
        assert_eq!(t.uplink(&flow6(4), Some(0), now), Err(NatError::NoFreePort));
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
            Err(NatError::NoFreePort)
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
            Err(NatError::NoFreePort)
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
            Err(NatError::NoFreePort)
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
            Err(NatError::NoFreePort)
        );
        ok(&t);
        let (clock, t) = table(NatConfig {
            port_range: 0..=0,
            ..cfg()
        });
        assert_eq!(
            t.uplink(&flow(1), Some(0), clock.now()),
            Err(NatError::NoFreePort)
        );
        // An empty range.
        let (clock, t) = table(NatConfig {
            port_range: 5..=4,
            ..cfg()
        });
        assert_eq!(
            t.uplink(&flow(1), Some(0), clock.now()),
            Err(NatError::NoFreePort)
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
        assert!(t.abort_half_open(u.port, u.generation, clock.now()));
        clock.advance(10 * SEC);
        assert_eq!(t.cleanup(clock.now()).closing, 1);
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
        assert_eq!(t.uplink(&flow(6), Some(0), now), Err(NatError::NoFreePort));
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
        assert_eq!(t.cleanup(at(Duration::from_millis(9_999))), none);
        assert_eq!(
            t.cleanup(at(10 * SEC)),
            CleanupReport { closing: 1, ..none }
        );
        assert_eq!(t.cleanup(at(Duration::from_millis(29_999))), none);
        assert_eq!(
            t.cleanup(at(30 * SEC)),
            CleanupReport {
                half_open: 1,
                ..none
            }
        );
        assert_eq!(t.cleanup(at(Duration::from_secs(7439))), none);
        assert_eq!(
            t.cleanup(at(Duration::from_secs(7440))),
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
        assert_eq!(t.state(h), Some(NatState::HalfOpen));
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
        assert_eq!(t.state(h), Some(NatState::HalfOpen));
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

        #[derive(Debug, Clone)]
        enum Op {
            Uplink { flow: u8, syn: bool },
            Downlink { port: u16 },
            Accept { port: u16 },
            DropGuard { idx: u8 },
            Abort { port: u16 },
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
                (0u8..20).prop_map(|secs| Op::Advance { secs }),
                Just(Op::Cleanup),
            ]
        }

        proptest! {
            /// Random operation sequences on a table with 4 ports and a
            /// budget of 3 keep the maps consistent, never translate a port
            /// to a key other than the one it maps, and never allocate for a
            /// non-SYN segment.
            #[test]
            fn random_ops_keep_invariants(ops in proptest::collection::vec(op(), 1..120)) {
                let (clock, t) = table(NatConfig {
                    port_range: 50000..=50003,
                    max_entries: 3,
                    ..cfg()
                });
                let mut guards: Vec<NatGuard> = Vec::new();
                // The generation each port's latest SYN was given: what a
                // connect task would abort with.
                let mut opened = std::collections::HashMap::new();
                for op in ops {
                    let now = clock.now();
                    match op {
                        Op::Uplink { flow: f, syn } => {
                            let key = if f % 2 == 0 { flow(u16::from(f)) } else { flow6(u16::from(f)) };
                            let before = t.len();
                            match t.uplink(&key, syn.then_some(0), now) {
                                Ok(u) => {
                                    prop_assert!(syn || !u.created);
                                    prop_assert_eq!(t.downlink(u.port, now), Some(key));
                                    if u.created {
                                        opened.insert(u.port, u.generation);
                                    }
                                }
                                Err(_) => prop_assert_eq!(t.len(), before),
                            }
                        }
                        Op::Downlink { port } => {
                            if let Some(key) = t.downlink(port, now) {
                                prop_assert_eq!(t.lookup(&key), Some(port));
                            }
                        }
                        Op::Accept { port } => {
                            if let Ok(a) = t.accept(port, now) {
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
                            t.abort_half_open(port, generation, now);
                        }
                        Op::Advance { secs } => clock.advance(Duration::from_secs(u64::from(secs))),
                        Op::Cleanup => {
                            t.cleanup(now);
                        }
                    }
                    if let Err(e) = t.check_invariants() {
                        return Err(TestCaseError::fail(e));
                    }
                }
            }
        }
    }

    /// Per-thread state of the stress test: one slot per private flow.
    #[derive(Default)]
    struct Slot {
        guard: Option<NatGuard>,
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
        t: &Arc<NatTable>,
        tid: u16,
        round: u16,
        slots: &mut [Slot],
        rng: &mut u64,
        now: Instant,
        barrier: &Barrier,
    ) -> Result<Uplink, NatError> {
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
                assert!(t.abort_half_open(u.port, u.generation, now));
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
                    let mine = slot.guard.as_ref().map(NatGuard::port).or(slot.closed_port);
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
                        Err(NatError::TableFull | NatError::NoFreePort) => {}
                        Err(e) => panic!("unexpected {e:?}"),
                    },
                    Some(g) => {
                        let port = g.port();
                        assert_eq!(
                            t.uplink(&key, None, now),
                            Ok(Uplink {
                                port,
                                created: false,
                                generation: g.generation(),
                                evicted: false
                            })
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
                                        let a = t
                                            .accept(u.port, now)
                                            .expect("fresh HalfOpen must accept");
                                        drop(g);
                                        assert_eq!(
                                            t.state(u.port),
                                            Some(NatState::Active),
                                            "stale guard closed the new entry"
                                        );
                                        slot.guard = Some(t.guard(&a));
                                    }
                                    Err(NatError::NoFreePort) => {
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
                s.spawn(|| {
                    barrier.wait();
                    let new = t.uplink(&key, Some(isn + 1), now).unwrap();
                    assert!(new.created, "round {round}");
                });
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
        let (tx, rx) = mpsc::channel();
        let worker = thread::spawn(move || {
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
            let _ = tx.send(t.error_counts());
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(errors) => {
                worker.join().unwrap();
                // The test is only worth something if it hit the limits: a
                // full table refuses, or evicts an entry nobody accepted.
                eprintln!("stress: {errors:?}");
                assert!(errors.table_full + errors.evicted > 0, "{errors:?}");
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                if let Err(p) = worker.join() {
                    panic::resume_unwind(p);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("stress test stuck for 60 s: deadlock"),
        }
    }
}
