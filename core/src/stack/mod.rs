//! The two TCP stacks, behind one entry: [`Stack::tcp`] takes every TCP
//! packet the driver reads.
//!
//! * [`system`]: kerntun implements no TCP. Each packet is rewritten in place
//!   (source NAT) and written back, so the kernel's own TCP accepts it on a
//!   listener bound to the gateway address (docs/architecture.md).
//! * [`smoltcp`]: a userspace TCP stack, for where no kernel listener can see
//!   the tunnel's connections (iOS `includeAllNetworks`).
//!
//! Both admit a new connection the same way, once, at its first SYN
//! ([`crate::dispatch::Dispatcher::admit`]: connect-first), hold the SYN in a
//! [`HeldSyn`] while the outbound connects, and serve the accepted
//! connection with the same sessions (`dispatch::session`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::packet::{self, Disposition, HEADROOM, IpInfo};
use crate::stats::{EngineDrop, LocalCounters, Stats, TcpFlowsSnapshot};
use crate::tun::Tun;

pub(crate) mod smoltcp;
pub(crate) mod system;

/// Half-open connections (between a new SYN and the end of its handshake:
/// connect in flight, or SYN answered and not yet completed by the app) at
/// most, whatever the admission limit; both stacks also keep them to half
/// the admission limit, so they never take the permits answered
/// connections need.
pub(crate) const HALF_OPEN_MAX: usize = 512;
/// Half-open connections one source address may hold: a bound on the
/// outbound connects one app (a port scanner, a flood) keeps in flight.
pub(crate) const HALF_OPEN_PER_SOURCE: usize = 256;
/// How long the app may take to complete a handshake the kernel answered.
/// The app's side is local (the SYN-ACK crosses the TUN, not a network), so
/// a real app answers within milliseconds; 3 s allows for its stack
/// retransmitting a lost ACK once (Linux's initial RTO is 1 s).
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// The stack an engine runs (chosen at start, never switched).
#[derive(Debug, Clone)]
pub(crate) enum Stack {
    System(Arc<system::SystemStack>),
    Smoltcp(smoltcp::SmoltcpStack),
}

impl Stack {
    /// One TCP packet from the TUN (`ip` its parsed header), processed in
    /// place. A new flow's first SYN is admitted here and held while its
    /// outbound connects.
    #[inline]
    pub fn tcp(
        &self,
        buf: &mut [u8],
        ip: &IpInfo,
        now: Instant,
        local: &mut LocalCounters,
    ) -> Disposition {
        match self {
            Stack::System(s) => s.tcp(buf, ip, now, local),
            Stack::Smoltcp(s) => s.tcp(buf, ip, now, local),
        }
    }

    /// The driver's drain ended (after every drain that read packets):
    /// smoltcp writes out the ACKs it held back during it.
    pub fn drain_done(&self) {
        if let Stack::Smoltcp(s) = self {
            s.drain_done();
        }
    }

    /// Whether there is state a cleanup tick could expire.
    pub fn has_state(&self) -> bool {
        match self {
            Stack::System(s) => s.has_state(),
            // smoltcp's own poller expires its sockets.
            Stack::Smoltcp(_) => false,
        }
    }

    /// The periodic cleanup of expired flows.
    pub fn cleanup(&self, now: Instant) {
        if let Stack::System(s) = self {
            s.cleanup(now);
        }
    }

    /// Flow counts for the statistics. smoltcp has no NAT table: its sockets
    /// (open or closing) and the connects in flight fill the same slots.
    pub fn counts(&self) -> TcpFlowsSnapshot {
        match self {
            Stack::System(s) => s.counts(),
            Stack::Smoltcp(s) => s.counts(),
        }
    }

    /// The configuration name of the stack.
    pub fn name(&self) -> &'static str {
        match self {
            Stack::System(_) => "system",
            Stack::Smoltcp(_) => "smoltcp",
        }
    }
}

/// A new connection's SYN, copied out of the driver's buffer (one small
/// allocation per connection, ~60-80 bytes) and held while the outbound
/// connects; then handed to the stack, or answered with an RST.
#[derive(Debug)]
pub(crate) struct HeldSyn(Box<[u8]>);

impl HeldSyn {
    /// Hold the packet `pkt` (headroom kept in front for the device header).
    pub fn new(pkt: &[u8]) -> Self {
        let mut b = vec![0u8; HEADROOM + pkt.len()].into_boxed_slice();
        b[HEADROOM..].copy_from_slice(pkt);
        HeldSyn(b)
    }

    /// The held packet.
    pub fn packet(&self) -> &[u8] {
        &self.0[HEADROOM..]
    }

    /// The held packet, to rewrite in place.
    pub fn packet_mut(&mut self) -> &mut [u8] {
        &mut self.0[HEADROOM..]
    }

    /// Write the (rewritten) packet to the TUN.
    pub async fn send(mut self, tun: &Tun, stats: &Stats) {
        let len = self.0.len() - HEADROOM;
        if tun.send(&mut self.0, len).await.is_err() {
            stats.drop(EngineDrop::TunWrite);
        }
    }

    /// Answer the app's SYN with an RST (the connect failed or was refused).
    pub async fn refuse(mut self, tun: &Tun, stats: &Stats) {
        let pkt = self.packet_mut();
        let n = match packet::parse_ip(pkt).and_then(|ip| Ok((ip, packet::parse_tcp(pkt, &ip)?))) {
            Ok((ip, tcp)) => packet::tcp_rst_reply(pkt, &ip, &tcp),
            // Parsed once already by the driver; cannot fail.
            Err(_) => return,
        };
        if n > 0 && tun.send(&mut self.0, n).await.is_err() {
            stats.drop(EngineDrop::TunWrite);
        }
    }
}
