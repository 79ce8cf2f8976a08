//! The system netstack's flow table, and the per-packet step over it
//! ([`translate`]).
//!
//! The TUN driver rewrites each uplink TCP segment `client:cport ->
//! server:sport` to `NAT_ADDR:P -> GATEWAY:LISTEN_PORT` so the kernel's own
//! TCP accepts it on a local listener; `P` comes from this table. Downlink
//! segments `GATEWAY:LISTEN_PORT -> NAT_ADDR:P` are restored through the
//! reverse map, and the accept loop looks `P` up to learn the original tuple.
//! One table and one port space serve IPv4 and IPv6 flows.
//!
//! # State machine
//!
//! One entry per flow carries its whole state, from its first SYN to the
//! end of its linger; the engine (the I/O shell, `core/src/stack/system/`)
//! attaches what it holds for a half-open flow (`P`: the connect task, the
//! admission permit, the connected outbound or the plan) and gets it back
//! from whichever transition ends that stage, so there is nothing to keep
//! in step with a second table:
//!
//! ```text
//! (none)               uplink (SYN)     -> HalfOpen(New)
//! HalfOpen(New)        admit            -> HalfOpen(Connecting), or HalfOpen(Ready) (nothing to connect)
//! HalfOpen(Connecting) connected        -> HalfOpen(Ready)
//! HalfOpen(any)        accept_syn       -> Active            (a new generation)
//! HalfOpen(any)        abort_half_open  -> Closing           (admission refused, connect failed)
//! HalfOpen(Conn/Ready) make_room        -> Closing           (past a half-open bound)
//! HalfOpen(Ready)      cleanup          -> Closing           (handshake timeout)
//! Active               mark_closing     -> Closing           (the session ended)
//! any                  cleanup          -> removed           (its state's timeout; Closing: the linger)
//! never accepted       uplink (SYN)     -> removed           (a full table's eviction)
//! HalfOpen, Closing     uplink (SYN)     -> removed           (another ISN, or any on Closing: a new entry replaces it)
//! Active               uplink (FIN/RST) -> Active            (the app closed its side: marked)
//! Active, marked       uplink (SYN)     -> removed           (another ISN: a new entry replaces it)
//! Active, not marked   uplink (SYN)     -> Active            (another ISN: the old connection's segment, challenge ACK)
//! ```
//!
//! | transition | method | hands back |
//! |---|---|---|
//! | new SYN | [`NatTable::uplink`] | a displaced flow's attachment (`evicted`: the full table's oldest unanswered entry; `replaced`: a SYN with a new ISN on its 4-tuple) |
//! | admit | [`NatTable::make_room`] then [`NatTable::admit`] | the flow evicted by the half-open bounds; the attachment itself if the flow is gone |
//! | connect succeeded | [`NatTable::connected`] | what the task connected, if the flow is gone |
//! | connect failed | [`NatTable::abort_half_open`] | the attachment, and whether the flow was still there to answer |
//! | accepted | [`NatTable::accept_syn`] | the attachment (Ready: what the session goes on to) |
//! | expired, handshake timeout | [`NatTable::cleanup`] | the attachments of the flows it ended |
//! | session ended | [`NatTable::mark_closing`] | |
//!
//! Generations keep a late actor off a newer flow: a SYN stamps one on the
//! entry it creates, an accept stamps a new one, and every transition names
//! the generation it acts for and is refused for another. A connect that
//! outlives its flow (evicted, expired, replaced) can thus neither hand its
//! outbound to a newer flow on the same port, nor close it, nor release its
//! own SYN to the kernel.
//!
//! The half-open policy is the table's too ([`HALF_OPEN_MAX`],
//! [`HALF_OPEN_PER_SOURCE`], [`HANDSHAKE_TIMEOUT`], and the full table's
//! eviction of its oldest unanswered entry); the engine passes in the
//! admission limit and `now`.
//!
//! # Structure
//!
//! * forward map: flow key -> NAT port, 64 shards chosen by the key's hash;
//! * reverse map: NAT port -> `Mapping` (key, state, generation,
//!   last-seen), 64 shards chosen by `port % 64`. The allocator hands out
//!   consecutive ports, so the low bits spread them evenly with no hashing.
//!   Beside it, in the same shard and under the same lock, the attachments
//!   of the admitted half-open flows (`Held`: when, and the engine's `P`).
//!
//! Each shard is a `parking_lot::RwLock` padded to 128 bytes, not
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
//! a mapping (admit, connected, accept, abort, `mark_closing`, the
//! half-open bounds) take only the port's reverse shard. `downlink` takes
//! only the reverse shard.
//! Debug builds assert the order on every acquisition (module `order`), so
//! each test that runs a path also checks its lock order.
//!
//! # Hot path
//!
//! `uplink` of an existing flow takes two read locks, `downlink` one; neither
//! allocates nor reads an attachment. `last_seen` is an `AtomicU64` of
//! milliseconds since the table's epoch, bumped with `fetch_max` only when
//! the millisecond changed, so a burst of packets does not keep writing the
//! entry's cache line. A direction's first segment with payload in a
//! 100 ms epoch counts it busy (`window.rs`: the window clamp's share), one
//! counter update per direction per epoch.
//!
//! # Entry size
//!
//! Measured with `size_of` (asserted in the tests, 64-bit targets):
//! `Mapping` is 72 bytes (8 generation + 8 last-seen + 38 packed key + 1
//! state + 4 SYN sequence number + 1 app-closed + 2 window scale shifts +
//! 2 busy epochs + 8 for the window clamp's two right edges), the reverse
//! bucket `(u16, Mapping)` 80, the forward bucket `(PackedKey, u16)` 40;
//! with hashbrown's one control byte per bucket that is 122 bytes per
//! connection at full load, about 139 to 244 bytes across hashbrown's 7/8
//! to 1/2 load range. An attachment costs its flow nothing
//! once the flow is established: only admitted half-open flows (at most
//! [`HALF_OPEN_MAX`]) have one, in the side map. `Closing { since }` reuses
//! the last-seen field: a Closing entry is never refreshed, so its
//! last-seen is the moment it was marked.
//!
//! # Time
//!
//! Every call takes `now`; the table reads no clock. Nothing here sleeps,
//! does I/O or logs.

