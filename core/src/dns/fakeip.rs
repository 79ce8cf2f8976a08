//! The fake-ip pool: each domain asked for gets an address of its own from a
//! configured prefix, so a later connection to that address can be routed
//! (and proxied) by the domain.
//!
//! One index space serves both families: slot `i` is the `i`-th usable IPv4
//! address of the pool and, when an IPv6 pool is set, the `i`-th of that one
//! too, so a domain's A and AAAA answers name the same slot.
//!
//! Bounded two ways: at most `fake_ip_entries` domains (capped by the pool
//! sizes), and in bytes by the fake-ip budget in force (the caller passes
//! the limit): each domain held costs its name plus [`HELD_ENTRY`], each
//! address waiting out its grace period [`COOLING_ENTRY`], and the free-slot
//! bitmap its size. Past the bytes, the least recently used domains give
//! their addresses back.
//!
//! An address goes to another domain only after [`GRACE`] without use (no
//! answer naming it, no connection or datagram to it), so an app still
//! holding a domain's address never reaches another domain through it.
//! When no address is free (every one held or waiting out its grace) a new
//! domain gets none: the caller answers it with the real address.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use ipnet::{Ipv4Net, Ipv6Net};
use parking_lot::Mutex;

use crate::stats::DnsCounters;

/// How long an address stays unused before it may stand for another
/// domain. Answers carry a TTL of 1 s, but apps keep addresses past it:
/// Java caches a lookup for 30 s by default, browsers for about a minute,
/// and an app may reconnect to the address it has for as long as it runs.
/// Five minutes covers the caches that honour no TTL; an app that keeps an
/// address longer without using it meets an address that stands for no
/// domain (an RST, `fake_ip_unknown`) or, after this, another domain.
pub const GRACE: Duration = Duration::from_secs(300);

/// Bytes a domain holding a slot costs beyond its name: its entry in the
/// slot map (48-byte buckets) and in the name map (24), each with the hash
/// table's slack (up to half its buckets empty after it grows, then the 7/8
/// load factor: 112 and 57 bytes), its share of the recency B-tree (12-byte
/// entries in nodes of 11 that may be half full, and the inner nodes: about
/// 40), and the name's `Arc` header with the allocator's rounding (about
/// 40).
pub(crate) const HELD_ENTRY: usize = 256;

/// Bytes an address waiting out its grace period costs: its 24-byte record
/// in the queue, twice for the queue's slack after it grows.
pub(crate) const COOLING_ENTRY: usize = 48;

#[derive(Debug)]
struct Held {
    domain: Arc<str>,
    /// Position in the recency order.
    tick: u64,
    /// When an answer last named the address or a connection last used it.
    used: Instant,
}

#[derive(Debug)]
struct Inner {
    held: HashMap<u32, Held>,
    by_domain: HashMap<Arc<str>, u32>,
    /// tick -> slot, least recently used first.
    order: BTreeMap<u64, u32>,
    /// Slots given back before their grace period passed, with their last
    /// use, oldest first.
    cooling: VecDeque<(u32, Instant)>,
    /// One bit per slot that no domain holds and that is not cooling.
    free: Vec<u64>,
    tick: u64,
    /// The latest `now` seen: uses are stamped no earlier, so the recency
    /// order and the use times agree (callers read the clock before the
    /// lock).
    latest: Option<Instant>,
    /// What the held domains, the cooling slots and the bitmap cost.
    bytes: usize,
}

/// A domain <-> address map over the configured pools.
#[derive(Debug)]
pub(crate) struct FakePool {
    v4: Ipv4Net,
    v6: Option<Ipv6Net>,
    /// Slots in use at most: `fake_ip_entries`, capped by the pool sizes.
    cap: u32,
    inner: Mutex<Inner>,
}

/// Usable IPv4 addresses: the network and broadcast addresses are skipped
/// (some stacks refuse to connect to them) where the prefix has them.
fn v4_span(n: Ipv4Net) -> (u32, u32) {
    let size = 1u64 << (32 - n.prefix_len());
    if size > 2 {
        (1, (size - 2).min(u64::from(u32::MAX)) as u32)
    } else {
        (0, size as u32)
    }
}

