//! Flows the driver does not send for itself: through a proxy (SOCKS5 UDP
//! ASSOCIATE, Shadowsocks UDP), which needs a handshake and framing before
//! a datagram can leave, and direct flows to a fake-ip address, whose
//! domain is resolved first. The driver copies each payload into one of the
//! flow's recycled buffers ([`Queue`]) and its task sends it; the task also
//! turns the replies back into IP packets.

use std::io;
use std::net::SocketAddr;
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
use crate::outbound::{Address, OutboundError, ProxyUdp, Route};
use crate::packet::HEADROOM;
use crate::stats::{EngineDrop, Stats};

/// Datagrams a proxied flow holds while its proxy is slow or still
/// handshaking. Each buffer is sized to the largest datagram it carried and
/// recycled, so a busy flow allocates at most this many; 16 x an iOS MTU of
/// 4064 bytes is 64 KiB per flow.
pub(crate) const QUEUE_DEPTH: usize = 16;

/// The driver's end of a proxied flow's queue.
#[derive(Debug)]
pub(super) struct Queue {
    pub(super) tx: mpsc::Sender<Vec<u8>>,
    /// Buffers the flow's task has sent and handed back.
    spare: mpsc::Receiver<Vec<u8>>,
    /// Buffers created so far (at most [`QUEUE_DEPTH`]).
    made: usize,
    /// Proxied-queue bytes; every buffer after the first is charged `unit`.
    budget: Arc<ByteBudget>,
    /// The most a buffer holds: the TUN's MTU (a datagram's payload is
    /// smaller, and buffers grow only to the payload they carry).
    unit: usize,
    /// Bytes charged for this flow's buffers, given back when it closes.
    charged: usize,
}

impl Queue {
    /// The driver's end, the flow task's receiver, and the task's way to
    /// hand buffers back.
    pub(super) fn new(
        budget: Arc<ByteBudget>,
        mtu: u16,
    ) -> (Queue, mpsc::Receiver<Vec<u8>>, mpsc::Sender<Vec<u8>>) {
        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        let (spare_tx, spare) = mpsc::channel(QUEUE_DEPTH);
        let q = Queue {
            tx,
            spare,
            made: 0,
            budget,
            unit: usize::from(mtu),
            charged: 0,
        };
        (q, rx, spare_tx)
    }

    /// A buffer for the next datagram: one the task handed back, else a new
    /// one while the flow has fewer than [`QUEUE_DEPTH`] (the first always,
    /// later ones while the byte budget in force at `now` has room). `None`:
    /// the queue is full.
    pub(super) fn buffer(&mut self, now: Instant) -> Option<Vec<u8>> {
        if let Ok(b) = self.spare.try_recv() {
            return Some(b);
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
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.budget.give_back(self.charged);
    }
}

/// A direct flow to a fake address: resolve its domain through the DNS
/// service (never the fake pool), connect to the real address, then relay
/// what the driver queues; replies reach the app from the fake address.
#[allow(clippy::too_many_arguments)]
pub(super) async fn resolved_flow(
    shared: Arc<UdpEnv>,
    dns: Arc<Dns>,
    domain: String,
    key: FlowKey,
    mut rx: mpsc::Receiver<Vec<u8>>,
    spare: mpsc::Sender<Vec<u8>>,
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
        state,
    );
    let up = async {
        while let Some(buf) = rx.recv().await {
            match sock.send(&buf).await {
                Ok(_) => {
                    stats.udp_packets_up.fetch_add(1, Relaxed);
                    stats.udp_bytes_up.fetch_add(buf.len() as u64, Relaxed);
                }
                Err(_) => stats.drop(EngineDrop::UdpSendError),
            }
            let _ = spare.try_send(buf);
        }
    };
    tokio::select! {
        () = down => {}
        () = up => {}
    }
}

