//! One platform budget for every bounded resource: TCP
//! flows, TCP admission permits, UDP flows, the listener backlog and relay
//! buffers all derive from it, so a phone's limits are set in one place.
//!
//! Memory is budgeted in bytes ([`Memory`]): TCP admission is the TCP
//! budget over what one session of the running stack costs at most
//! ([`Budget::session_cost`]); the relay pool, the DNS cache, DNS queries in
//! flight, the fake-ip pool and proxied UDP queues are [`ByteBudget`]s
//! their holders charge.
//! Every one of them shrinks with the host's memory pressure ([`tiers`]:
//! all, a half, a quarter), read from one [`Pressure`].
//!
//! Admission is a counter, not a semaphore: raising the memory pressure lowers
//! the limit new sessions are checked against, while sessions that already
//! hold a permit keep it until they end.
//!
//! A pressure tier raised by the host decays by itself ([`PressureDecay`]):
//! iOS warns a process nearing its own limit but reports `.normal` only
//! when pressure recovers system-wide, and Android 14+ delivers no trim
//! level that says pressure ended, so without decay a single warning would
//! hold admission at the critical tier for the tunnel's life. The core
//! reads no clock: the engine passes `now` in.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};

mod pressure;

pub use pressure::{MemoryPressure, PRESSURE_DECAY_STEP, Pressure, PressureDecay};

/// The platform a budget is tuned for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Platform {
    /// iOS Network Extension: 50 MiB process-wide, fatal when exceeded.
    Ios,
    /// Android VpnService: a background-process budget.
    Android,
    /// Linux/macOS desktop or server.
    Desktop,
}

impl Platform {
    /// The platform this library was compiled for.
    pub const fn current() -> Self {
        if cfg!(target_os = "ios") {
            Platform::Ios
        } else if cfg!(target_os = "android") {
            Platform::Android
        } else {
            Platform::Desktop
        }
    }

    /// Default MTU per platform. iOS 4064: a Network Extension's packet flow
    /// loses throughput above it; Android 9000: some devices refuse writes
    /// of 65535-byte packets to the TUN with ENOBUFS; desktop Linux 65535,
    /// the largest IP packet, so a bulk transfer crosses the TUN in the
    /// fewest packets. The iOS and Android values are not measured here (no
    /// device in this lab); a host can set `tun.mtu`.
    pub const fn default_mtu(self) -> u16 {
        match self {
            Platform::Ios => 4064,
            Platform::Android => 9000,
            Platform::Desktop => 65535,
        }
    }

    /// Packets the per-packet driver's reader thread holds in its ring
    /// (`tun.read_ring`; Linux/Android only, Darwin reads on the driver
    /// task): 0, no reader thread, on every platform. On the phone profile
    /// (docs/notes.md, "A reader thread for the per-packet TUN") 512 slots
    /// cut the TUN's drops at MTU 1500 from 21-29 % to 16-19 % of its
    /// packets at 16 and 64 streams, but at MTU 9000, Android's default,
    /// they cost 7-40 % of the throughput at 1, 16 and 64 streams except
    /// one row, and up to 32 % more CPU per byte.
    pub const fn read_ring(self) -> usize {
        match self {
            Platform::Ios | Platform::Android | Platform::Desktop => 0,
        }
    }
}

/// Limits that come from the platform unless overridden .
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BudgetConfig {
    /// Platform whose budget is the starting point; defaults to the build target.
    pub platform: Option<Platform>,
    /// TCP flows the running stack tracks at once: the system stack's NAT
    /// entries, or smoltcp's sockets (open or closing) plus its connects in
    /// flight. Also read under its former name, `nat_entries`.
    #[serde(alias = "nat_entries")]
    pub tcp_flows: Option<usize>,
    /// TCP admission permits at normal pressure (elevated and critical are
    /// 1/2 and 1/4). Unset: the TCP memory budget over the most one session
    /// of the running stack holds ([`Budget::tcp_sessions`]).
    pub tcp_sessions: Option<usize>,
    /// Concurrent UDP flows; the least recently used flow is evicted past it.
    pub udp_flows: Option<usize>,
    /// Kernel listener backlog.
    pub backlog: Option<u32>,
    /// Userspace relay buffer per direction, allocated only while data flows.
    pub relay_buffer: Option<usize>,
}

impl BudgetConfig {
    /// The first field that is set to zero, if any (every limit must admit
    /// at least one).
    pub fn zero_field(&self) -> Option<&'static str> {
        [
            ("tcp_flows", self.tcp_flows),
            ("tcp_sessions", self.tcp_sessions),
            ("udp_flows", self.udp_flows),
            ("relay_buffer", self.relay_buffer),
            ("backlog", self.backlog.map(|b| b as usize)),
        ]
        .into_iter()
        .find_map(|(name, v)| (v == Some(0)).then_some(name))
    }
}

/// Userspace memory one idle system-stack session holds: its task (the
/// relay's state machine), the two sockets' runtime registrations, its NAT
/// entry and permit. `core/tests/memory.rs` holds 1000 idle sessions under
/// the iOS budget and checks the engine's resident memory grows by no more
/// than this per session (docs/reliability.md records the measured figure).
pub const SESSION_STATE: usize = 5 * 1024;