/// What holding `domain` costs.
fn held_cost(domain: &str) -> usize {
    HELD_ENTRY + domain.len()
}

impl Inner {
    fn take_free(&mut self) -> Option<u32> {
        let (w, word) = self.free.iter_mut().enumerate().find(|(_, w)| **w != 0)?;
        let bit = word.trailing_zeros();
        *word &= !(1 << bit);
        Some(w as u32 * 64 + bit)
    }

    fn set_free(&mut self, i: u32) {
        if let Some(word) = self.free.get_mut(i as usize / 64) {
            *word |= 1 << (i % 64);
        }
    }

    /// Free the cooling slots whose grace period has passed at `now`.
    fn cool(&mut self, now: Instant) {
        while let Some(&(i, used)) = self.cooling.front() {
            if now.saturating_duration_since(used) < GRACE {
                break;
            }
            self.cooling.pop_front();
            self.bytes -= COOLING_ENTRY;
            self.set_free(i);
        }
    }

    /// Take slot `i` from the domain holding it. Its address waits out its
    /// grace period from that domain's last use, unless `now` is past it.
    fn release(&mut self, i: u32, now: Instant, c: &DnsCounters) {
        let Some(h) = self.held.remove(&i) else {
            return;
        };
        self.order.remove(&h.tick);
        self.by_domain.remove(&h.domain);
        self.bytes -= held_cost(&h.domain);
        if now.saturating_duration_since(h.used) >= GRACE {
            self.set_free(i);
        } else {
            self.cooling.push_back((i, h.used));
            self.bytes += COOLING_ENTRY;
        }
        c.fakeip_evictions.fetch_add(1, Relaxed);
        c.fakeip_active.store(self.held.len() as u64, Relaxed);
    }

    /// Give back least recently used domains until `room` more bytes fit
    /// under `limit`; false if they do not even with none held.
    fn make_room(&mut self, room: usize, limit: usize, now: Instant, c: &DnsCounters) -> bool {
        while self.bytes + room > limit {
            let Some((_, i)) = self.order.first_key_value().map(|(t, i)| (*t, *i)) else {
                return false;
            };
            self.release(i, now, c);
        }
        true
    }

    /// Stamp slot `i`'s domain as used at `now` (most recently).
    fn touch(&mut self, i: u32, now: Instant) -> Option<&Held> {
        self.tick += 1;
        let tick = self.tick;
        let now = self.latest.map_or(now, |l| l.max(now));
        self.latest = Some(now);
        let h = self.held.get_mut(&i)?;
        self.order.remove(&h.tick);
        h.tick = tick;
        h.used = now;
        self.order.insert(tick, i);
        Some(h)
    }
}

impl FakePool {
    pub fn new(v4: Ipv4Net, v6: Option<Ipv6Net>, entries: usize) -> Self {
        let v4 = v4.trunc();
        let v6 = v6.map(|n| n.trunc());
        let (_, n4) = v4_span(v4);
        let mut cap = n4.min(u32::try_from(entries).unwrap_or(u32::MAX));
        if let Some(n6) = v6 {
            // The subnet-router anycast address (offset 0) is skipped.
            let bits = 128 - u32::from(n6.prefix_len());
            if bits < 32 {
                cap = cap.min((1u32 << bits).saturating_sub(1));
            }
        }
        let cap = cap.max(1);
        // Every slot starts free; the last word's bits past `cap` stay 0.
        let mut free = vec![u64::MAX; cap.div_ceil(64) as usize];
        if cap % 64 != 0
            && let Some(last) = free.last_mut()
        {
            *last = (1 << (cap % 64)) - 1;
        }
        let bytes = free.len() * 8;
        Self {
            v4,
            v6,
            cap,
            inner: Mutex::new(Inner {
                held: HashMap::new(),
                by_domain: HashMap::new(),
                order: BTreeMap::new(),
                cooling: VecDeque::new(),
                free,
                tick: 0,
                latest: None,
                bytes,
            }),
        }
    }

