//! The NAT table's public types: configuration, keys, states, results.

use std::fmt;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::time::{Duration, Instant};

#[cfg(doc)]
use super::NatTable;
use super::key::PackedKey;
use super::window::WindowScale;

/// Configuration of a [`NatTable`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatConfig {
    /// NAT ports handed out. Port 0 is never used even if included (IANA
    /// lists it as reserved, and to a socket it means "any port"). An empty
    /// range makes every allocation fail with [`NatError::NoFreePort`].
    pub port_range: RangeInclusive<u16>,
    /// Entry budget: mappings in any state, lingering ones included.
    pub max_entries: usize,
    /// A HalfOpen entry with no packet for this long is removed (the kernel
    /// never accepted it, or the client gave up).
    pub half_open_timeout: Duration,
    /// How long a Closing entry is kept so the kernel's FIN/ACK and the
    /// app's last ACKs are still translated.
    pub linger: Duration,
    /// An Active entry with no packet for this long is removed.
    pub idle_timeout: Duration,
    /// Most candidate ports examined per allocation, so a nearly full range
    /// costs bounded work instead of a spin.
    pub max_probes: u32,
}

impl Default for NatConfig {
    fn default() -> Self {
        Self {
            // Below 10000 are well-known and registered ports some hosts
            // filter or reserve; 55536 ports is ample for one device.
            port_range: 10000..=65535,
            // The engine passes the platform budget; this default is the
            // mobile one (4096 x ~200 B is under 1 MiB).
            max_entries: 4096,
            half_open_timeout: Duration::from_secs(30),
            linger: Duration::from_secs(10),
            // RFC 5382 REQ-5: an established-connection idle timeout must
            // not be less than 2 hours 4 minutes.
            idle_timeout: Duration::from_secs(7440),
            max_probes: 4096,
        }
    }
}

/// A TCP flow as the app sees it (TCP implied).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// The app's address and port.
    pub client: SocketAddr,
    /// The destination the app connected to.
    pub server: SocketAddr,
}

impl FlowKey {
    /// A flow from `client` to `server`.
    pub fn new(client: SocketAddr, server: SocketAddr) -> Self {
        Self { client, server }
    }
}

/// Lifecycle of a flow: `HalfOpen(New)` on its SYN, `HalfOpen(Connecting)`
/// or `HalfOpen(Ready)` once admitted, `Active` once the kernel accepted
/// it, `Closing` for the linger (module docs, "State machine").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatState {
    /// Port allocated on a SYN, not yet accepted by the kernel listener.
    HalfOpen(Stage),
    /// Accepted; a session owns it until it marks it Closing
    /// ([`NatTable::mark_closing`]).
    Active,
    /// Session ended; kept for the linger so late segments are translated.
    Closing {
        /// When it was marked Closing.
        since: Instant,
    },
}

/// Where a half-open flow is between its SYN and the kernel's accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Created by its SYN; nothing attached yet. The engine admits it in the
    /// same step ([`NatTable::admit`]) or aborts it.
    New,
    /// Admitted: the outbound connects while the app's SYN is held. A SYN
    /// retransmit is absorbed ([`Uplink::held`]).
    Connecting,
    /// The SYN went to the kernel; the flow waits for its accept, at most
    /// [`HANDSHAKE_TIMEOUT`](super::HANDSHAKE_TIMEOUT).
    Ready,
}

/// Why a NAT operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NatError {
    /// The entry budget (`max_entries`) is used up.
    TableFull,
    /// No free port among the probed candidates of `port_range`.
    NoFreePort,
    /// No mapping for this flow or port.
    NoMapping,
    /// The mapping exists but is not HalfOpen (already accepted or closing).
    NotHalfOpen,
    /// The accepted connection's SYN is not the one that opened the
    /// mapping: its initial sequence number differs.
    IsnMismatch,
}

impl fmt::Display for NatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::TableFull => "NAT table full (entry budget exhausted)",
            Self::NoFreePort => "no free NAT port within the probe limit",
            Self::NoMapping => "no NAT mapping",
            Self::NotHalfOpen => "NAT mapping is not half-open",
            Self::IsnMismatch => "accepted SYN is not the one that opened the NAT mapping",
        })
    }
}

impl std::error::Error for NatError {}

/// Result of [`NatTable::uplink`]. `P` is what the engine attaches to a
/// half-open flow ([`NatTable::admit`]); a SYN that displaced another flow
/// hands that flow's back here, for the engine to close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uplink<P = ()> {
    /// NAT port to write as the source port.
    pub port: u16,
    /// Whether this call created the mapping (a new connection).
    pub created: bool,
    /// The entry's generation: for a new mapping, the one stamped when it
    /// was created, which every later transition of the half-open flow
    /// names ([`NatTable::admit`], [`NatTable::connected`],
    /// [`NatTable::abort_half_open`]), so nothing done for this flow can
    /// touch a later flow on the same port.
    pub generation: u64,
    /// The segment is a retransmit of a SYN the table holds while its
    /// outbound connects ([`Stage::Connecting`]): drop it, the held SYN
    /// goes to the kernel when the connect succeeds.
    pub held: bool,
    /// The table was full and evicted its oldest unanswered entry to make
    /// room for this one.
    pub evicted: Option<Evicted<P>>,
    /// This SYN replaced its 4-tuple's half-open entry (another ISN: a new
    /// connection): what the engine had attached to the old one.
    pub replaced: Option<P>,
    /// What the flow's handshake said about window scaling (unknown for a
    /// new entry, and for a SYN's or one the old connection answers).
    pub scale: WindowScale,
}

