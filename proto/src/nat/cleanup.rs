//! The end of a flow: a session's Closing mark and idle clock, and the
//! periodic cleanup (expiry per state, the handshake timeout).

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use super::shard::{Mapping, Phase, Ports};
use super::{Cleanup, Expired, NatTable, Stage};

impl<P> NatTable<P> {
    /// Marks the Active entry at `port` Closing (since `now`) if it still
    /// carries `generation` (the one its accept stamped); a newer entry on
    /// the same port is left alone. The session's end: its hold calls this
    /// when it drops. Returns whether it marked. (A half-open flow ends
    /// through [`NatTable::abort_half_open`], which hands back what was
    /// attached to it.)
    pub fn mark_closing(&self, port: u16, generation: u64, now: Instant) -> bool {
        self.close_if(port, generation, now, |phase| phase == Phase::Active)
            .is_some()
    }

    /// How long the Active entry at `port` that carries `generation` may
    /// still go without a packet before it is idle for `idle_timeout` (zero
    /// once it is), or `None` when that entry is gone, replaced or no longer
    /// Active. A session polls this (through its hold) to end when its
    /// connection went idle, instead of holding its sockets and permit
    /// after cleanup dropped the mapping.
    pub fn idle_left(&self, port: u16, generation: u64, now: Instant) -> Option<Duration> {
        let rev = self.reverse_shard(port).read();
        let m = rev
            .map
            .get(&port)
            .filter(|m| m.generation == generation && m.phase == Phase::Active)?;
        let idle = self.ms(now).saturating_sub(m.last_seen.load(Relaxed));
        Some(Duration::from_millis(self.idle_ms.saturating_sub(idle)))
    }

    /// Periodic cleanup: [`collect_expired`](Self::collect_expired) then
    /// [`remove_if_expired`](Self::remove_if_expired). HalfOpen entries with
    /// no packet for `half_open_timeout`, Closing entries past `linger`,
    /// Active entries idle for `idle_timeout` are removed from both maps;
    /// Ready flows not accepted within the handshake time are closed.
    pub fn cleanup(&self, now: Instant) -> Cleanup<P> {
        let expired = self.collect_expired(now);
        self.remove_if_expired(&expired, now)
    }

    /// Gives back what a burst of flows left in the maps' capacity: each
    /// map (and the queue of unanswered SYNs) whose capacity is more than
    /// four times what it holds shrinks to twice that. One shard at a
    /// time under its write lock, so the hot path waits at most for one
    /// shard's reallocation. For the quiet time after load (a SYN flood
    /// grows the maps to the half-open bound, and nothing else shrinks
    /// them), not for every cleanup. Returns the bytes of capacity given
    /// back (approximate: the maps' slots, not their control bytes).
    pub fn shrink(&self) -> usize {
        fn shrink_map<K: std::hash::Hash + Eq, V, S: std::hash::BuildHasher>(
            m: &mut std::collections::HashMap<K, V, S>,
        ) -> usize {
            let (len, cap) = (m.len(), m.capacity());
            if cap <= 4 * len.max(8) {
                return 0;
            }
            m.shrink_to(2 * len);
            (cap - m.capacity()) * std::mem::size_of::<(K, V)>()
        }
        let mut freed = 0;
        for shard in self.forward.iter() {
            freed += shrink_map(&mut shard.write());
        }
        for shard in self.reverse.iter() {
            let mut rev = shard.write();
            freed += shrink_map(&mut rev.map);
            freed += shrink_map(&mut rev.held);
        }
        let mut q = self.unanswered.lock();
        let (len, cap) = (q.len(), q.capacity());
        if cap > 4 * len.max(64) {
            q.shrink_to(2 * len);
            freed += (cap - q.capacity()) * std::mem::size_of::<(u16, u64)>();
        }
        freed
    }

    /// First half of cleanup: scans each reverse shard under its read lock
    /// (one at a time) and returns the expired entries, and the Ready flows
    /// past their handshake time. Takes no write lock, so the hot path is
    /// never blocked by the scan.
    pub fn collect_expired(&self, now: Instant) -> Vec<Expired> {
        let now_ms = self.ms(now);
        let mut out = Vec::new();
        for shard in self.reverse.iter() {
            let rev = shard.read();
            out.extend(
                rev.map
                    .iter()
                    .filter(|&(&port, m)| {
                        self.is_expired(m, now_ms) || self.handshake_over(&rev, port, m, now)
                    })
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
    /// and the port's reverse write locks, acts only if it is still the
    /// same entry (generation) and still due at `now`: an expired entry is
    /// deleted, a Ready flow past its handshake time is marked Closing. A
    /// segment that refreshed it after collection, an accept, or a
    /// replacement by a new SYN keeps the mapping.
    pub fn remove_if_expired(&self, expired: &[Expired], now: Instant) -> Cleanup<P> {
        let now_ms = self.ms(now);
        let mut done = Cleanup {
            removed: Default::default(),
            timed_out: Vec::new(),
            expired: Vec::new(),
        };
        for e in expired {
            let mut fwd = self.forward_shard(&e.key).write();
            let mut guard = self.reverse_shard(e.port).write();
            let rev = &mut *guard;
            let Some(m) = rev
                .map
                .get(&e.port)
                .filter(|m| m.generation == e.generation)
            else {
                continue;
            };
            let handshake_over = self.handshake_over(rev, e.port, m, now);
            if !self.is_expired(m, now_ms) {
                if handshake_over {
                    drop(fwd); // a state change: the reverse shard suffices
                    if let Some(Some(p)) = self.close_locked(rev, e.port, now_ms) {
                        done.timed_out.push(p);
                    }
                }
                continue;
            }
            let Some((phase, payload)) = rev.remove(e.port) else {
                continue;
            };
            if fwd.get(&e.key) == Some(&e.port) {
                fwd.remove(&e.key);
            }
            self.len.fetch_sub(1, Relaxed);
            self.count_out(phase);
            match phase {
                Phase::HalfOpen(_) => done.removed.half_open += 1,
                Phase::Active => done.removed.active += 1,
                Phase::Closing => done.removed.closing += 1,
            }
            if let Some(p) = payload {
                if handshake_over {
                    done.timed_out.push(p);
                } else {
                    done.expired.push(p);
                }
            }
        }
        done
    }

    fn is_expired(&self, m: &Mapping, now_ms: u64) -> bool {
        let limit = match m.phase {
            Phase::HalfOpen(_) => self.half_open_ms,
            Phase::Active => self.idle_ms,
            Phase::Closing => self.linger_ms,
        };
        now_ms.saturating_sub(m.last_seen.load(Relaxed)) >= limit
    }

    /// Whether `m` (at `port` of `rev`) is a Ready flow whose SYN went to
    /// the kernel at least the handshake time ago.
    fn handshake_over(&self, rev: &Ports<P>, port: u16, m: &Mapping, now: Instant) -> bool {
        m.phase == Phase::HalfOpen(Stage::Ready)
            && rev
                .held
                .get(&port)
                .is_some_and(|h| now.saturating_duration_since(h.since) >= self.handshake)
    }
}
