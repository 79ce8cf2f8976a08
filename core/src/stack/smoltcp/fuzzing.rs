//! An entry point for the `smol` fuzz target (not part of the API): the
//! smoltcp stack driven the way the engine drives it, from a byte program.
//!
//! The program feeds raw packets and well-formed segments of a few flows
//! (SYN-first handshakes, data, FIN, RST, odd options, stray sequence
//! numbers) through the same gate the engine applies before
//! [`Sockets::input`] (`gate.rs`: a TCP packet that parses, unicast
//! addresses; then SYNs classified by [`Sockets::syn`] and held until the
//! "outbound" connects), completes or fails connects, reads, writes, closes,
//! aborts and drops sessions, moves the clock, and may make the sink refuse
//! writes (a full TUN queue).
//!
//! Checked after every step: nothing panics; every segment smoltcp emits
//! parses, is TCP, fits the MTU and carries a valid checksum; the flow
//! table, the connecting set and smoltcp's socket set agree and stay within
//! the socket budget. At the end every session is dropped and the clock
//! moved past the linger time: the stack must be empty again (no socket
//! leaks however the connections ended).

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use ipnet::IpNet;

use super::device::Sink;
use super::gate::{Gate, gate};
use super::half_open::Syn;
use super::sockets::Sockets;
use super::stream::SmolStream;
use super::wire::segment;
use crate::nat::FlowKey;
use crate::packet::HEADROOM;
use crate::packet::{self, checksum, protocol, tcp_flags};
use crate::stats::Stats;

/// Socket budget of the fuzzed stack: small, so `Syn::Full` is reachable.
pub const MAX_SOCKETS: usize = 4;
/// Socket buffers: small, so windows fill within a short program.
const BUFFER: usize = 4096;
const MTU: u16 = 1500;
const IDLE: Duration = Duration::from_secs(60);
const LINGER: Duration = Duration::from_secs(10);
/// Steps per program: libFuzzer inputs are bounded, this bounds the time.
const MAX_STEPS: usize = 512;

/// What a run reached, so tests can tell a harness that does something from
/// one that silently drops every input.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Summary {
    pub steps: usize,
    /// Segments handed to `Sockets::input`.
    pub inputs: usize,
    /// Connections smoltcp accepted (SYN taken after the connect).
    pub accepted: usize,
    /// SYNs refused because the socket budget was spent.
    pub full: usize,
    /// Bytes the sessions read from the app.
    pub received: usize,
    /// Bytes the sessions queued toward the app.
    pub sent: usize,
    /// Segments smoltcp emitted.
    pub emitted: usize,
    /// Most sockets (open, closing, connecting) seen at once.
    pub peak_sockets: usize,
}

/// A flow the structured steps build segments for: (client, server).
fn flow(i: u8) -> FlowKey {
    let v4 = |a: [u8; 4], p: u16| SocketAddr::new(IpAddr::V4(Ipv4Addr::from(a)), p);
    let v6 = |a: Ipv6Addr, p: u16| SocketAddr::new(IpAddr::V6(a), p);
    let c6 = Ipv6Addr::new(0xfd00, 0x18, 0, 0, 0, 0, 0, 9);
    let (client, server) = match i % 6 {
        0 => (v4([10, 0, 0, 9], 40000), v4([1, 1, 1, 1], 443)),
        1 => (v4([10, 0, 0, 9], 40001), v4([1, 1, 1, 1], 443)),
        2 => (v4([10, 0, 0, 7], 40000), v4([198, 19, 1, 2], 80)),
        // To the TUN's own gateway address.
        3 => (v4([198, 18, 0, 9], 50000), v4([198, 18, 0, 1], 22)),
        4 => (
            v6(c6, 40000),
            v6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1), 443),
        ),
        _ => (
            v6(c6, 40002),
            v6(Ipv6Addr::new(0xfd00, 0x18, 0, 0, 0, 0, 0, 1), 8080),
        ),
    };
    FlowKey::new(client, server)
}

const FLOWS: u8 = 6;

/// Sequence state of a flow as the program has seen it.
#[derive(Debug, Default, Clone, Copy)]
struct Seqs {
    /// The client's next sequence number.
    client: u32,
    /// The server side's next sequence number (from smoltcp's segments).
    server: u32,
}

/// The engine's TUN write, without a TUN: checks each segment, remembers
/// the server-side sequence numbers per flow, and keeps nothing else.
struct Discard {
    refuse: bool,
    seqs: [Seqs; FLOWS as usize],
    emitted: usize,
}

