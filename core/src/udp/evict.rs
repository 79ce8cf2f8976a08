//! How flows leave the table: eviction when the flow budget is reached,
//! idle expiry, flows the host closed (`listed.rs`) and flows a network
//! change stranded. Apart from `mod.rs`, which opens flows; every path
//! here keeps the table's counts (`owned`, `udp_flows_active`) in step with
//! what it removes.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use super::flow::{FlowIo, Mapping};
use super::{UdpTable, listed};
use crate::nat::FlowKey;
use crate::network::Addresses;
use crate::stats::LocalCounters;

/// The flow the budget would evict first.
enum Victim {
    Flow(FlowKey),
    Mapping(SocketAddr),
}

impl UdpTable {
    /// Drop the flows the host closed (`listed.rs`): a flow of its own
    /// with its socket and task, a mapping's entry (the mapping stays for
    /// its other destinations, and idles out as before).
    pub(super) fn close_listed(&mut self, keys: &[FlowKey]) {
        for key in keys {
            let Some(f) = self.flows.remove(key) else {
                continue;
            };
            if f.task.is_some() {
                self.owned -= 1;
                self.shared.d.stats.udp_flows_active.fetch_sub(1, Relaxed);
            } else if let Some(m) = self.mappings.get_mut(&key.client) {
                m.peers.retain(|p| p != &key.server);
                m.state.tally.remove(key.server);
            }
        }
    }

    /// When a mapping was last active: its last reply, or the last datagram
    /// to any destination it has an entry for.
    fn mapping_active(&self, client: SocketAddr, m: &Mapping) -> Instant {
        m.peers
            .iter()
            .filter_map(|&p| self.flows.get(&FlowKey::new(client, p)))
            .map(|f| f.last_up)
            .fold(m.state.last_down(), Instant::max)
    }

    /// Remove a mapping and its destinations' entries.
    fn unmap(&mut self, client: SocketAddr) {
        if let Some(m) = self.mappings.remove(&client) {
            for p in &m.peers {
                self.flows.remove(&FlowKey::new(client, *p));
            }
        }
    }

    /// Eviction when the flow budget is reached: the least recently used
    /// flow that never saw a reply, or, when every flow was answered, the
    /// least recently used of all. O(n) over a bounded table, and only when
    /// a new flow arrives at the limit.
    pub(super) fn evict_oldest(&mut self) {
        let flows = self
            .flows
            .iter()
            .filter(|(_, f)| f.task.is_some())
            .map(|(k, f)| ((f.replied(), f.last_active()), Victim::Flow(*k)));
        let mappings = self.mappings.iter().map(|(c, m)| {
            (
                (m.state.replied(), self.mapping_active(*c, m)),
                Victim::Mapping(*c),
            )
        });
        if let Some((_, victim)) = flows.chain(mappings).min_by_key(|(age, _)| *age) {
            match victim {
                Victim::Flow(key) => {
                    self.flows.remove(&key);
                    self.owned -= 1;
                }
                Victim::Mapping(client) => self.unmap(client),
            }
            self.evicted += 1;
            self.shared.d.stats.udp_flows_evicted.fetch_add(1, Relaxed);
            self.shared.d.stats.udp_flows_active.fetch_sub(1, Relaxed);
        }
    }

    /// Close flows idle for longer than their timeout: `unreplied` for a
    /// flow that never saw a reply, `idle` for one that did; route the
    /// flows whose QUIC sniffer did not answer in time by their address
    /// (`sniff.rs`).
    pub fn sweep(&mut self, now: Instant, local: &mut LocalCounters) {
        self.sweep_sniffing(now, local);
        let closing: Vec<FlowKey> = (self.flows.iter())
            .filter(|(_, f)| listed::closing(&f.listed))
            .map(|(k, _)| *k)
            .collect();
        self.close_listed(&closing);
        let (idle, unreplied) = (self.shared.idle, self.shared.unreplied);
        let before = self.flows.len();
        self.flows.retain(|_, f| {
            let limit = if f.replied() { idle } else { unreplied };
            // A mapped flow goes with its mapping (below).
            f.task.is_none() || now.saturating_duration_since(f.last_active()) < limit
        });
        let mut removed = before - self.flows.len();
        self.owned -= removed;
        let expired: Vec<SocketAddr> = self
            .mappings
            .iter()
            .filter(|(c, m)| {
                let limit = if m.state.replied() { idle } else { unreplied };
                now.saturating_duration_since(self.mapping_active(**c, m)) >= limit
            })
            .map(|(c, _)| *c)
            .collect();
        removed += expired.len();
        for c in expired {
            self.unmap(c);
        }
        let removed = removed as u64;
        if removed > 0 {
            self.shared
                .d
                .stats
                .udp_flows_active
                .fetch_sub(removed, Relaxed);
        }
    }
}

impl UdpTable {
    /// The host moved to another network: close the direct flows whose
    /// socket can no longer send ([`Addresses::strands`]: a connected
    /// socket whose source address went, a mapping bound to an interface
    /// left without an address of its family), counted; the app's next
    /// datagram opens a flow on the new network. Flows whose socket still
    /// works are kept. A queued flow's task owns its socket (and a SOCKS5
    /// association's control connection) and checks them itself
    /// (`proxied.rs`); the table closes such a flow at its next datagram
    /// ([`UdpTable::forward`]). Runs once per change, on the driver: a
    /// `getsockname` per direct flow.
    pub fn network_changed(&mut self, addrs: &Addresses, local: &mut LocalCounters) {
        // What the uplink gathered goes out (or fails) before its flow closes.
        self.flush(local);
        let before = self.flows.len();
        self.flows.retain(|_, f| match &f.io {
            FlowIo::Direct(sock) => !addrs.strands(&**sock),
            FlowIo::Mapped(_) | FlowIo::Queued(_) => true,
        });
        let flows = before - self.flows.len();
        self.owned -= flows;
        let stranded: Vec<SocketAddr> = self
            .mappings
            .iter()
            .filter(|(_, m)| addrs.strands(&*m.sock))
            .map(|(c, _)| *c)
            .collect();
        let dropped = (flows + stranded.len()) as u64;
        for c in stranded {
            self.unmap(c);
        }
        if dropped > 0 {
            self.evicted += 1;
            let stats = &self.shared.d.stats;
            stats.udp_flows_active.fetch_sub(dropped, Relaxed);
            stats
                .udp_flows_dropped_on_network_change
                .fetch_add(dropped, Relaxed);
        }
    }
}