/// What a smoltcp socket holds besides its two rings: the socket itself
/// (`stack::smoltcp` tests check its size against this), its slot in the
/// socket set, its entries in the flow maps.
pub const SMOLTCP_SOCKET_STATE: usize = 2 * 1024;

/// Bytes of each of the two rings a smoltcp socket starts on and keeps
/// while it moves little data; it borrows a full ring
/// (`Budget::smoltcp_buffer`) from [`Memory::smoltcp_rings`] for a
/// direction whose small ring data fills (`stack/smoltcp/rings.rs`). One TCP segment of the common
/// 1500-byte path MTU fits.
pub const SMOLTCP_SMALL_RING: usize = 2 * 1024;

/// What an outbound's framing holds for a session besides its frames: a
/// Shadowsocks stream's state is 280 bytes on x86_64, plus its two
/// ciphers' key schedules on the heap. Charged to a session admitted
/// without the relay's fallback share (smoltcp's) while it relays through a
/// framing; the system stack's sessions have it within that share.
pub const FRAMING_STATE: usize = 2 * 1024;

/// The copy buffer a relay direction uses while the relay pool has no room
/// for a full one (and, with a codec, as much again for its output). Small
/// enough that it can be counted in every session's cost; large enough for
/// a TCP segment of the common 1500-byte path MTU.
pub const RELAY_FALLBACK_BUFFER: usize = 2 * 1024;

/// Which TCP stack a session cost is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpStack {
    /// Kernel TCP via NAT: no socket buffers in the process.
    System,
    /// smoltcp: a receive and a send ring per connection.
    Smoltcp,
}

/// Bytes each memory budget allows at normal pressure; the elevated and
/// critical tiers allow a half and a quarter ([`tiers`]). docs/reliability.md
/// tabulates the worst case each allows per platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Memory {
    /// TCP sessions: admission permits are this over the stack's
    /// [`Budget::session_cost`].
    pub tcp: usize,
    /// Full-size relay copy buffers of busy sessions, all together.
    pub relay: usize,
    /// Cached DNS answers.
    pub dns_cache: usize,
    /// Hijacked DNS queries being answered and upstream exchanges.
    pub dns_in_flight: usize,
    /// Domains holding a fake-ip address (with `dns.fake_ip`): each name
    /// and its entries (`dns::fakeip`), and the addresses waiting out their
    /// grace period.
    pub fake_ip: usize,
    /// Proxied UDP flows' queued datagrams beyond one buffer per flow.
    pub udp_queues: usize,
    /// smoltcp only: the full rings (`Budget::smoltcp_buffer` each) lent
    /// to sockets while data fills their small rings.
    pub smoltcp_rings: usize,
}

const MIB: usize = 1024 * 1024;

/// Resolved limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Budget {
    pub platform: Platform,
    /// TCP flows the running stack tracks at once (`budget.tcp_flows`).
    pub tcp_flows: usize,
    /// `budget.tcp_sessions` when configured: admission permits at normal
    /// pressure instead of the count the memory budget gives.
    pub tcp_sessions_override: Option<usize>,
    pub udp_flows: usize,
    pub backlog: u32,
    /// Userspace relay buffer per direction while data flows (charged to
    /// [`Memory::relay`]; [`RELAY_FALLBACK_BUFFER`] past it).
    pub relay_buffer: usize,
    /// smoltcp's receive and send ring per connection, each.
    pub smoltcp_buffer: usize,
    /// Bytes per memory budget at normal pressure.
    pub memory: Memory,
}

