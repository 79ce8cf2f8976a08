//! The system netstack: kerntun does not implement TCP. Each TCP packet read
//! from the TUN is rewritten in place (source NAT, `crate::translate`) and
//! written back, so the kernel's own TCP accepts it on a listener bound to
//! the gateway address; the accepted socket's peer port is the NAT port,
//! which the NAT table maps back to the app's original 5-tuple.
//!
//! Connect-first: a new connection's SYN is admitted, routed and held while
//! the outbound connects. Only when the outbound answers is the SYN rewritten
//! and handed to the kernel; if the outbound refuses or times out, the app
//! receives an RST answering its SYN. The app therefore sees what a real
//! network would show it (`ECONNREFUSED`, not a connection that opens and
//! then dies), which keeps happy-eyeballs and fallback logic in apps working.
//! A SYN retransmitted while the connect is pending is absorbed.
//!
//! Half-open connections (connect in flight, or SYN handed to the kernel
//! and not yet accepted) are bounded apart from established ones: at most
//! [`HALF_OPEN_MAX`] in total and never more than half the admission limit,
//! so they cannot take the permits answered connections need, and at most
//! [`HALF_OPEN_PER_SOURCE`] from one source address, which bounds the
//! outbound connects one app keeps in flight. A new SYN past either bound
//! evicts the oldest half-open connection (of that source, or of all), never
//! the newcomer, and one whose app does not complete the handshake within
//! [`HANDSHAKE_TIMEOUT`] is closed. A SYN flood from spoofed sources thus
//! holds a bounded number of outbound sockets and recycles its own slots,
//! and the next real connection is admitted at once.
//!
//! `listener.rs`: the kernel listeners and the accept loop; `pending.rs`:
//! the connections between SYN and accept, keyed by NAT port and generation.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{HALF_OPEN_MAX, HALF_OPEN_PER_SOURCE, HANDSHAKE_TIMEOUT, HeldSyn};
use crate::dispatch::{Dispatcher, Next, Plan};
use crate::nat::{FlowKey, NatTable};
use crate::outbound::reset_on_close;
use crate::packet::{self, Disposition, IpInfo, TcpInfo};
use crate::stats::{EngineDrop, LocalCounters, Stats, TcpFlowsSnapshot};
use crate::translate::{self, Cause, FamilyAddrs, StackAddrs, TcpStep};
use crate::tun::Tun;

mod listener;
mod pending;

pub(crate) use listener::{ListenOn, NoTunIndex, accept_loop, bind_listener, listen_on};
use pending::PendingMap;

/// The system stack of one engine: its NAT table, its addresses, and the
/// connections between SYN and accept.
#[derive(Debug)]
pub(crate) struct SystemStack {
    d: Arc<Dispatcher>,
    tun: Arc<Tun>,
    nat: Arc<NatTable>,
    /// Gateway, NAT address and listener port per family.
    addrs: StackAddrs,
    pending: PendingMap,
    /// How long a SYN handed to the kernel may wait for its accept.
    half_open_timeout: Duration,
}

impl SystemStack {
    pub fn new(
        d: Arc<Dispatcher>,
        tun: Arc<Tun>,
        nat: NatTable,
        addrs: StackAddrs,
        half_open_timeout: Duration,
    ) -> Self {
        SystemStack {
            d,
            tun,
            nat: Arc::new(nat),
            addrs,
            pending: PendingMap::default(),
            half_open_timeout,
        }
    }

    /// One TCP packet from the TUN, translated in place.
    #[inline]
    pub fn tcp(
        self: &Arc<Self>,
        buf: &mut [u8],
        ip: &IpInfo,
        now: Instant,
        local: &mut LocalCounters,
    ) -> Disposition {
        let held = |port| self.pending.is_connecting(port);
        match translate::translate_tcp(buf, ip, &self.nat, &self.addrs, now, held) {
            TcpStep::Uplink(n) => {
                local.packets_up += 1;
                local.bytes_up += n as u64;
                Disposition::WriteBack(n)
            }
            TcpStep::Downlink(n) => {
                local.packets_down += 1;
                local.bytes_down += n as u64;
                Disposition::WriteBack(n)
            }
            TcpStep::NewFlow {
                key,
                port,
                generation,
                tcp,
                evicted,
            } => {
                if evicted {
                    local.drop(EngineDrop::HalfOpenEvicted);
                }
                self.new_flow(buf, ip, &tcp, (key, port, generation), now, local)
            }
            TcpStep::Reset { len, cause } => {
                if matches!(cause, EngineDrop::NatTableFull | EngineDrop::NatNoFreePort) {
                    self.d.warn.warn(format_args!(
                        "NAT table refused a new flow ({})",
                        cause.as_str()
                    ));
                }
                local.drop(cause);
                Disposition::WriteBack(len)
            }
            TcpStep::Drop(Cause::Reject(r)) => {
                local.reject(r);
                Disposition::Done
            }
            TcpStep::Drop(Cause::Engine(d)) => {
                local.drop(d);
                Disposition::Done
            }
        }
    }

