//! DNS hijack: a datagram to a hijacked address's port 53 opens no flow.
//! Its payload goes to a task that asks the DNS service and writes the
//! answer to the TUN from the address the app asked; the driver never
//! waits for DNS.

use std::sync::Arc;
use std::time::Instant;

use super::reply::{udp_room, write_reply};
use super::{UdpEnv, UdpTable};
use crate::budget::Charge;
use crate::dns::Dns;
use crate::lifecycle::{EngineTask, Panicked, supervised};
use crate::nat::FlowKey;
use crate::packet::HEADROOM;
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
        let Some(dns) = self.shared.d.routing().dns.clone() else {
            return;
        };
        let charge = match dns.charge_udp_query(payload.len(), self.shared.mtu, now) {
            Ok(c) => c,
            Err(why) => return local.drop(why),
        };
        let answer = answer_hijacked(self.shared.clone(), dns, payload.to_vec(), key, charge);
        let d = self.shared.d.clone();
        tokio::spawn(async move {
            // A panic decoding the app's bytes ends this query alone (its
            // charge is released as the task unwinds), counted.
            if let Err(Panicked(why)) = supervised(d.life.clone(), EngineTask::Dns, answer).await {
                Stats::drop(&d.stats, EngineDrop::DnsTaskPanic);
                d.warn
                    .warn(format_args!("a DNS query task panicked: {why}"));
            }
        });
    }
}

/// Answer one hijacked query and write the answer to the TUN as a datagram
/// from the address the app asked (`key.server`) to the app (`key.client`),
/// as the flows write their replies ([`write_reply`]; the answer fits one
/// TUN packet, a longer one is truncated by the DNS service).
async fn answer_hijacked(
    shared: Arc<UdpEnv>,
    dns: Arc<Dns>,
    query: Vec<u8>,
    key: FlowKey,
    _charge: Charge,
) {
    let (hdr, max_payload) = udp_room(shared.mtu, key.server);
    let Some(reply) = dns.answer_udp(&query, max_payload, &shared.d.stats).await else {
        return;
    };
    let mut b = vec![0u8; HEADROOM + hdr + reply.len()];
    b[HEADROOM + hdr..].copy_from_slice(&reply);
    write_reply(&shared, &mut b, key, reply.len(), usize::from(shared.mtu)).await;
}