impl Budget {
    /// The platform defaults, in bytes first: iOS keeps its worst case
    /// near 25 MiB of the Network Extension's 50 MiB (docs/reliability.md,
    /// "Memory budgets"), which admits 1365 system-stack sessions; Android
    /// and desktop give each budget more room.
    pub fn for_platform(platform: Platform) -> Self {
        match platform {
            Platform::Ios => Budget {
                platform,
                tcp_flows: 2_048,
                tcp_sessions_override: None,
                udp_flows: 128,
                backlog: 64,
                relay_buffer: 16 * 1024,
                // 64 KiB rings. They face the app only (the outbound
                // socket's kernel buffers cover the remote path), yet 16 KiB
                // halved one upload stream on the smoltcp profile and 8 KiB
                // lost 60-70 % (docs/notes.md, "smoltcp: smaller rings on
                // the local leg").
                smoltcp_buffer: 64 * 1024,
                memory: Memory {
                    tcp: 16 * MIB,
                    relay: 4 * MIB,
                    dns_cache: MIB,
                    dns_in_flight: MIB,
                    // About 1 900 domains of 20 characters; past that the
                    // least recently used give their addresses back.
                    fake_ip: MIB / 2,
                    udp_queues: MIB,
                    // 64 rings of 64 KiB: 64 transfers (one direction
                    // each) on full rings at once (docs/notes.md,
                    // "smoltcp: rings on loan").
                    smoltcp_rings: 4 * MIB,
                },
            },
            Platform::Android => Budget {
                platform,
                tcp_flows: 8_192,
                tcp_sessions_override: None,
                udp_flows: 512,
                backlog: 256,
                relay_buffer: 32 * 1024,
                smoltcp_buffer: 128 * 1024,
                memory: Memory {
                    tcp: 128 * MIB,
                    relay: 16 * MIB,
                    dns_cache: 4 * MIB,
                    dns_in_flight: 4 * MIB,
                    fake_ip: 4 * MIB,
                    udp_queues: 8 * MIB,
                    // 128 rings of 128 KiB.
                    smoltcp_rings: 16 * MIB,
                },
            },
            Platform::Desktop => Budget {
                platform,
                tcp_flows: 50_000,
                tcp_sessions_override: None,
                udp_flows: 4_096,
                backlog: 1_024,
                relay_buffer: 64 * 1024,
                // Enough window for multi-Gbit/s on a sub-millisecond path.
                smoltcp_buffer: 512 * 1024,
                memory: Memory {
                    tcp: 2048 * MIB,
                    relay: 256 * MIB,
                    dns_cache: 32 * MIB,
                    dns_in_flight: 32 * MIB,
                    // Every address of the default pool (32 766), names up
                    // to the longest (253 characters) included.
                    fake_ip: 16 * MIB,
                    udp_queues: 256 * MIB,
                    // 512 rings of 512 KiB.
                    smoltcp_rings: 256 * MIB,
                },
            },
        }
    }

    /// Platform defaults with the configured overrides applied.
    pub fn resolve(cfg: &BudgetConfig) -> Self {
        let mut b = Budget::for_platform(cfg.platform.unwrap_or(Platform::current()));
        if let Some(v) = cfg.tcp_flows {
            b.tcp_flows = v;
        }
        b.tcp_sessions_override = cfg.tcp_sessions;
        if let Some(v) = cfg.udp_flows {
            b.udp_flows = v;
        }
        if let Some(v) = cfg.backlog {
            b.backlog = v;
        }
        if let Some(v) = cfg.relay_buffer {
            b.relay_buffer = v;
        }
        b
    }

    /// What admission charges one session of `stack`: its state, and
    ///
    /// * system stack: the relay's fallback share (two directions, a read
    ///   buffer and a codec's output each), which also covers what sniffing
    ///   and a framing hold;
    /// * smoltcp: its socket and two small rings. Its unframed relay moves
    ///   bytes between the rings and the outbound's socket with no buffer,
    ///   and sniffing looks at the bytes in the ring; a framed relay
    ///   charges its framing's state and fallback buffers to the relay pool
    ///   as it needs them, or takes a second permit (`relay::Scratch`).
    ///
    /// Full-size relay buffers come out of [`Memory::relay`], smoltcp's
    /// full rings out of [`Memory::smoltcp_rings`].
    pub fn session_cost(&self, stack: TcpStack) -> usize {
        match stack {
            TcpStack::System => SESSION_STATE + 4 * RELAY_FALLBACK_BUFFER,
            TcpStack::Smoltcp => {
                let ring = SMOLTCP_SMALL_RING.min(self.smoltcp_buffer);
                SESSION_STATE + SMOLTCP_SOCKET_STATE + 2 * ring
            }
        }
    }

    /// How many full smoltcp rings may be lent at once
    /// ([`Memory::smoltcp_rings`] over one ring), at least one.
    pub fn smoltcp_full_rings(&self) -> usize {
        (self.memory.smoltcp_rings / self.smoltcp_buffer.max(1)).max(1)
    }

    /// The most each budget lets the engine hold at normal pressure, with
    /// the system stack and TUN MTU `mtu`: (what, bytes). Their sum is the
    /// worst case docs/reliability.md ("Memory budgets") gives per
    /// platform; smoltcp sessions are bounded by the same TCP bytes.
    pub fn worst_case(&self, mtu: u16) -> Vec<(&'static str, usize)> {
        self.worst_case_with_ring(mtu, self.platform.read_ring())
    }

