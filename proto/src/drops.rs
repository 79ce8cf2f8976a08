//! What the engine counts when it drops a packet or refuses a flow: one name
//! per cause, shared by the pure layers that decide it (the system stack's
//! translation, reassembly) and the engine's statistics, which count it.

named_enum! {
    /// Drops decided by the engine (parse rejections are counted by
    /// [`Reject`](crate::packet::Reject)).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum EngineDrop {
        /// A downlink packet whose NAT port has no mapping (never forwarded with a wrong tuple).
        NoMapping => "no_mapping",
        /// A non-SYN uplink segment for a flow the table does not know.
        StrayTcp => "stray_tcp",
        /// The system stack's NAT table is at `budget.tcp_flows` entries.
        NatTableFull => "nat_table_full",
        /// No free NAT port within the probe bound.
        NatNoFreePort => "nat_no_free_port",
        /// A SYN retransmit while the outbound connect is still in progress.
        SynWhileConnecting => "syn_while_connecting",
        /// ICMP other than an echo request to the gateway.
        IcmpUnhandled => "icmp_unhandled",
        /// A packet of an address family the engine has no address for.
        FamilyDisabled => "family_disabled",
        /// UDP datagram dropped because the flow's socket buffer was full.
        UdpSendFull => "udp_send_full",
        /// UDP datagram that could not be sent (socket error).
        UdpSendError => "udp_send_error",
        /// UDP datagram refused by the rules.
        UdpRejected => "udp_rejected",
        /// UDP flow could not be opened (socket/protect/bind failure).
        UdpOpenFailed => "udp_open_failed",
        /// A batched read that failed as a whole (e.g. too many GSO segments).
        TunReadBatch => "tun_read_batch",
        /// A packet the TUN refused to take.
        TunWrite => "tun_write",
        /// A proxied UDP flow's bounded queue was full, or the UDP queue byte
        /// budget had no room for another buffer (proxy slow or still
        /// handshaking); or a datagram held while its flow's QUIC Initials were
        /// read, for a flow forgotten to make room (`core/src/udp/sniff.rs`).
        UdpQueueFull => "udp_queue_full",
        /// A datagram from a proxy that did not decode (bad header, tag,
        /// fragment, or a source other than the flow's server), or too long for
        /// one TUN packet.
        UdpProxyReply => "udp_proxy_reply",
        /// A hijacked DNS query, or an upstream exchange for one, found the DNS
        /// in-flight byte budget spent.
        DnsQueueFull => "dns_queue_full",
        /// A hijacked DNS query longer than the service takes
        /// (`dnswire::msg::MAX_QUERY`): dropped over UDP; over TCP the
        /// connection is closed once the length prefix announces it, unread.
        DnsQueryTooLong => "dns_query_too_long",
        /// A flow to a fake-ip address that stands for no domain (never handed
        /// out, or its domain was evicted): TCP gets an RST, UDP is dropped.
        FakeIpUnknown => "fake_ip_unknown",
        /// A connection between its SYN and the end of its handshake (connect
        /// in flight, or SYN handed over and never completed) evicted, oldest
        /// first, to make room for a newer one: a SYN flood recycles its own
        /// half-open connections instead of locking out the next one.
        HalfOpenEvicted => "half_open_evicted",
        /// A connection whose app never completed the handshake within the
        /// handshake timeout: its outbound is closed.
        HandshakeTimeout => "handshake_timeout",
        /// A reply datagram larger than the engine fragments
        /// (`udp::FRAGMENTED_REPLY_MAX`): dropped, never passed on truncated.
        UdpReplyTooBig => "udp_reply_too_big",
        /// An IP fragment overlapping one already held: its datagram is
        /// discarded (`packet::frag`).
        FragOverlap => "frag_overlap",
        /// An exact or contained copy of a fragment already held.
        FragDuplicate => "frag_duplicate",
        /// A malformed fragment: not a multiple of 8 bytes before the last,
        /// past 65535 bytes, a first fragment without the UDP header, lengths
        /// that disagree, not UDP.
        FragMalformed => "frag_malformed",
        /// A datagram in reassembly discarded for the memory bounds (its own
        /// size, or evicted for a newer one).
        FragNoRoom => "frag_no_room",
        /// A datagram that did not complete within the reassembly timeout.
        FragTimeout => "frag_timeout",
        /// The smoltcp stack's sockets (open or closing) and connects in flight
        /// are at `budget.tcp_flows`: a new flow's SYN is answered with an RST.
        SmoltcpSocketsFull => "smoltcp_sockets_full",
        /// A hijacked DNS query's task panicked (the query is dropped; the
        /// engine keeps running).
        DnsTaskPanic => "dns_task_panic",
        /// A TCP connection to port 853 (DNS over TLS) of a hijacked address,
        /// answered with an RST so the platform's resolver (Android's Private
        /// DNS in its automatic mode) asks port 53, which kerntun answers
        /// (`dns.reset_dot`).
        DnsTlsReset => "dns_tls_reset",
        /// A proxied TCP session ended (both sides reset) because its outbound
        /// cut a frame longer than the relay's fallback buffer (a Shadowsocks
        /// chunk of up to 64 KiB) and no room to hold it until the rest
        /// arrives came free in the relay pool within the relay's wait (10 s).
        RelayFrameRefused => "relay_frame_refused",
        /// A datagram a `reject` rule refused (counted `udp_rejected` too) was
        /// not answered with an ICMP port unreachable: the answers' rate limit
        /// held it back (`core/src/udp/reject.rs`).
        IcmpRateLimited => "icmp_rate_limited",
        /// A UDP datagram the rules sent to a proxy outbound configured with
        /// `udp = false`: refused (answered with an ICMP port unreachable like
        /// a `reject` rule's), never sent direct instead.
        UdpOutboundRefused => "udp_outbound_refused",
        /// A pure ACK whose window was held for want of a window grant could
        /// not be kept to be written again when one comes free: the demux
        /// already keeps a copy for as many flow directions as it holds
        /// (`core/src/demux.rs`, `PARKED_MAX`). The ACK itself was written; its
        /// sender asks for the window again with its persist timer.
        ParkedAckNotKept => "parked_ack_not_kept",
    }
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
}
