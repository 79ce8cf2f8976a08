//! The smoltcp stack: a userspace TCP behind the same entry point, drivers,
//! connect-first admission, outbounds, sessions and statistics as the system
//! stack. Only the way TCP segments become streams differs: instead of
//! rewriting them for the kernel, the driver hands them to one smoltcp
//! `Interface` in any-IP mode, and each accepted connection is a smoltcp
//! socket read and written by a session task. UDP and ICMP never come here.
//!
//! * `gate`: what one packet is before any state is touched (sans-I/O, also
//!   the fuzz target's way in);
//! * `sockets`: the interface and its sockets behind one lock, the poller
//!   that drives their timers; `half_open.rs`: the connections between a
//!   SYN and the end of its handshake;
//! * `device`: the device smoltcp polls, writing straight to the TUN;
//! * `stream`: the app's side of one connection, as sessions use it.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::dispatch::{Dispatcher, Next, Plan, session};
use crate::lifecycle::Phase;
use crate::nat::FlowKey;
use crate::outbound::reset_on_close;
use crate::packet::{self, Disposition, IpInfo};
use crate::stats::{EngineDrop, LocalCounters, TcpFlowsSnapshot};
use crate::tun::Tun;

#[cfg(any(test, feature = "bench-internals"))]
pub mod bench;
mod device;
#[cfg(any(test, fuzzing))]
pub mod fuzzing;
mod gate;
mod half_open;
mod rings;
mod sockets;
mod stream;
#[cfg(any(test, fuzzing, feature = "bench-internals"))]
mod wire;

use device::TunSink;
use gate::Gate;
use half_open::Syn;
pub(crate) use sockets::Sockets;
pub(crate) use stream::SmolStream;

use super::HeldSyn;

/// The smoltcp stack of one engine, as the driver and the engine see it.
#[derive(Debug, Clone)]
pub(crate) struct SmoltcpStack {
    pub sockets: Arc<Sockets>,
    d: Arc<Dispatcher>,
    tun: Arc<Tun>,
    /// Which address families the TUN carries (IPv4, IPv6).
    families: (bool, bool),
}

impl SmoltcpStack {
    pub fn new(
        sockets: Sockets,
        d: Arc<Dispatcher>,
        tun: Arc<Tun>,
        families: (bool, bool),
    ) -> Self {
        SmoltcpStack {
            sockets: Arc::new(sockets),
            d,
            tun,
            families,
        }
    }

    /// One TCP packet from the TUN: through the gate, then to smoltcp, whose
    /// answers are written to the TUN from inside its poll. A new
    /// connection is admitted and held while its outbound connects.
    pub fn tcp(
        &self,
        buf: &mut [u8],
        ip: &IpInfo,
        now: Instant,
        local: &mut LocalCounters,
    ) -> Disposition {
        let family = match ip.dst {
            IpAddr::V4(_) => self.families.0,
            IpAddr::V6(_) => self.families.1,
        };
        let syn = match gate::gate(buf, ip, family) {
            Gate::Reject(r) => {
                local.reject(r);
                return Disposition::Done;
            }
            Gate::Drop(d) => {
                local.drop(d);
                return Disposition::Done;
            }
            Gate::Input => None,
            Gate::Syn(key, tcp) => Some((key, tcp)),
        };
        local.packets_up += 1;
        local.bytes_up += ip.len as u64;
        let Some((key, tcp)) = syn else {
            return self.input(buf, ip, now);
        };
        match self.sockets.syn(key) {
            Syn::Known => self.input(buf, ip, now),
            Syn::Connecting => {
                local.drop(EngineDrop::SynWhileConnecting);
                Disposition::Done
            }
            Syn::Full => {
                local.drop(EngineDrop::SmoltcpSocketsFull);
                self.d.warn.warn(format_args!(
                    "smoltcp socket budget refused a new flow ({})",
                    EngineDrop::SmoltcpSocketsFull.as_str()
                ));
                Disposition::WriteBack(packet::tcp_rst_reply(buf, ip, &tcp))
            }
            Syn::New => match self.d.admit(key.server, now) {
                None => {
                    self.sockets.unmark(&key);
                    Disposition::WriteBack(packet::tcp_rst_reply(buf, ip, &tcp))
                }
                Some((plan, permit)) => {
                    let syn = HeldSyn::new(&buf[..ip.len]);
                    let conn = Connect {
                        sockets: self.sockets.clone(),
                        d: self.d.clone(),
                        tun: self.tun.clone(),
                    };
                    let task = tokio::spawn(conn.run(key, syn, plan));
                    // Evicting the connection aborts the connect and hands
                    // the permit back at once.
                    self.sockets
                        .connecting_task(&key, task.abort_handle(), permit);
                    Disposition::Done
                }
            },
        }
    }

    /// A segment for smoltcp (its answers go out from inside the poll).
    fn input(&self, buf: &[u8], ip: &IpInfo, now: Instant) -> Disposition {
        let stats = &self.d.stats;
        self.sockets
            .input_held(&buf[..ip.len], now, &mut TunSink(&self.tun), stats);
        Disposition::Done
    }

    /// The driver's drain ended: the pure ACKs held in it go out.
    pub fn drain_done(&self) {
        self.sockets
            .drain_done(&mut TunSink(&self.tun), &self.d.stats);
    }

    /// Sockets (open or closing) and connects in flight.
    pub fn counts(&self) -> TcpFlowsSnapshot {
        let (sockets, connecting) = self.sockets.counts();
        TcpFlowsSnapshot {
            half_open: connecting as u64,
            active: sockets as u64,
            closing: 0,
        }
    }

    /// The poller task: smoltcp's timers and the sessions' output.
    pub fn poller(&self) -> impl Future<Output = ()> + Send + 'static {
        let (tun, stats) = (self.tun.clone(), self.d.stats.clone());
        self.sockets
            .clone()
            .run_poller(tun, stats, self.d.life.clone())
    }
}

/// What a held SYN's task needs.
struct Connect {
    sockets: Arc<Sockets>,
    d: Arc<Dispatcher>,
    tun: Arc<Tun>,
}

impl Connect {
    /// Connect the outbound (connect-first, as in the system stack), then
    /// give smoltcp the SYN and run the session; on failure the app gets an
    /// RST answering its SYN.
    async fn run(self, key: FlowKey, syn: HeldSyn, plan: Plan) {
        let Connect { sockets, d, tun } = self;
        let server = key.server;
        let next = d.prepare(plan, server).await;
        let next = match next {
            Some(next) if d.life.phase() < Phase::Draining => next,
            other => {
                if let Some(Next::Relay(out)) = &other {
                    reset_on_close(&out.stream);
                }
                sockets.connect_failed(&key);
                syn.refuse(&tun, &d.stats).await;
                return;
            }
        };
        // The permit waits with the sockets while connecting; none left means
        // the connection was evicted meanwhile.
        let permit = sockets.take_permit(&key);
        let accepted = permit.and_then(|p| {
            let h = sockets.accept(key, syn.packet(), Instant::now(), &mut TunSink(&tun))?;
            Some((h, p))
        });
        let Some((h, permit)) = accepted else {
            if let Next::Relay(out) = &next {
                reset_on_close(&out.stream);
            }
            syn.refuse(&tun, &d.stats).await;
            return;
        };
        drop(syn);
        // The stream holds the permit, and hands it to the closing socket.
        let app = SmolStream::new(sockets, h, key, Some(permit));
        // A task of its own, sized for the session alone (this one, sized
        // for the connect, ends here).
        tokio::spawn(session::run(d, app, next, key.client, server, ()));
    }
}
