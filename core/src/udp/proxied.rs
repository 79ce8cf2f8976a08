//! Flows the driver does not send for itself: through a proxy (SOCKS5 UDP
//! ASSOCIATE, Shadowsocks UDP), which needs a handshake and framing before
//! a datagram can leave, and direct flows to a fake-ip address, whose
//! domain is resolved first. The driver copies each payload into one of the
//! flow's recycled buffers ([`Queue`]) and its task sends it; the task also
//! turns the replies back into IP packets.

use std::io;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use tokio::sync::mpsc;

use super::reply::{PROXIED_REPLY_MAX, recv_error_is_transient, reply_loop, send_reply, udp_room};
use super::{ReplyState, UdpEnv};
use crate::budget::ByteBudget;
use crate::dns::Dns;
use crate::nat::FlowKey;
use crate::outbound::config::UdpNat;
use crate::outbound::{Address, OutboundError, Outbounds, ProxyUdp, Route, UdpCodec};
use crate::packet::HEADROOM;
use crate::stats::{EngineDrop, Stats};

/// Datagrams a proxied flow holds while its proxy is slow or still
/// handshaking. Each buffer is recycled, so a busy flow allocates at most
/// this many; a buffer keeps at most one MTU between datagrams, so 16 x an
/// iOS MTU of 4064 bytes is 64 KiB per flow.
pub(crate) const QUEUE_DEPTH: usize = 16;

/// The driver's end of a proxied flow's queue.
#[derive(Debug)]
pub(super) struct Queue {
    pub(super) tx: mpsc::Sender<Vec<u8>>,
    /// Buffers the flow's task has sent and handed back.
    spare: mpsc::Receiver<Vec<u8>>,
    /// Buffers created so far (at most [`QUEUE_DEPTH`]).
    made: usize,
    /// Proxied-queue bytes; every buffer after the first is charged `unit`,
    /// and a buffer longer than `unit` its excess too while it is that long.
    budget: Arc<ByteBudget>,
    /// What a buffer is charged for: the TUN's MTU. A datagram the app
    /// sent as fragments is longer (up to 65,507 bytes); the buffer that
    /// carries it is charged its whole capacity and shrunk before its next
    /// datagram ([`Queue::load`]).
    unit: usize,
    /// Bytes charged for this flow's buffers, given back when it closes.
    charged: usize,
    /// A buffer the channel refused, kept for the next datagram.
    kept: Option<Vec<u8>>,
}

/// The flow task's end of its queue: the datagrams the driver loaded, and
/// the way back for each buffer once it is sent.
#[derive(Debug)]
pub(super) struct Inbox {
    rx: mpsc::Receiver<Vec<u8>>,
    spare: mpsc::Sender<Vec<u8>>,
}

impl Inbox {
    /// The next datagram; `None` once the driver closed the flow.
    async fn next(&mut self) -> Option<Vec<u8>> {
        self.rx.recv().await
    }

    /// Hand `buf` back for the driver's next datagram (the driver
    /// allocates only while fewer than [`QUEUE_DEPTH`] exist).
    fn give_back(&self, buf: Vec<u8>) {
        let _ = self.spare.try_send(buf);
    }
}

impl Queue {
    /// The driver's end and the flow task's.
    pub(super) fn new(budget: Arc<ByteBudget>, mtu: u16) -> (Queue, Inbox) {
        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        let (spare_tx, spare) = mpsc::channel(QUEUE_DEPTH);
        let q = Queue {
            tx,
            spare,
            made: 0,
            budget,
            unit: usize::from(mtu),
            charged: 0,
            kept: None,
        };
        (
            q,
            Inbox {
                rx,
                spare: spare_tx,
            },
        )
    }

    /// `payload` copied into a buffer for the flow's task, charged at the
    /// buffer's capacity. `None`: the queue is full, or the budget refused
    /// the buffer or the excess of a payload longer than `unit` (the caller
    /// counts the drop).
    pub(super) fn load(&mut self, payload: &[u8], now: Instant) -> Option<Vec<u8>> {
        // Charged before a byte is allocated: what the buffer will hold
        // beyond `unit` (recycled buffers are at most `unit` long).
        let excess = payload.len().saturating_sub(self.unit);
        if excess > 0 && !self.budget.take(excess, now) {
            return None;
        }
        let Some(mut buf) = self.buffer(now) else {
            self.budget.give_back(excess);
            return None;
        };
        self.charged += excess;
        buf.clear();
        // A buffer grows only to the payload it carries: `with_capacity`
        // allocates exactly that much (what `excess` charged beyond `unit`).
        if buf.capacity() < payload.len() {
            buf = Vec::with_capacity(payload.len());
        }
        buf.extend_from_slice(payload);
        Some(buf)
    }