impl<P> Uplink<P> {
    /// An existing entry's port, nothing displaced.
    pub(super) fn existing(port: u16, generation: u64, held: bool) -> Self {
        Self {
            port,
            created: false,
            generation,
            held,
            evicted: None,
            replaced: None,
            scale: WindowScale::UNKNOWN,
        }
    }

    /// With the flow's window scaling.
    pub(super) fn with_scale(mut self, scale: WindowScale) -> Self {
        self.scale = scale;
        self
    }
}

/// A SYN refused by [`NatTable::uplink`] (or a segment of no flow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused<P = ()> {
    /// Why.
    pub error: NatError,
    /// The table was full and evicted an unanswered entry before the SYN
    /// was refused anyway (no free port among the probed ones): that
    /// entry's attachment, for the engine to close.
    pub evicted: Option<Evicted<P>>,
}

impl<P> From<NatError> for Refused<P> {
    fn from(error: NatError) -> Self {
        Self {
            error,
            evicted: None,
        }
    }
}

/// A half-open flow the table took out to make room for another: by the
/// entry budget ([`NatTable::uplink`], the entry is removed) or by the
/// half-open bounds ([`NatTable::make_room`], the entry lingers Closing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evicted<P = ()> {
    /// Its NAT port.
    pub port: u16,
    /// What the engine had attached to it (`None`: nothing was, it was
    /// [`Stage::New`] or Closing after its connect failed).
    pub payload: Option<P>,
}

/// A half-open flow closed by [`NatTable::abort_half_open`]: it was still
/// that flow, so the caller speaks for it (answers the app's SYN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aborted<P = ()> {
    /// What the engine had attached to it.
    pub payload: Option<P>,
}

/// Result of [`NatTable::accept`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted<P = ()> {
    /// The original flow.
    pub key: FlowKey,
    /// Its NAT port.
    pub port: u16,
    /// Generation stamped by this accept; later marks must carry it.
    pub generation: u64,
    /// The generation the entry carried before this accept: the one its SYN
    /// was given ([`Uplink::generation`]).
    pub opened: u64,
    /// The stage the flow was in when the kernel accepted it.
    pub stage: Stage,
    /// What the engine attached to it ([`Stage::Ready`]: what the accepted
    /// connection goes on to; any other stage's, for the engine to close).
    pub payload: Option<P>,
}

/// What one cleanup did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cleanup<P = ()> {
    /// Entries removed, per state they were in.
    pub removed: CleanupReport,
    /// Ready flows whose app did not complete the handshake within
    /// [`HANDSHAKE_TIMEOUT`](super::HANDSHAKE_TIMEOUT) (now Closing, or
    /// removed if they had also expired): their attachments, to close.
    pub timed_out: Vec<P>,
    /// Connecting flows whose entry expired (no packet for
    /// `half_open_timeout`: the app gave up) and was removed: their
    /// attachments, to close.
    pub expired: Vec<P>,
}

impl<P> Cleanup<P> {
    /// Entries removed plus flows timed out.
    pub fn total(&self) -> usize {
        self.removed.total() + self.timed_out.len()
    }
}

/// Entries removed by one cleanup, per state they were in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CleanupReport {
    /// HalfOpen entries older than `half_open_timeout`.
    pub half_open: usize,
    /// Active entries idle longer than `idle_timeout`.
    pub active: usize,
    /// Closing entries past the linger.
    pub closing: usize,
}

impl CleanupReport {
    /// All entries removed.
    pub fn total(&self) -> usize {
        self.half_open + self.active + self.closing
    }
}

/// Live entries per state (counters, no scan).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NatCounts {
    /// HalfOpen entries.
    pub half_open: usize,
    /// Active entries.
    pub active: usize,
    /// Closing (lingering) entries.
    pub closing: usize,
}

impl NatCounts {
    /// All entries.
    pub fn total(&self) -> usize {
        self.half_open + self.active + self.closing
    }
}

/// Refusals and misses since the table was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NatErrorCounts {
    /// New flows refused because the entry budget was used up.
    pub table_full: u64,
    /// New flows refused because no free port was found.
    pub no_free_port: u64,
    /// Uplink segments of unknown flows plus downlink segments to unmapped ports.
    pub no_mapping: u64,
    /// The downlink share of `no_mapping`.
    pub downlink_no_mapping: u64,
    /// Accepts refused (unknown port or not HalfOpen).
    pub accept_refused: u64,
    /// Unanswered entries (never accepted) evicted to make room for a new
    /// flow in a full table.
    pub evicted: u64,
    /// SYNs with another ISN on an Active flow the app had not closed, sent
    /// on to the old connection (whose kernel socket answers with a
    /// challenge ACK) instead of replacing it.
    pub syn_on_active: u64,
}

/// An expired entry (or a Ready flow past its handshake time) found by
/// [`NatTable::collect_expired`], to be passed to
/// [`NatTable::remove_if_expired`].
#[derive(Debug, Clone, Copy)]
pub struct Expired {
    pub(super) port: u16,
    pub(super) generation: u64,
    pub(super) key: PackedKey,
}

impl Expired {
    /// The entry's NAT port.
    pub fn port(&self) -> u16 {
        self.port
    }
}