    #[cfg(test)]
    pub fn capacity(&self) -> u32 {
        self.cap
    }

    fn v4_at(&self, i: u32) -> Ipv4Addr {
        let (first, _) = v4_span(self.v4);
        Ipv4Addr::from(u32::from(self.v4.network()) + first + i)
    }

    fn v6_at(&self, i: u32) -> Option<Ipv6Addr> {
        self.v6
            .map(|n| Ipv6Addr::from(u128::from(n.network()) + 1 + u128::from(i)))
    }

    /// The slot an address names, if it is one of the pool's.
    fn index(&self, ip: IpAddr) -> Option<u32> {
        let i = match ip {
            IpAddr::V4(a) => {
                if !self.v4.contains(&a) {
                    return None;
                }
                let (first, _) = v4_span(self.v4);
                (u32::from(a) - u32::from(self.v4.network())).checked_sub(first)?
            }
            IpAddr::V6(a) => {
                let n = self.v6?;
                if !n.contains(&a) {
                    return None;
                }
                let off = (u128::from(a) - u128::from(n.network())).checked_sub(1)?;
                u32::try_from(off).ok()?
            }
        };
        (i < self.cap).then_some(i)
    }

    /// Whether `ip` lies in a pool (whether or not a domain holds it).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(a) => self.v4.contains(&a),
            IpAddr::V6(a) => self.v6.is_some_and(|n| n.contains(&a)),
        }
    }

    /// The addresses of `domain` (lower-case, no trailing dot) at `now`,
    /// with `limit` the byte budget in force. A domain without a slot gets
    /// a free one, after the least recently used domains give back what
    /// its bytes need; when no slot is free, the least recently used
    /// domain's if it has gone unused for [`GRACE`]. `None`: no address
    /// can be had now (the caller answers with the real address).
    pub fn assign(
        &self,
        domain: &str,
        now: Instant,
        limit: usize,
        c: &DnsCounters,
    ) -> Option<(Ipv4Addr, Option<Ipv6Addr>)> {
        let mut g = self.inner.lock();
        let inner = &mut *g;
        if let Some(&i) = inner.by_domain.get(domain) {
            inner.touch(i, now);
            return Some((self.v4_at(i), self.v6_at(i)));
        }
        inner.cool(now);
        // Without a free slot the least recently used domain's may be
        // taken, once it has been idle for the grace period; otherwise
        // nothing is given back for a slot that cannot be had.
        let oldest = inner.order.first_key_value().map(|(_, &i)| i);
        if !inner.free.iter().any(|w| *w != 0) {
            let used = inner.held.get(&oldest?)?.used;
            if now.saturating_duration_since(used) < GRACE {
                return None;
            }
        }
        let cost = held_cost(domain);
        if !inner.make_room(cost, limit, now, c) {
            return None;
        }
        let i = match inner.take_free() {
            Some(i) => i,
            None => {
                // Idle past its grace: freed at once, not cooled.
                inner.release(oldest?, now, c);
                inner.take_free()?
            }
        };
        let d: Arc<str> = domain.into();
        inner.by_domain.insert(d.clone(), i);
        inner.held.insert(
            i,
            Held {
                domain: d,
                tick: 0,
                used: now,
            },
        );
        inner.bytes += cost;
        inner.touch(i, now);
        c.fakeip_active.store(inner.held.len() as u64, Relaxed);
        Some((self.v4_at(i), self.v6_at(i)))
    }

    /// The domain holding `ip` (a connection to it at `now` refreshes its
    /// recency and its last use), if any.
    pub fn domain(&self, ip: IpAddr, now: Instant) -> Option<Arc<str>> {
        let i = self.index(ip)?;
        let mut g = self.inner.lock();
        g.touch(i, now).map(|h| h.domain.clone())
    }

    /// Give back least recently used domains until the pool holds at most
    /// `limit` bytes (memory pressure went up).
    pub fn trim(&self, limit: usize, now: Instant, c: &DnsCounters) {
        let mut g = self.inner.lock();
        g.cool(now);
        g.make_room(0, limit, now, c);
    }

    /// Bytes the pool's domains, cooling slots and bitmap cost.
    #[cfg(any(test, fuzzing))]
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_LIMIT: usize = usize::MAX / 2;

    #[test]
    fn assigns_stable_addresses_and_maps_back() {
        let c = DnsCounters::default();
        let t = Instant::now();
        let p = FakePool::new(
            "198.18.128.0/17".parse().expect("net"),
            Some("fd00:fa::/64".parse().expect("net")),
            1000,
        );
        let (a, a6) = p.assign("a.test", t, NO_LIMIT, &c).expect("room");
        assert_eq!(a, Ipv4Addr::new(198, 18, 128, 1));
        assert_eq!(a6, Some("fd00:fa::1".parse().expect("ip")));
        let (b, _) = p.assign("b.test", t, NO_LIMIT, &c).expect("room");
        assert_ne!(a, b);
        assert_eq!(
            p.assign("a.test", t, NO_LIMIT, &c).expect("held").0,
            a,
            "stable while held"
        );
        assert_eq!(p.domain(IpAddr::V4(a), t).as_deref(), Some("a.test"));
        assert_eq!(
            p.domain(a6.map(IpAddr::V6).expect("v6"), t).as_deref(),
            Some("a.test")
        );
        let unheld = IpAddr::V4(Ipv4Addr::new(198, 18, 200, 9));
        assert_eq!(p.domain(unheld, t), None);
        assert_eq!(p.domain(IpAddr::V4(Ipv4Addr::new(198, 18, 0, 9)), t), None);
        assert!(p.contains(unheld));
        assert_eq!(c.fakeip_active.load(Relaxed), 2);
    }

    /// A full pool hands out no address that was used within the grace
    /// period: the new domain gets none (and the old one keeps its own)
    /// until the least recently used domain has been idle that long.
    #[test]
    fn exhaustion_reuses_the_least_recently_used_only_after_its_grace() {
        let c = DnsCounters::default();
        let t0 = Instant::now();
        // A /30 has two usable addresses.
        let p = FakePool::new("198.18.0.0/30".parse().expect("net"), None, 100);
        assert_eq!(p.capacity(), 2);
        let (a, _) = p.assign("a", t0, NO_LIMIT, &c).expect("room");
        let (b, _) = p.assign("b", t0, NO_LIMIT, &c).expect("room");
        // Use a: b is now the oldest.
        let t1 = t0 + Duration::from_secs(10);
        assert!(p.domain(IpAddr::V4(a), t1).is_some());
        assert_eq!(p.assign("x", t1, NO_LIMIT, &c), None, "b was just used");
        assert_eq!(c.fakeip_evictions.load(Relaxed), 0);
        assert_eq!(c.fakeip_active.load(Relaxed), 2, "b keeps its address");
        let just_before = t0 + GRACE - Duration::from_millis(1);
        assert_eq!(p.assign("x", just_before, NO_LIMIT, &c), None);
        // Idle for the grace period: b's address goes to x.
        let (x, _) = p.assign("x", t0 + GRACE, NO_LIMIT, &c).expect("b idle");
        assert_eq!(x, b);
        assert_eq!(p.domain(IpAddr::V4(b), t0 + GRACE).as_deref(), Some("x"));
        assert_eq!(p.domain(IpAddr::V4(a), t0 + GRACE).as_deref(), Some("a"));
        assert_eq!(c.fakeip_evictions.load(Relaxed), 1);
        assert_eq!(c.fakeip_active.load(Relaxed), 2);
    }

    #[test]
    fn entries_cap_the_map() {
        let c = DnsCounters::default();
        let t0 = Instant::now();
        let p = FakePool::new("198.18.128.0/17".parse().expect("net"), None, 3);
        for i in 0..50u64 {
            // Two minutes apart: the least recently used of three has been
            // idle for six when the next comes, past its grace.
            let t = t0 + Duration::from_secs(120 * i);
            let (a, _) = p.assign(&format!("d{i}"), t, NO_LIMIT, &c).expect("a slot");
            assert!(p.index(IpAddr::V4(a)).expect("in pool") < 3);
        }
        assert_eq!(c.fakeip_active.load(Relaxed), 3);
        assert_eq!(c.fakeip_evictions.load(Relaxed), 47);
    }

    /// Names held cost their bytes: the pool keeps to the limit in force,
    /// giving back the least recently used, and counts exactly what it
    /// holds; each address went to one name only (the evicted ones cool
    /// while fresh ones are handed out). Memory pressure trims at once.
    #[test]
    fn bytes_stay_within_the_limit_in_force() {
        let c = DnsCounters::default();
        let t0 = Instant::now();
        let p = FakePool::new("198.18.128.0/24".parse().expect("net"), None, 1000);
        let fixed = p.bytes();
        assert_eq!(fixed, 4 * 8, "254 slots: four words of bitmap");
        let name = |i: usize| format!("{i:0>60}.example");
        let each = held_cost(&name(0));
        let limit = fixed + 10 * each;
        let mut addrs = Vec::new();
        for i in 0..40 {
            let (a, _) = p.assign(&name(i), t0, limit, &c).expect("room");
            addrs.push(a);
            assert!(p.bytes() <= limit, "{} bytes after {i}", p.bytes());
        }
        let held = c.fakeip_active.load(Relaxed) as usize;
        let evicted = c.fakeip_evictions.load(Relaxed) as usize;
        assert_eq!(held + evicted, 40);
        assert!(held >= 1);
        assert_eq!(p.bytes(), fixed + held * each + evicted * COOLING_ENTRY);
        let mut unique = addrs.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), 40, "no address handed out twice");
        assert_eq!(p.domain(IpAddr::V4(addrs[0]), t0), None, "evicted");
        assert_eq!(
            p.domain(IpAddr::V4(addrs[39]), t0).as_deref(),
            Some(name(39).as_str())
        );
        // Once their grace has passed the cooling slots cost nothing.
        p.trim(limit, t0 + GRACE, &c);
        assert_eq!(p.bytes(), fixed + held * each);
        p.trim(fixed + each, t0 + GRACE, &c);
        assert_eq!(c.fakeip_active.load(Relaxed), 1, "the newest stays");
        assert_eq!(p.bytes(), fixed + each);
    }

    /// An address given back for bytes is not handed out again within its
    /// grace period, even when the pool has no other: the new domain gets
    /// none until it has passed.
    #[test]
    fn an_evicted_address_cools_before_it_is_reused() {
        let c = DnsCounters::default();
        let t0 = Instant::now();
        // A /29 has six usable addresses; the bytes hold two names.
        let p = FakePool::new("198.18.0.0/29".parse().expect("net"), None, 100);
        let limit = p.bytes() + 2 * held_cost("n0") + 4 * COOLING_ENTRY;
        let mut addrs = Vec::new();
        for i in 0..6 {
            let (a, _) = p.assign(&format!("n{i}"), t0, limit, &c).expect("fresh");
            addrs.push(a);
        }
        assert_eq!(c.fakeip_evictions.load(Relaxed), 4);
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(p.assign("late", t1, limit, &c), None, "all held or cooling");
        assert_eq!(
            c.fakeip_evictions.load(Relaxed),
            4,
            "none given back for it"
        );
        assert_eq!(
            p.domain(IpAddr::V4(addrs[0]), t1),
            None,
            "n0's stays unheld"
        );
        assert_eq!(p.domain(IpAddr::V4(addrs[5]), t1).as_deref(), Some("n5"));
        let (late, _) = p.assign("late", t0 + GRACE, limit, &c).expect("cooled");
        assert_eq!(late, addrs[0], "the first to cool");
    }
}
