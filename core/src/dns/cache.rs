//! The answer cache: bounded in entries and in bytes, least-recently-used
//! eviction, each entry kept for the lifetime its reply allows (see
//! [`super::msg::cache_ttl`]). Entries hold the reply's wire form, whose
//! size is known exactly (a decoded message holds several times its wire
//! size, and that size is not known without walking it); a hit decodes it
//! again, no dearer than the clone of a decoded message it replaced. Takes
//! the clock reading and the byte limit in force from the caller, so tests
//! need no sleeping.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// (lower-cased query name, query type, query class).
pub(crate) type Key = (Box<str>, u16, u16);

/// Bytes an entry costs beyond its reply and its name: the key and entry
/// structs (48 + 64 bytes), the recency map's node share (about 48 bytes
/// per key in a B-tree of 11-key nodes), the `Arc` header (16), the hash
/// table's slack (up to half its slots empty after growing: another 112),
/// and allocator rounding.
pub(crate) const ENTRY_OVERHEAD: usize = 320;

#[derive(Debug)]
struct Entry {
    wire: Arc<[u8]>,
    stored: Instant,
    ttl: u32,
    /// Position in the recency order.
    tick: u64,
    /// What this entry counts against the byte limit.
    cost: usize,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<Key, Entry>,
    /// tick -> key, oldest first.
    order: BTreeMap<u64, Key>,
    tick: u64,
    /// Sum of the entries' costs.
    bytes: usize,
}

impl Inner {
    fn remove(&mut self, key: &Key) {
        if let Some(e) = self.map.remove(key) {
            self.order.remove(&e.tick);
            self.bytes -= e.cost;
        }
    }

    /// Evict least recently used entries until `bytes + room <= limit`.
    fn make_room(&mut self, room: usize, limit: usize) {
        while self.bytes + room > limit {
            let Some((_, k)) = self.order.pop_first() else {
                return;
            };
            if let Some(e) = self.map.remove(&k) {
                self.bytes -= e.cost;
            }
        }
    }
}

/// A bounded answer cache (capacity 0: caches nothing).
#[derive(Debug)]
pub(crate) struct Cache {
    cap: usize,
    inner: Mutex<Inner>,
}

/// What an entry for `key` holding `wire` costs.
pub(crate) fn entry_cost(key: &Key, wire: &[u8]) -> usize {
    ENTRY_OVERHEAD + key.0.len() + wire.len()
}

impl Cache {
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// A live entry's wire form and the whole seconds it has spent here; an
    /// expired entry is removed.
    pub fn get(&self, key: &Key, now: Instant) -> Option<(Arc<[u8]>, u32)> {
        if self.cap == 0 {
            return None;
        }
        let mut g = self.inner.lock();
        let inner = &mut *g;
        let e = inner.map.get_mut(key)?;
        let age = now.saturating_duration_since(e.stored);
        if age >= Duration::from_secs(u64::from(e.ttl)) {
            inner.remove(key);
            return None;
        }
        inner.tick += 1;
        let old = std::mem::replace(&mut e.tick, inner.tick);
        if let Some(k) = inner.order.remove(&old) {
            inner.order.insert(inner.tick, k);
        }
        Some((e.wire.clone(), age.as_secs() as u32))
    }

