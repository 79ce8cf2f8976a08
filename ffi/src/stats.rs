//! [`EngineStats`]: every counter of [`kerntun::StatsSnapshot`], as a record.
//!
//! The conversion destructures the snapshot without `..`, so a counter added
//! to the core fails to compile here until it is exposed to the apps too.

use kerntun::StatsSnapshot;
use kerntun::stats::{DnsSnapshot, OutboundSnapshot, TcpFlowsSnapshot};

use crate::config::MemoryPressure;

/// The TCP flows the running stack tracks, by state (their sum is bounded
/// by `BudgetOptions.tcp_flows`).
#[derive(Debug, Clone, Default, PartialEq, Eq, uniffi::Record, serde::Serialize)]
pub struct TcpFlowStats {
    /// System stack: NAT port allocated, SYN seen, not yet accepted by the
    /// listener. smoltcp: outbound connects in flight.
    pub half_open: u64,
    /// System stack: accepted and relaying. smoltcp: sockets, open or
    /// closing.
    pub active: u64,
    /// System stack: stream ended, kept for the linger so late FIN/ACKs are
    /// translated. smoltcp: 0 (closing sockets count as active).
    pub closing: u64,
}

/// One drop reason and how often it happened.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Serialize)]
pub struct DropCount {
    /// Stable snake_case name, e.g. `no_mapping`, `ipv4_fragment`, `tun_write`.
    pub reason: String,
    pub count: u64,
}

/// Counters of one proxy outbound.
#[derive(Debug, Clone, Default, PartialEq, Eq, uniffi::Record, serde::Serialize)]
pub struct OutboundStats {
    /// Its key in `EngineConfig.outbounds`.
    pub name: String,
    /// TCP connections opened through it (handshake done).
    pub tcp_connects: u64,
    /// TCP connects that failed on the network (refused, unreachable, timeout).
    pub tcp_failures: u64,
    /// Handshakes or frames the proxy got wrong (bad reply, refusal, failed
    /// decryption), TCP and UDP.
    pub protocol_errors: u64,
    /// UDP flows opened through it.
    pub udp_flows: u64,
    /// UDP associations that could not be opened.
    pub udp_failures: u64,
    /// TCP connections and UDP flows that failed because the server's host
    /// name did not resolve.
    pub resolve_failures: u64,
}

/// DNS hijack, cache, fake-ip and domain sniffing.
#[derive(Debug, Clone, Default, PartialEq, Eq, uniffi::Record, serde::Serialize)]
pub struct DnsStats {
    /// Hijacked queries received (UDP and TCP).
    pub queries: u64,
    /// Of those, queries that arrived over TCP.
    pub tcp_queries: u64,
    /// Answered from the cache.
    pub cache_hits: u64,
    /// Upstream exchanges that failed or timed out (each try counts).
    pub upstream_failures: u64,
    /// Queries that found the `"platform"` upstream without a server (no
    /// `networkChanged` yet, or none of its `dns_servers` usable): the
    /// next upstream was asked, or the query failed if there was none.
    pub platform_unavailable: u64,
    /// Queries answered SERVFAIL because every upstream failed.
    pub servfail: u64,
    /// Hijacked packets that were not a DNS query (dropped).
    pub malformed: u64,
    /// Queries answered FORMERR or NOTIMP from their header alone.
    pub refused: u64,
    /// A/AAAA answers given from the fake-ip pool.
    pub fakeip_answers: u64,
    /// Domains holding a fake address now.
    pub fakeip_active: u64,
    /// Fake addresses taken back from the least recently used domain.
    pub fakeip_evictions: u64,
    /// A/AAAA answered with the real address: no fake one was free.
    pub fakeip_fallbacks: u64,
    /// Connections whose domain was read from TLS SNI or HTTP Host.
    pub sniffed: u64,
    /// Sniffing gave up (timeout, or no domain in the first bytes).
    pub sniff_misses: u64,
    /// Of those, sniffs that needed more than a session's own 8 KiB and
    /// found no room in the relay pool (routed by address).
    pub sniff_unbudgeted: u64,
    /// A/AAAA queries answered NOERROR without records because
    /// `DnsOptions.strategy` leaves their family out (AAAA when the tunnel
    /// has no IPv6 address, by default).
    pub strategy_empty: u64,
}

moved!(DnsSnapshot => DnsStats {
    queries,
    tcp_queries,
    cache_hits,
    upstream_failures,
    platform_unavailable,
    servfail,
    malformed,
    refused,
    fakeip_answers,
    fakeip_active,
    fakeip_evictions,
    fakeip_fallbacks,
    sniffed,
    sniff_misses,
    sniff_unbudgeted,
    strategy_empty,
});