/// A proxied flow: open the association, then send what the driver queues
/// and turn the proxy's replies into IP packets, until the flow is dropped
/// (the driver aborts the task), the queue closes, or the association ends.
#[allow(clippy::too_many_arguments)]
pub(super) async fn proxy_flow(
    shared: Arc<UdpEnv>,
    idx: usize,
    key: FlowKey,
    target: Address,
    mut rx: mpsc::Receiver<Vec<u8>>,
    spare: mpsc::Sender<Vec<u8>>,
    state: Arc<ReplyState>,
) {
    let server = key.server;
    let stats: &Stats = &shared.d.stats;
    let counters = stats.outbounds.get(idx);
    let assoc = match shared.d.outbounds.udp(idx).await {
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
                shared.d.outbounds.name(Route::Proxy(idx))
            ));
            return;
        }
    };
    let ProxyUdp {
        sock,
        control,
        mut codec,
    } = assoc;
    // A domain target is resolved by the proxy: its replies name whatever
    // address that was, so they reach the app from the address it used.
    // An IP target's replies: with endpoint-independent filtering
    // (`direct.udp_nat`) from whatever address the proxy names, else only
    // the flow's server's (as a connected socket).
    let eim = shared.nat == UdpNat::EndpointIndependent;
    let pinned = match &target {
        Address::Ip(_) if !eim => Some(canonical(server)),
        _ => None,
    };
    let (hdr, max_payload) = udp_room(shared.mtu, server);
    let max_payload = max_payload.max(PROXIED_REPLY_MAX);
    const MAX_DATAGRAM: usize = 65_535;
    // Framing around a reply's payload: at most a SIP022 header with 900
    // bytes of padding, session ids, a domain address (up to 259 bytes) and
    // the AEAD tag, under 2 KiB.
    const MAX_FRAMING: usize = 2 * 1024;
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
    loop {
        tokio::select! {
            d = rx.recv() => {
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
                // Hand the buffer back for the next datagram (the driver
                // allocates only while fewer than QUEUE_DEPTH exist).
                let _ = spare.try_send(buf);
                if wire.capacity() > MAX_DATAGRAM * 2 {
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
                    Ok(n) if n == recv_room => {
                        state.mark();
                        stats.drop(EngineDrop::UdpProxyReply);
                    }
                    Ok(n) => {
                        let (from, range) = match codec.decode(&mut b[start..start + n]) {
                            Ok(v) => v,
                            Err(e) => {
                                if e.is_protocol() && let Some(c) = counters {
                                    c.protocol_errors.fetch_add(1, Relaxed);
                                }
                                stats.drop(EngineDrop::UdpProxyReply);
                                continue;
                            }
                        };
                        // Like a connected socket: only the flow's server answers.
                        if let Some(p) = pinned
                            && from.canonical_ip().is_some_and(|a| a != p)
                        {
                            stats.drop(EngineDrop::UdpProxyReply);
                            continue;
                        }
                        // From another peer: written from it, if it is
                        // of the app's family.
                        let reply_key = match (&target, from.canonical_ip()) {
                            (Address::Ip(_), Some(a)) if eim && a != canonical(server) => {
                                if a.is_ipv6() != server.is_ipv6() {
                                    stats.drop(EngineDrop::UdpProxyReply);
                                    continue;
                                }
                                FlowKey::new(key.client, a)
                            }
                            _ => key,
                        };
                        state.mark();
                        let len = range.len();
                        if len > max_payload {
                            stats.drop(EngineDrop::UdpReplyTooBig);
                            continue;
                        }
                        b.copy_within(start + range.start..start + range.end, start);
                        send_reply(&shared, b, reply_key, len, state.mtu()).await;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => rbuf = None,
                    Err(e) if recv_error_is_transient(&e) => {}
                    Err(_) => return,
                }
            }
            _ = &mut control_closed => return,
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
        for (q, _, _) in &mut flows {
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
        let (q, _, spare) = &mut flows[1];
        spare.try_send(Vec::with_capacity(unit)).expect("room");
        assert!(q.buffer(now).is_some());
        assert!(q.buffer(now).is_none());
        // Critical pressure: a quarter of the budget for new buffers.
        pressure.report(MemoryPressure::Critical, now);
        drop(flows.remove(0));
        assert_eq!(budget.used(), 0, "a closed flow gives its bytes back");
        let (q, _, _) = &mut flows[0];
        let mut n = 0;
        while q.buffer(now).is_some() {
            n += 1;
        }
        assert_eq!(n, 10 * unit / 4 / unit, "a quarter of the budget");
        assert!(budget.used() <= 10 * unit / 4);
    }
}