    /// [`Budget::worst_case`] with a TUN reader ring of `read_ring`
    /// packets (`tun.read_ring`).
    pub fn worst_case_with_ring(&self, mtu: u16, read_ring: usize) -> Vec<(&'static str, usize)> {
        let mtu = usize::from(mtu);
        let sessions = self.tcp_sessions(TcpStack::System)[0];
        vec![
            (
                "tcp sessions",
                sessions * self.session_cost(TcpStack::System),
            ),
            ("relay pool", self.memory.relay),
            ("dns cache", self.memory.dns_cache),
            ("dns in flight", self.memory.dns_in_flight),
            ("fake-ip pool", self.memory.fake_ip),
            ("udp queues", self.memory.udp_queues),
            // Per flow, the larger of what a proxied flow keeps (its first
            // queue buffer, its encoded datagram and its reply buffer) and
            // a direct flow's reply batch while replies arrive.
            (
                "udp flow buffers",
                self.udp_flows * proxied_udp_flow_bytes(mtu).max(self.udp_reply_bytes()),
            ),
            // IP reassembly of the app's fragmented datagrams: a fixed
            // bound, whatever the platform (`packet::frag::Limits`).
            ("ip reassembly", REASSEMBLY_BYTES),
            // QUIC flows whose Initials are being read (`udp/sniff.rs`).
            ("quic sniffing", QUIC_SNIFF_BYTES),
            // Each runtime thread's spill area for replies longer than a
            // batch slot (Linux/Android; 1 thread on mobile, 2 on desktop).
            (
                "udp reply spill",
                match self.platform {
                    Platform::Ios => 0,
                    Platform::Android => UDP_REPLY_SPILL_BYTES,
                    Platform::Desktop => 2 * UDP_REPLY_SPILL_BYTES,
                },
            ),
            // The per-packet driver's reader thread: its slots, allocated
            // at start (`driver/read_ring.rs`).
            ("tun read ring", read_ring * read_ring_slot_bytes(mtu)),
            // What the per-packet driver holds back until a drain ends, and
            // the ACKs parked for a window grant.
            ("tun write-back", write_back_bytes(self.platform)),
        ]
    }

    /// What a direct UDP flow's reply path holds while replies arrive: a
    /// `recvmmsg` batch on Linux/Android, one buffer of the largest reply
    /// passed on (16 KiB) on Darwin.
    fn udp_reply_bytes(&self) -> usize {
        match self.platform {
            Platform::Ios => UDP_REPLY_BUFFER_DARWIN,
            Platform::Android | Platform::Desktop => UDP_REPLY_BATCH_BYTES,
        }
    }

    /// Admission permits at normal, elevated and critical pressure for
    /// `stack`: the TCP memory budget over the session cost (at most one
    /// per TCP flow the stack may track, `tcp_flows`), or the
    /// configured count; the tiers are its [`tiers`].
    pub fn tcp_sessions(&self, stack: TcpStack) -> [usize; 3] {
        let n = self
            .tcp_sessions_override
            .unwrap_or_else(|| (self.memory.tcp / self.session_cost(stack)).min(self.tcp_flows));
        tiers(n.max(1))
    }
}

/// TCP admission under memory pressure.
#[derive(Debug)]
pub struct Admission {
    limits: [usize; 3],
    /// The host's pressure, shared with every other memory budget.
    pressure: Arc<Pressure>,
    active: AtomicUsize,
}

/// A held admission; released on drop.
#[derive(Debug)]
pub struct Permit<'a> {
    owner: &'a Admission,
}

impl Admission {
    /// Admission with a pressure of its own.
    pub fn new(limits: [usize; 3]) -> Self {
        Self::with_pressure(limits, Arc::new(Pressure::default()))
    }

    /// Admission that follows `pressure`, shared with other budgets.
    pub fn with_pressure(limits: [usize; 3], pressure: Arc<Pressure>) -> Self {
        Self {
            limits,
            pressure,
            active: AtomicUsize::new(0),
        }
    }

    /// The host reported `level` at `now` (see [`PressureDecay`]); every
    /// budget sharing this admission's [`Pressure`] follows.
    pub fn set_pressure(&self, level: MemoryPressure, now: Instant) {
        self.pressure.report(level, now);
    }

    /// The pressure in force at `now`: the host's last report, decayed.
    pub fn pressure(&self, now: Instant) -> MemoryPressure {
        self.pressure.level(now)
    }

    /// The limit new sessions are checked against at `now`.
    pub fn limit(&self, now: Instant) -> usize {
        self.limits[self.pressure(now) as usize]
    }