/// A point-in-time copy of everything the engine counts. "Up" is from the
/// apps (TUN) toward the network, "down" the reverse.
#[derive(Debug, Clone, Default, PartialEq, Eq, uniffi::Record, serde::Serialize)]
pub struct EngineStats {
    /// `system` or `smoltcp`.
    pub stack: String,
    /// `batch` or `per_packet`.
    pub driver: String,
    pub memory_pressure: Option<MemoryPressure>,
    pub uptime_ms: u64,
    /// Packets and bytes read from the TUN.
    pub packets_up: u64,
    pub bytes_up: u64,
    /// Packets and bytes written to the TUN.
    pub packets_down: u64,
    pub bytes_down: u64,
    pub icmp_echo_replies: u64,
    pub tcp_sessions_active: u64,
    pub tcp_sessions_total: u64,
    /// Payload bytes relayed app -> network / network -> app.
    pub tcp_bytes_up: u64,
    pub tcp_bytes_down: u64,
    pub tcp_rejected_by_rule: u64,
    pub tcp_connect_failed: u64,
    /// New TCP sessions admitted at the current pressure.
    pub admission_limit: u64,
    pub admission_refused: u64,
    pub accept_errors: u64,
    /// Connections to the kernel listener that were not the app's: another
    /// address, or the NAT address with a SYN its entry did not record.
    pub accept_foreign_peer: u64,
    /// Accepted on the address alone: the kernel kept no SYN to check (a
    /// SYN cookie completed the handshake).
    pub accept_syn_unverified: u64,
    pub accept_unknown_port: u64,
    pub udp_flows_active: u64,
    pub udp_flows_total: u64,
    pub udp_flows_evicted: u64,
    pub udp_packets_up: u64,
    pub udp_bytes_up: u64,
    pub udp_packets_down: u64,
    pub udp_bytes_down: u64,
    pub tcp_flows: TcpFlowStats,
    /// Device reads (a batched read counts once) and the packets they carried.
    pub tun_reads: u64,
    pub tun_read_packets: u64,
    pub tun_read_max_batch: u64,
    pub tun_writes: u64,
    /// Times the TUN reader thread found its ring full (`tun.read_ring`)
    /// and left packets in the kernel's queue until the engine freed slots.
    pub tun_ring_full: u64,
    /// TCP segments whose advertised window the system stack clamped to
    /// their share of the TUN's transmit queue.
    pub tcp_window_clamped: u64,
    /// Pure ACKs the engine did not write to the TUN because a newer one of
    /// the same flow, read in the same drain, said the same.
    pub tcp_acks_thinned: u64,
    /// Full smoltcp rings lent from the engine's pool to sockets now (the
    /// other sockets move their data on small rings).
    pub smoltcp_ring_loans: u64,
    /// Times a smoltcp socket asked for a full ring while the pool had lent
    /// every one (it went on with its small ring, more slowly).
    pub smoltcp_ring_loans_refused: u64,
    /// Sum of `drops`.
    pub total_drops: u64,
    /// Non-zero drop counters by reason (parse rejections and engine drops).
    pub drops: Vec<DropCount>,
    /// TCP payload bytes (both directions) moved with splice(2), never in
    /// userspace (Linux/Android).
    pub tcp_bytes_spliced: u64,
    /// TCP payload bytes (both directions) moved through userspace buffers.
    pub tcp_bytes_copied: u64,
    /// Relay directions that fell back from splice to a userspace copy.
    pub splice_fallbacks: u64,
    /// Network changes that changed something (`Engine.networkChanged`;
    /// the same network twice counts once).
    pub network_changes: u64,
    /// TCP sessions reset because a network change left their outbound
    /// socket's address or interface behind.
    pub sessions_reset_on_network_change: u64,
    /// Direct UDP flows closed for the same reason.
    pub udp_flows_dropped_on_network_change: u64,
    /// Connections the app closed (`Engine.closeConnection`).
    pub connections_closed_by_host: u64,
    /// Connections `Engine.reload` closed because their outbound is not in
    /// the new configuration.
    pub reload_closed: u64,
    /// Owner lookups asked of the app's `OwnerHooks` (`Engine.startWithOwner`).
    pub owner_lookups: u64,
    /// Of those, answered with no owner (`null`/`nil`).
    pub owner_unknown: u64,
    /// Of those, failed: the hook threw, did not answer within 250 ms, or
    /// 64 lookups were already waiting for it.
    pub owner_failed: u64,
    /// The NAT64 prefix of the IPv6-only network the device is on (as
    /// `64:ff9b::/96`), found from the network's DNS64 after
    /// `Engine.networkChanged`; `null` on a network with IPv4 or without
    /// NAT64. While it is set, IPv4 proxies and destinations are reached
    /// through it.
    pub nat64_prefix: Option<String>,
    /// Outbound connections to IPv4 sent through the NAT64 prefix.
    pub nat64_synthesized: u64,
    /// Prefix discoveries on an IPv6-only network that found none (IPv4
    /// then stays unreachable).
    pub nat64_discovery_failed: u64,
    /// Ticks of the engine's periodic timers (the cleanup of expired
    /// flows once a second while there are flows; the heap trim on Linux
    /// with glibc): they stand still between `Engine.sleep` and
    /// `Engine.wake`.
    pub timer_ticks: u64,
    /// Per proxy outbound.
    pub outbounds: Vec<OutboundStats>,
    /// DNS service and sniffing.
    pub dns: DnsStats,
}

