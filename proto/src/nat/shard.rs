//! The NAT table's storage: the per-connection [`Mapping`], what the engine
//! attaches to a half-open flow ([`Held`]), lock shards on their own cache
//! lines, and the lock-order check of debug builds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::Stage;
use super::key::{KeyedBuild, PackedKey};
use super::window::{self, SynAck, WindowScale};

/// One byte: the stage lives in the mapping, so the per-packet path (a
/// SYN retransmit held while connecting) never reads the side map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    HalfOpen(Stage),
    Active,
    Closing,
}

impl Phase {
    /// Whether the flow has a [`Held`] beside its mapping.
    #[inline]
    pub(super) fn is_held(self) -> bool {
        matches!(
            self,
            Phase::HalfOpen(Stage::Connecting) | Phase::HalfOpen(Stage::Ready)
        )
    }
}

/// Reverse-map value: everything the table keeps per connection besides the
/// forward map's copy of the key.
#[derive(Debug)]
pub(super) struct Mapping {
    /// Unique per entry: drawn at creation and again at every accept, from
    /// one counter, so a stale (port, generation) never matches a newer entry
    /// on the same port.
    pub(super) generation: u64,
    /// Milliseconds since the table's epoch of the last packet; for Closing,
    /// the moment it was marked (Closing entries are never refreshed).
    pub(super) last_seen: AtomicU64,
    pub(super) key: PackedKey,
    pub(super) phase: Phase,
    /// Initial sequence number of the SYN that created the entry: a SYN with
    /// the same ISN is a retransmit, another ISN is a new connection.
    pub(super) isn: u32,
    /// The app sent a FIN or an RST on this flow: only then may a SYN with
    /// another ISN replace an Active entry (until then it is the old
    /// connection's, whose kernel socket answers it with a challenge ACK).
    pub(super) app_closed: AtomicBool,
    /// Window scale shift codes (`window::code`) of the app's SYN and of
    /// the listener's SYN-ACK, `window::UNSEEN` until that SYN passed.
    pub(super) app_wscale: AtomicU8,
    pub(super) listener_wscale: AtomicU8,
    /// Per direction (`window::Dir`), the epoch (modulo 256) of its last
    /// segment with payload.
    pub(super) data_epoch: [AtomicU8; 2],
    /// Per direction (`window::Dir`), the right edge (acknowledgment plus
    /// window, in the other side's sequence space) the segments of that
    /// direction have advertised, as far as the window clamp knows: a
    /// clamped window never moves it back. Set when the listener's SYN-ACK
    /// passes; until then `edge[Dir::Up]` holds the app's SYN window.
    pub(super) edge: [AtomicU32; 2],
}

/// What the engine attached to an admitted half-open flow (Connecting or
/// Ready), kept beside its [`Mapping`] in the same reverse shard, under
/// the same lock: a flow has one while, and only while, its phase says
/// so ([`Phase::is_held`]), and every transition that ends it hands it
/// back. Established flows carry none, so the per-packet maps keep their
/// size.
#[derive(Debug)]
pub(super) struct Held<P> {
    /// When it was admitted (Connecting) or its SYN went to the kernel
    /// (Ready): what the half-open bounds evict by, oldest first, and what
    /// the handshake timeout counts from.
    pub(super) since: Instant,
    pub(super) payload: P,
}

/// A reverse shard's contents: the mappings of its ports, and the
/// attachments of those that are admitted half-open flows.
#[derive(Debug)]
pub(super) struct Ports<P> {
    pub(super) map: HashMap<u16, Mapping, KeyedBuild>,
    pub(super) held: HashMap<u16, Held<P>, KeyedBuild>,
}

impl<P> Ports<P> {
    pub(super) fn new(hasher: KeyedBuild) -> Self {
        Self {
            map: HashMap::with_hasher(hasher),
            held: HashMap::with_hasher(hasher),
        }
    }

    /// Removes `port`'s entry and its attachment: the phase it had and the
    /// attachment, if it had one.
    pub(super) fn remove(&mut self, port: u16) -> Option<(Phase, Option<P>)> {
        let m = self.map.remove(&port)?;
        let payload = if m.phase.is_held() {
            self.held.remove(&port).map(|h| h.payload)
        } else {
            None
        };
        Some((m.phase, payload))
    }
}

impl Mapping {
    /// Per-packet refresh, under a read lock. Closing entries are left alone
    /// so late segments cannot extend the linger.
    #[inline]
    pub(super) fn touch(&self, now_ms: u64) {
        if self.phase != Phase::Closing && self.last_seen.load(Relaxed) < now_ms {
            self.last_seen.fetch_max(now_ms, Relaxed);
        }
    }

    /// A segment with payload from the app (`Dir::Up`) or the listener
    /// (`Dir::Down`) in `epoch`: true for the first of its direction in
    /// that epoch (`window::Busy` counts it). The epoch is kept modulo 256
    /// (25.6 s): a direction quiet for a multiple of that is counted one
    /// epoch late.
    #[inline]
    pub(super) fn carried(&self, dir: window::Dir, epoch: u64) -> bool {
        let tag = epoch as u8;
        let seen = &self.data_epoch[dir as usize];
        if seen.load(Relaxed) == tag {
            return false;
        }
        seen.store(tag, Relaxed);
        true
    }

