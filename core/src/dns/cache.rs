//! The answer cache: bounded, least-recently-used eviction, each entry kept
//! for the lifetime its reply allows (see [`super::msg::cache_ttl`]). Takes
//! the clock reading from the caller, so tests need no sleeping.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_proto::op::Message;
use parking_lot::Mutex;

/// (lower-cased query name, query type, query class).
pub(crate) type Key = (Box<str>, u16, u16);

#[derive(Debug)]
struct Entry {
    msg: Arc<Message>,
    stored: Instant,
    ttl: u32,
    /// Position in the recency order.
    tick: u64,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<Key, Entry>,
    /// tick -> key, oldest first.
    order: BTreeMap<u64, Key>,
    tick: u64,
}

/// A bounded answer cache (capacity 0: caches nothing).
#[derive(Debug)]
pub(crate) struct Cache {
    cap: usize,
    inner: Mutex<Inner>,
}

impl Cache {
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// A live entry and the whole seconds it has spent here; an expired
    /// entry is removed.
    pub fn get(&self, key: &Key, now: Instant) -> Option<(Arc<Message>, u32)> {
        if self.cap == 0 {
            return None;
        }
        let mut g = self.inner.lock();
        let inner = &mut *g;
        let e = inner.map.get_mut(key)?;
        let age = now.saturating_duration_since(e.stored);
        if age >= Duration::from_secs(u64::from(e.ttl)) {
            let tick = e.tick;
            inner.order.remove(&tick);
            inner.map.remove(key);
            return None;
        }
        inner.tick += 1;
        let old = std::mem::replace(&mut e.tick, inner.tick);
        if let Some(k) = inner.order.remove(&old) {
            inner.order.insert(inner.tick, k);
        }
        Some((e.msg.clone(), age.as_secs() as u32))
    }

    /// Store a reply for `ttl` seconds, evicting the least recently used
    /// entry when full.
    pub fn insert(&self, key: Key, msg: Arc<Message>, ttl: u32, now: Instant) {
        if self.cap == 0 || ttl == 0 {
            return;
        }
        let mut g = self.inner.lock();
        let inner = &mut *g;
        inner.tick += 1;
        let tick = inner.tick;
        if let Some(old) = inner.map.remove(&key) {
            inner.order.remove(&old.tick);
        } else if inner.map.len() >= self.cap
            && let Some((_, k)) = inner.order.pop_first()
        {
            inner.map.remove(&k);
        }
        inner.order.insert(tick, key.clone());
        inner.map.insert(
            key,
            Entry {
                msg,
                stored: now,
                ttl,
                tick,
            },
        );
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: &str) -> Key {
        (n.into(), 1, 1)
    }

    #[test]
    fn ttl_and_age() {
        let c = Cache::new(4);
        let t0 = Instant::now();
        let m = Arc::new(Message::query());
        c.insert(k("a."), m, 10, t0);
        let (_, age) = c
            .get(&k("a."), t0 + Duration::from_millis(3_500))
            .expect("live");
        assert_eq!(age, 3);
        assert!(c.get(&k("a."), t0 + Duration::from_secs(10)).is_none());
        assert_eq!(c.len(), 0, "expired entries leave");
        c.insert(k("b."), Arc::new(Message::query()), 0, t0);
        assert_eq!(c.len(), 0, "TTL 0 is not cached");
    }

    #[test]
    fn lru_eviction_and_bound() {
        let c = Cache::new(2);
        let t = Instant::now();
        c.insert(k("a."), Arc::new(Message::query()), 60, t);
        c.insert(k("b."), Arc::new(Message::query()), 60, t);
        // Touch a: b becomes the least recently used.
        assert!(c.get(&k("a."), t).is_some());
        c.insert(k("c."), Arc::new(Message::query()), 60, t);
        assert_eq!(c.len(), 2);
        assert!(c.get(&k("b."), t).is_none());
        assert!(c.get(&k("a."), t).is_some());
        assert!(c.get(&k("c."), t).is_some());
        // Re-inserting a key does not grow the cache.
        c.insert(k("c."), Arc::new(Message::query()), 60, t);
        assert_eq!(c.len(), 2);
        for i in 0..100 {
            c.insert(k(&format!("n{i}.")), Arc::new(Message::query()), 60, t);
        }
        assert_eq!(c.len(), 2);
        let off = Cache::new(0);
        off.insert(k("a."), Arc::new(Message::query()), 60, t);
        assert!(off.get(&k("a."), t).is_none());
    }
}
