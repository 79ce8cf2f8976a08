//! What the engine counts when it drops a packet or refuses a flow: one name
//! per cause, shared by the pure layers that decide it (the system stack's
//! translation, reassembly) and the engine's statistics, which count it.

/// Drops decided by the engine (parse rejections are counted by [`Reject`](crate::packet::Reject)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum EngineDrop {
    /// A downlink packet whose NAT port has no mapping (never forwarded with a wrong tuple).
    NoMapping,
    /// A non-SYN uplink segment for a flow the table does not know.
    StrayTcp,
    /// The system stack's NAT table is at `budget.tcp_flows` entries.
    NatTableFull,
    /// No free NAT port within the probe bound.
    NatNoFreePort,
    /// A SYN retransmit while the outbound connect is still in progress.
    SynWhileConnecting,
    /// ICMP other than an echo request to the gateway.
    IcmpUnhandled,
    /// A packet of an address family the engine has no address for.
    FamilyDisabled,
    /// UDP datagram dropped because the flow's socket buffer was full.
    UdpSendFull,
    /// UDP datagram that could not be sent (socket error).
    UdpSendError,
    /// UDP datagram refused by the rules.
    UdpRejected,
    /// UDP flow could not be opened (socket/protect/bind failure).
    UdpOpenFailed,
    /// A batched read that failed as a whole (e.g. too many GSO segments).
    TunReadBatch,
    /// A packet the TUN refused to take.
    TunWrite,
    /// A proxied UDP flow's bounded queue was full, or the UDP queue byte
    /// budget had no room for another buffer (proxy slow or still
    /// handshaking); or a datagram held while its flow's QUIC Initials were
    /// read, for a flow forgotten to make room (`core/src/udp/sniff.rs`).
    UdpQueueFull,
    /// A datagram from a proxy that did not decode (bad header, tag,
    /// fragment, or a source other than the flow's server), or too long for
    /// one TUN packet.
    UdpProxyReply,
    /// A hijacked DNS query, or an upstream exchange for one, found the DNS
    /// in-flight byte budget spent.
    DnsQueueFull,
    /// A hijacked DNS query longer than the service takes
    /// (`dnswire::msg::MAX_QUERY`): dropped over UDP; over TCP the
    /// connection is closed once the length prefix announces it, unread.
    DnsQueryTooLong,
    /// A flow to a fake-ip address that stands for no domain (never handed
    /// out, or its domain was evicted): TCP gets an RST, UDP is dropped.
    FakeIpUnknown,
    /// A connection between its SYN and the end of its handshake (connect
    /// in flight, or SYN handed over and never completed) evicted, oldest
    /// first, to make room for a newer one: a SYN flood recycles its own
    /// half-open connections instead of locking out the next one.
    HalfOpenEvicted,
    /// A connection whose app never completed the handshake within the
    /// handshake timeout: its outbound is closed.
    HandshakeTimeout,
    /// A reply datagram larger than the engine fragments
    /// (`udp::FRAGMENTED_REPLY_MAX`): dropped, never passed on truncated.
    UdpReplyTooBig,
    /// An IP fragment overlapping one already held: its datagram is
    /// discarded (`packet::frag`).
    FragOverlap,
    /// An exact or contained copy of a fragment already held.
    FragDuplicate,
    /// A malformed fragment: not a multiple of 8 bytes before the last,
    /// past 65535 bytes, a first fragment without the UDP header, lengths
    /// that disagree, not UDP.
    FragMalformed,
    /// A datagram in reassembly discarded for the memory bounds (its own
    /// size, or evicted for a newer one).
    FragNoRoom,
    /// A datagram that did not complete within the reassembly timeout.
    FragTimeout,
    /// The smoltcp stack's sockets (open or closing) and connects in flight
    /// are at `budget.tcp_flows`: a new flow's SYN is answered with an RST.
    SmoltcpSocketsFull,
    /// A hijacked DNS query's task panicked (the query is dropped; the
    /// engine keeps running).
    DnsTaskPanic,
    /// A TCP connection to port 853 (DNS over TLS) of a hijacked address,
    /// answered with an RST so the platform's resolver (Android's Private
    /// DNS in its automatic mode) asks port 53, which kerntun answers
    /// (`dns.reset_dot`).
    DnsTlsReset,
    /// A proxied TCP session ended (both sides reset) because its outbound
    /// cut a frame longer than the relay's fallback buffer (a Shadowsocks
    /// chunk of up to 64 KiB) and the relay pool had no room to hold it
    /// until the rest arrives.
    RelayFrameRefused,
    /// A datagram a `reject` rule refused (counted `udp_rejected` too) was
    /// not answered with an ICMP port unreachable: the answers' rate limit
    /// held it back (`core/src/udp/reject.rs`).
    IcmpRateLimited,
    /// A UDP datagram the rules sent to a proxy outbound configured with
    /// `udp = false`: refused (answered with an ICMP port unreachable like
    /// a `reject` rule's), never sent direct instead.
    UdpOutboundRefused,
    /// A pure ACK whose window was held for want of a window grant could
    /// not be kept to be written again when one comes free: the demux
    /// already keeps a copy for as many flow directions as it holds
    /// (`core/src/demux.rs`, `PARKED_MAX`). The ACK itself was written; its
    /// sender asks for the window again with its persist timer.
    ParkedAckNotKept,
}