impl Sink for Discard {
    fn send(&mut self, buf: &mut [u8], len: usize) -> bool {
        let pkt = &buf[HEADROOM..HEADROOM + len];
        assert!(len <= usize::from(MTU), "segment of {len} B over the MTU");
        let ip = packet::parse_ip(pkt).expect("smoltcp emits IP packets that parse");
        assert_eq!(ip.protocol, protocol::TCP, "smoltcp emits TCP only");
        assert_eq!(ip.len, len, "no trailing bytes");
        let tcp = packet::parse_tcp(pkt, &ip).expect("smoltcp emits TCP that parses");
        assert!(
            checksum::verify_transport_checksum(pkt, &ip),
            "smoltcp's checksum verifies"
        );
        self.emitted += 1;
        let from = SocketAddr::new(ip.src, tcp.src_port);
        let to = SocketAddr::new(ip.dst, tcp.dst_port);
        for i in 0..FLOWS {
            let FlowKey {
                client: c,
                server: s,
            } = flow(i);
            if (from, to) == (s, c) {
                let mut next = tcp.seq.wrapping_add(tcp.payload_len as u32);
                if tcp.flags & (tcp_flags::SYN | tcp_flags::FIN) != 0 {
                    next = next.wrapping_add(1);
                }
                self.seqs[usize::from(i)].server = next;
            }
        }
        !self.refuse
    }
}

/// The program's bytes; reads past the end are zeros.
struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Bytes<'_> {
    fn done(&self) -> bool {
        self.pos >= self.data.len()
    }

    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.u8(), self.u8()])
    }

    fn u32(&mut self) -> u32 {
        u32::from_be_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    fn take(&mut self, n: usize) -> &[u8] {
        let start = self.pos.min(self.data.len());
        let end = (self.pos + n).min(self.data.len());
        self.pos += n;
        &self.data[start..end]
    }
}

struct Run {
    st: Arc<Sockets>,
    stats: Stats,
    now: Instant,
    sink: Discard,
    /// SYNs held while their "outbound" connects: at most one per key.
    pending: Vec<(FlowKey, Vec<u8>)>,
    sessions: Vec<SmolStream>,
    summary: Summary,
}

impl Run {
    /// What the engine's smoltcp path does with a packet from the TUN
    /// (the same gate, then the same classification of a SYN), minus the
    /// routing and admission (a connect's outcome is a later step).
    fn deliver(&mut self, pkt: &[u8]) {
        let Ok(ip) = packet::parse_ip(pkt) else {
            return;
        };
        let pkt = &pkt[..ip.len];
        let key = match gate(pkt, &ip, true) {
            Gate::Reject(_) | Gate::Drop(_) => return,
            Gate::Input => None,
            Gate::Syn(key, _) => Some(key),
        };
        match key.map(|key| (key, self.st.syn(key))) {
            None | Some((_, Syn::Known)) => {
                self.summary.inputs += 1;
                self.st.input(pkt, self.now, &mut self.sink, &self.stats);
            }
            Some((key, Syn::Connecting)) => assert!(
                self.pending.iter().any(|p| p.0 == key),
                "connecting without a held SYN"
            ),
            Some((_, Syn::Full)) => self.summary.full += 1,
            Some((key, Syn::New)) => {
                assert!(
                    !self.pending.iter().any(|p| p.0 == key),
                    "new while connecting"
                );
                self.pending.push((key, pkt.to_vec()));
            }
        }
    }

    /// The outbound connect of pending SYN `i` finished.
    fn connected(&mut self, i: usize, ok: bool) -> bool {
        if self.pending.is_empty() {
            return false;
        }
        let (key, syn) = self.pending.swap_remove(i % self.pending.len());
        if !ok {
            self.st.connect_failed(&key);
            return false;
        }
        // HEADROOM in front, as the processor holds it.
        match self.st.accept(key, &syn, self.now, &mut self.sink) {
            Some(h) => {
                self.summary.accepted += 1;
                self.sessions
                    .push(SmolStream::new(self.st.clone(), h, key, None));
                true
            }
            None => false,
        }
    }

    fn seqs(&mut self, f: u8) -> &mut Seqs {
        &mut self.sink.seqs[usize::from(f % FLOWS)]
    }

