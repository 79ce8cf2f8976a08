//! One flow's record in the table and what it shares: the socket or queue
//! a datagram goes out on ([`FlowIo`]), the state the driver and the flow's
//! reply task share ([`ReplyState`]), and an app source's endpoint-independent
//! [`Mapping`]. Apart from `mod.rs` so the table there reads as the
//! driver's decisions (lookup, plan, open) over these records.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tokio::task::AbortHandle;

use super::listed;
use super::proxied::Queue;
use crate::conns::Registered;

#[derive(Debug)]
pub(super) enum FlowIo {
    /// Direct: a connected socket, sent to synchronously.
    Direct(Arc<UdpSocket>),
    /// Direct, endpoint-independent: the app source's [`Mapping`] socket,
    /// sent to this flow's server synchronously.
    Mapped(Arc<UdpSocket>),
    /// Through a proxy: queued to the flow's task.
    Queued(Queue),
}

#[derive(Debug)]
pub(super) struct Flow {
    pub(super) io: FlowIo,
    /// Whether this flow's uplink datagrams are gathered for one GSO send
    /// (direct flows where the kernel has `UDP_SEGMENT`, until their path
    /// refuses one; never on Darwin).
    pub(super) gso: bool,
    /// Last uplink datagram (driver-local, no atomics needed).
    pub(super) last_up: Instant,
    /// What the driver and the flow's reply task share (a mapped flow:
    /// its mapping's).
    pub(super) state: Arc<ReplyState>,
    /// The flow's own task; `None` for a mapped flow, whose mapping has it.
    pub(super) task: Option<AbortHandle>,
    /// Its record in the live connection list (`listed.rs`).
    pub(super) listed: Registered,
}

impl Flow {
    pub(super) fn last_active(&self) -> Instant {
        self.last_up.max(self.state.last_down())
    }

    /// Whether a reply ever came back on this flow.
    pub(super) fn replied(&self) -> bool {
        self.state.replied()
    }
}

/// What a flow's reply task and the driver share: when the last reply
/// came, and how long a reply packet toward the app may be.
#[derive(Debug)]
pub(crate) struct ReplyState {
    /// The flow table's epoch, which `last_down` counts from.
    epoch: Instant,
    /// Last downlink datagram, milliseconds since `epoch`, at least 1; 0
    /// while the flow never saw a reply ([`ReplyState::mark`]).
    last_down: AtomicU64,
    /// The longest reply packet written whole: the TUN's MTU, lowered to
    /// the longest fragment the app's datagrams came in
    /// ([`ReplyState::lower_mtu`]).
    mtu: AtomicU16,
    /// A network change stranded the socket of the flow's task, which
    /// ended ([`ReplyState::strand`]): the driver closes the flow at its
    /// next datagram and opens another on the new network.
    stranded: AtomicBool,
    /// The records the replies count into (`listed.rs`).
    pub(super) tally: listed::Tally,
}

impl ReplyState {
    pub(super) fn new(epoch: Instant, mtu: u16) -> Self {
        Self {
            epoch,
            last_down: AtomicU64::new(0),
            mtu: AtomicU16::new(mtu),
            stranded: AtomicBool::new(false),
            tally: listed::Tally::default(),
        }
    }

    /// The flow's task ends because a network change stranded its socket
    /// (`proxied.rs`).
    pub(crate) fn strand(&self) {
        self.stranded.store(true, Relaxed);
    }

    pub(super) fn stranded(&self) -> bool {
        self.stranded.load(Relaxed)
    }

    /// Record a reply at the present moment: milliseconds since the epoch,
    /// never 0, which stands for "never replied".
    pub(crate) fn mark(&self) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_down.store(ms.max(1), Relaxed);
    }

    pub(super) fn replied(&self) -> bool {
        self.last_down.load(Relaxed) != 0
    }

    pub(super) fn last_down(&self) -> Instant {
        self.epoch + Duration::from_millis(self.last_down.load(Relaxed))
    }

    /// The longest reply packet to write whole; a longer reply goes as
    /// fragments of at most this size.
    pub(crate) fn mtu(&self) -> usize {
        usize::from(self.mtu.load(Relaxed))
    }

    /// The app's datagram came as fragments of at most `longest` bytes: the
    /// link between the app and the TUN is that small (a gateway forwarding
    /// the app into a larger TUN), and a reply packet longer than that
    /// would be lost there (a router never fragments IPv6, nor IPv4 with
    /// DF). The flow's replies are fragmented to it from now on, never
    /// below the least MTU of the family (576 bytes, RFC 791; 1280, RFC
    /// 8200), whatever the app sends.
    pub(super) fn lower_mtu(&self, longest: usize, v6: bool) {
        let floor = if v6 { 1280 } else { 576 };
        let m = u16::try_from(longest.max(floor)).unwrap_or(u16::MAX);
        self.mtu.fetch_min(m, Relaxed);
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

/// Endpoint-independent mapping and filtering (`direct.udp_nat`, RFC 4787
/// REQ-1 and REQ-8): one unconnected socket per app source (address and
/// port), bound once and used for every destination the rules send direct,
/// and one reply task that writes each datagram it receives, from any peer,
/// to the app as from that peer. A mapping is what the flow budget counts
/// and expires (`budget.udp_flows`, `timeouts.udp_idle_s` /
/// `udp_unreplied_s`, with the activity of all its destinations and every
/// reply); its destinations' entries in the table only remember that their
/// plan was "direct" (the rules decide per destination), at most
/// [`MAPPING_PEERS`] of them, the oldest forgotten first (its next datagram
/// is planned again; the mapping and its socket stay).
#[derive(Debug)]
pub(super) struct Mapping {
    pub(super) sock: Arc<UdpSocket>,
    pub(super) state: Arc<ReplyState>,
    pub(super) task: AbortHandle,
    /// The destinations with an entry in the table, oldest first.
    pub(super) peers: VecDeque<SocketAddr>,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Destinations one mapping keeps a planned entry for: an ICE agent's
/// STUN/TURN servers and candidates, a game's servers and peers. Each entry
/// is about 150 bytes of table, so `udp_flows` mappings hold at most
/// `udp_flows` x 32 of them (600 KiB at iOS's 128 flows); a source talking
/// to more (a DHT node) has its older destinations planned again.
pub(super) const MAPPING_PEERS: usize = 32;