fn pressure(name: &str) -> Option<MemoryPressure> {
    match name {
        "normal" => Some(MemoryPressure::Normal),
        "elevated" => Some(MemoryPressure::Elevated),
        "critical" => Some(MemoryPressure::Critical),
        _ => None,
    }
}

impl From<StatsSnapshot> for EngineStats {
    fn from(s: StatsSnapshot) -> Self {
        let total_drops = s.total_drops();
        moved!(s; StatsSnapshot => EngineStats {
            uptime_ms,
            packets_up,
            bytes_up,
            packets_down,
            bytes_down,
            icmp_echo_replies,
            tcp_sessions_active,
            tcp_sessions_total,
            tcp_bytes_up,
            tcp_bytes_down,
            tcp_rejected_by_rule,
            tcp_connect_failed,
            admission_limit,
            admission_refused,
            accept_errors,
            accept_foreign_peer,
            accept_syn_unverified,
            accept_unknown_port,
            udp_flows_active,
            udp_flows_total,
            udp_flows_evicted,
            udp_packets_up,
            udp_bytes_up,
            udp_packets_down,
            udp_bytes_down,
            tun_reads,
            tun_read_packets,
            tun_read_max_batch,
            tun_writes,
            tun_ring_full,
            tcp_window_clamped,
            tcp_acks_thinned,
            smoltcp_ring_loans,
            smoltcp_ring_loans_refused,
            tcp_bytes_spliced,
            tcp_bytes_copied,
            splice_fallbacks,
            network_changes,
            sessions_reset_on_network_change,
            udp_flows_dropped_on_network_change,
            connections_closed_by_host,
            reload_closed,
            owner_lookups,
            owner_unknown,
            owner_failed,
            nat64_prefix,
            nat64_synthesized,
            nat64_discovery_failed,
            timer_ticks,
        } converted {
            stack: stack.to_string(),
            driver: driver.to_string(),
            memory_pressure: pressure(memory_pressure),
            tcp_flows: TcpFlowStats::from(tcp_flows),
            drops: drops
                .into_iter()
                .map(|(reason, count)| DropCount {
                    reason: reason.to_string(),
                    count,
                })
                .collect(),
            outbounds: outbounds.into_iter().map(OutboundStats::from).collect(),
            dns: DnsStats::from(dns),
        } added {
            total_drops,
        })
    }
}

moved!(TcpFlowsSnapshot => TcpFlowStats {
    half_open,
    active,
    closing,
});

moved!(OutboundSnapshot => OutboundStats {
    name,
    tcp_connects,
    tcp_failures,
    protocol_errors,
    udp_flows,
    udp_failures,
    resolve_failures,
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_maps_field_by_field() {
        let s = StatsSnapshot {
            stack: "system",
            driver: "batch",
            memory_pressure: "elevated",
            tcp_bytes_down: 42,
            tcp_flows: TcpFlowsSnapshot {
                half_open: 1,
                active: 2,
                closing: 3,
            },
            drops: vec![("no_mapping", 4), ("tun_write", 5)],
            ..Default::default()
        };
        let e = EngineStats::from(s);
        assert_eq!(e.stack, "system");
        assert_eq!(e.memory_pressure, Some(MemoryPressure::Elevated));
        assert_eq!(e.tcp_bytes_down, 42);
        assert_eq!(
            e.tcp_flows,
            TcpFlowStats {
                half_open: 1,
                active: 2,
                closing: 3
            }
        );
        assert_eq!(e.total_drops, 9);
        assert_eq!(e.drops[1].reason, "tun_write");
        assert_eq!(e.drops[1].count, 5);
    }
}