    /// One well-formed segment of flow `f`, sequence numbers picked by the
    /// program relative to what each side has sent (or raw).
    fn structured(&mut self, b: &mut Bytes) {
        let f = b.u8() % FLOWS;
        let flags = b.u8();
        let mode = b.u8();
        let s = *self.seqs(f);
        let seq = match mode & 3 {
            0 | 1 => s.client,
            2 => s.client.wrapping_add(i32::from(b.u16() as i16) as u32),
            _ => b.u32(),
        };
        let ack = match (mode >> 2) & 3 {
            0 | 1 => s.server,
            2 => s.server.wrapping_add(i32::from(b.u16() as i16) as u32),
            _ => b.u32(),
        };
        let window = match (mode >> 4) & 3 {
            0 => 65535,
            1 => 0,
            _ => b.u16(),
        };
        let options: Vec<u8> = match (mode >> 6) & 3 {
            0 => Vec::new(),
            // MSS 1460, window scale 7, SACK permitted.
            1 => vec![2, 4, 5, 180, 3, 3, 7, 1, 4, 2, 1, 1],
            2 => {
                // A SACK block around what the server sent.
                let l = s.server.wrapping_sub(100).to_be_bytes();
                let r = s.server.to_be_bytes();
                vec![1, 1, 5, 10, l[0], l[1], l[2], l[3], r[0], r[1], r[2], r[3]]
            }
            _ => {
                let n = usize::from(b.u8() % 41);
                b.take(n).to_vec()
            }
        };
        let n = usize::from(b.u8()) * 8;
        let data = b.take(n).to_vec();
        let pkt = segment(flow(f), seq, ack, flags, window, &options, &data);
        if mode & 3 == 0 {
            let mut next = seq.wrapping_add(data.len() as u32);
            if flags & (tcp_flags::SYN | tcp_flags::FIN) != 0 {
                next = next.wrapping_add(1);
            }
            self.seqs(f).client = next;
        }
        self.deliver(&pkt);
    }

    /// SYN, connect, SYN-ACK, ACK: a connection established in one step.
    fn handshake(&mut self, b: &mut Bytes) {
        let f = b.u8() % FLOWS;
        let isn = b.u32();
        let key = flow(f);
        let syn = segment(key, isn, 0, tcp_flags::SYN, 65535, &[2, 4, 5, 180], &[]);
        self.seqs(f).client = isn.wrapping_add(1);
        self.deliver(&syn);
        let Some(i) = self.pending.iter().position(|p| p.0 == key) else {
            return;
        };
        if self.connected(i, true) {
            let s = *self.seqs(f);
            let ack = segment(key, s.client, s.server, tcp_flags::ACK, 65535, &[], &[]);
            self.deliver(&ack);
        }
    }

    fn session(&mut self, b: &mut Bytes) -> Option<usize> {
        let i = usize::from(b.u8());
        (!self.sessions.is_empty()).then(|| i % self.sessions.len())
    }

    /// Poll a session future once, as a session task's first poll would.
    fn once<F: Future>(fut: F) -> Poll<F::Output> {
        let mut cx = Context::from_waker(Waker::noop());
        pin!(fut).poll(&mut cx)
    }

    fn step(&mut self, b: &mut Bytes) {
        match b.u8() % 12 {
            0 => {
                let n = usize::from(b.u16() % 1600);
                let pkt = b.take(n).to_vec();
                self.deliver(&pkt);
            }
            1 | 2 => self.structured(b),
            3 => self.handshake(b),
            4 => {
                let i = usize::from(b.u8());
                let ok = b.u8() & 1 == 0;
                self.connected(i, ok);
            }
            5 => {
                if let Some(i) = self.session(b) {
                    let mut buf = [0u8; 2048];
                    if let Poll::Ready(Ok(n)) = Self::once(self.sessions[i].recv(&mut buf)) {
                        self.summary.received += n;
                    }
                }
            }
            6 => {
                if let Some(i) = self.session(b) {
                    let n = usize::from(b.u8()) * 64;
                    let data = vec![0x5a; n];
                    // A pending write is dropped, as when a session task is
                    // cancelled; what smoltcp queued stays queued.
                    let before = self.st.inner.lock().socket(self.sessions[i].h).send_queue();
                    let _ = Self::once(self.sessions[i].send_all(&data));
                    let after = self.st.inner.lock().socket(self.sessions[i].h).send_queue();
                    self.summary.sent += after.saturating_sub(before);
                }
            }
            7 => {
                if let Some(i) = self.session(b) {
                    self.sessions[i].close();
                }
            }
            8 => {
                if let Some(i) = self.session(b) {
                    self.sessions[i].abort();
                }
            }
            9 => {
                if let Some(i) = self.session(b) {
                    drop(self.sessions.swap_remove(i));
                }
            }
            10 => {
                let ms: u64 = match b.u8() % 8 {
                    0 => 0,
                    1 => 1,
                    2 => 50,
                    3 => 200,
                    4 => 1_000,
                    5 => 3_000,
                    6 => LINGER.as_millis() as u64 + 1,
                    _ => IDLE.as_millis() as u64 + 1,
                };
                self.now += Duration::from_millis(ms);
                let next = self.st.poll_once(&mut self.sink, &self.stats, self.now);
                let detached = !self.st.inner.lock().detached.is_empty();
                assert!(
                    next.is_some() || !detached,
                    "a lingering socket always has a deadline"
                );
            }
            _ => self.sink.refuse = b.u8() & 1 == 1,
        }
    }

