//! The table's invariants, checked by its tests and the fuzz target.

use std::sync::atomic::Ordering::Relaxed;

use super::key::shard_index;
use super::shard::Phase;
use super::{NatCounts, NatTable, SHARDS};

impl<P> NatTable<P> {
    /// Checks forward/reverse consistency (a bijection between forward
    /// entries and reverse entries with matching keys, each in its own
    /// shard, ports inside the range), that exactly the admitted half-open
    /// flows (Connecting, Ready) have an attachment, and that the counters
    /// equal a scan. Meaningful only while no other thread is using the
    /// table. For tests and fuzzing.
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
                match rev.map.get(&port) {
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
        let mut held = 0usize;
        for (i, shard) in self.reverse.iter().enumerate() {
            let rev = shard.read();
            for (&port, m) in rev.map.iter() {
                if usize::from(port) % SHARDS != i {
                    return Err(format!("port {port} in wrong reverse shard {i}"));
                }
                if port == 0 || !self.cfg.port_range.contains(&port) {
                    return Err(format!("port {port} outside the port range"));
                }
                match m.phase {
                    Phase::HalfOpen(_) => scan.half_open += 1,
                    Phase::Active => scan.active += 1,
                    Phase::Closing => scan.closing += 1,
                }
                if m.phase.is_held() != rev.held.contains_key(&port) {
                    return Err(format!(
                        "port {port} is {:?} but {} an attachment",
                        m.phase,
                        if m.phase.is_held() { "lacks" } else { "has" }
                    ));
                }
            }
            // Each attachment belongs to a mapping (checked above from the
            // mapping's side), so counting them counts the held flows.
            if let Some(port) = rev.held.keys().find(|p| !rev.map.contains_key(p)) {
                return Err(format!("attachment at port {port} without a mapping"));
            }
            held += rev.held.len();
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
        if held != self.held.load(Relaxed) {
            return Err(format!(
                "held counter {} != scan {held}",
                self.held.load(Relaxed)
            ));
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
}
