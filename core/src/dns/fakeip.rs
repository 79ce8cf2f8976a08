//! The fake-ip pool: each domain asked for gets an address of its own from a
//! configured prefix, so a later connection to that address can be routed
//! (and proxied) by the domain. The map is bounded: past its capacity the
//! least recently used domain gives its address back.
//!
//! One index space serves both families: slot `i` is the `i`-th usable IPv4
//! address of the pool and, when an IPv6 pool is set, the `i`-th of that one
//! too, so a domain's A and AAAA answers name the same slot.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use ipnet::{Ipv4Net, Ipv6Net};
use parking_lot::Mutex;

use crate::stats::DnsCounters;

#[derive(Debug)]
struct Slot {
    domain: Arc<str>,
    tick: u64,
}

#[derive(Debug, Default)]
struct Inner {
    /// Grows to `cap` and stays; `None` never recurs once filled (an
    /// evicted slot is taken over at once).
    slots: Vec<Option<Slot>>,
    by_domain: HashMap<Arc<str>, u32>,
    /// tick -> slot, oldest first.
    order: BTreeMap<u64, u32>,
    tick: u64,
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
        Self {
            v4,
            v6,
            cap: cap.max(1),
            inner: Mutex::new(Inner::default()),
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

    /// The addresses of `domain` (lower-case, no trailing dot), assigning a
    /// slot if it has none: a fresh one while the pool has room, else the
    /// least recently used domain's.
    pub fn assign(&self, domain: &str, c: &DnsCounters) -> (Ipv4Addr, Option<Ipv6Addr>) {
        let mut g = self.inner.lock();
        let inner = &mut *g;
        inner.tick += 1;
        let tick = inner.tick;
        let i = if let Some(&i) = inner.by_domain.get(domain) {
            if let Some(Some(s)) = inner.slots.get_mut(i as usize) {
                inner.order.remove(&s.tick);
                s.tick = tick;
            }
            i
        } else {
            let i = if (inner.slots.len() as u32) < self.cap {
                inner.slots.push(None);
                inner.slots.len() as u32 - 1
            } else {
                // A full pool always has an oldest slot.
                let old = inner.order.pop_first().map_or(0, |(_, i)| i);
                if let Some(Some(s)) = inner.slots.get(old as usize) {
                    inner.by_domain.remove(&s.domain);
                }
                c.fakeip_evictions.fetch_add(1, Relaxed);
                old
            };
            let d: Arc<str> = domain.into();
            inner.by_domain.insert(d.clone(), i);
            inner.slots[i as usize] = Some(Slot { domain: d, tick });
            c.fakeip_active.store(inner.by_domain.len() as u64, Relaxed);
            i
        };
        inner.order.insert(tick, i);
        (self.v4_at(i), self.v6_at(i))
    }

    /// The domain holding `ip` (refreshing its recency), if any.
    pub fn domain(&self, ip: IpAddr) -> Option<Arc<str>> {
        let i = self.index(ip)?;
        let mut g = self.inner.lock();
        let inner = &mut *g;
        inner.tick += 1;
        let tick = inner.tick;
        let s = inner.slots.get_mut(i as usize)?.as_mut()?;
        inner.order.remove(&s.tick);
        s.tick = tick;
        inner.order.insert(tick, i);
        Some(s.domain.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assigns_stable_addresses_and_maps_back() {
        let c = DnsCounters::default();
        let p = FakePool::new(
            "198.18.128.0/17".parse().expect("net"),
            Some("fd00:fa::/64".parse().expect("net")),
            1000,
        );
        let (a, a6) = p.assign("a.test", &c);
        assert_eq!(a, Ipv4Addr::new(198, 18, 128, 1));
        assert_eq!(a6, Some("fd00:fa::1".parse().expect("ip")));
        let (b, _) = p.assign("b.test", &c);
        assert_ne!(a, b);
        assert_eq!(p.assign("a.test", &c).0, a, "stable while held");
        assert_eq!(p.domain(IpAddr::V4(a)).as_deref(), Some("a.test"));
        assert_eq!(
            p.domain(a6.map(IpAddr::V6).expect("v6")).as_deref(),
            Some("a.test")
        );
        assert_eq!(p.domain(IpAddr::V4(Ipv4Addr::new(198, 18, 200, 9))), None);
        assert_eq!(p.domain(IpAddr::V4(Ipv4Addr::new(198, 18, 0, 9))), None);
        assert!(p.contains(IpAddr::V4(Ipv4Addr::new(198, 18, 200, 9))));
        assert_eq!(c.fakeip_active.load(Relaxed), 2);
    }

    #[test]
    fn exhaustion_takes_the_least_recently_used() {
        let c = DnsCounters::default();
        // A /30 has two usable addresses.
        let p = FakePool::new("198.18.0.0/30".parse().expect("net"), None, 100);
        assert_eq!(p.capacity(), 2);
        let (a, _) = p.assign("a", &c);
        let (b, _) = p.assign("b", &c);
        // Use a: b is now the oldest.
        assert!(p.domain(IpAddr::V4(a)).is_some());
        let (x, _) = p.assign("x", &c);
        assert_eq!(x, b, "b's address went to x");
        assert_eq!(p.domain(IpAddr::V4(b)).as_deref(), Some("x"));
        assert_eq!(p.domain(IpAddr::V4(a)).as_deref(), Some("a"));
        assert_eq!(c.fakeip_evictions.load(Relaxed), 1);
        assert_eq!(c.fakeip_active.load(Relaxed), 2);
        // b asks again: the oldest is x (a was looked up after it).
        let (b2, _) = p.assign("b", &c);
        assert_eq!(b2, x);
        assert_eq!(c.fakeip_evictions.load(Relaxed), 2);
    }

    #[test]
    fn entries_cap_the_map() {
        let c = DnsCounters::default();
        let p = FakePool::new("198.18.128.0/17".parse().expect("net"), None, 3);
        for i in 0..50 {
            let (a, _) = p.assign(&format!("d{i}"), &c);
            assert!(p.index(IpAddr::V4(a)).expect("in pool") < 3);
        }
        assert_eq!(c.fakeip_active.load(Relaxed), 3);
        assert_eq!(c.fakeip_evictions.load(Relaxed), 47);
    }
}