    /// Keep `buf`, which the channel refused, for the next datagram.
    pub(super) fn keep(&mut self, buf: Vec<u8>) {
        self.recycle(buf);
    }

    /// A buffer for the next datagram, at most `unit` long: one the task
    /// handed back (shrunk), else a new one while the flow has fewer than
    /// [`QUEUE_DEPTH`] (the first always, later ones while the byte budget
    /// in force at `now` has room). `None`: the queue is full.
    fn buffer(&mut self, now: Instant) -> Option<Vec<u8>> {
        if let Some(b) = self.kept.take() {
            return Some(b);
        }
        if let Ok(b) = self.spare.try_recv() {
            self.recycle(b);
            return self.kept.take();
        }
        if self.made >= QUEUE_DEPTH {
            return None;
        }
        if self.made > 0 {
            if !self.budget.take(self.unit, now) {
                return None;
            }
            self.charged += self.unit;
        }
        self.made += 1;
        Some(Vec::new())
    }

    /// Keep `b` for the next datagram, its excess over `unit` freed and
    /// given back: a buffer that carried one 64 KiB datagram holds no more
    /// than an MTU while it waits.
    fn recycle(&mut self, b: Vec<u8>) {
        let excess = b.capacity().saturating_sub(self.unit);
        let b = if excess > 0 {
            self.budget.give_back(excess);
            self.charged -= excess;
            Vec::new()
        } else {
            b
        };
        self.kept = Some(b);
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.budget.give_back(self.charged);
    }
}

/// A direct flow to a fake address: resolve its domain through the DNS
/// service (never the fake pool), connect to the real address, then relay
/// what the driver queues; replies reach the app from the fake address.
pub(super) async fn resolved_flow(
    shared: Arc<UdpEnv>,
    dns: Arc<Dns>,
    domain: String,
    key: FlowKey,
    mut inbox: Inbox,
    state: Arc<ReplyState>,
) {
    let server = key.server;
    let stats: &Stats = &shared.d.stats;
    let ip = match dns.resolve(&domain, server.is_ipv6(), stats).await {
        Ok(ip) => ip,
        Err(e) => {
            shared
                .d
                .warn
                .warn(format_args!("udp flow to {domain} ({server}): {e}"));
            return;
        }
    };
    let real = SocketAddr::new(ip, server.port());
    let sock = match shared.factory.udp_connected(real) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            stats.drop(EngineDrop::UdpOpenFailed);
            shared
                .d
                .warn
                .warn(format_args!("udp flow to {domain} ({real}): {e}"));
            return;
        }
    };
    let down = reply_loop(
        sock.clone(),
        shared.clone(),
        key.client,
        Some(key.server),
        state.clone(),
    );
    let up = async {
        while let Some(buf) = inbox.next().await {
            match sock.send(&buf).await {
                Ok(_) => {
                    stats.udp_packets_up.fetch_add(1, Relaxed);
                    stats.udp_bytes_up.fetch_add(buf.len() as u64, Relaxed);
                }
                Err(_) => stats.drop(EngineDrop::UdpSendError),
            }
            inbox.give_back(buf);
        }
    };
    tokio::select! {
        () = down => {}
        () = up => {}
        () = shared.d.life.network().stranded(&*sock) => stranded(&shared, &state),
    }
}

/// A network change stranded the socket of a flow's task
/// ([`crate::network::NetworkWatch::stranded`]): counted, and the flow
/// marked so the driver closes it at its next datagram, which then opens
/// a flow on the new network.
fn stranded(shared: &UdpEnv, state: &ReplyState) {
    state.strand();
    shared
        .d
        .stats
        .udp_flows_dropped_on_network_change
        .fetch_add(1, Relaxed);
}