    /// A SYN that created NAT entry `port` (stamped `generation`): admit it,
    /// then hold it while the outbound connects, or (DNS, sniffing) hand it
    /// to the kernel at once.
    fn new_flow(
        self: &Arc<Self>,
        buf: &mut [u8],
        ip: &IpInfo,
        tcp: &TcpInfo,
        (key, port, generation): (FlowKey, u16, u64),
        now: Instant,
        local: &mut LocalCounters,
    ) -> Disposition {
        let source = key.client.ip();
        // Room first: an evicted connection's permit is back before admit.
        let cap = HALF_OPEN_MAX.min(self.d.admission.limit(now) / 2).max(1);
        let per_source = HALF_OPEN_PER_SOURCE.min(cap);
        if let Some((port, generation, p)) = self.pending.evict_for(source, cap, per_source) {
            p.close();
            self.nat.abort_half_open(port, generation, now);
            local.drop(EngineDrop::HalfOpenEvicted);
        }
        let Some((plan, permit)) = self.d.admit(key.server, now) else {
            self.nat.abort_half_open(port, generation, now);
            return Disposition::WriteBack(packet::tcp_rst_reply(buf, ip, tcp));
        };
        let Some(fam) = self.addrs.family(key.server.ip()) else {
            // translate_tcp only reports new flows of an enabled family.
            self.nat.abort_half_open(port, generation, now);
            return Disposition::Done;
        };
        let flow = Flow {
            key,
            port,
            generation,
            fam,
        };
        let next = match plan {
            Plan::Connect { .. } => {
                self.pending.connecting(port, generation, source, now);
                let syn = HeldSyn::new(&buf[..ip.len]);
                let task = tokio::spawn(self.clone().connect(flow, syn, plan));
                // The permit waits in the pending map; evicting the
                // connection aborts the task and hands it back at once.
                self.pending
                    .attach(port, generation, Some(task.abort_handle()), permit);
                return Disposition::Done;
            }
            // Nothing to connect first: the kernel accepts now and the
            // session does the rest.
            Plan::Dns => Next::Dns,
            Plan::Sniff => Next::Sniff,
        };
        self.pending
            .ready_now(port, generation, source, (next, permit), now);
        match rewrite_to_listener(buf, ip, fam, port) {
            Ok(()) => Disposition::WriteBack(ip.len),
            Err(r) => {
                self.pending.forget(port, generation);
                self.nat.abort_half_open(port, generation, now);
                local.reject(r);
                Disposition::Done
            }
        }
    }

    /// Connect the outbound for a held SYN along its plan, then release the
    /// SYN to the kernel (success) or answer the app with an RST (failure).
    /// A flow whose NAT entry expired meanwhile, its port perhaps reused by a
    /// newer flow, is dropped quietly: its outbound is reset, its SYN never
    /// reaches the kernel, and the app (which has retransmitted its SYN into
    /// a new entry by now, or given up) hears nothing from this task.
    async fn connect(self: Arc<Self>, flow: Flow, mut syn: HeldSyn, plan: Plan) {
        let Flow {
            key,
            port,
            generation,
            fam,
        } = flow;
        let Some(next) = self.d.prepare(plan, key.server).await else {
            if self.pending.forget(port, generation) {
                self.nat.abort_half_open(port, generation, Instant::now());
                syn.refuse(&self.tun, &self.d.stats).await;
            }
            return;
        };
        // Parsed and rewritten once already in the driver: cannot fail.
        let rewritten = packet::parse_ip(syn.packet())
            .ok()
            .and_then(|ip| rewrite_to_listener(syn.packet_mut(), &ip, fam, port).ok());
        if rewritten.is_none() {
            if self.pending.forget(port, generation) {
                self.nat.abort_half_open(port, generation, Instant::now());
            }
            return;
        }
        match self
            .pending
            .connected(port, generation, next, Instant::now())
        {
            Ok(()) => syn.send(&self.tun, &self.d.stats).await,
            Err(next) => {
                if let Next::Relay(out) = &next {
                    reset_on_close(&out.stream);
                }
            }
        }
    }

    /// Whether there is state a cleanup tick could expire.
    pub fn has_state(&self) -> bool {
        !self.nat.is_empty() || !self.pending.is_empty()
    }

    /// Expire NAT entries, and close outbounds whose SYN the app never
    /// completed within the handshake timeout (their NAT entries end too).
    pub fn cleanup(&self, now: Instant) {
        self.nat.cleanup(now);
        let timeout = self.half_open_timeout.min(HANDSHAKE_TIMEOUT);
        for (port, generation, p) in self.pending.expire(now, timeout) {
            p.close();
            self.nat.abort_half_open(port, generation, now);
            Stats::drop(&self.d.stats, EngineDrop::HandshakeTimeout);
        }
    }

    /// NAT entries by state.
    pub fn counts(&self) -> TcpFlowsSnapshot {
        let c = self.nat.counts();
        TcpFlowsSnapshot {
            half_open: c.half_open as u64,
            active: c.active as u64,
            closing: c.closing as u64,
        }
    }

    /// The listeners' addresses (gateway and port per family).
    pub fn listen_addrs(&self) -> Vec<SocketAddr> {
        [self.addrs.v4, self.addrs.v6]
            .into_iter()
            .flatten()
            .map(|f| SocketAddr::new(f.gateway, f.listen_port))
            .collect()
    }
}

/// The real clock, which the NAT table reads only when a session's guard
/// drops (`kerntun_proto::nat::Clock`; the table itself reads none).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SystemClock;

impl crate::nat::Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A new flow as the system stack tracks it until the kernel accepts it.
#[derive(Debug, Clone, Copy)]
struct Flow {
    key: FlowKey,
    port: u16,
    /// Stamped by the NAT table on the entry the SYN created.
    generation: u64,
    fam: FamilyAddrs,
}

/// Rewrite the app's SYN at `buf` from its own tuple to NAT address:`port`
/// -> the family's listener.
fn rewrite_to_listener(
    buf: &mut [u8],
    ip: &IpInfo,
    fam: FamilyAddrs,
    port: u16,
) -> Result<(), packet::Reject> {
    let nat_src = SocketAddr::new(fam.nat, port);
    let listener = SocketAddr::new(fam.gateway, fam.listen_port);
    packet::rewrite_tcp(buf, ip, nat_src, listener)
}