impl EngineDrop {
    /// The counter of a reassembly discard.
    pub fn of_frag(d: crate::packet::frag::FragDrop) -> Self {
        use crate::packet::frag::FragDrop;
        match d {
            FragDrop::Overlap => EngineDrop::FragOverlap,
            FragDrop::Duplicate => EngineDrop::FragDuplicate,
            FragDrop::Malformed => EngineDrop::FragMalformed,
            FragDrop::NoRoom => EngineDrop::FragNoRoom,
            FragDrop::Timeout => EngineDrop::FragTimeout,
        }
    }

    pub const COUNT: usize = 33;
    pub const ALL: [EngineDrop; Self::COUNT] = [
        EngineDrop::NoMapping,
        EngineDrop::StrayTcp,
        EngineDrop::NatTableFull,
        EngineDrop::NatNoFreePort,
        EngineDrop::SynWhileConnecting,
        EngineDrop::IcmpUnhandled,
        EngineDrop::FamilyDisabled,
        EngineDrop::UdpSendFull,
        EngineDrop::UdpSendError,
        EngineDrop::UdpRejected,
        EngineDrop::UdpOpenFailed,
        EngineDrop::TunReadBatch,
        EngineDrop::TunWrite,
        EngineDrop::UdpQueueFull,
        EngineDrop::UdpProxyReply,
        EngineDrop::DnsQueueFull,
        EngineDrop::DnsQueryTooLong,
        EngineDrop::FakeIpUnknown,
        EngineDrop::HalfOpenEvicted,
        EngineDrop::HandshakeTimeout,
        EngineDrop::UdpReplyTooBig,
        EngineDrop::FragOverlap,
        EngineDrop::FragDuplicate,
        EngineDrop::FragMalformed,
        EngineDrop::FragNoRoom,
        EngineDrop::FragTimeout,
        EngineDrop::SmoltcpSocketsFull,
        EngineDrop::DnsTaskPanic,
        EngineDrop::DnsTlsReset,
        EngineDrop::RelayFrameRefused,
        EngineDrop::IcmpRateLimited,
        EngineDrop::UdpOutboundRefused,
        EngineDrop::ParkedAckNotKept,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EngineDrop::NoMapping => "no_mapping",
            EngineDrop::StrayTcp => "stray_tcp",
            EngineDrop::NatTableFull => "nat_table_full",
            EngineDrop::NatNoFreePort => "nat_no_free_port",
            EngineDrop::SynWhileConnecting => "syn_while_connecting",
            EngineDrop::IcmpUnhandled => "icmp_unhandled",
            EngineDrop::FamilyDisabled => "family_disabled",
            EngineDrop::UdpSendFull => "udp_send_full",
            EngineDrop::UdpSendError => "udp_send_error",
            EngineDrop::UdpRejected => "udp_rejected",
            EngineDrop::UdpOpenFailed => "udp_open_failed",
            EngineDrop::TunReadBatch => "tun_read_batch",
            EngineDrop::TunWrite => "tun_write",
            EngineDrop::UdpQueueFull => "udp_queue_full",
            EngineDrop::UdpProxyReply => "udp_proxy_reply",
            EngineDrop::DnsQueueFull => "dns_queue_full",
            EngineDrop::DnsQueryTooLong => "dns_query_too_long",
            EngineDrop::FakeIpUnknown => "fake_ip_unknown",
            EngineDrop::HalfOpenEvicted => "half_open_evicted",
            EngineDrop::HandshakeTimeout => "handshake_timeout",
            EngineDrop::UdpReplyTooBig => "udp_reply_too_big",
            EngineDrop::FragOverlap => "frag_overlap",
            EngineDrop::FragDuplicate => "frag_duplicate",
            EngineDrop::FragMalformed => "frag_malformed",
            EngineDrop::FragNoRoom => "frag_no_room",
            EngineDrop::FragTimeout => "frag_timeout",
            EngineDrop::SmoltcpSocketsFull => "smoltcp_sockets_full",
            EngineDrop::DnsTaskPanic => "dns_task_panic",
            EngineDrop::DnsTlsReset => "dns_tls_reset",
            EngineDrop::RelayFrameRefused => "relay_frame_refused",
            EngineDrop::IcmpRateLimited => "icmp_rate_limited",
            EngineDrop::UdpOutboundRefused => "udp_outbound_refused",
            EngineDrop::ParkedAckNotKept => "parked_ack_not_kept",
        }
    }
}