    /// The stack's books agree with each other and with the budget.
    fn check(&mut self) {
        let g = self.st.inner.lock();
        let sockets = g.socket_count();
        assert_eq!(sockets, g.flows.len(), "every socket is a flow's");
        for (key, h, _, _) in &g.detached {
            assert_eq!(
                g.flows.get(key),
                Some(h),
                "a detached socket is still its flow's"
            );
        }
        assert!(
            g.flows.len() + g.connecting.len() <= MAX_SOCKETS,
            "budget: {} sockets + {} connecting",
            g.flows.len(),
            g.connecting.len()
        );
        assert_eq!(
            g.connecting.len(),
            self.pending.len(),
            "one mark per held SYN"
        );
        assert!(
            self.sessions.len() <= g.flows.len(),
            "a session owns a socket"
        );
        self.summary.peak_sockets = self
            .summary
            .peak_sockets
            .max(g.flows.len() + g.connecting.len());
    }
}

/// Run one program; panics on a broken invariant.
pub fn run(data: &[u8]) -> Summary {
    let nets: [IpNet; 2] = [
        "198.18.0.1/16".parse().expect("static prefix"),
        "fd00:18::1/64".parse().expect("static prefix"),
    ];
    // Sockets start on 1 KiB rings and one at a time borrows a 4 KiB ring
    // (`rings.rs`): programs move sockets between rings mid-stream. A
    // 3 KiB window budget caps what a socket on the full ring offers.
    let st = Arc::new(
        Sockets::new(&nets, MTU, BUFFER, IDLE, LINGER, MAX_SOCKETS)
            .with_loans(1024, 1, None)
            .with_window_budget(3 * 1024),
    );
    let mut r = Run {
        st,
        stats: Stats::default(),
        now: Instant::now(),
        sink: Discard {
            refuse: false,
            seqs: [Seqs::default(); FLOWS as usize],
            emitted: 0,
        },
        pending: Vec::new(),
        sessions: Vec::new(),
        summary: Summary::default(),
    };
    let mut b = Bytes { data, pos: 0 };
    while !b.done() && r.summary.steps < MAX_STEPS {
        r.step(&mut b);
        r.summary.steps += 1;
        r.check();
    }
    // Wind down: connects fail, sessions end, the clock passes the linger
    // time. Nothing may remain.
    r.sink.refuse = false;
    while !r.pending.is_empty() {
        r.connected(0, false);
    }
    r.sessions.clear();
    for _ in 0..2 {
        r.now += LINGER + Duration::from_secs(1);
        r.st.poll_once(&mut r.sink, &r.stats, r.now);
    }
    r.check();
    assert_eq!(
        r.st.counts(),
        (0, 0),
        "sockets left after every session ended"
    );
    assert_eq!(r.st.inner.lock().socket_count(), 0);
    r.summary.emitted = r.sink.emitted;
    r.summary
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handshake_program_reaches_data_both_ways() {
        // handshake flow 0; app sends 16 B (structured, seq/ack tracked,
        // PSH|ACK); session reads; session writes 64 B; poll 1 ms; session
        // FIN; app FIN; drop; linger.
        let mut p = vec![3, 0, 0, 0, 0x10, 0x00];
        p.extend([1, 0, tcp_flags::PSH | tcp_flags::ACK, 0, 2]);
        p.extend([0xaa; 16]);
        p.extend([5, 0, 6, 0, 1, 10, 1, 7, 0]);
        p.extend([1, 0, tcp_flags::FIN | tcp_flags::ACK, 0, 0]);
        p.extend([10, 2, 9, 0, 10, 6]);
        let s = run(&p);
        assert_eq!(s.accepted, 1, "{s:?}");
        assert_eq!(s.received, 16, "{s:?}");
        assert_eq!(s.sent, 64, "{s:?}");
        assert!(s.emitted >= 3, "SYN-ACK, data, FIN at least: {s:?}");
    }

    #[test]
    fn the_budget_refuses_past_max_sockets() {
        // Six handshakes on six flows: four fit, two are refused.
        let mut p = Vec::new();
        for f in 0..6u8 {
            p.extend([3, f, 0, 0, 1, f]);
        }
        let s = run(&p);
        assert_eq!((s.accepted, s.full), (MAX_SOCKETS, 2), "{s:?}");
        assert_eq!(s.peak_sockets, MAX_SOCKETS);
    }

    #[test]
    fn seeded_random_programs_hold_the_invariants() {
        let mut x: u64 = 0x5eed;
        for len in [0usize, 1, 7, 64, 300, 2000] {
            for _ in 0..20 {
                let p: Vec<u8> = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x >> 24) as u8
                    })
                    .collect();
                let s = run(&p);
                assert!(s.steps <= MAX_STEPS);
            }
        }
    }
}
