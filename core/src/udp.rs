//! The datagram path: each (client, server) pair gets a connected outbound
//! UDP socket, owned by the TUN driver's flow table (no locks on the uplink),
//! and a reply task that turns received datagrams back into IP packets.
//!
//! Bounds: at most `budget.udp_flows` flows (the least recently used is
//! evicted and counted past that), idle flows closed after
//! `timeouts.udp_idle_s`, and uplink datagrams are handed to the kernel with
//! a non-blocking send, so the socket's own send buffer is the only queue: a
//! full one is a counted drop, never unbounded memory.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tokio::task::AbortHandle;

use crate::packet::{self, IPV4_UDP_HEADERS, IPV6_UDP_HEADERS, IpInfo};
use crate::rules::{self, Action};
use crate::stats::{EngineDrop, LocalCounters, Stats};
use crate::system::Shared;
use crate::tun::HEADROOM;

type Key = (SocketAddr, SocketAddr);

#[derive(Debug)]
struct Flow {
    sock: Arc<UdpSocket>,
    /// Last uplink datagram (driver-local, no atomics needed).
    last_up: Instant,
    /// Last downlink datagram, milliseconds since the table's epoch.
    last_down: Arc<AtomicU64>,
    task: AbortHandle,
}

impl Flow {
    fn last_active(&self, epoch: Instant) -> Instant {
        let down = epoch + Duration::from_millis(self.last_down.load(Relaxed));
        self.last_up.max(down)
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Flow table, owned by the TUN driver task.
#[derive(Debug)]
pub(crate) struct UdpTable {
    flows: HashMap<Key, Flow>,
    shared: Arc<Shared>,
    epoch: Instant,
}

impl UdpTable {
    pub fn new(shared: Arc<Shared>, now: Instant) -> Self {
        Self {
            flows: HashMap::new(),
            shared,
            epoch: now,
        }
    }

    pub fn len(&self) -> usize {
        self.flows.len()
    }

    /// Send one uplink datagram (`buf` holds the whole IP packet).
    pub fn handle(&mut self, buf: &[u8], ip: &IpInfo, now: Instant, local: &mut LocalCounters) {
        let udp = match packet::parse_udp(buf, ip) {
            Ok(u) => u,
            Err(r) => return local.reject(r),
        };
        let key = (
            SocketAddr::new(ip.src, udp.src_port),
            SocketAddr::new(ip.dst, udp.dst_port),
        );
        let payload = &buf[udp.payload_offset..udp.payload_offset + udp.payload_len];
        if !self.flows.contains_key(&key) && !self.open(key, now, local) {
            return;
        }
        let Some(flow) = self.flows.get_mut(&key) else {
            return;
        };
        flow.last_up = now;
        // A direct non-blocking send(2): tokio's `try_send` consults its cached
        // readiness first and answers WouldBlock on a socket epoll has not yet
        // reported writable, which would drop every flow's first datagram.
        match socket2::SockRef::from(&*flow.sock).send(payload) {
            Ok(_) => {
                local.udp_packets_up += 1;
                local.udp_bytes_up += payload.len() as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => local.drop(EngineDrop::UdpSendFull),
            Err(_) => local.drop(EngineDrop::UdpSendError),
        }
    }

    fn open(&mut self, key: Key, now: Instant, local: &mut LocalCounters) -> bool {
        let (client, server) = key;
        if rules::decide(&self.shared.rules, &server) == Action::Reject {
            local.drop(EngineDrop::UdpRejected);
            return false;
        }
        if self.flows.len() >= self.shared.budget.udp_flows {
            self.evict_oldest();
        }
        let sock = match self.shared.factory.udp_connected(server) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                local.drop(EngineDrop::UdpOpenFailed);
                self.shared
                    .warn
                    .warn(format_args!("udp flow to {server}: {e}"));
                return false;
            }
        };
        let last_down = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(reply_loop(
            sock.clone(),
            self.shared.clone(),
            client,
            server,
            last_down.clone(),
            self.epoch,
        ))
        .abort_handle();
        self.flows.insert(
            key,
            Flow {
                sock,
                last_up: now,
                last_down,
                task,
            },
        );
        self.shared.stats.udp_flows_total.fetch_add(1, Relaxed);
        self.shared.stats.udp_flows_active.fetch_add(1, Relaxed);
        true
    }

    /// Least-recently-used eviction when the flow budget is reached. O(n) over
    /// a bounded table, and only when a new flow arrives at the limit.
    fn evict_oldest(&mut self) {
        let epoch = self.epoch;
        if let Some(key) = self
            .flows
            .iter()
            .min_by_key(|(_, f)| f.last_active(epoch))
            .map(|(k, _)| *k)
        {
            self.flows.remove(&key);
            self.shared.stats.udp_flows_evicted.fetch_add(1, Relaxed);
            self.shared.stats.udp_flows_active.fetch_sub(1, Relaxed);
        }
    }

    /// Close flows idle for longer than the configured timeout.
    pub fn sweep(&mut self, now: Instant) {
        let idle = self.shared.udp_idle;
        let epoch = self.epoch;
        let before = self.flows.len();
        self.flows
            .retain(|_, f| now.saturating_duration_since(f.last_active(epoch)) < idle);
        let removed = (before - self.flows.len()) as u64;
        if removed > 0 {
            self.shared
                .stats
                .udp_flows_active
                .fetch_sub(removed, Relaxed);
        }
    }
}

impl Drop for UdpTable {
    fn drop(&mut self) {
        let n = self.flows.len() as u64;
        self.shared.stats.udp_flows_active.fetch_sub(n, Relaxed);
    }
}

/// Receive replies for one flow and write them to the TUN as IP packets from
/// `server` to `client`. The buffer exists only while replies are arriving.
async fn reply_loop(
    sock: Arc<UdpSocket>,
    shared: Arc<Shared>,
    client: SocketAddr,
    server: SocketAddr,
    last_down: Arc<AtomicU64>,
    epoch: Instant,
) {
    let hdr = if server.is_ipv6() {
        IPV6_UDP_HEADERS
    } else {
        IPV4_UDP_HEADERS
    };
    // One datagram must fit in one TUN packet of the device MTU.
    let max_payload = usize::from(shared.mtu).saturating_sub(hdr);
    let stats: &Stats = &shared.stats;
    let mut buf: Option<Box<[u8]>> = None;
    loop {
        if sock.readable().await.is_err() {
            return;
        }
        let b =
            buf.get_or_insert_with(|| vec![0u8; HEADROOM + hdr + max_payload].into_boxed_slice());
        match sock.try_recv(&mut b[HEADROOM + hdr..]) {
            Ok(n) => {
                last_down.store(epoch.elapsed().as_millis() as u64, Relaxed);
                match packet::write_udp_headers(&mut b[HEADROOM..], server, client, n) {
                    Ok(len) => match shared.tun.send(b, len).await {
                        Ok(()) => {
                            stats.udp_packets_down.fetch_add(1, Relaxed);
                            stats.udp_bytes_down.fetch_add(n as u64, Relaxed);
                        }
                        Err(_) => stats.drop(EngineDrop::TunWrite),
                    },
                    Err(r) => {
                        stats.rejects[r.index()].fetch_add(1, Relaxed);
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => buf = None,
            // ICMP errors (port unreachable) surface as errors on a connected
            // UDP socket; the flow stays usable.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
}