    /// Whether direction `dir` carried payload in epoch `epoch` or the one
    /// before.
    #[inline]
    pub(super) fn sends_data(&self, dir: window::Dir, epoch: u64) -> bool {
        let seen = self.data_epoch[dir as usize].load(Relaxed);
        seen == epoch as u8 || seen == epoch.wrapping_sub(1) as u8
    }

    /// Record the listener's SYN-ACK: its window scale option, and, the
    /// first time, the right edges both SYNs advertised (unscaled).
    #[inline]
    pub(super) fn note_syn_ack(&self, s: SynAck) {
        let seen = self.listener_wscale.swap(window::code(s.option), Relaxed);
        if seen == window::UNSEEN {
            let up = &self.edge[window::Dir::Up as usize];
            let app_window = up.load(Relaxed);
            up.store(s.seq.wrapping_add(1).wrapping_add(app_window), Relaxed);
            self.edge[window::Dir::Down as usize]
                .store(s.ack.wrapping_add(u32::from(s.window)), Relaxed);
        }
    }

    /// What the flow's handshake said about window scaling so far.
    #[inline]
    pub(super) fn window_scale(&self) -> WindowScale {
        WindowScale::from_codes(
            self.app_wscale.load(Relaxed),
            self.listener_wscale.load(Relaxed),
        )
    }
}

/// A lock on its own 128-byte block, so threads on different shards do not
/// bounce one cache line (128: adjacent-line prefetch on x86, line size on
/// Apple cores). `MAP` says which map it belongs to, for the lock-order
/// check.
#[repr(align(128))]
#[derive(Default)]
pub(super) struct Shard<T, const MAP: u8>(pub(super) RwLock<T>);

impl<T, const MAP: u8> Shard<T, MAP> {
    #[inline]
    pub(super) fn read(&self) -> order::Held<RwLockReadGuard<'_, T>> {
        order::acquire(MAP);
        order::Held::new(self.0.read(), MAP)
    }

    #[inline]
    pub(super) fn write(&self) -> order::Held<RwLockWriteGuard<'_, T>> {
        order::acquire(MAP);
        order::Held::new(self.0.write(), MAP)
    }
}

pub(super) type ForwardShard = Shard<HashMap<PackedKey, u16, KeyedBuild>, { order::FORWARD }>;
pub(super) type ReverseShard<P> = Shard<Ports<P>, { order::REVERSE }>;

/// Lock-order check, in the spirit of the kernel's lockdep: in debug builds
/// each thread records which maps it holds a shard of, and every acquisition
/// asserts the rule (forward before reverse, one shard per map) *before*
/// blocking, so every test that runs a path checks its order even when no
/// second thread is there to deadlock with. Release builds keep only the
/// plain lock.
pub(super) mod order {
    use std::ops::{Deref, DerefMut};

    pub(in crate::nat) const FORWARD: u8 = 1;
    pub(in crate::nat) const REVERSE: u8 = 2;

    #[cfg(debug_assertions)]
    thread_local! {
        static HELD: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
    }

    #[inline]
    pub(in crate::nat) fn acquire(map: u8) {
        #[cfg(debug_assertions)]
        HELD.with(|held| {
            // A forward shard: nothing may be held yet. A reverse shard: no
            // other reverse shard.
            let forbidden = if map == FORWARD {
                FORWARD | REVERSE
            } else {
                REVERSE
            };
            assert!(
                held.get() & forbidden == 0,
                "NAT lock order violated: taking {} while holding {:#b}",
                if map == FORWARD { "forward" } else { "reverse" },
                held.get()
            );
            held.set(held.get() | map);
        });
        #[cfg(not(debug_assertions))]
        let _ = map;
    }

    /// A lock guard that clears its map's bit when dropped.
    pub(in crate::nat) struct Held<G> {
        guard: G,
        #[cfg(debug_assertions)]
        map: u8,
    }

    impl<G> Held<G> {
        #[inline]
        pub(in crate::nat) fn new(guard: G, map: u8) -> Self {
            #[cfg(not(debug_assertions))]
            let _ = map;
            Self {
                guard,
                #[cfg(debug_assertions)]
                map,
            }
        }
    }

    impl<G> Drop for Held<G> {
        #[inline]
        fn drop(&mut self) {
            #[cfg(debug_assertions)]
            HELD.with(|held| held.set(held.get() & !self.map));
        }
    }

    impl<G: Deref> Deref for Held<G> {
        type Target = G::Target;
        #[inline]
        fn deref(&self) -> &G::Target {
            &self.guard
        }
    }

    impl<G: DerefMut> DerefMut for Held<G> {
        #[inline]
        fn deref_mut(&mut self) -> &mut G::Target {
            &mut self.guard
        }
    }
}

#[derive(Default)]
pub(super) struct ErrorCounters {
    pub(super) table_full: AtomicU64,
    pub(super) no_free_port: AtomicU64,
    pub(super) uplink_no_mapping: AtomicU64,
    pub(super) downlink_no_mapping: AtomicU64,
    pub(super) accept_refused: AtomicU64,
    pub(super) evicted: AtomicU64,
    pub(super) syn_on_active: AtomicU64,
}