mod cleanup;
mod half_open;
mod invariants;
mod key;
mod shard;
pub mod translate;
mod types;
mod uplink;
mod window;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

pub use half_open::{HALF_OPEN_MAX, HALF_OPEN_PER_SOURCE, HANDSHAKE_TIMEOUT, half_open_bounds};
use key::{KeyedBuild, PackedKey, shard_index};
use shard::{ErrorCounters, ForwardShard, Phase, Ports, ReverseShard, Shard};
pub use types::*;
pub use window::{EPOCH_MS, FLOOR_SEGMENTS, GRANT_MS, GRANTS, Regrant, WindowBudget, WindowScale};

/// Shards per map. 64 keeps two threads on different flows off each other's
/// locks nearly always (1/64 collision) for 2 x 64 x 128 B = 16 KiB of locks.
pub(crate) const SHARDS: usize = 64;

/// The flow table. Share it (`Arc`); every method takes `&self`. `P` is
/// what the engine attaches to an admitted half-open flow; the table only
/// keeps it and hands it back.
pub struct NatTable<P = ()> {
    cfg: NatConfig,
    epoch: Instant,
    half_open_ms: u64,
    /// `half_open_timeout`, but at most [`HANDSHAKE_TIMEOUT`]: how long a
    /// Ready flow waits for its accept.
    handshake: Duration,
    linger_ms: u64,
    idle_ms: u64,
    range_start: u16,
    /// Ports in `port_range` (0 when empty; up to 65536, hence u32).
    range_len: u32,
    /// The table's random hash key: shard choice and both maps' buckets.
    hasher: KeyedBuild,
    forward: Box<[ForwardShard; SHARDS]>,
    reverse: Box<[ReverseShard<P>; SHARDS]>,
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
    /// Half-open flows with an attachment (Connecting or Ready): what the
    /// half-open bounds count.
    held: AtomicUsize,
    active: AtomicUsize,
    closing: AtomicUsize,
    /// Flows with a packet in the last epochs, for the window clamp.
    busy: window::Busy,
    /// Window grants among the busy flows (`window::GRANTS`).
    grants: window::Grants,
    errors: ErrorCounters,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl<P> NatTable<P> {
    /// An empty table whose clock starts at `epoch` (the engine's start;
    /// any `now` passed in later is measured from it, an earlier one counts
    /// as the epoch itself).
    pub fn new(cfg: NatConfig, epoch: Instant) -> Self {
        let (range_start, range_len) = if cfg.port_range.is_empty() {
            (0, 0)
        } else {
            let (s, e) = (*cfg.port_range.start(), *cfg.port_range.end());
            (s, u32::from(e) - u32::from(s) + 1)
        };
        let hasher = KeyedBuild::random();
        Self {
            epoch,
            half_open_ms: millis(cfg.half_open_timeout),
            handshake: cfg.half_open_timeout.min(HANDSHAKE_TIMEOUT),
            linger_ms: millis(cfg.linger),
            idle_ms: millis(cfg.idle_timeout),
            range_start,
            range_len,
            hasher,
            forward: Box::new(std::array::from_fn(|_| {
                Shard(RwLock::new(HashMap::with_hasher(hasher)))
            })),
            reverse: Box::new(std::array::from_fn(|_| {
                Shard(RwLock::new(Ports::new(hasher)))
            })),
            cursor: AtomicU32::new(0),
            next_generation: AtomicU64::new(1),
            unanswered: Mutex::new(VecDeque::new()),
            len: AtomicUsize::new(0),
            half_open: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            closing: AtomicUsize::new(0),
            busy: window::Busy::default(),
            grants: window::Grants::default(),
            errors: ErrorCounters::default(),
            cfg,
        }
    }

    /// The configuration the table was built with.
    pub fn config(&self) -> &NatConfig {
        &self.cfg
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
        rev.map.get(&port).map(|m| match m.phase {
            Phase::HalfOpen(stage) => NatState::HalfOpen(stage),
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
            syn_on_active: e.syn_on_active.load(Relaxed),
        }
    }

    /// The counter of entries in `phase`.
    #[inline]
    fn phase_count(&self, phase: Phase) -> &AtomicUsize {
        match phase {
            Phase::HalfOpen(_) => &self.half_open,
            Phase::Active => &self.active,
            Phase::Closing => &self.closing,
        }
    }

    /// Counts an entry into `phase`.
    #[inline]
    fn count_in(&self, phase: Phase) {
        self.phase_count(phase).fetch_add(1, Relaxed);
        if phase.is_held() {
            self.held.fetch_add(1, Relaxed);
        }
    }

    /// Counts an entry out of `phase` (removed, or moving to another).
    #[inline]
    fn count_out(&self, phase: Phase) {
        self.phase_count(phase).fetch_sub(1, Relaxed);
        if phase.is_held() {
            self.held.fetch_sub(1, Relaxed);
        }
    }

    #[inline]
    fn reverse_shard(&self, port: u16) -> &ReverseShard<P> {
        &self.reverse[usize::from(port) % SHARDS]
    }

    #[inline]
    fn forward_shard(&self, key: &PackedKey) -> &ForwardShard {
        &self.forward[shard_index(self.hasher.hash_key(key))]
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

impl<P> fmt::Debug for NatTable<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatTable")
            .field("cfg", &self.cfg)
            .field("counts", &self.counts())
            .field("errors", &self.error_counts())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
