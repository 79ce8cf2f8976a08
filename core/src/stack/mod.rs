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
//! [`HeldSyn`] while the outbound connects, bound their half-open
//! connections alike (`nat::HALF_OPEN_MAX`, `HALF_OPEN_PER_SOURCE`,
//! `HANDSHAKE_TIMEOUT`: the policy lives with the system stack's flow
//! table in the pure crate), and serve the accepted connection with the
//! same sessions (`dispatch::session`).

use std::sync::Arc;
use std::time::Instant;

use crate::packet::{Disposition, IpInfo};
use crate::stats::{LocalCounters, TcpFlowsSnapshot};

mod held_syn;
pub(crate) mod smoltcp;
pub(crate) mod system;

pub(crate) use crate::nat::{HALF_OPEN_MAX, HALF_OPEN_PER_SOURCE, HANDSHAKE_TIMEOUT};
pub(crate) use held_syn::HeldSyn;

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

    /// Gives back the capacity a burst of flows left in the flow table
    /// (`NatTable::shrink`); the bytes given back. For the quiet time
    /// after load (`housekeeping.rs`). smoltcp's sockets are freed with
    /// their sessions: nothing to shrink.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    pub fn shrink(&self) -> usize {
        match self {
            Stack::System(s) => s.shrink(),
            Stack::Smoltcp(_) => 0,
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