    /// Store a reply (`wire`) for `ttl` seconds, evicting the least recently
    /// used entries while the cache is full or the bytes would pass `limit`
    /// (the budget in force now). A reply larger than the whole limit is not
    /// stored.
    pub fn insert(&self, key: Key, wire: &[u8], ttl: u32, now: Instant, limit: usize) {
        if self.cap == 0 || ttl == 0 {
            return;
        }
        let cost = entry_cost(&key, wire);
        let mut g = self.inner.lock();
        let inner = &mut *g;
        inner.remove(&key);
        if cost > limit {
            inner.make_room(0, limit);
            return;
        }
        inner.make_room(cost, limit);
        if inner.map.len() >= self.cap
            && let Some((_, k)) = inner.order.pop_first()
        {
            inner.remove(&k);
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.order.insert(tick, key.clone());
        inner.bytes += cost;
        inner.map.insert(
            key,
            Entry {
                wire: wire.into(),
                stored: now,
                ttl,
                tick,
                cost,
            },
        );
    }

    /// Evict least recently used entries until the cache holds at most
    /// `limit` bytes (memory pressure went up).
    pub fn trim(&self, limit: usize) {
        self.inner.lock().make_room(0, limit);
    }

    /// Bytes the entries cost.
    #[cfg(any(test, fuzzing))]
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_LIMIT: usize = usize::MAX / 2;

    fn k(n: &str) -> Key {
        (n.into(), 1, 1)
    }

    #[test]
    fn ttl_and_age() {
        let c = Cache::new(4);
        let t0 = Instant::now();
        c.insert(k("a."), b"reply", 10, t0, NO_LIMIT);
        let (w, age) = c
            .get(&k("a."), t0 + Duration::from_millis(3_500))
            .expect("live");
        assert_eq!((&*w, age), (&b"reply"[..], 3));
        assert!(c.get(&k("a."), t0 + Duration::from_secs(10)).is_none());
        assert_eq!((c.len(), c.bytes()), (0, 0), "expired entries leave");
        c.insert(k("b."), b"reply", 0, t0, NO_LIMIT);
        assert_eq!(c.len(), 0, "TTL 0 is not cached");
    }

    #[test]
    fn lru_eviction_and_bound() {
        let c = Cache::new(2);
        let t = Instant::now();
        c.insert(k("a."), b"1", 60, t, NO_LIMIT);
        c.insert(k("b."), b"2", 60, t, NO_LIMIT);
        // Touch a: b becomes the least recently used.
        assert!(c.get(&k("a."), t).is_some());
        c.insert(k("c."), b"3", 60, t, NO_LIMIT);
        assert_eq!(c.len(), 2);
        assert!(c.get(&k("b."), t).is_none());
        assert!(c.get(&k("a."), t).is_some());
        assert!(c.get(&k("c."), t).is_some());
        // Re-inserting a key does not grow the cache.
        c.insert(k("c."), b"3", 60, t, NO_LIMIT);
        assert_eq!(c.len(), 2);
        for i in 0..100 {
            c.insert(k(&format!("n{i}.")), b"4", 60, t, NO_LIMIT);
        }
        assert_eq!(c.len(), 2);
        assert_eq!(c.bytes(), 2 * entry_cost(&k("n99."), b"4"));
        let off = Cache::new(0);
        off.insert(k("a."), b"1", 60, t, NO_LIMIT);
        assert!(off.get(&k("a."), t).is_none());
    }

    /// Large answers: the cache holds what the byte limit allows, not what
    /// the entry count allows (4096 answers of 64 KiB would be 256 MiB), and
    /// a lower limit (memory pressure) evicts down to it.
    #[test]
    fn bytes_stay_within_the_limit_in_force() {
        const MIB: usize = 1024 * 1024;
        let c = Cache::new(4_096);
        let t = Instant::now();
        let big = vec![7u8; 65_535];
        for i in 0..100 {
            c.insert(k(&format!("n{i}.")), &big, 600, t, MIB);
            assert!(c.bytes() <= MIB, "{} bytes after {i}", c.bytes());
        }
        let cost = entry_cost(&k("n10."), &big);
        assert_eq!(c.len(), MIB / cost, "as many as fit");
        assert!(c.get(&k("n99."), t).is_some(), "the newest stays");
        assert!(c.get(&k("n0."), t).is_none(), "the oldest went");
        c.trim(MIB / 4);
        assert!(c.bytes() <= MIB / 4);
        assert_eq!(c.len(), (MIB / 4) / cost);
        assert!(c.get(&k("n99."), t).is_some(), "trimming keeps the newest");
        // An answer larger than the whole limit is not kept; the rest still
        // keeps to the limit in force.
        let before = c.len();
        c.insert(k("huge."), &big, 600, t, cost - 1);
        assert!(c.get(&k("huge."), t).is_none());
        assert!(c.len() <= before);
        assert!(c.bytes() < cost);
    }
}
