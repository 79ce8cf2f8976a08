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
//! [`HALF_OPEN_MAX`](crate::nat::HALF_OPEN_MAX) in total and never more than half the admission limit,
//! so they cannot take the permits answered connections need, and at most
//! [`HALF_OPEN_PER_SOURCE`](crate::nat::HALF_OPEN_PER_SOURCE) from one source address, which bounds the
//! outbound connects one app keeps in flight. A new SYN past either bound
//! evicts the oldest half-open connection (of that source, or of all), never
//! the newcomer, and one whose app does not complete the handshake within
//! [`HANDSHAKE_TIMEOUT`](crate::nat::HANDSHAKE_TIMEOUT) is closed. A SYN flood from spoofed sources thus
//! holds a bounded number of outbound sockets and recycles its own slots,
//! and the next real connection is admitted at once.
//!
//! The flow's whole state, those bounds and timeouts included, is one entry
//! of the pure crate's flow table (`kerntun_proto::nat`); this folder is the
//! I/O shell around it, and only does what the table's transitions hand
//! back: spawn a connect, release or refuse a held SYN, start a session,
//! close what an ended flow held. `pending.rs`: what it attaches to a
//! half-open flow; `listener.rs`: the kernel listeners, the accept loop and
//! the session's hold on its flow.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::HeldSyn;
use crate::dispatch::{Dispatcher, Next, Plan};
use crate::nat::{Evicted, FlowKey, NatConfig, NatTable, Regrant, Stage, WindowBudget};
use crate::packet::{self, Disposition, IpInfo, TcpInfo};
use crate::stats::{EngineDrop, LocalCounters, Stats, TcpFlowsSnapshot};
use crate::translate::{self, Cause, DataSums, FamilyAddrs, StackAddrs, TcpStep, WindowClamp};
use crate::tun::Tun;

mod listener;
#[cfg(test)]
pub(crate) use listener::FlowHold;
mod pending;

pub(crate) use listener::{ListenOn, NoTunIndex, accept_loop, bind_listener, listen_on};
use pending::{Pending, close_next};

/// The system stack of one engine: its flow table and its addresses.
#[derive(Debug)]
pub(crate) struct SystemStack {
    d: Arc<Dispatcher>,
    tun: Arc<Tun>,
    nat: Arc<NatTable<Pending>>,
    /// Gateway, NAT address and listener port per family.
    addrs: StackAddrs,
    /// What the window clamp shares out (`tun.window_clamp`; `None`: off).
    window: Option<WindowBudget>,
    /// Who verifies the app's data segments ([`SystemStack::new`]).
    sums: DataSums,
}

impl SystemStack {
    /// The stack over a new flow table built from `nat` (its clock starts
    /// at `now`), clamping windows to `window` if given.
    pub fn new(
        d: Arc<Dispatcher>,
        tun: Arc<Tun>,
        nat: NatConfig,
        addrs: StackAddrs,
        window: Option<WindowBudget>,
        now: Instant,
    ) -> Self {
        // A Linux TUN written without `virtio_net_hdr` (the per-packet
        // driver's) hands every packet to the kernel as unchecked, so the
        // listener's TCP verifies what the uplink would: leaving it took the
        // engine's checksum sums from 6.9 % to 4.7 % of its samples in a
        // one-stream upload at MTU 1500 (docs/notes.md, "The kernel verifies
        // the app's data").
        // The batch driver's merged writes are marked as checksummed, and
        // Darwin's utun was not read for it: both verify here.
        let sums = if cfg!(any(target_os = "linux", target_os = "android")) && !tun.vnet_hdr {
            DataSums::Kernel
        } else {
            DataSums::Verify
        };
        SystemStack {
            d,
            tun,
            sums,
            nat: Arc::new(NatTable::new(nat, now)),
            addrs,
            window,
        }
    }

    /// Write a packet the stack made (`buf[HEADROOM..][..len]`) without
    /// waiting.
    pub fn write(&self, buf: &mut [u8], len: usize) -> std::io::Result<()> {
        self.tun.try_send(buf, len)
    }

    /// What a parked ACK may advertise now (`NatTable::regrant`); without
    /// a clamp, nothing is parked.
    pub fn regrant(&self, p: &translate::Parked, now: Instant) -> Regrant {
        match self.window {
            Some(budget) => self
                .nat
                .regrant(p.port, p.down, p.ack, p.field, p.shift, budget, now),
            None => Regrant::Gone,
        }
    }