/// A proxied flow: open the association, then send what the driver queues
/// and turn the proxy's replies into IP packets, until the flow is dropped
/// (the driver aborts the task), the queue closes, the association ends,
/// or a network change strands its socket or its control connection.
pub(super) async fn proxy_flow(
    shared: Arc<UdpEnv>,
    outbounds: Arc<Outbounds>,
    idx: usize,
    key: FlowKey,
    target: Address,
    mut inbox: Inbox,
    state: Arc<ReplyState>,
) {
    let server = key.server;
    let stats: &Stats = &shared.d.stats;
    // The flow's own generation of the outbounds: `idx` indexes it.
    let counters = outbounds.counters_of(idx);
    let assoc = match outbounds.udp(idx).await {
        Ok(a) => {
            if let Some(c) = counters {
                c.udp_flows.fetch_add(1, Relaxed);
            }
            a
        }
        Err(e) => {
            if let Some(c) = counters {
                if e.is_protocol() {
                    c.protocol_errors.fetch_add(1, Relaxed);
                } else if matches!(e, OutboundError::Resolve { .. }) {
                    c.resolve_failures.fetch_add(1, Relaxed);
                } else {
                    c.udp_failures.fetch_add(1, Relaxed);
                }
            }
            shared.d.warn.warn(format_args!(
                "udp flow to {server} via {}: {e}",
                outbounds.name(Route::Proxy(idx))
            ));
            return;
        }
    };
    let ProxyUdp {
        sock,
        control,
        mut codec,
    } = assoc;
    let filter = ReplyFilter::new(key, &target, shared.nat);
    let (hdr, max_payload) = udp_room(shared.mtu, server);
    let max_payload = max_payload.max(PROXIED_REPLY_MAX);
    // Framing around a datagram's payload: at most a SIP022 header with 900
    // bytes of padding, session ids, a domain address (up to 259 bytes) and
    // the AEAD tag, under 2 KiB.
    const MAX_FRAMING: usize = 2 * 1024;
    // What the encoded uplink datagram keeps between sends: one MTU's
    // payload with its framing. A longer (reassembled) datagram's encoding
    // is freed once it is sent.
    let wire_keep = usize::from(shared.mtu) + MAX_FRAMING;
    // Every reply whose payload fits one TUN packet fits here with its
    // framing; a datagram that fills the room was longer, and its payload
    // could not be delivered anyway. So a flow holds about one MTU while
    // replies arrive, not 64 KiB.
    let recv_room = max_payload + MAX_FRAMING + 1;
    let mut wire: Vec<u8> = Vec::new();
    let mut rbuf: Option<Box<[u8]>> = None;
    let control_closed = async {
        let Some(c) = &control else {
            return std::future::pending::<()>().await;
        };
        let mut b = [0u8; 64];
        loop {
            if c.readable().await.is_err() {
                return;
            }
            match c.try_read(&mut b) {
                Ok(0) => return,
                Ok(_) => {} // nothing is expected on it; ignore
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
    };
    tokio::pin!(control_closed);
    // The host moved to a network without the association's socket or its
    // control connection: the proxy will never hear from it again.
    let network = shared.d.life.network();
    let lost = async {
        match &control {
            Some(c) => tokio::select! {
                () = network.stranded(&sock) => {}
                () = network.stranded(c) => {}
            },
            None => network.stranded(&sock).await,
        }
    };
    tokio::pin!(lost);
    let mut tally = super::listed::TallyCache::default();
    loop {
        tokio::select! {
            d = inbox.next() => {
                let Some(buf) = d else { return };
                match codec.encode(&target, &buf, &mut wire) {
                    Ok(()) => match sock.send(&wire).await {
                        Ok(_) => {
                            stats.udp_packets_up.fetch_add(1, Relaxed);
                            stats.udp_bytes_up.fetch_add(buf.len() as u64, Relaxed);
                        }
                        Err(_) => stats.drop(EngineDrop::UdpSendError),
                    },
                    Err(_) => stats.drop(EngineDrop::UdpSendError),
                }
                inbox.give_back(buf);
                if wire.capacity() > wire_keep {
                    wire = Vec::new();
                }
            }
            r = sock.readable() => {
                if r.is_err() {
                    return;
                }
                let b = rbuf.get_or_insert_with(|| vec![0u8; HEADROOM + hdr + recv_room].into_boxed_slice());
                let start = HEADROOM + hdr;
                match sock.try_recv(&mut b[start..]) {
                    Ok(n) => {
                        let wire = &mut b[start..start + n];
                        let (reply_key, range) = match filter.screen(&mut codec, wire, n == recv_room, &state) {
                            Ok(v) => v,
                            Err(refused) => {
                                if refused == Refused::Protocol && let Some(c) = counters {
                                    c.protocol_errors.fetch_add(1, Relaxed);
                                }
                                stats.drop(EngineDrop::UdpProxyReply);
                                continue;
                            }
                        };
                        let len = range.len();
                        if len > max_payload {
                            stats.drop(EngineDrop::UdpReplyTooBig);
                            continue;
                        }
                        b.copy_within(start + range.start..start + range.end, start);
                        if send_reply(&shared, b, reply_key, len, state.mtu()).await {
                            tally.count(&state.tally, reply_key.server, len);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => rbuf = None,
                    Err(e) if recv_error_is_transient(&e) => {}
                    Err(_) => return,
                }
            }
            _ = &mut control_closed => return,
            () = &mut lost => return stranded(&shared, &state),
        }
    }
}

/// Why a datagram from the proxy is not a reply to its flow (each a
/// counted `udp_proxy_reply` drop that leaves the flow unreplied).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// It filled the receive room: longer than any reply passed on, and
    /// never decoded.
    TooLong,
    /// It did not decode: a protocol error of the outbound's.
    Protocol,
    /// It did not decode for another reason (an unsupported fragment).
    Undecoded,
    /// It names a source the flow does not take replies from.
    Source,
}

/// Which datagrams from the proxy a flow takes, and from whom they reach
/// the app.
#[derive(Debug)]
struct ReplyFilter {
    key: FlowKey,
    /// Replies only from this address (the flow's server, canonical), as a
    /// connected socket: an IP target without endpoint-independent
    /// filtering.
    pinned: Option<SocketAddr>,
    /// An IP target with endpoint-independent filtering (`direct.udp_nat`):
    /// a reply from another address of the app's family reaches the app
    /// from that address.
    any_peer: bool,
}

impl ReplyFilter {
    /// A domain target is resolved by the proxy: its replies name whatever
    /// address that was, so they reach the app from the address it used.
    fn new(key: FlowKey, target: &Address, nat: UdpNat) -> Self {
        let ip = matches!(target, Address::Ip(_));
        let eim = nat == UdpNat::EndpointIndependent;
        ReplyFilter {
            key,
            pinned: (ip && !eim).then(|| canonical(key.server)),
            any_peer: ip && eim,
        }
    }

    /// Decode one datagram from the proxy (`filled`: it filled the receive
    /// room) in place: the key its reply goes out under and its payload's
    /// range in `wire`, the flow marked as replied; or why it is dropped,
    /// the flow left as it was.
    fn screen(
        &self,
        codec: &mut UdpCodec,
        wire: &mut [u8],
        filled: bool,
        state: &ReplyState,
    ) -> Result<(FlowKey, Range<usize>), Refused> {
        let r = self.check(codec, wire, filled);
        if r.is_ok() {
            state.mark();
        }
        r
    }

    fn check(
        &self,
        codec: &mut UdpCodec,
        wire: &mut [u8],
        filled: bool,
    ) -> Result<(FlowKey, Range<usize>), Refused> {
        if filled {
            return Err(Refused::TooLong);
        }
        let (from, range) = codec.decode(wire).map_err(|e| {
            if e.is_protocol() {
                Refused::Protocol
            } else {
                Refused::Undecoded
            }
        })?;
        let from = from.canonical_ip();
        // Like a connected socket: only the flow's server answers, and a
        // reply that names a domain is not from it.
        if let Some(p) = self.pinned
            && from != Some(p)
        {
            return Err(Refused::Source);
        }
        match from {
            // From another peer: written from it, if it is of the app's
            // family.
            Some(a) if self.any_peer && a != canonical(self.key.server) => {
                if a.is_ipv6() != self.key.server.is_ipv6() {
                    return Err(Refused::Source);
                }
                Ok((FlowKey::new(self.key.client, a), range))
            }
            _ => Ok((self.key, range)),
        }
    }
}

fn canonical(a: SocketAddr) -> SocketAddr {
    Address::Ip(a).canonical_ip().unwrap_or(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{MemoryPressure, Pressure};

    /// Proxied flows that never drain: each gets its first buffer, the
    /// buffers past it come out of the byte budget, and a closed flow gives
    /// its bytes back. Raised pressure shrinks what new buffers may take.
    /// (Each flow used to fill all 16 buffers, whatever the flow count.)
    #[test]
    fn proxied_queues_stay_within_their_byte_budget() {
        const MTU: u16 = 1500;
        let unit = usize::from(MTU);
        let now = Instant::now();
        let pressure = Arc::new(Pressure::default());
        let budget = Arc::new(ByteBudget::new(10 * unit, pressure.clone()));
        let mut flows: Vec<_> = (0..4).map(|_| Queue::new(budget.clone(), MTU)).collect();
        let mut made = Vec::new();
        for (q, _) in &mut flows {
            let mut n = 0;
            while let Some(b) = q.buffer(now) {
                n += 1;
                assert!(n <= QUEUE_DEPTH);
                drop(b);
            }
            made.push(n);
        }
        assert_eq!(made, [11, 1, 1, 1], "one each, ten from the budget");
        assert_eq!(budget.used(), 10 * unit);
        // A buffer the task hands back is reused without a charge.
        let (q, inbox) = &mut flows[1];
        inbox
            .spare
            .try_send(Vec::with_capacity(unit))
            .expect("room");
        assert!(q.buffer(now).is_some());
        assert!(q.buffer(now).is_none());
        // Critical pressure: a quarter of the budget for new buffers.
        pressure.report(MemoryPressure::Critical, now);
        drop(flows.remove(0));
        assert_eq!(budget.used(), 0, "a closed flow gives its bytes back");
        let (q, _) = &mut flows[0];
        let mut n = 0;
        while q.buffer(now).is_some() {
            n += 1;
        }
        assert_eq!(n, 10 * unit / 4 / unit, "a quarter of the budget");
        assert!(budget.used() <= 10 * unit / 4);
    }

    /// Datagrams the app sent as fragments (up to 65,507 bytes) on flows
    /// whose proxy never drains: every byte the buffers hold beyond one MTU
    /// per flow is charged, a buffer handed back is shrunk to an MTU and its
    /// excess given back, and a flow's close gives back the rest. (Buffers
    /// used to be charged one MTU each whatever they held: these 8 flows
    /// held 128 buffers of 64 KiB, 8 MiB, under a 256 KiB budget.)
    #[test]
    fn reassembled_datagrams_are_charged_at_their_capacity() {
        const MTU: u16 = 1500;
        let unit = usize::from(MTU);
        let big = vec![7u8; 65_507];
        let now = Instant::now();
        let pressure = Arc::new(Pressure::default());
        let limit = 256 * 1024;
        let budget = Arc::new(ByteBudget::new(limit, pressure));
        let mut flows: Vec<_> = (0..8).map(|_| Queue::new(budget.clone(), MTU)).collect();
        let mut held = Vec::new();
        for (q, _) in &mut flows {
            for _ in 0..QUEUE_DEPTH {
                held.extend(q.load(&big, now));
            }
        }
        let bytes: usize = held.iter().map(Vec::capacity).sum();
        assert!(
            bytes <= flows.len() * unit + budget.used(),
            "{bytes} bytes held, {} charged beyond one MTU a flow",
            budget.used()
        );
        assert!(budget.used() <= limit);
        assert_eq!(
            held.len(),
            limit / (big.len() - unit),
            "as many as the budget holds"
        );

        // One flow, its excess charged: the task hands the buffer back, and
        // the next datagram's buffer is an MTU at most, its excess given back.
        drop(held);
        drop(flows);
        assert_eq!(budget.used(), 0, "closed flows give their bytes back");
        let budget = Arc::new(ByteBudget::new(64 * 1024, Arc::new(Pressure::default())));
        let (mut q, inbox) = Queue::new(budget.clone(), MTU);
        let b = q.load(&big, now).expect("the excess fits");
        assert_eq!(b.capacity(), big.len());
        assert_eq!(budget.used(), big.len() - unit, "the excess over the MTU");
        assert!(q.load(&big, now).is_none(), "a second excess does not fit");
        assert_eq!(budget.used(), big.len() - unit, "a refusal charges nothing");
        inbox.spare.try_send(b).expect("room");
        let small = q.load(&[1u8; 100], now).expect("the recycled buffer");
        assert!(small.capacity() <= unit, "shrunk: {}", small.capacity());
        assert_eq!(budget.used(), 0, "its excess given back");
        // A buffer the channel refused is kept, not lost or charged twice.
        q.keep(small);
        let again = q.load(&[2u8; 1000], now).expect("the kept buffer");
        assert_eq!(again, [2u8; 1000]);
        assert_eq!(budget.used(), 0);
    }

    /// A SOCKS5 reply datagram from `from` carrying `payload`.
    fn socks5_reply(from: &Address, payload: &[u8]) -> Vec<u8> {
        let mut w = Vec::new();
        crate::outbound::socks5::encode_udp_header(from, &mut w).expect("encodes");
        w.extend_from_slice(payload);
        w
    }

    /// A flow pinned to an IP (no endpoint-independent filtering) takes
    /// replies only from that IP: one naming a domain is refused like one
    /// from another address. With endpoint-independent filtering another
    /// IP's reply reaches the app from it, and a domain's from the server.
    /// (A domain passed the pinned check before: it has no IP to differ.)
    #[test]
    fn a_pinned_flow_refuses_a_reply_naming_a_domain() {
        let key = FlowKey::new(
            "10.0.0.2:5000".parse().expect("addr"),
            "198.51.100.7:53".parse().expect("addr"),
        );
        let server = Address::Ip(key.server);
        let other = Address::Ip("198.51.100.8:53".parse().expect("addr"));
        let domain = Address::Domain("example.com".into(), 53);
        let mut codec = UdpCodec::socks5();
        let pinned = ReplyFilter::new(key, &server, UdpNat::Connected);
        let any = ReplyFilter::new(key, &server, UdpNat::EndpointIndependent);
        let state = ReplyState::new(Instant::now(), 1500);
        let mut check = |f: &ReplyFilter, from: &Address| {
            let mut w = socks5_reply(from, b"answer");
            let n = w.len();
            f.screen(&mut codec, &mut w, false, &state)
                .map(|(k, r)| (k, r == (n - 6..n)))
        };
        assert_eq!(check(&pinned, &server), Ok((key, true)));
        assert_eq!(check(&pinned, &other), Err(Refused::Source));
        assert_eq!(check(&pinned, &domain), Err(Refused::Source));
        let from_other = FlowKey::new(key.client, "198.51.100.8:53".parse().expect("addr"));
        assert_eq!(check(&any, &other), Ok((from_other, true)));
        assert_eq!(check(&any, &domain), Ok((key, true)));
        // A domain target: the proxy resolved it, every reply is the flow's.
        let to_domain = ReplyFilter::new(key, &domain, UdpNat::Connected);
        assert_eq!(check(&to_domain, &other), Ok((key, true)));
    }

    /// A datagram that filled the receive room is refused before it is
    /// decoded, and one that does not decode is refused: neither is a
    /// reply, so the flow stays unreplied (the caller marks the flow only
    /// for `Ok`; a filled room used to mark it).
    #[test]
    fn oversized_or_undecoded_datagrams_are_not_replies() {
        let key = FlowKey::new(
            "10.0.0.2:5000".parse().expect("addr"),
            "198.51.100.7:53".parse().expect("addr"),
        );
        let server = Address::Ip(key.server);
        let f = ReplyFilter::new(key, &server, UdpNat::EndpointIndependent);
        let mut codec = UdpCodec::socks5();
        let state = ReplyState::new(Instant::now(), 1500);
        let mut w = socks5_reply(&server, &[0u8; 100]);
        assert_eq!(
            f.screen(&mut codec, &mut w, true, &state),
            Err(Refused::TooLong)
        );
        assert!(!state.replied(), "a datagram that filled the room");
        let mut garbage = [5u8, 0, 0, 9, 9, 9];
        assert!(matches!(
            f.screen(&mut codec, &mut garbage, false, &state),
            Err(Refused::Protocol | Refused::Undecoded)
        ));
        let pinned = ReplyFilter::new(key, &server, UdpNat::Connected);
        let mut w2 = socks5_reply(&Address::Domain("example.com".into(), 53), b"x");
        assert_eq!(
            pinned.screen(&mut codec, &mut w2, false, &state),
            Err(Refused::Source)
        );
        assert!(!state.replied(), "undecoded or from elsewhere");
        assert!(f.screen(&mut codec, &mut w, false, &state).is_ok());
        assert!(state.replied(), "a reply marks the flow");
    }
}
