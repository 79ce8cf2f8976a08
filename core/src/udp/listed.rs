//! UDP flows in the live connection list (`conns.rs`): each flow of the
//! table (a mapping's destination entries included) is registered while it
//! is in the table, its uplink bytes counted by the driver as it sends them
//! and its replies' bytes by the task that receives them.
//!
//! A reply task does not share the table: it learns which record a reply's
//! peer belongs to from its flow's [`Tally`] (one peer for a connected or
//! proxied flow, up to `MAPPING_PEERS` for a mapping), through a copy
//! ([`TallyCache`]) that it refreshes only when the table changed the peers,
//! so counting a reply takes no lock.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use parking_lot::Mutex;

use crate::conns::{ConnState, DomainSource, Record, Registered};
use crate::outbound::{Address, Explained};
use crate::rules::Network;

use super::{FlowKey, UdpEnv};

/// The records of the peers a flow's replies may come from.
#[derive(Debug, Default)]
pub(super) struct Tally {
    /// Bumped after each change of `peers`.
    generation: AtomicU32,
    peers: Mutex<Vec<(SocketAddr, Arc<Record>)>>,
}

impl Tally {
    /// Replies from `peer` count into `record` from now on.
    pub fn add(&self, peer: SocketAddr, record: Arc<Record>) {
        let mut peers = self.peers.lock();
        peers.retain(|(p, _)| *p != peer);
        peers.push((peer, record));
        self.generation.fetch_add(1, Release);
    }

    /// Replies from `peer` are no longer counted (its entry left the table).
    pub fn remove(&self, peer: SocketAddr) {
        let mut peers = self.peers.lock();
        peers.retain(|(p, _)| *p != peer);
        self.generation.fetch_add(1, Release);
    }
}

/// A reply task's copy of its flow's [`Tally`].
#[derive(Debug, Default)]
pub(super) struct TallyCache {
    generation: u32,
    peers: Vec<(SocketAddr, Arc<Record>)>,
}

impl TallyCache {
    /// Count `bytes` of a reply from `peer` that reached the app. A flow
    /// of its own has one record, which every reply counts into (a flow
    /// to a fake address gets its replies from the address its domain
    /// resolved to, a proxied one may get them from any address).
    pub fn count(&mut self, tally: &Tally, peer: SocketAddr, bytes: usize) {
        let now = tally.generation.load(Acquire);
        if now != self.generation {
            self.peers.clone_from(&tally.peers.lock());
            self.generation = now;
        }
        let record = match self.peers.as_slice() {
            [(_, only)] => Some(only),
            peers => peers.iter().find(|(p, _)| *p == peer).map(|(_, r)| r),
        };
        if let Some(r) = record {
            r.down.fetch_add(bytes as u64, Relaxed);
        }
    }
}

/// Register the new flow `key` of the table, routed to `outbound` for the
/// reasons `why` to `dst` (a fake address's domain, or the address the app
/// used; `sniffed`: the domain its QUIC Initial named), and enter it in
/// `tally` for its replies.
pub(super) fn register(
    env: &UdpEnv,
    key: FlowKey,
    outbound: &str,
    why: Option<Box<Explained>>,
    dst: &Address,
    sniffed: Option<&str>,
    tally: &Tally,
) -> Registered {
    let flow = env.d.conns.register(Network::Udp, key.client, key.server);
    match (dst, sniffed) {
        (Address::Domain(domain, _), _) => flow.record.set_domain(domain, DomainSource::FakeIp),
        (_, Some(domain)) => flow.record.set_domain(domain, DomainSource::Sniffed),
        _ => {}
    }
    flow.record.relaying(outbound, why);
    tally.add(key.server, flow.record.clone());
    flow
}

/// Whether the host asked to close this flow (`Engine::close_connection`):
/// the table then drops it at its next datagram or sweep, and the app's next
/// datagram opens a new one.
pub(super) fn closing(flow: &Registered) -> bool {
    flow.record.state() == ConnState::Closing
}