    /// Whether the kernel, not the uplink, verifies the app's data segments
    /// of a flow the table holds (`DataSums::Kernel`).
    pub fn defers_data_sums(&self) -> bool {
        self.sums == DataSums::Kernel
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
        let mut clamp = WindowClamp {
            budget: self.window,
            clamped: 0,
            parked: None,
        };
        let step = translate::translate_tcp_clamped(
            buf,
            ip,
            &self.nat,
            &self.addrs,
            &mut clamp,
            self.sums,
            now,
        );
        local.window_clamped += clamp.clamped;
        local.parked = clamp.parked;
        match step {
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
                replaced,
            } => {
                if let Some(p) = replaced {
                    p.close();
                }
                evict(evicted, local);
                self.new_flow(buf, ip, &tcp, (key, port, generation), now, local)
            }
            TcpStep::Reset {
                len,
                cause,
                evicted,
            } => {
                evict(evicted, local);
                if matches!(cause, EngineDrop::NatTableFull | EngineDrop::NatNoFreePort) {
                    self.d.warn.warn(format_args!(
                        "NAT table refused a new flow ({})",
                        cause.as_str()
                    ));
                }
                local.drop(cause);
                match len {
                    0 => Disposition::Done,
                    len => Disposition::WriteBack(len),
                }
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
        // Room first: an evicted connection's permit is back before admit.
        let limit = self.d.admission.limit(now);
        evict(self.nat.make_room(key.client.ip(), limit, now), local);
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
                let pending = Pending::connecting(permit);
                if let Err(p) = self
                    .nat
                    .admit(port, generation, Stage::Connecting, pending, now)
                {
                    // Its entry went since its SYN (evicted): nothing to
                    // connect for; the app's next SYN starts over.
                    p.close();
                    return Disposition::Done;
                }
                let syn = HeldSyn::new(&buf[..ip.len]);
                let task = tokio::spawn(self.clone().connect(flow, syn, plan));
                // The permit waits in the table; evicting the flow aborts
                // the task and hands the permit back at once.
                if !self
                    .nat
                    .attach(port, generation, |p| p.set_task(task.abort_handle()))
                {
                    task.abort();
                }
                return Disposition::Done;
            }
            // Nothing to connect first: the kernel accepts now and the
            // session does the rest.
            Plan::Dns => Next::Dns,
            Plan::Sniff => Next::Sniff,
            Plan::Owner => Next::Owner,
        };
        let ready = Pending::Ready { next, permit };
        if let Err(p) = self.nat.admit(port, generation, Stage::Ready, ready, now) {
            p.close();
            return Disposition::Done;
        }
        match rewrite_to_listener(buf, ip, fam, port) {
            Ok(()) => Disposition::WriteBack(ip.len),
            Err(r) => {
                if let Some(p) = self
                    .nat
                    .abort_half_open(port, generation, now)
                    .and_then(|a| a.payload)
                {
                    p.close();
                }
                local.reject(r);
                Disposition::Done
            }
        }
    }

    /// Connect the outbound for a held SYN along its plan, then release the
    /// SYN to the kernel (success) or answer the app with an RST (failure).
    /// A flow that ended meanwhile (evicted, expired, replaced; its port
    /// perhaps reused by a newer flow) is dropped quietly: its outbound is
    /// reset, its SYN never reaches the kernel, and the app (which has
    /// retransmitted its SYN into a new entry by now, or given up) hears
    /// nothing from this task.
    async fn connect(self: Arc<Self>, flow: Flow, mut syn: HeldSyn, plan: Plan) {
        let Flow {
            key,
            port,
            generation,
            fam,
        } = flow;
        let Some(next) = self.d.prepare(plan, key.server).await else {
            // The flow's permit comes back with it and is dropped here
            // (its task handle too: this task is ending anyway).
            let speaks_for_it = self
                .nat
                .abort_half_open(port, generation, Instant::now())
                .is_some();
            if speaks_for_it {
                syn.refuse(&self.tun, &self.d.stats).await;
            }
            return;
        };
        // Parsed and rewritten once already in the driver: cannot fail.
        let rewritten = packet::parse_ip(syn.packet())
            .ok()
            .and_then(|ip| rewrite_to_listener(syn.packet_mut(), &ip, fam, port).ok());
        if rewritten.is_none() {
            self.nat.abort_half_open(port, generation, Instant::now());
            return;
        }
        match self
            .nat
            .connected(port, generation, Instant::now(), next, Pending::ready)
        {
            Ok(()) => syn.send(&self.tun, &self.d.stats).await,
            Err(next) => close_next(&next),
        }
    }

    /// Whether there is state a cleanup tick could expire.
    pub fn has_state(&self) -> bool {
        !self.nat.is_empty()
    }

    /// The flow table's capacity given back after load (`NatTable::shrink`).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    pub fn shrink(&self) -> usize {
        self.nat.shrink()
    }

    /// Expire flows, and close the outbounds whose SYN the app never
    /// completed within the handshake timeout (their entries linger
    /// Closing) or whose entries expired while they connected.
    pub fn cleanup(&self, now: Instant) {
        let done = self.nat.cleanup(now);
        for p in done.timed_out {
            p.close();
            Stats::drop(&self.d.stats, EngineDrop::HandshakeTimeout);
        }
        for p in done.expired {
            p.close();
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

/// A half-open flow the table evicted to make room for a new one: counted,
/// and what it held closed.
fn evict(evicted: Option<Evicted<Pending>>, local: &mut LocalCounters) {
    if let Some(e) = evicted {
        if let Some(p) = e.payload {
            p.close();
        }
        local.drop(EngineDrop::HalfOpenEvicted);
    }
}

/// A new flow as the system stack tracks it until the kernel accepts it.
#[derive(Debug, Clone, Copy)]
struct Flow {
    key: FlowKey,
    port: u16,
    /// Stamped by the flow table on the entry the SYN created.
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