    /// Sessions currently holding a permit.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Take a permit if the limit at `now` allows one. Never blocks.
    pub fn try_acquire(&self, now: Instant) -> Option<Permit<'_>> {
        // `then`, not `then_some`: a Permit built eagerly would be dropped on
        // refusal and release a permit nobody took.
        self.try_increment(now).then(|| Permit { owner: self })
    }

    fn try_increment(&self, now: Instant) -> bool {
        let limit = self.limit(now);
        self.active
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok()
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.owner.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An owned permit for session tasks (`'static`).
#[derive(Debug)]
pub struct OwnedPermit {
    owner: std::sync::Arc<Admission>,
}

impl Admission {
    /// [`Admission::try_acquire`] for an `Arc`, yielding a `'static` permit.
    pub fn try_acquire_owned(self: &std::sync::Arc<Self>, now: Instant) -> Option<OwnedPermit> {
        self.try_increment(now).then(|| OwnedPermit {
            owner: self.clone(),
        })
    }
}

impl Drop for OwnedPermit {
    fn drop(&mut self) {
        self.owner.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The most a direct UDP flow's reply path holds while replies arrive:
/// one `recvmmsg` batch of 16 slots, each up to 2 KiB of payload behind
/// room for the headers (`udp/reply/linux.rs`; freed when the socket runs dry).
pub const UDP_REPLY_BATCH_BYTES: usize = 16 * (2048 + 128);

/// What a proxied UDP flow (or a direct one to a fake-ip domain) keeps
/// with a TUN MTU of `mtu` (`udp/proxied.rs`): its first queue buffer (one
/// MTU, the rest charged to the UDP queue budget), the encoded uplink
/// datagram kept between sends (an MTU and 2 KiB of framing), and while
/// replies arrive its receive buffer (the larger of an MTU and the 16 KiB
/// passed on, 2 KiB of framing, the headers).
pub const fn proxied_udp_flow_bytes(mtu: usize) -> usize {
    const FRAMING: usize = 2 * 1024;
    const HEADERS: usize = 128;
    let reply = if mtu > 16 * 1024 { mtu } else { 16 * 1024 };
    mtu + (mtu + FRAMING) + (reply + FRAMING + HEADERS)
}

/// The most payload bytes held for one UDP flow while its QUIC Initials
/// are read (`udp/sniff.rs`): a ClientHello spans at most 4 Initials, each
/// in a datagram of at most 1500 bytes on the links apps use; more than
/// 16 KiB is not QUIC's start.
pub const QUIC_SNIFF_HELD: usize = 16 * 1024;

/// UDP flows whose QUIC Initials are read at once. A client sends its
/// Initials back to back, so a flow is read for about the time its first
/// datagrams take to arrive; 16 covers a page load opening QUIC
/// connections to many hosts at once.
pub const QUIC_SNIFF_READING: usize = 16;

/// What QUIC sniffing holds at most: per flow read, its sniffer (its
/// CRYPTO stream and one packet's plaintext, `sniff::MAX_SNIFF` each) and
/// its held datagrams. 768 KiB.
pub const QUIC_SNIFF_BYTES: usize =
    QUIC_SNIFF_READING * (2 * kerntun_proto::sniff::MAX_SNIFF + QUIC_SNIFF_HELD);

/// One slot of the TUN reader thread's ring with a TUN MTU of `mtu`: the
/// packet, the headroom in front of it and the same 64 bytes of slack as
/// the in-task reader's buffer (`driver/read_ring.rs`).
pub const fn read_ring_slot_bytes(mtu: usize) -> usize {
    let mtu = if mtu > 1500 { mtu } else { 1500 };
    kerntun_proto::packet::HEADROOM + mtu + 64
}

/// A buffer of the per-packet driver's write-back that may hold a merged
/// segment: the headroom and the largest IP packet (`driver/writeback.rs`).
pub const WRITE_BACK_MERGE_BUFFER: usize = kerntun_proto::packet::HEADROOM + 65_535;

/// The per-packet driver's merge slots and its buffer for a refused merge's
/// segments: 4 + 1 (`driver/writeback.rs`, `MERGE_FLOWS` and `scratch`).
pub const WRITE_BACK_MERGE_BUFFERS: usize = 5;

/// The pure ACKs the per-packet driver holds in place until its drain ends,
/// all slots together (`driver/writeback.rs`, `ACK_FLOWS` x `HeldAck`).
pub const WRITE_BACK_HELD_ACKS: usize = 16 * 192;

/// The demux's parked ACKs, all together (`demux.rs`, `PARKED_MAX` x
/// `ParkedAck`): one per flow direction whose window waits for a grant,
/// allocated with the demux.
pub const PARKED_ACKS_BYTES: usize = 1024 * 160;

/// The most the per-packet driver's write-back and the demux's parked ACKs
/// hold on `platform`: merges only on Linux and Android (the only ones
/// whose TUN takes a packet above its MTU); held and parked ACKs on every
/// platform. `driver/writeback.rs` and `demux.rs` hold the figures to
/// their code at compile time.
pub const fn write_back_bytes(platform: Platform) -> usize {
    let merges = match platform {
        Platform::Ios => 0,
        Platform::Android | Platform::Desktop => WRITE_BACK_MERGE_BUFFERS * WRITE_BACK_MERGE_BUFFER,
    };
    merges + WRITE_BACK_HELD_ACKS + PARKED_ACKS_BYTES
}

/// The IP reassembler's bound on incomplete datagrams, all sources
/// together (`packet::frag::Limits::default`, one reassembler per engine).
pub const REASSEMBLY_BYTES: usize = 1 << 20;

/// Darwin's reply buffer of a direct UDP flow: the largest reply passed on
/// (16 KiB, sent as fragments) behind room for the headers.
pub const UDP_REPLY_BUFFER_DARWIN: usize = 16 * 1024 + 128;

/// A runtime thread's spill area for replies longer than a batch slot
/// (16 slots of up to any UDP datagram, 65,527 bytes), touched only where
/// such replies came (`udp/reply/linux.rs`).
pub const UDP_REPLY_SPILL_BYTES: usize = 16 * (65_535 - 8);

/// Descriptors the engine holds apart from its sessions, UDP flows and
/// splice pipes: the device, the listeners, the runtime's epoll and wakers,
/// DNS upstreams, with room to spare.
pub const DESCRIPTOR_RESERVE: usize = 256;

/// Splice pipes that may exist at once in this process (held by relay
/// directions moving data, or pooled), two descriptors each: counted in
/// the descriptor budget ([`SPLICE_PIPE_DESCRIPTORS`]), so stalled
/// downloads cannot take the descriptors accepts, connects and DNS need.
/// 256 pipes of the relay's 256 KiB are Linux's default per-user pipe
/// budget (64 MiB); past that the kernel grants pipes too small to splice
/// through anyway.
pub const MAX_PIPES: usize = 256;

/// Descriptors of the splice pipes that may exist at once (two per pipe,
/// at most [`MAX_PIPES`]); none where there is no splice(2).
#[cfg(any(target_os = "linux", target_os = "android"))]
pub const SPLICE_PIPE_DESCRIPTORS: usize = 2 * MAX_PIPES;
/// Descriptors of the splice pipes: none where there is no splice(2).
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub const SPLICE_PIPE_DESCRIPTORS: usize = 0;

impl TcpStack {
    /// Descriptors one TCP session holds: the app's side (the kernel
    /// listener's accepted socket, system stack only) and the outbound.
    pub const fn descriptors_per_session(self) -> usize {
        match self {
            TcpStack::System => 2,
            TcpStack::Smoltcp => 1,
        }
    }
}

/// Descriptors the engine needs to admit `sessions` TCP sessions of
/// `stack` beside `udp_flows` flows (one socket each).
pub const fn descriptors_needed(sessions: usize, stack: TcpStack, udp_flows: usize) -> usize {
    sessions * stack.descriptors_per_session()
        + udp_flows
        + DESCRIPTOR_RESERVE
        + SPLICE_PIPE_DESCRIPTORS
}

/// The admission limits `sessions` (normal, elevated, critical) cut to
/// what a descriptor limit of `nofile` holds, tiers kept as fractions. A
/// session past the descriptor limit would fail at accept or connect with
/// EMFILE, after its handshake; refused at admission it gets a clean RST.
pub fn fit_descriptors(
    sessions: [usize; 3],
    stack: TcpStack,
    udp_flows: usize,
    nofile: usize,
) -> [usize; 3] {
    let room = nofile.saturating_sub(udp_flows + DESCRIPTOR_RESERVE + SPLICE_PIPE_DESCRIPTORS);
    let fit = room / stack.descriptors_per_session();
    if fit >= sessions[0] {
        sessions
    } else {
        tiers(fit.max(1))
    }
}

/// What each pressure tier leaves of a budget: all of it at normal, half
/// when elevated, a quarter when critical (never below one unit).
pub const fn tiers(normal: usize) -> [usize; 3] {
    let half = if normal / 2 > 0 { normal / 2 } else { 1 };
    let quarter = if normal / 4 > 0 { normal / 4 } else { 1 };
    [normal, half, quarter]
}

/// A memory budget in bytes that shrinks with the pressure tier: holders
/// charge what they hold and give it back when done. Like admission, a
/// lower limit refuses new charges while existing ones stay until released.
/// One atomic counter; charging never blocks.
#[derive(Debug)]
pub struct ByteBudget {
    limits: [usize; 3],
    pressure: Arc<Pressure>,
    used: AtomicUsize,
}

impl ByteBudget {
    /// `normal` bytes at normal pressure, the tiers of [`tiers`] above it.
    pub fn new(normal: usize, pressure: Arc<Pressure>) -> Self {
        ByteBudget {
            limits: tiers(normal),
            pressure,
            used: AtomicUsize::new(0),
        }
    }

    /// The bytes allowed at `now`.
    pub fn limit(&self, now: Instant) -> usize {
        self.limits[self.pressure.level(now) as usize]
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Charge `n` bytes if the limit at `now` has room for them.
    pub fn take(&self, n: usize, now: Instant) -> bool {
        let limit = self.limit(now);
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |u| {
                (u + n <= limit).then_some(u + n)
            })
            .is_ok()
    }

    /// Give back `n` bytes taken earlier.
    pub fn give_back(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }

    /// [`ByteBudget::take`] as a charge given back on drop.
    pub fn try_charge(self: &Arc<Self>, n: usize, now: Instant) -> Option<Charge> {
        self.take(n, now).then(|| Charge {
            owner: self.clone(),
            n,
        })
    }
}

/// Bytes charged to a [`ByteBudget`]; given back on drop.
#[derive(Debug)]
pub struct Charge {
    owner: Arc<ByteBudget>,
    n: usize,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.owner.give_back(self.n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn ios_admission_follows_pressure_and_keeps_existing_permits() {
        let t = Instant::now();
        // The tiers of a 64-session budget.
        let a = Arc::new(Admission::new(tiers(64)));
        let held: Vec<_> = (0..40)
            .map(|_| a.try_acquire_owned(t).expect("permit"))
            .collect();
        a.set_pressure(MemoryPressure::Elevated, t);
        assert_eq!(a.limit(t), 32);
        assert!(
            a.try_acquire(t).is_none(),
            "40 held > 32: new sessions refused"
        );
        assert_eq!(a.active(), 40, "existing sessions keep their permits");
        drop(held);
        assert_eq!(a.active(), 0);
        let held: Vec<_> = (0..32)
            .map(|_| a.try_acquire_owned(t).expect("permit"))
            .collect();
        assert!(a.try_acquire(t).is_none());
        a.set_pressure(MemoryPressure::Critical, t);
        assert_eq!(a.limit(t), 16);
        a.set_pressure(MemoryPressure::Normal, t);
        assert_eq!(a.limit(t), 64);
        assert!(a.try_acquire(t).is_some());
        drop(held);
    }

    /// A critical warning and then silence: elevated after one step, normal
    /// after two, and admission follows. A new warning restarts the clock;
    /// the host's own "normal" takes effect at once.
    #[test]
    fn host_pressure_decays_after_quiet_minutes() {
        let t0 = Instant::now();
        let step = PRESSURE_DECAY_STEP;
        let a = Admission::new(tiers(64));
        assert_eq!(a.pressure(t0), MemoryPressure::Normal, "never reported");
        a.set_pressure(MemoryPressure::Critical, t0);
        let held: Vec<_> = (0..16)
            .map(|_| a.try_acquire(t0).expect("permit"))
            .collect();
        assert!(a.try_acquire(t0 + step / 2).is_none(), "critical: 16");
        let just_before = t0 + step - Duration::from_millis(1);
        assert_eq!(a.pressure(just_before), MemoryPressure::Critical);
        assert_eq!(a.pressure(t0 + step), MemoryPressure::Elevated);
        assert_eq!(a.limit(t0 + step), 32);
        assert!(a.try_acquire(t0 + step).is_some(), "room again at elevated");
        assert_eq!(a.pressure(t0 + 2 * step), MemoryPressure::Normal);
        assert_eq!(a.pressure(t0 + 100 * step), MemoryPressure::Normal);
        assert_eq!(a.limit(t0 + 2 * step), 64);
        // A new warning while decaying restarts the clock from its level.
        let t1 = t0 + step + step / 2;
        a.set_pressure(MemoryPressure::Critical, t1);
        assert_eq!(a.pressure(t0 + 2 * step), MemoryPressure::Critical);
        assert_eq!(a.pressure(t1 + step), MemoryPressure::Elevated);
        // An elevated report decays straight to normal after one step.
        a.set_pressure(MemoryPressure::Elevated, t1);
        assert_eq!(a.pressure(t1 + step), MemoryPressure::Normal);
        // The host's own all-clear is immediate.
        a.set_pressure(MemoryPressure::Critical, t1);
        a.set_pressure(MemoryPressure::Normal, t1 + Duration::from_secs(1));
        assert_eq!(
            a.pressure(t1 + Duration::from_secs(1)),
            MemoryPressure::Normal
        );
        // A clock read before the report (another thread's older `now`)
        // sees the report undecayed.
        assert_eq!(
            {
                let mut d = PressureDecay::new();
                d.report(MemoryPressure::Critical, t1);
                d.level(t0)
            },
            MemoryPressure::Critical
        );
        drop(held);
    }

    #[test]
    fn overrides_apply() {
        let cfg = BudgetConfig {
            platform: Some(Platform::Android),
            tcp_sessions: Some(10),
            ..Default::default()
        };
        let b = Budget::resolve(&cfg);
        assert_eq!(b.tcp_sessions(TcpStack::System), [10, 5, 2]);
        assert_eq!(b.tcp_sessions(TcpStack::Smoltcp), [10, 5, 2]);
        assert_eq!(b.udp_flows, 512);
    }

    /// The table in docs/reliability.md ("Memory budgets"):
    /// `cargo test -p kerntun --lib budget::tests::worst_case_per_platform -- --nocapture`.
    /// The iOS total stays near half of the extension's 50 MiB, and admits
    /// at least 1000 system-stack sessions at normal pressure.
    #[test]
    fn worst_case_per_platform() {
        const MIB: f64 = 1024.0 * 1024.0;
        for p in [Platform::Ios, Platform::Android, Platform::Desktop] {
            let b = Budget::for_platform(p);
            let rows = b.worst_case(p.default_mtu());
            let total: usize = rows.iter().map(|r| r.1).sum();
            eprintln!(
                "[budget] {p:?}: sessions system {:?} ({} B each), smoltcp {:?} ({} B each, \
                 {} full rings in {:.2} MiB)",
                b.tcp_sessions(TcpStack::System),
                b.session_cost(TcpStack::System),
                b.tcp_sessions(TcpStack::Smoltcp),
                b.session_cost(TcpStack::Smoltcp),
                b.smoltcp_full_rings(),
                b.memory.smoltcp_rings as f64 / MIB,
            );
            for (what, bytes) in &rows {
                eprintln!("[budget] {p:?}: {what}: {:.2} MiB", *bytes as f64 / MIB);
            }
            eprintln!("[budget] {p:?}: total {:.2} MiB", total as f64 / MIB);
            if p == Platform::Ios {
                assert!(b.tcp_sessions(TcpStack::System)[0] >= 1000);
                assert!(total <= 29 * 1024 * 1024, "{total}");
            }
        }
        assert_eq!(
            REASSEMBLY_BYTES,
            crate::packet::frag::Limits::default().total_bytes,
            "the reassembler's bound, as the engine builds it"
        );
    }

    #[test]
    fn admission_follows_the_memory_budget_and_the_stack() {
        let ios = Budget::for_platform(Platform::Ios);
        let system = ios.tcp_sessions(TcpStack::System);
        assert_eq!(
            system[0],
            ios.memory.tcp / ios.session_cost(TcpStack::System)
        );
        assert_eq!(system, tiers(system[0]), "tiers stay fractions");
        assert_eq!((system[1], system[2]), (system[0] / 2, system[0] / 4));
        // smoltcp sessions hold their socket and two small rings, and no
        // fallback share: their relay needs none unless framed, and a
        // framed one charges as it goes. The full rings they borrow are a
        // pool of their own.
        let smol = ios.tcp_sessions(TcpStack::Smoltcp);
        assert_eq!(
            ios.session_cost(TcpStack::Smoltcp),
            SESSION_STATE + SMOLTCP_SOCKET_STATE + 2 * SMOLTCP_SMALL_RING,
        );
        assert_eq!(
            smol[0],
            ios.memory.tcp / ios.session_cost(TcpStack::Smoltcp)
        );
        // A second permit covers what a framed relay may need past the
        // pool: a direction's fallback buffers, or the framing's state
        // with a short cut frame.
        assert!(ios.session_cost(TcpStack::Smoltcp) >= 2 * RELAY_FALLBACK_BUFFER);
        assert!(ios.session_cost(TcpStack::Smoltcp) >= FRAMING_STATE + RELAY_FALLBACK_BUFFER);
        assert!(smol[0] >= 1000, "{smol:?}");
        assert_eq!(ios.smoltcp_full_rings(), 64);
        assert_eq!(
            ios.smoltcp_full_rings() * ios.smoltcp_buffer,
            ios.memory.smoltcp_rings
        );
        // Never more sessions than TCP flows.
        let desktop = Budget::for_platform(Platform::Desktop);
        assert_eq!(desktop.tcp_sessions(TcpStack::System)[0], desktop.tcp_flows);
    }

    /// Sessions past the descriptor limit are refused at admission: 2 per
    /// system-stack session, 1 per smoltcp session, beside the UDP flows
    /// and a reserve.
    #[test]
    fn admission_fits_the_descriptor_limit() {
        let ios = Budget::for_platform(Platform::Ios);
        let want = ios.tcp_sessions(TcpStack::System);
        let need = descriptors_needed(want[0], TcpStack::System, ios.udp_flows);
        assert_eq!(
            need,
            2 * want[0] + ios.udp_flows + DESCRIPTOR_RESERVE + SPLICE_PIPE_DESCRIPTORS
        );
        assert_eq!(
            fit_descriptors(want, TcpStack::System, ios.udp_flows, need),
            want
        );
        // iOS's default soft limit of 256 leaves room for none beyond the
        // reserve and the flows: one session, never zero.
        assert_eq!(
            fit_descriptors(want, TcpStack::System, ios.udp_flows, 256),
            [1, 1, 1]
        );
        let cut = fit_descriptors(want, TcpStack::System, 128, 1024);
        let reserved = DESCRIPTOR_RESERVE + SPLICE_PIPE_DESCRIPTORS;
        assert_eq!(cut, tiers((1024 - 128 - reserved) / 2));
        assert_eq!(
            fit_descriptors(want, TcpStack::Smoltcp, 128, 1024)[0],
            1024 - 128 - reserved
        );
    }

    /// A byte budget shrinks with the pressure tier: charges past the tier's
    /// limit are refused, charges already held stay until given back, and
    /// the tier decays as admission's does.
    #[test]
    fn byte_budget_follows_pressure() {
        let t0 = Instant::now();
        let pressure = Arc::new(Pressure::default());
        let b = Arc::new(ByteBudget::new(1000, pressure.clone()));
        let held = b.try_charge(600, t0).expect("room");
        assert!(b.try_charge(401, t0).is_none());
        let more = b.try_charge(400, t0).expect("exactly full");
        pressure.report(MemoryPressure::Elevated, t0);
        assert_eq!(b.limit(t0), 500);
        assert_eq!(b.used(), 1000, "held charges stay");
        assert!(b.try_charge(1, t0).is_none());
        drop(more);
        assert!(b.try_charge(1, t0).is_none(), "600 held > 500");
        drop(held);
        pressure.report(MemoryPressure::Critical, t0);
        assert_eq!(b.limit(t0), 250);
        assert!(b.try_charge(251, t0).is_none());
        assert!(!b.take(251, t0));
        assert!(b.take(250, t0));
        b.give_back(250);
        assert_eq!(b.used(), 0);
        // Decay: elevated after one quiet step, normal after two.
        assert_eq!(b.limit(t0 + PRESSURE_DECAY_STEP), 500);
        assert_eq!(b.limit(t0 + 2 * PRESSURE_DECAY_STEP), 1000);
    }
}
