//! The smoltcp stack: a userspace TCP behind the same entry point, drivers,
//! connect-first admission, outbounds, sessions and statistics as the system
//! stack. Only the way TCP segments become streams differs: instead of
//! rewriting them for the kernel, the driver hands them to one smoltcp
//! `Interface` in any-IP mode, and each accepted connection is a smoltcp
//! socket read and written by a session task. UDP and ICMP never come here.
//!
//! * `gate`: the sans-I/O decision per packet (also the fuzz target's way in);
//! * `stack`: the interface, its sockets, the poller that drives timers;
//! * `device`: the device smoltcp polls, writing straight to the TUN;
//! * `stream`: the app's side of one connection, as sessions use it.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::dispatch::{Dispatcher, Next, Plan, session};
use crate::lifecycle::Phase;
use crate::outbound::reset_on_close;
use crate::packet::{self, Disposition, IpInfo};
use crate::stats::{EngineDrop, LocalCounters, NatSnapshot};
use crate::tun::Tun;

#[cfg(any(test, feature = "bench-internals"))]
pub mod bench;
mod device;
#[cfg(any(test, fuzzing))]
pub mod fuzzing;
mod gate;
mod stack;
mod stream;

use device::TunSink;
use gate::Gate;
pub(crate) use stack::{Key, SmolStack};
pub(crate) use stream::SmolStream;

use super::HeldSyn;

/// The smoltcp stack of one engine, as the driver and the engine see it.
#[derive(Debug, Clone)]
pub(crate) struct SmolTcp {
    pub stack: Arc<SmolStack>,
    d: Arc<Dispatcher>,
    tun: Arc<Tun>,
    /// Which address families the TUN carries (IPv4, IPv6).
    families: (bool, bool),
}

impl SmolTcp {
    pub fn new(
        stack: SmolStack,
        d: Arc<Dispatcher>,
        tun: Arc<Tun>,
        families: (bool, bool),
    ) -> Self {
        SmolTcp {
            stack: Arc::new(stack),
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
        let gated = gate::gate(&self.stack, buf, ip, family);
        match gated {
            Gate::Reject(r) => {
                local.reject(r);
                return Disposition::Done;
            }
            Gate::Drop(d) if d != EngineDrop::SynWhileConnecting => {
                local.drop(d);
                return Disposition::Done;
            }
            _ => {}
        }
        local.packets_up += 1;
        local.bytes_up += ip.len as u64;
        match gated {
            Gate::Input => {
                let stats = &self.d.stats;
                self.stack
                    .input_held(&buf[..ip.len], now, &mut TunSink(&self.tun), stats);
                Disposition::Done
            }
            Gate::Full(tcp) => {
                local.drop(EngineDrop::NatTableFull);
                self.d.warn.warn(format_args!(
                    "smoltcp socket budget refused a new flow ({})",
                    EngineDrop::NatTableFull.as_str()
                ));
                Disposition::WriteBack(packet::tcp_rst_reply(buf, ip, &tcp))
            }
            Gate::New(key, tcp) => match self.d.admit(key.1, now) {
                None => {
                    self.stack.unmark(&key);
                    Disposition::WriteBack(packet::tcp_rst_reply(buf, ip, &tcp))
                }
                Some((plan, permit)) => {
                    let syn = HeldSyn::new(&buf[..ip.len]);
                    let conn = Connect {
                        stack: self.stack.clone(),
                        d: self.d.clone(),
                        tun: self.tun.clone(),
                    };
                    let task = tokio::spawn(conn.run(key, syn, plan));
                    // Evicting the connection aborts the connect and hands
                    // the permit back at once.
                    self.stack
                        .connecting_task(&key, task.abort_handle(), permit);
                    Disposition::Done
                }
            },
            Gate::Drop(d) => {
                local.drop(d);
                Disposition::Done
            }
            Gate::Reject(_) => Disposition::Done,
        }
    }

    /// The driver's drain ended: the pure ACKs held in it go out.
    pub fn drain_done(&self) {
        self.stack
            .drain_done(&mut TunSink(&self.tun), &self.d.stats);
    }

    /// Sockets (open or closing) and connects in flight.
    pub fn counts(&self) -> NatSnapshot {
        let (sockets, connecting) = self.stack.counts();
        NatSnapshot {
            half_open: connecting as u64,
            active: sockets as u64,
            closing: 0,
        }
    }

    /// The poller task: smoltcp's timers and the sessions' output.
    pub fn poller(&self) -> impl Future<Output = ()> + Send + 'static {
        let (tun, stats) = (self.tun.clone(), self.d.stats.clone());
        self.stack
            .clone()
            .run_poller(tun, stats, self.d.life.clone())
    }
}

/// What a held SYN's task needs.
struct Connect {
    stack: Arc<SmolStack>,
    d: Arc<Dispatcher>,
    tun: Arc<Tun>,
}

impl Connect {
    /// Connect the outbound (connect-first, as in the system stack), then
    /// give smoltcp the SYN and run the session; on failure the app gets an
    /// RST answering its SYN.
    async fn run(self, key: Key, syn: HeldSyn, plan: Plan) {
        let Connect { stack, d, tun } = self;
        let server = key.1;
        let next = d.prepare(plan, server).await;
        let next = match next {
            Some(next) if d.life.phase() < Phase::Draining => next,
            other => {
                if let Some(Next::Relay(out)) = &other {
                    reset_on_close(&out.stream);
                }
                stack.connect_failed(&key);
                syn.refuse(&tun, &d.stats).await;
                return;
            }
        };
        // The permit waits in the stack while connecting; none left means
        // the connection was evicted meanwhile.
        let permit = stack.take_permit(&key);
        let accepted = permit.and_then(|p| {
            let h = stack.accept(key, syn.packet(), Instant::now(), &mut TunSink(&tun))?;
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
        let app = SmolStream::new(stack, h, key, Some(permit));
        // A task of its own, sized for the session alone (this one, sized
        // for the connect, ends here).
        tokio::spawn(session::run(d, app, next, server, ()));
    }
}
