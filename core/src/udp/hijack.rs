//! DNS hijack: a datagram to a hijacked address's port 53 opens no flow.
//! Its payload goes to a task that asks the DNS service and writes the
//! answer to the TUN from the address the app asked; the driver never
//! waits for DNS.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use super::reply::udp_room;
use super::{UdpEnv, UdpTable};
use crate::budget::Charge;
use crate::dns::{self, Dns};
use crate::lifecycle::{EngineTask, supervised};
use crate::nat::FlowKey;
use crate::packet::{self, HEADROOM};
use crate::stats::{EngineDrop, LocalCounters, Stats};

impl UdpTable {
    /// Hand a hijacked query to a task (one copy of the payload; the driver
    /// does not wait). The task is charged its state, the query and the
    /// reply (up to one MTU, held once as the answer and once as the packet
    /// written) against the DNS in-flight budget while it runs.
    pub(super) fn hijack(
        &mut self,
        key: FlowKey,
        payload: &[u8],
        now: Instant,
        local: &mut LocalCounters,
    ) {
        let Some(dns) = self.shared.d.dns.clone() else {
            return;
        };
        let cost = dns::QUERY_STATE + payload.len() + 2 * usize::from(self.shared.mtu);
        let Some(charge) = dns.in_flight().try_charge(cost, now) else {
            return local.drop(EngineDrop::DnsQueueFull);
        };
        let answer = answer_hijacked(self.shared.clone(), dns, payload.to_vec(), key, charge);
        let life = self.shared.d.life.clone();
        tokio::spawn(supervised(life, EngineTask::Dns, answer));
    }
}

/// Answer one hijacked query and write the answer to the TUN as a datagram
/// from the address the app asked (`key.server`) to the app (`key.client`).
async fn answer_hijacked(
    shared: Arc<UdpEnv>,
    dns: Arc<Dns>,
    query: Vec<u8>,
    FlowKey { client, server }: FlowKey,
    _charge: Charge,
) {
    let (hdr, max_payload) = udp_room(shared.mtu, server);
    let stats: &Stats = &shared.d.stats;
    let Some(reply) = dns.answer_udp(&query, max_payload, stats).await else {
        return;
    };
    let mut b = vec![0u8; HEADROOM + hdr + reply.len()];
    b[HEADROOM + hdr..].copy_from_slice(&reply);
    match packet::write_udp_headers(&mut b[HEADROOM..], server, client, reply.len()) {
        Ok(len) => {
            if shared.tun.send(&mut b, len).await.is_err() {
                stats.drop(EngineDrop::TunWrite);
            }
        }
        Err(r) => {
            stats.rejects[r.index()].fetch_add(1, Relaxed);
        }
    }
}
