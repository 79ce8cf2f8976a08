//! The smoltcp stack without a TUN: packets in, packets out through a vector.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use super::super::device::{Sink, shade_window};
use super::super::half_open::Syn;
use super::super::rings::RING_QUIET;
use super::super::stream::SmolStream;
use super::*;
use crate::budget::Admission;
use crate::packet::tcp::flags::{ACK, FIN, PSH, RST, SYN};
use crate::packet::testutil::{corpus, tcp_v4, tcp_v6};
use crate::packet::{parse_ip, parse_tcp};

#[derive(Default)]
struct Capture(Vec<Vec<u8>>);

impl Sink for Capture {
    fn send(&mut self, buf: &mut [u8], len: usize) -> bool {
        self.0.push(buf[HEADROOM..HEADROOM + len].to_vec());
        true
    }
}

/// Both families, 16 KiB rings, a socket budget of 2, linger 10 s.
fn stack() -> Arc<Sockets> {
    stack_of(&["198.18.0.1/16", "fd00:18::1/64"], 16 * 1024, 2)
}

/// A stack on `nets` with rings of `buffer` bytes and room for
/// `max_sockets` sockets (MTU 1500, linger 10 s).
fn stack_of(nets: &[&str], buffer: usize, max_sockets: usize) -> Arc<Sockets> {
    let nets: Vec<IpNet> = nets
        .iter()
        .map(|n| n.parse().expect("test input"))
        .collect();
    Arc::new(Sockets::new(
        &nets,
        1500,
        buffer,
        Duration::from_secs(7440),
        Duration::from_secs(10),
        max_sockets,
    ))
}

/// The runtime the tests' sessions read and write on.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("test input")
}

/// `n` bytes that differ with `salt`.
fn pattern(n: usize, salt: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 7 + salt) % 251) as u8).collect()
}

/// The session reads from `app` until it has `n` bytes, at most `chunk`
/// bytes a read.
fn read_exactly(rt: &tokio::runtime::Runtime, app: &SmolStream, n: usize, chunk: usize) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = vec![0u8; chunk];
    while got.len() < n {
        let r = rt.block_on(app.recv(&mut buf)).expect("test input");
        assert!(r > 0);
        got.extend_from_slice(&buf[..r]);
    }
    got
}

fn key(c: &str, s: &str) -> FlowKey {
    FlowKey::new(
        c.parse().expect("test input"),
        s.parse().expect("test input"),
    )
}

/// (src, dst, seq, ack, flags, payload) of a captured segment.
fn seg(p: &[u8]) -> (SocketAddr, SocketAddr, u32, u32, u8, Vec<u8>) {
    let ip = parse_ip(p).expect("test input");
    let t = parse_tcp(p, &ip).expect("test input");
    let payload = p[ip.len - t.payload_len..ip.len].to_vec();
    (
        SocketAddr::new(ip.src, t.src_port),
        SocketAddr::new(ip.dst, t.dst_port),
        t.seq,
        t.ack,
        t.flags,
        payload,
    )
}

fn handshake(st: &Sockets, out: &mut Capture, stats: &Stats, v6: bool) -> (FlowKey, Id, u32) {
    let (c, s) = if v6 {
        ("[fd00:18::9]:40000", "[2001:db8::1]:443")
    } else {
        ("10.0.0.9:40000", "1.1.1.1:443")
    };
    let k = key(c, s);
    let syn = from_app(k, 1000, 0, SYN, &[]);
    assert_eq!(st.syn(k), Syn::New);
    assert_eq!(
        st.syn(k),
        Syn::Connecting,
        "a retransmit while connecting is absorbed"
    );
    let h = st.accept(k, &syn, Instant::now(), out).expect("accepted");
    let synack = out.0.pop().expect("SYN-ACK sent");
    let (src, dst, sseq, ack, fl, _) = seg(&synack);
    assert_eq!(
        (src, dst),
        (k.server, k.client),
        "answered from the server's address"
    );
    assert_eq!(fl & (SYN | ACK), SYN | ACK);
    assert_eq!(ack, 1001);
    assert_eq!(
        st.syn(k),
        Syn::Known,
        "a SYN retransmit now goes to the socket"
    );
    let ack = from_app(k, 1001, sseq.wrapping_add(1), ACK, &[]);
    st.input(&ack, Instant::now(), out, stats);
    (k, h, sseq.wrapping_add(1))
}

/// A segment of flow `k` from its app (the client side), either family.
fn from_app(k: FlowKey, seq: u32, ack: u32, flags: u8, data: &[u8]) -> Vec<u8> {
    let (c, s) = (k.client.to_string(), k.server.to_string());
    if k.client.is_ipv6() {
        tcp_v6(&c, &s, &[], seq, ack, flags, &[], data)
    } else {
        tcp_v4(&c, &s, seq, ack, flags, &[], data)
    }
}

/// A [`stack`] with one flow past its [`handshake`]: the stack, its
/// stats and capture, and the flow's key, socket and server-side next
/// sequence number.
fn established(v6: bool) -> (Arc<Sockets>, Stats, Capture, FlowKey, Id, u32) {
    let st = stack();
    let stats = Stats::default();
    let mut out = Capture::default();
    let (k, h, srv_seq) = handshake(&st, &mut out, &stats, v6);
    (st, stats, out, k, h, srv_seq)
}

#[test]
fn handshake_data_and_close_both_families() {
    for v6 in [false, true] {
        let (st, stats, mut out, k, h, srv_seq) = established(v6);
        assert_eq!(st.inner.lock().socket(h).state(), State::Established);
        let mk = |seq, fl, data: &[u8]| from_app(k, seq, srv_seq, fl, data);
        st.input(
            &mk(1001, ACK | PSH, b"hello"),
            Instant::now(),
            &mut out,
            &stats,
        );
        let rt = runtime();
        let app = SmolStream::new(st.clone(), h, k, None);
        let mut buf = [0u8; 64];
        let n = rt.block_on(app.recv(&mut buf)).expect("test input");
        assert_eq!(&buf[..n], b"hello");
        rt.block_on(app.send_all(b"world")).expect("test input");
        out.0.clear();
        st.poll_once(&mut out, &stats, Instant::now());
        let data: Vec<u8> = out.0.iter().flat_map(|p| seg(p).5).collect();
        assert_eq!(data, b"world");
        // The app's FIN reads as EOF.
        st.input(&mk(1006, ACK | FIN, b""), Instant::now(), &mut out, &stats);
        assert_eq!(rt.block_on(app.recv(&mut buf)).expect("test input"), 0);
        app.close();
        drop(app);
        out.0.clear();
        st.poll_once(&mut out, &stats, Instant::now());
        assert!(
            out.0.iter().any(|p| seg(p).4 & FIN != 0),
            "our FIN went out"
        );
        assert!(
            stats.packets_down.load(Relaxed) > 0,
            "transmits are counted"
        );
    }
}

#[test]
fn abort_sends_rst_and_socket_is_swept() {
    let (st, stats, mut out, k, h, _) = established(false);
    let app = SmolStream::new(st.clone(), h, k, None);
    app.abort();
    drop(app);
    out.0.clear();
    st.poll_once(&mut out, &stats, Instant::now());
    assert!(out.0.iter().any(|p| seg(p).4 & RST != 0), "RST to the app");
    assert_eq!(st.counts(), (0, 0), "socket removed once closed");
    assert_eq!(st.syn(k), Syn::New, "the tuple is free again");
}

/// A session that ended while its socket still closes (our FIN not yet
/// acknowledged by the app) keeps its admission permit until the poller
/// removes the socket: the rings still exist, so they still count. (The
/// permit used to be released when the session ended, leaving closing
/// sockets outside admission.)
#[test]
fn closing_socket_keeps_its_permit_until_removed() {
    let st = stack(); // linger 10 s
    let stats = Stats::default();
    let mut out = Capture::default();
    let t0 = Instant::now();
    let admission = Arc::new(Admission::new([1, 1, 1]));
    let (k, h, _) = handshake(&st, &mut out, &stats, false);
    let permit = admission.try_acquire_owned(t0).expect("permit");
    drop(SmolStream::new(st.clone(), h, k, Some(permit)));
    out.0.clear();
    st.poll_once(&mut out, &stats, t0);
    assert!(
        out.0.iter().any(|p| seg(p).4 & FIN != 0),
        "our FIN went out"
    );
    assert_eq!(st.counts(), (1, 0), "the socket is closing");
    assert_eq!(admission.active(), 1, "and holds its permit");
    assert!(
        admission.try_acquire(t0).is_none(),
        "a new session waits for it"
    );
    // The app never answers: the linger time ends it.
    st.poll_once(&mut out, &stats, t0 + Duration::from_secs(11));
    assert_eq!(st.counts(), (0, 0));
    assert_eq!(admission.active(), 0, "released with the socket");
}

/// What a socket holds besides its rings (its socket set of one, which
/// contains the socket, its slot, its flow map entries and its deadline)
/// fits the state the budget charges each smoltcp session for it.
#[test]
fn socket_state_fits_the_budget() {
    use std::mem::size_of;
    let storage = size_of::<smoltcp::iface::SocketStorage<'static>>();
    let slot = size_of::<Option<Slot>>() + size_of::<Id>();
    let entries = size_of::<(FlowKey, Id)>()
        + size_of::<(FlowKey, Id, Instant, Option<OwnedPermit>)>()
        + size_of::<(SmolInstant, Id)>();
    // Hash maps keep up to half their slots free after growing, B-tree
    // nodes up to half theirs, the slot vector as much again.
    let state = storage + 2 * slot + 2 * entries;
    assert!(
        state <= crate::budget::SMOLTCP_SOCKET_STATE,
        "{state} bytes (storage {storage}, slot {slot}, entries {entries})"
    );
}

#[test]
fn socket_budget_refuses_past_the_limit() {
    let st = stack(); // budget 2
    assert_eq!(st.syn(key("10.0.0.9:1", "1.1.1.1:80")), Syn::New);
    assert_eq!(st.syn(key("10.0.0.9:2", "1.1.1.1:80")), Syn::New);
    assert_eq!(st.syn(key("10.0.0.9:3", "1.1.1.1:80")), Syn::Full);
    assert_eq!(
        st.syn(key("10.0.0.9:1", "1.1.1.1:80")),
        Syn::Connecting,
        "a retransmit is still recognised at the limit"
    );
    st.connect_failed(&key("10.0.0.9:1", "1.1.1.1:80"));
    assert_eq!(st.syn(key("10.0.0.9:3", "1.1.1.1:80")), Syn::New);
}

#[test]
fn refused_before_connect_unmarks() {
    let st = stack();
    let k = key("10.0.0.9:1", "1.1.1.1:80");
    assert_eq!(st.syn(k), Syn::New);
    st.unmark(&k);
    assert_eq!(st.syn(k), Syn::New);
    st.connect_failed(&k);
    assert_eq!(st.counts(), (0, 0));
}

/// Malformed SYNs (bad checksum, either family; invalid flags) are rejects
/// at the gate, before the sockets classify a SYN: no connect is marked, so
/// no outbound is dialled.
#[test]
fn malformed_syn_at_the_gate_marks_no_connect() {
    use super::super::gate::{Gate, gate};
    use crate::packet::Reject;
    let st = stack();
    let corrupt = |mut p: Vec<u8>| {
        let ip = parse_ip(&p).expect("test input");
        p[ip.l4_offset + 16] ^= 0x55; // the TCP checksum field
        p
    };
    let cases = [
        (
            corrupt(tcp_v4("10.0.0.9:40000", "1.1.1.1:443", 7, 0, SYN, &[], &[])),
            Reject::TcpBadChecksum,
        ),
        (
            corrupt(tcp_v6(
                "[fd00:18::9]:40000",
                "[2001:db8::1]:443",
                &[],
                7,
                0,
                SYN,
                &[],
                &[],
            )),
            Reject::TcpBadChecksum,
        ),
        (
            tcp_v4("10.0.0.9:40001", "1.1.1.1:443", 7, 0, SYN | FIN, &[], &[]),
            Reject::TcpBadFlags,
        ),
        (
            tcp_v4("10.0.0.9:40002", "1.1.1.1:443", 7, 0, SYN | RST, &[], &[]),
            Reject::TcpBadFlags,
        ),
        (
            tcp_v4("10.0.0.9:40003", "1.1.1.1:443", 7, 0, 0, &[], &[]),
            Reject::TcpBadFlags,
        ),
    ];
    for (p, want) in cases {
        let ip = parse_ip(&p).expect("test input");
        assert_eq!(gate(&p, &ip, true), Gate::Reject(want));
    }
    assert_eq!(st.counts(), (0, 0), "nothing marked connecting");
    let ok = tcp_v4("10.0.0.9:40000", "1.1.1.1:443", 7, 0, SYN, &[], &[]);
    let ip = parse_ip(&ok).expect("test input");
    assert!(matches!(gate(&ok, &ip, true), Gate::Syn(..)));
}

#[test]
fn syn_smoltcp_does_not_take_is_refused() {
    let st = stack();
    let mut out = Capture::default();
    let k = key("10.0.0.9:40000", "1.1.1.1:443");
    let mut syn = tcp_v4("10.0.0.9:40000", "1.1.1.1:443", 7, 0, SYN, &[], &[]);
    let last = syn.len() - 1;
    syn[last - 2] ^= 0x55; // corrupt the TCP checksum
    assert_eq!(st.syn(k), Syn::New);
    assert!(st.accept(k, &syn, Instant::now(), &mut out).is_none());
    assert_eq!(st.counts(), (0, 0), "no listening socket left behind");
    // Port 0 cannot be listened on.
    let k0 = key("10.0.0.9:40001", "1.1.1.1:0");
    let syn0 = tcp_v4("10.0.0.9:40001", "1.1.1.1:0", 7, 0, SYN, &[], &[]);
    assert!(st.accept(k0, &syn0, Instant::now(), &mut out).is_none());
}

#[test]
fn idle_stack_has_no_deadline_and_garbage_does_not_panic() {
    let st = stack();
    let stats = Stats::default();
    let mut out = Capture::default();
    assert_eq!(st.poll_once(&mut out, &stats, Instant::now()), None);
    for (_, p) in corpus() {
        st.input(&p, Instant::now(), &mut out, &stats);
    }
    let mut rng = crate::packet::testutil::Rng::new(6);
    let bases = [
        tcp_v4("10.0.0.9:40000", "1.1.1.1:443", 7, 9, ACK, &[], b"xyz"),
        tcp_v4(
            "10.0.0.9:40000",
            "1.1.1.1:443",
            7,
            0,
            SYN,
            &[2, 4, 5, 180],
            b"",
        ),
        tcp_v6(
            "[fd00:18::9]:40000",
            "[2001:db8::1]:443",
            &[],
            7,
            9,
            ACK,
            &[],
            b"xyz",
        ),
        tcp_v6(
            "[fd00:18::9]:40000",
            "[2001:db8::1]:443",
            &[],
            7,
            0,
            SYN,
            &[],
            b"",
        ),
    ];
    for i in 0..8000 {
        let mut p = bases[i % bases.len()].clone();
        for _ in 0..3 {
            let i = rng.below(p.len());
            p[i] = rng.byte();
        }
        p.truncate(rng.below(p.len() + 1));
        st.input(&p, Instant::now(), &mut out, &stats);
    }
    // Stray segments get RSTs (smoltcp has no socket for them) or are dropped.
    assert!(out.0.iter().all(|p| parse_ip(p).is_ok()));
    assert_eq!(
        st.poll_once(&mut out, &stats, Instant::now()),
        None,
        "still idle"
    );
    // The same storm against live connections on those tuples.
    handshake(&st, &mut out, &stats, false);
    handshake(&st, &mut out, &stats, true);
    for i in 0..8000 {
        let mut p = bases[i % bases.len()].clone();
        let at = rng.below(p.len());
        p[at] = rng.byte();
        st.input(&p, Instant::now(), &mut out, &stats);
    }
    assert!(out.0.iter().all(|p| parse_ip(p).is_ok()));
}

#[test]
fn buffers_follow_the_platform() {
    let buf = |p| crate::budget::Budget::for_platform(p).smoltcp_buffer;
    use crate::budget::Platform;
    assert_eq!(buf(Platform::Ios), 64 * 1024);
    assert!(buf(Platform::Android) <= 128 * 1024);
    assert!(buf(Platform::Desktop) > buf(Platform::Android));
}

/// The TCP window field of a segment.
fn window(p: &[u8]) -> u16 {
    let ip = parse_ip(p).expect("test input");
    u16::from_be_bytes([p[ip.l4_offset + 14], p[ip.l4_offset + 15]])
}

/// The window scale option of a SYN-ACK (0 if absent).
fn wscale(p: &[u8]) -> u8 {
    let ip = parse_ip(p).expect("test input");
    let t = parse_tcp(p, &ip).expect("test input");
    let opts = &p[ip.l4_offset + 20..ip.l4_offset + t.header_len];
    let mut i = 0;
    while i < opts.len() {
        match opts[i] {
            0 => break,
            1 => i += 1,
            kind => {
                let len = usize::from(*opts.get(i + 1).unwrap_or(&2)).max(2);
                if kind == 3 && len == 3 {
                    return opts[i + 2];
                }
                i += len;
            }
        }
    }
    0
}

/// `p` with its TCP window field set to `w` (checksum recomputed).
fn with_window(mut p: Vec<u8>, w: u16) -> Vec<u8> {
    let ip = parse_ip(&p).expect("test input");
    p[ip.l4_offset + 14..ip.l4_offset + 16].copy_from_slice(&w.to_be_bytes());
    assert!(crate::packet::checksum::fill_transport_checksum(
        &mut p, &ip
    ));
    p
}

/// Issue 6 (bulk transfers stalled for good): with window scaling smoltcp
/// advertises its free space rounded down to the scale unit, so the right
/// edge of its window can move back by up to a unit between two ACKs, and it
/// drops the bytes a sender had already sent inside the earlier edge. Once
/// its buffer is full (zero window) it then rejects every segment whose
/// sequence number is not exactly its next expected one, ACK and window
/// included: the sender's window updates, whose sequence number is past the
/// dropped bytes, are never seen, and with an echo-style app (our receive
/// side drains only when the other direction moves) both directions stop.
///
/// The client here behaves like Linux: bursts up to the right edge of the
/// last ACK it saw, keeps its SND.NXT, goes back to the ACK only when the
/// window is still open, and does not read (window 0) until smoltcp's window
/// closes; then it opens its window with a pure ACK. That update must be
/// taken (the app's queued bytes flow), and no byte sent inside an
/// advertised window may have been dropped.
#[test]
fn window_edge_never_strands_the_sender() {
    for chunk in [997usize, 1201, 1301, 1459, 1460, 513] {
        // 128 KiB: smoltcp scales its window (shift 2), as the engine's
        // 512 KiB desktop buffers do (shift 4).
        let st = stack_of(&["198.18.0.1/16"], 128 * 1024, 4);
        let stats = Stats::default();
        let mut out = Capture::default();
        let (c, s) = ("10.0.0.9:40000", "1.1.1.1:443");
        let k = key(c, s);
        // MSS 1460, NOP, window scale 7 (as Linux sends).
        let opts = [2, 4, 0x05, 0xb4, 1, 3, 3, 7];
        let syn = tcp_v4(c, s, 1000, 0, SYN, &opts, &[]);
        assert_eq!(st.syn(k), Syn::New);
        let mut t = Instant::now();
        let h = st.accept(k, &syn, t, &mut out).expect("accepted");
        let synack = out.0.pop().expect("SYN-ACK");
        let shift = wscale(&synack);
        assert!(shift > 0, "the stack scales its window");
        let srv = seg(&synack).2.wrapping_add(1);
        // The client's ACK: window 0 (it is not reading yet).
        let mut snd_nxt = 1001u32;
        let pkt = |seq: u32, data: &[u8], win: u16| {
            with_window(tcp_v4(c, s, seq, srv, ACK, &[], data), win)
        };
        st.input(&pkt(snd_nxt, &[], 0), t, &mut out, &stats);
        let data = vec![0x5au8; 2048];
        // The client's view of smoltcp's receive window.
        let (mut ack, mut edge) = (1001u32, 1001u32.wrapping_add(u32::from(window(&synack))));
        let mut closed = false;
        for _ in 0..2000 {
            if edge.wrapping_sub(snd_nxt) as i32 <= 0 {
                closed = true;
                break;
            }
            // Window still open with bytes missing: resend from the ACK.
            if ack != snd_nxt {
                snd_nxt = ack;
            }
            // One burst up to the edge known now, ACKs read after it.
            out.0.clear();
            while snd_nxt != edge {
                let n = (edge.wrapping_sub(snd_nxt) as usize).min(chunk);
                st.input(&pkt(snd_nxt, &data[..n], 0), t, &mut out, &stats);
                snd_nxt = snd_nxt.wrapping_add(n as u32);
            }
            // Past smoltcp's delayed-ACK time.
            t += Duration::from_millis(20);
            st.poll_once(&mut out, &stats, t);
            let last = out.0.iter().rev().find(|p| seg(p).1 == k.client);
            let last = last.expect("smoltcp acknowledges a burst");
            ack = seg(last).3;
            edge = ack.wrapping_add(u32::from(window(last)) << shift);
            assert_eq!(
                ack, snd_nxt,
                "chunk {chunk}: bytes sent inside an advertised window were dropped"
            );
        }
        assert!(closed, "chunk {chunk}: smoltcp's window closes");
        // The app has something to say; the client cannot take it yet.
        let rt = runtime();
        let app = SmolStream::new(st.clone(), h, k, None);
        rt.block_on(app.send_all(b"echoed bytes")).expect("queued");
        out.0.clear();
        st.poll_once(&mut out, &stats, t);
        assert!(
            out.0.iter().all(|p| seg(p).5.is_empty()),
            "zero window held"
        );
        // The client reads and opens its window.
        st.input(&pkt(snd_nxt, &[], 64), t, &mut out, &stats);
        st.poll_once(&mut out, &stats, t);
        let sent: Vec<u8> = out.0.iter().flat_map(|p| seg(p).5).collect();
        assert_eq!(
            sent, b"echoed bytes",
            "chunk {chunk}: the client's window update was taken"
        );
        drop(app);
    }
}

#[test]
fn shaded_window_is_one_unit_less_with_valid_checksums() {
    use crate::packet::checksum::verify_transport_checksum;
    let v4 = |fl, w| with_window(tcp_v4("1.1.1.1:443", "10.0.0.9:4", 7, 9, fl, &[], b"ab"), w);
    let v6 = |fl, w| {
        with_window(
            tcp_v6(
                "[2001:db8::1]:443",
                "[fd00::9]:4",
                &[],
                7,
                9,
                fl,
                &[],
                b"abc",
            ),
            w,
        )
    };
    for (mut p, want) in [
        (v4(ACK, 1000), 999),
        (v4(ACK | PSH, 1), 0),
        (v4(ACK, 0), 0),
        (v4(SYN | ACK, 1000), 1000),
        (v4(RST | ACK, 1000), 1000),
        (v6(ACK, 0xffff), 0xfffe),
        (v6(ACK | FIN, 0), 0),
        (v6(SYN | ACK, 500), 500),
    ] {
        // Across the window's range (and so many checksum values).
        for w in (0..=0xffffu16).step_by(4099) {
            let mut r = with_window(p.clone(), w);
            shade_window(&mut r);
            let ip = parse_ip(&r).expect("test input");
            assert!(verify_transport_checksum(&r, &ip), "checksum after w={w}");
        }
        shade_window(&mut p);
        assert_eq!(window(&p), want);
        let ip = parse_ip(&p).expect("test input");
        assert!(verify_transport_checksum(&p, &ip));
    }
    // Not TCP, truncated, garbage: left alone, no panic.
    for mut junk in [
        vec![],
        vec![0x45; 10],
        vec![0x60; 39],
        vec![0x45; 20],
        vec![0x46; 22],
    ] {
        let before = junk.clone();
        shade_window(&mut junk);
        assert_eq!(junk, before);
    }
}

/// A flow through its handshake: its key, its socket and the server
/// side's next sequence number.
type Opened = (FlowKey, Id, u32);

/// SYN, accept, ACK of an IPv4 flow `c -> s`: its socket and the server
/// side's next sequence number.
fn open(st: &Sockets, out: &mut Capture, stats: &Stats, c: &str, s: &str) -> Opened {
    let k = key(c, s);
    let syn = tcp_v4(c, s, 1000, 0, SYN, &[], &[]);
    assert_eq!(st.syn(k), Syn::New);
    let id = st.accept(k, &syn, Instant::now(), out).expect("accepted");
    let (_, _, sseq, _, _, _) = seg(&out.0.pop().expect("SYN-ACK sent"));
    let ack = tcp_v4(c, s, 1001, sseq.wrapping_add(1), ACK, &[], &[]);
    st.input(&ack, Instant::now(), out, stats);
    (k, id, sseq.wrapping_add(1))
}

fn sized_stack(max_sockets: usize) -> Arc<Sockets> {
    stack_of(&["198.18.0.1/16"], 16 * 1024, max_sockets)
}

/// A [`sized_stack`] of 4 sockets with two flows [`open`] to 1.1.1.1:443,
/// A from 10.0.0.9:40000 and B from 10.0.0.9:40001: the stack, its stats
/// and capture, and each flow's key, socket and server-side next sequence
/// number.
fn two_flows() -> (Arc<Sockets>, Stats, Capture, [Opened; 2]) {
    let st = sized_stack(4);
    let stats = Stats::default();
    let mut out = Capture::default();
    let a = open(&st, &mut out, &stats, "10.0.0.9:40000", "1.1.1.1:443");
    let b = open(&st, &mut out, &stats, "10.0.0.9:40001", "1.1.1.1:443");
    (st, stats, out, [a, b])
}

/// A packet is polled with its own flow's socket alone: another socket's
/// queued output does not go out with it (it waits for the poller, which
/// polls only the sockets a session touched or whose deadline came).
#[test]
fn a_packet_polls_its_own_flow_only() {
    let (st, stats, mut out, [(ka, _, sa), (kb, hb, _)]) = two_flows();
    let rt = runtime();
    let b = SmolStream::new(st.clone(), hb, kb, None);
    rt.block_on(b.send_all(b"for b")).expect("test input");
    out.0.clear();
    // Two full segments of A: smoltcp acknowledges them at once.
    let data = [0x61u8; 1460];
    for i in 0..2u32 {
        let p = from_app(ka, 1001 + i * 1460, sa, ACK, &data);
        st.input(&p, Instant::now(), &mut out, &stats);
    }
    let flows: Vec<(SocketAddr, SocketAddr)> = out.0.iter().map(|p| (seg(p).0, seg(p).1)).collect();
    assert!(!flows.is_empty(), "A's segments are acknowledged");
    assert!(
        flows.iter().all(|&f| f == (ka.server, ka.client)),
        "only A's socket answers A's packets: {flows:?}"
    );
    assert_eq!(st.inner.lock().dirty, vec![hb], "B waits for the poller");
    out.0.clear();
    st.poll_once(&mut out, &stats, Instant::now());
    let to_b: Vec<u8> = out
        .0
        .iter()
        .filter(|p| (seg(p).0, seg(p).1) == (kb.server, kb.client))
        .flat_map(|p| seg(p).5)
        .collect();
    assert_eq!(to_b, b"for b", "the poller sent B's output");
    assert!(st.inner.lock().dirty.is_empty());
}

/// Many flows, each in a socket set of its own, interleaved packet by
/// packet: every session reads exactly its flow's bytes and every flow's
/// answer reaches its app byte-exact; removing them leaves nothing behind.
#[test]
fn interleaved_flows_each_complete_byte_exact() {
    const FLOWS: u16 = 24;
    let st = sized_stack(usize::from(FLOWS));
    let stats = Stats::default();
    let mut out = Capture::default();
    let rt = runtime();
    let mut flows = Vec::new();
    for i in 0..FLOWS {
        let c = format!("10.0.{}.{}:{}", i % 3, 9 + i, 40000 + i);
        let (k, id, sseq) = open(&st, &mut out, &stats, &c, "1.1.1.1:443");
        flows.push((c, k, SmolStream::new(st.clone(), id, k, None), sseq));
    }
    let payload = |i: usize, j: u32| -> Vec<u8> {
        (0..700)
            .map(|b| (i as u32 * 31 + j * 7 + b) as u8)
            .collect()
    };
    // Three segments per flow, round-robin over the flows.
    for j in 0..3u32 {
        for (i, (c, _, _, sseq)) in flows.iter().enumerate() {
            let p = tcp_v4(
                c,
                "1.1.1.1:443",
                1001 + j * 700,
                *sseq,
                ACK | PSH,
                &[],
                &payload(i, j),
            );
            st.input(&p, Instant::now(), &mut out, &stats);
        }
    }
    for (i, (_, _, app, _)) in flows.iter().enumerate() {
        let got = read_exactly(&rt, app, 2100, 4096);
        let want: Vec<u8> = (0..3).flat_map(|j| payload(i, j)).collect();
        assert_eq!(got, want, "flow {i} reads its own bytes");
        let answer = format!("answer of flow {i}");
        rt.block_on(app.send_all(answer.as_bytes()))
            .expect("test input");
    }
    out.0.clear();
    st.poll_once(&mut out, &stats, Instant::now());
    for (i, (_, k, _, _)) in flows.iter().enumerate() {
        let got: Vec<u8> = out
            .0
            .iter()
            .filter(|p| (seg(p).0, seg(p).1) == (k.server, k.client))
            .flat_map(|p| seg(p).5)
            .collect();
        assert_eq!(got, format!("answer of flow {i}").as_bytes());
    }
    // Sessions end; the app never answers the FINs: the linger time ends
    // them all.
    let apps: Vec<SmolStream> = flows.into_iter().map(|f| f.2).collect();
    drop(apps);
    st.poll_once(&mut out, &stats, Instant::now() + Duration::from_secs(11));
    assert_eq!(st.counts(), (0, 0));
    let g = st.inner.lock();
    assert_eq!(g.socket_count(), 0);
    assert!(
        g.timers.is_empty(),
        "no deadline of a removed socket is left"
    );
}

/// An idle flow's timer fires from the poller while the packets of other
/// flows come and go: the retransmission of data the app never
/// acknowledged goes out at its deadline, and the poller's deadline is the
/// earliest of all sockets'.
#[test]
fn an_idle_flows_retransmission_fires_from_the_poller() {
    let (st, stats, mut out, [(ka, ha, _), (kb, _, sb)]) = two_flows();
    let t0 = Instant::now();
    let rt = runtime();
    let a = SmolStream::new(st.clone(), ha, ka, None);
    rt.block_on(a.send_all(b"unacknowledged"))
        .expect("test input");
    out.0.clear();
    let deadline = st
        .poll_once(&mut out, &stats, t0)
        .expect("a retransmission deadline");
    assert_eq!(seg(&out.0[0]).5, b"unacknowledged");
    // Traffic on B in the meantime does not touch A.
    for i in 0..5u32 {
        let p = from_app(kb, 1001 + i, sb, ACK | PSH, b"b");
        st.input(
            &p,
            t0 + Duration::from_millis(10 * u64::from(i)),
            &mut out,
            &stats,
        );
    }
    assert!(out.0[1..].iter().all(|p| seg(p).1 != ka.client));
    out.0.clear();
    // Before the deadline nothing is due; at it, A retransmits.
    st.poll_once(&mut out, &stats, deadline - Duration::from_millis(1));
    assert!(out.0.iter().all(|p| seg(p).1 != ka.client), "not yet");
    st.poll_once(&mut out, &stats, deadline + Duration::from_millis(1));
    let again: Vec<u8> = out
        .0
        .iter()
        .filter(|p| seg(p).1 == ka.client)
        .flat_map(|p| seg(p).5)
        .collect();
    assert_eq!(again, b"unacknowledged", "retransmitted at its deadline");
}

/// The driver's path holds each flow's pure ACKs until its drain ends:
/// one cumulative ACK per flow goes out, the newest; anything else of the
/// flow (its session's data through the poller) goes out after the ACK it
/// holds, and the packets and bytes are counted once sent.
#[test]
fn a_drain_sends_one_cumulative_ack_per_flow() {
    let (st, stats, mut out, [(ka, ha, sa), (kb, _, sb)]) = two_flows();
    out.0.clear();
    let data = [0x62u8; 1460];
    for i in 0..6u32 {
        for (k, s) in [(ka, sa), (kb, sb)] {
            let p = from_app(k, 1001 + i * 1460, s, ACK, &data);
            st.input_held(&p, Instant::now(), &mut out, &stats);
        }
    }
    assert!(
        out.0.is_empty(),
        "ACKs held during the drain: {}",
        out.0.len()
    );
    st.drain_done(&mut out, &stats);
    let acks: Vec<_> = out.0.iter().map(|p| seg(p)).collect();
    assert_eq!(acks.len(), 2, "one ACK per flow");
    for (k, _) in [(ka, sa), (kb, sb)] {
        let a = acks
            .iter()
            .find(|a| (a.0, a.1) == (k.server, k.client))
            .expect("an ACK of each flow");
        assert_eq!(a.3, 1001 + 6 * 1460, "the newest, cumulative");
        assert_eq!(a.4, ACK);
    }
    st.drain_done(&mut out, &stats);
    assert_eq!(out.0.len(), 2, "nothing held twice");
    st.poll_once(&mut out, &stats, Instant::now());
    assert_eq!(out.0.len(), 2);
    assert_eq!(
        stats.packets_down.load(Relaxed),
        4,
        "two SYN-ACKs and the two ACKs sent, counted once"
    );
    // A held ACK goes out before the flow's next segment from the poller.
    out.0.clear();
    let p = from_app(ka, 1001 + 6 * 1460, sa, ACK, &data);
    st.input_held(&p, Instant::now(), &mut out, &stats);
    st.input_held(
        &from_app(ka, 1001 + 7 * 1460, sa, ACK, &data),
        Instant::now(),
        &mut out,
        &stats,
    );
    assert!(out.0.is_empty());
    let rt = runtime();
    let a = SmolStream::new(st.clone(), ha, ka, None);
    let mut buf = vec![0u8; 16 * 1024];
    let mut n = 0;
    while n < 8 * 1460 {
        n += rt.block_on(a.recv(&mut buf)).expect("test input");
    }
    rt.block_on(a.send_all(b"reply")).expect("test input");
    st.poll_once(&mut out, &stats, Instant::now());
    let segs: Vec<_> = out.0.iter().map(|p| seg(p)).collect();
    assert!(segs.len() >= 2, "{segs:?}");
    assert_eq!(
        (segs[0].3, segs[0].5.len()),
        (1001 + 8 * 1460, 0),
        "the held ACK first"
    );
    assert!(segs.iter().any(|s| s.5 == b"reply"));
    st.drain_done(&mut out, &stats);
    assert_eq!(out.0.len(), segs.len(), "flushed by the poller, not again");
}

/// A stack of 16 KiB full rings and room for 4 sockets whose sockets
/// start on 2 KiB rings, with `rings` full rings to lend.
fn loan_stack(rings: usize) -> Arc<Sockets> {
    loan_stack_under(rings, None)
}

/// [`loan_stack`] whose pool follows `pressure`.
fn loan_stack_under(rings: usize, pressure: Option<Arc<crate::budget::Pressure>>) -> Arc<Sockets> {
    Arc::new(loan_sockets(rings, pressure))
}

/// The sockets of a [`loan_stack_under`], not shared yet.
fn loan_sockets(rings: usize, pressure: Option<Arc<crate::budget::Pressure>>) -> Sockets {
    let nets: Vec<IpNet> = vec!["198.18.0.1/16".parse().expect("test input")];
    Sockets::new(
        &nets,
        1500,
        16 * 1024,
        Duration::from_secs(7440),
        Duration::from_secs(10),
        4,
    )
    .with_loans(2048, rings, pressure)
}

/// Whether socket `id` holds a full ring, and how many are lent.
fn loan_of(st: &Sockets, id: Id) -> (bool, usize) {
    let g = st.inner.lock();
    let on = g.slots[id as usize].as_ref().is_some_and(|s| s.loan.any());
    (on, g.loans.lent)
}

/// The app of flow `k` sends `data` from `seq` in 1400-byte segments, each
/// once; returns the next sequence number.
#[allow(clippy::too_many_arguments)]
fn app_sends(
    st: &Sockets,
    out: &mut Capture,
    stats: &Stats,
    k: FlowKey,
    seq: u32,
    ack: u32,
    data: &[u8],
    t: Instant,
) -> u32 {
    let mut seq = seq;
    for chunk in data.chunks(1400) {
        st.input(&from_app(k, seq, ack, ACK | PSH, chunk), t, out, stats);
        seq = seq.wrapping_add(chunk.len() as u32);
    }
    seq
}

/// A socket starts on its small rings (the SYN-ACK offers 2 KiB, scaled
/// for the full ring), borrows a full receive ring once the app's data
/// fills the small one past half (and says so to the app at once) and a
/// full send ring once its session writes more than half a small one;
/// once quiet for `RING_QUIET` it hands back the empty receive ring and
/// keeps the send ring while data in it waits unacknowledged, then hands
/// that back too; the next round borrows the spare rings. Every byte
/// arrives exact both ways.
#[test]
fn full_rings_are_lent_while_data_fills_and_taken_back_quiet() {
    let st = loan_stack(2);
    let stats = Stats::default();
    let mut out = Capture::default();
    let rt = runtime();
    let (c, srv) = ("10.0.0.9:40000", "1.1.1.1:443");
    let k = key(c, srv);
    // MSS 1460, window scale 7: the SYN-ACK scales for 16 KiB (shift 0).
    let syn = tcp_v4(c, srv, 1000, 0, SYN, &[2, 4, 0x05, 0xb4, 1, 3, 3, 7], &[]);
    assert_eq!(st.syn(k), Syn::New);
    let h = st
        .accept(k, &syn, Instant::now(), &mut out)
        .expect("accepted");
    let synack = out.0.pop().expect("SYN-ACK sent");
    assert_eq!(wscale(&synack), 0);
    assert!(window(&synack) <= 2048, "{}", window(&synack));
    let srv_seq = seg(&synack).2.wrapping_add(1);
    let mut t = Instant::now();
    st.input(&from_app(k, 1001, srv_seq, ACK, &[]), t, &mut out, &stats);
    assert_eq!(loan_of(&st, h), (false, 0), "small rings to start");
    let app = SmolStream::new(st.clone(), h, k, None);
    let mut app_seq = 1001u32;
    let mut acked = srv_seq;
    for round in 0..3 {
        // One segment fills the small ring past half: a full receive
        // ring, and a window update that offers it.
        out.0.clear();
        let up = pattern(10 * 1400, round);
        app_seq = app_sends(&st, &mut out, &stats, k, app_seq, acked, &up[..1400], t);
        assert_eq!(loan_of(&st, h), (true, 1), "round {round}: lent");
        if round == 0 {
            // Later rounds: the wide window offered before still stands.
            let last = out.0.last().expect("an ACK");
            assert!(window(last) > 8 * 1024, "{}", window(last));
        }
        app_seq = app_sends(&st, &mut out, &stats, k, app_seq, acked, &up[1400..], t);
        let got = read_exactly(&rt, &app, up.len(), 4096);
        assert!(got == up, "round {round}: the app's bytes arrive exact");
        // Session to app: 12 KiB through a full send ring.
        let down = pattern(12 * 1024, 100 + round);
        rt.block_on(app.send_all(&down)).expect("test input");
        assert_eq!(loan_of(&st, h), (true, 2), "round {round}: both lent");
        out.0.clear();
        st.poll_once(&mut out, &stats, t);
        let data: Vec<u8> = out.0.iter().flat_map(|p| seg(p).5).collect();
        assert!(
            data == down,
            "round {round}: the session's bytes arrive exact"
        );
        // Quiet: the empty receive ring goes back, the send ring's
        // unacknowledged data keeps it.
        t += RING_QUIET + Duration::from_millis(100);
        st.poll_once(&mut out, &stats, t);
        assert_eq!(
            loan_of(&st, h),
            (true, 1),
            "round {round}: unacknowledged data keeps the send ring"
        );
        assert_eq!(st.inner.lock().socket(h).recv_capacity(), 2048);
        acked = acked.wrapping_add(down.len() as u32);
        st.input(&from_app(k, app_seq, acked, ACK, &[]), t, &mut out, &stats);
        assert_eq!(st.inner.lock().socket(h).send_queue(), 0);
        t += 2 * RING_QUIET + Duration::from_millis(100);
        st.poll_once(&mut out, &stats, t);
        assert_eq!(
            loan_of(&st, h),
            (false, 0),
            "round {round}: handed back quiet"
        );
        assert_eq!(stats.smoltcp_ring_loans.load(Relaxed), 0);
        assert_eq!(st.inner.lock().socket(h).recv_capacity(), 2048);
    }
    assert_eq!(st.inner.lock().socket(h).state(), State::Established);
    assert_eq!(stats.smoltcp_ring_loans_refused.load(Relaxed), 0);
}

/// With every ring lent, a socket whose data fills its small ring stays
/// on it (counted) and still delivers every byte, a small window at a
/// time; the app's segments past that window, sent inside the wider one
/// the socket offered while it held full rings, are cut to what fits and
/// taken again from where the ACK says (the window is clamped to the
/// ring: without it smoltcp would account bytes it never stored). Once
/// the ring is free again, the socket borrows it.
#[test]
fn with_every_ring_lent_a_socket_moves_data_on_its_small_rings() {
    let st = loan_stack(1);
    let stats = Stats::default();
    let mut out = Capture::default();
    let rt = runtime();
    let (ka, ha, sa) = open(&st, &mut out, &stats, "10.0.0.9:40000", "1.1.1.1:443");
    let (kb, hb, sb) = open(&st, &mut out, &stats, "10.0.0.9:40001", "1.1.1.1:443");
    let a = SmolStream::new(st.clone(), ha, ka, None);
    let b = SmolStream::new(st.clone(), hb, kb, None);
    let mut t = Instant::now();
    // A borrows the ring, offers its wide window, reads, goes quiet and
    // hands the ring back.
    let first = pattern(8 * 1400, 1);
    let mut a_seq = app_sends(&st, &mut out, &stats, ka, 1001, sa, &first, t);
    assert!(read_exactly(&rt, &a, first.len(), 32 * 1024) == first);
    go_quiet(&st, &mut out, &stats, &mut t);
    assert_eq!(loan_of(&st, ha), (false, 0));
    // B borrows it now.
    let bdata = pattern(3 * 1400, 2);
    app_sends(&st, &mut out, &stats, kb, 1001, sb, &bdata, t);
    assert_eq!(loan_of(&st, hb), (true, 1));
    assert!(read_exactly(&rt, &b, bdata.len(), 32 * 1024) == bdata);
    // A's app sends 5 segments at once, inside the window A offered last
    // (16 KiB): A is refused the ring and its 2 KiB ring takes what fits.
    let burst = pattern(5 * 1400, 3);
    let got = app_delivers(
        &st, &mut out, &stats, &rt, &a, ka, &mut a_seq, sa, &burst, &mut t,
    );
    assert!(got == burst, "every byte exact, in order");
    assert_eq!(loan_of(&st, ha), (false, 1), "A stayed on its small rings");
    assert!(stats.smoltcp_ring_loans_refused.load(Relaxed) > 0);
    assert_eq!(stats.smoltcp_ring_loans.load(Relaxed), 1);
    // B goes quiet and hands the ring back; A's next fill borrows it.
    go_quiet(&st, &mut out, &stats, &mut t);
    assert_eq!(loan_of(&st, hb), (false, 0));
    let more = pattern(6 * 1400, 4);
    let got = app_delivers(
        &st, &mut out, &stats, &rt, &a, ka, &mut a_seq, sa, &more, &mut t,
    );
    assert!(got == more, "every byte exact, in order");
    assert_eq!(loan_of(&st, ha), (true, 1));
}

/// Nothing moves for twice `RING_QUIET`, with the poller's passes.
fn go_quiet(st: &Sockets, out: &mut Capture, stats: &Stats, t: &mut Instant) {
    for _ in 0..2 {
        st.poll_once(out, stats, *t);
        *t += RING_QUIET;
    }
    st.poll_once(out, stats, *t);
}

/// The app of flow `k` sends `data` from `*seq` the way TCP does when
/// every segment past the window is lost: all it has not had acknowledged,
/// at once, then again from the newest ACK (smoltcp's delayed ACK comes
/// from the poller 20 ms on). The session reads what each ACK took; the
/// bytes read, in order.
#[allow(clippy::too_many_arguments)]
fn app_delivers(
    st: &Sockets,
    out: &mut Capture,
    stats: &Stats,
    rt: &tokio::runtime::Runtime,
    app: &SmolStream,
    k: FlowKey,
    seq: &mut u32,
    ack: u32,
    data: &[u8],
    t: &mut Instant,
) -> Vec<u8> {
    let mut sent = 0usize;
    let mut got = Vec::new();
    for _ in 0..50 {
        if sent == data.len() {
            return got;
        }
        out.0.clear();
        app_sends(st, out, stats, k, *seq, ack, &data[sent..], *t);
        *t += Duration::from_millis(20);
        st.poll_once(out, stats, *t);
        let acked = out
            .0
            .iter()
            .filter(|p| seg(p).1 == k.client)
            .map(|p| seg(p).3)
            .next_back()
            .expect("the socket acknowledges");
        let took = acked.wrapping_sub(*seq) as usize;
        sent += took;
        *seq = acked;
        if took > 0 {
            got.extend(read_exactly(rt, app, took, 32 * 1024));
        }
    }
    panic!("{sent} of {} bytes taken in 50 rounds", data.len());
}

/// Under memory pressure the pool lends a quarter of its rings
/// (critical), as every budget does for new charges; back at normal, the
/// whole pool again.
#[test]
fn memory_pressure_lends_fewer_rings() {
    use crate::budget::{MemoryPressure, Pressure};
    let pressure = Arc::new(Pressure::default());
    let st = loan_stack_under(4, Some(pressure.clone()));
    let stats = Stats::default();
    let mut out = Capture::default();
    let t = Instant::now();
    pressure.report(MemoryPressure::Critical, t);
    let a = open(&st, &mut out, &stats, "10.0.0.9:40000", "1.1.1.1:443");
    let b = open(&st, &mut out, &stats, "10.0.0.9:40001", "1.1.1.1:443");
    app_sends(&st, &mut out, &stats, a.0, 1001, a.2, &pattern(1400, 1), t);
    app_sends(&st, &mut out, &stats, b.0, 1001, b.2, &pattern(1400, 2), t);
    assert_eq!(loan_of(&st, a.1), (true, 1), "critical: a quarter of 4");
    assert_eq!(loan_of(&st, b.1), (false, 1));
    pressure.report(MemoryPressure::Normal, t);
    app_sends(&st, &mut out, &stats, b.0, 2401, b.2, &pattern(600, 3), t);
    assert_eq!(loan_of(&st, b.1), (true, 2), "normal: the whole pool");
}

/// A socket removed while on loan gives its ring back to the pool.
#[test]
fn a_removed_socket_returns_its_ring() {
    let st = loan_stack(1);
    let stats = Stats::default();
    let mut out = Capture::default();
    let (k, h, srv_seq) = open(&st, &mut out, &stats, "10.0.0.9:40000", "1.1.1.1:443");
    app_sends(
        &st,
        &mut out,
        &stats,
        k,
        1001,
        srv_seq,
        &pattern(1400, 5),
        Instant::now(),
    );
    assert_eq!(loan_of(&st, h), (true, 1));
    let app = SmolStream::new(st.clone(), h, k, None);
    app.abort();
    drop(app);
    st.poll_once(&mut out, &stats, Instant::now());
    assert_eq!(st.counts(), (0, 0));
    assert_eq!(st.inner.lock().loans.lent, 0);
}

/// The app's last bytes and its FIN are both in before the session reads:
/// one read returns every byte, also when they wrap around the end of the
/// ring (two borrows of it), and only the next read is EOF. smoltcp answers
/// a read of an empty ring with `Finished` once the FIN is in, so a read
/// that asked again after emptying the ring turned what it had just taken
/// out into an EOF (the sniffer and the relay lost the app's last bytes).
#[test]
fn bytes_before_the_fin_are_read_before_eof() {
    for wrap in [false, true] {
        let (st, stats, mut out, k, h, srv_seq) = established(false);
        let rt = runtime();
        let app = SmolStream::new(st.clone(), h, k, None);
        let mut seq = 1001u32;
        let mut send = |data: &[u8], fl: u8| {
            for chunk in data.chunks(1400) {
                let p = from_app(k, seq, srv_seq, fl, chunk);
                st.input(&p, Instant::now(), &mut out, &stats);
                seq = seq.wrapping_add(chunk.len() as u32);
            }
        };
        let mut buf = vec![0u8; 32 * 1024];
        if wrap {
            // 12 KiB read first: the read position stands 4 KiB before the
            // end of the 16 KiB ring, so the next 10 KiB wrap around it.
            let first = pattern(12 * 1024, 1);
            send(&first, ACK | PSH);
            assert!(read_exactly(&rt, &app, first.len(), 32 * 1024) == first);
        }
        let last = pattern(10 * 1024, 2);
        send(&last, ACK | PSH);
        let fin = from_app(k, seq, srv_seq, ACK | FIN, &[]);
        st.input(&fin, Instant::now(), &mut out, &stats);
        assert_eq!(st.inner.lock().socket(h).state(), State::CloseWait);
        let n = rt.block_on(app.recv(&mut buf)).expect("test input");
        assert_eq!(n, last.len(), "wrap {wrap}: the bytes before the FIN");
        assert!(buf[..n] == last[..], "wrap {wrap}: exact");
        let eof = rt.block_on(app.recv(&mut buf)).expect("test input");
        assert_eq!(eof, 0, "wrap {wrap}: then EOF");
    }
}

/// Let the runtime's tasks (the relay) run for a moment.
fn settle(rt: &tokio::runtime::Runtime) {
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(5)).await });
}

/// The segments in `out` toward the app of `k`: (seq, flags, payload).
fn toward_app(out: &Capture, k: FlowKey) -> Vec<(u32, u8, Vec<u8>)> {
    out.0
        .iter()
        .map(|p| seg(p))
        .filter(|s| s.1 == k.client)
        .map(|s| (s.2, s.4, s.5))
        .collect()
}

/// The acknowledgement number of the last segment in `out` toward the app
/// of `k`.
fn last_ack(out: &Capture, k: FlowKey) -> Option<u32> {
    out.0
        .iter()
        .map(|p| seg(p))
        .filter(|s| s.1 == k.client)
        .map(|s| s.3)
        .next_back()
}

/// An unframed relay between a smoltcp socket and a kernel socket moves
/// the bytes between the socket's rings and the kernel with no relay
/// buffer: while the outbound's reader stalls, the app's bytes wait in the
/// receive ring (its window closes) and the relay pool stays untouched;
/// while the app does not acknowledge, the outbound's bytes wait in the
/// kernel. A download that fills the small send ring borrows a full one.
/// Every byte and both FINs arrive, in order.
#[test]
fn an_unframed_relay_moves_bytes_between_rings_and_kernel_alone() {
    use crate::budget::{ByteBudget, Pressure};
    use crate::relay::{self, Meter, RelayOptions};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let st = loan_stack(2);
    let stats = Arc::new(Stats::default());
    let mut out = Capture::default();
    let rt = crate::testutil::runtime();
    let (k, h, srv_seq) = open(&st, &mut out, &stats, "10.0.0.9:40000", "1.1.1.1:443");
    let app = SmolStream::new(st.clone(), h, k, None);
    // The outbound: a loopback connection whose buffers are small, so a
    // stalled reader stalls the relay within a few KiB.
    let (to_server, mut server) = rt.block_on(async {
        let l = tokio::net::TcpSocket::new_v4().expect("socket");
        l.set_recv_buffer_size(4096).expect("rcvbuf");
        l.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let addr = l.local_addr().expect("addr");
        let l = l.listen(1).expect("listen");
        let c = tokio::net::TcpSocket::new_v4().expect("socket");
        c.set_send_buffer_size(4096).expect("sndbuf");
        let (c, a) = tokio::join!(c.connect(addr), l.accept());
        (c.expect("connect"), a.expect("accept").0)
    });
    let pool = Arc::new(ByteBudget::new(1 << 20, Arc::new(Pressure::default())));
    let (p, s) = (pool.clone(), stats.clone());
    let relay = rt.spawn(async move {
        let meter = Meter::tcp(&s, Some(&p));
        let opts = RelayOptions::default();
        relay::run(&app, &to_server, None, &opts, &meter).await
    });

    // Upload while the server does not read.
    let up = pattern(512 * 1024, 1);
    let mut seq = 1001u32;
    let mut t = Instant::now();
    // The app sends up to 16 KiB of `up` from `seq`, the relay runs, 20 ms
    // pass with a poll: the socket's newest ACK, if it sent one.
    let mut send_more = |seq: u32, t: &mut Instant| {
        let sent = seq.wrapping_sub(1001) as usize;
        out.0.clear();
        let end = up.len().min(sent + 16 * 1024);
        app_sends(&st, &mut out, &stats, k, seq, srv_seq, &up[sent..end], *t);
        settle(&rt);
        *t += Duration::from_millis(20);
        st.poll_once(&mut out, &stats, *t);
        last_ack(&out, k)
    };
    let mut stalled = 0;
    for _ in 0..200 {
        let acked = send_more(seq, &mut t).unwrap_or(seq);
        stalled = if acked == seq { stalled + 1 } else { 0 };
        seq = acked;
        if stalled == 3 {
            break;
        }
    }
    let taken = seq.wrapping_sub(1001) as usize;
    assert!(
        stalled == 3 && taken < up.len(),
        "the window closed at {taken}"
    );
    assert!(
        st.inner.lock().socket(h).recv_queue() > 0,
        "bytes wait in the ring"
    );
    assert_eq!(pool.used(), 0, "no relay buffer");
    // The server reads now: the rest follows, then the app's FIN.
    let reader = rt.spawn(async move {
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.expect("read");
        (server, got)
    });
    for _ in 0..2000 {
        if seq.wrapping_sub(1001) as usize == up.len() {
            break;
        }
        seq = send_more(seq, &mut t).unwrap_or(seq);
    }
    assert_eq!(seq.wrapping_sub(1001) as usize, up.len(), "all taken");
    st.input(
        &from_app(k, seq, srv_seq, ACK | FIN, &[]),
        t,
        &mut out,
        &stats,
    );
    let (mut server, got) = loop {
        settle(&rt);
        if reader.is_finished() {
            break rt.block_on(reader).expect("reader");
        }
    };
    assert!(got == up, "the app's bytes arrive exact, then its FIN");

    // Download: the app does not acknowledge at first.
    let down = pattern(256 * 1024, 2);
    let d = down.clone();
    let writer = rt.spawn(async move {
        server.write_all(&d).await.expect("write");
        server.shutdown().await.expect("fin");
        server
    });
    let mut srv_next = srv_seq;
    let mut recv = Vec::new();
    let mut fin = false;
    let mut lent = false;
    for round in 0..4000 {
        out.0.clear();
        settle(&rt);
        t += Duration::from_millis(20);
        st.poll_once(&mut out, &stats, t);
        lent |= loan_of(&st, h).0;
        for (sq, fl, data) in toward_app(&out, k) {
            if sq == srv_next && !data.is_empty() {
                recv.extend_from_slice(&data);
                srv_next = srv_next.wrapping_add(data.len() as u32);
            }
            if fl & FIN != 0 && sq.wrapping_add(data.len() as u32) == srv_next {
                fin = true;
            }
        }
        if round < 3 {
            // Unacknowledged: the send ring is full, the rest waits in the
            // kernel, not in a relay buffer.
            assert_eq!(pool.used(), 0, "no relay buffer");
            continue;
        }
        let ack_to = srv_next.wrapping_add(u32::from(fin));
        st.input(&from_app(k, seq + 1, ack_to, ACK, &[]), t, &mut out, &stats);
        if fin {
            break;
        }
    }
    assert!(fin, "the outbound's FIN reaches the app");
    assert!(recv == down, "the outbound's bytes arrive exact");
    assert!(lent, "the download borrowed a full send ring");
    let r = loop {
        settle(&rt);
        if relay.is_finished() {
            break rt.block_on(relay).expect("relay task").expect("relay");
        }
    };
    drop(rt.block_on(writer));
    assert_eq!(
        (r.up.copied, r.down.copied),
        (up.len() as u64, down.len() as u64)
    );
    assert_eq!(pool.used(), 0);
}

/// Sniffing looks at the app's first bytes in the receive ring and takes
/// none out: a request head cut over two segments (the first fills the
/// small ring past half, so a full ring is lent and keeps the bytes at its
/// start) names its domain once the second is in, and the session then
/// reads every byte. A head longer than the small ring while every full
/// ring is lent ends the sniff at once (the ring is full, more cannot
/// come), its bytes still all there.
#[test]
fn sniffing_reads_the_first_bytes_in_place() {
    use crate::budget::{ByteBudget, Pressure};
    use crate::dispatch::session::{App, SniffBytes};

    let st = loan_stack(1);
    let stats = Stats::default();
    let mut out = Capture::default();
    let rt = crate::testutil::runtime();
    let pool = Arc::new(ByteBudget::new(0, Arc::new(Pressure::default())));
    let bytes = SniffBytes {
        pool: &pool,
        stats: &stats,
    };
    let pad: String = "p".repeat(1500);
    let head = format!("GET / HTTP/1.1\r\nX-Pad: {pad}\r\nHost: in.place.test\r\n\r\n");
    let (k, h, sa) = open(&st, &mut out, &stats, "10.0.0.9:40000", "1.1.1.1:80");
    let app = SmolStream::new(st.clone(), h, k, None);
    let cut = 1400;
    let seq = app_sends(
        &st,
        &mut out,
        &stats,
        k,
        1001,
        sa,
        &head.as_bytes()[..cut],
        Instant::now(),
    );
    assert_eq!(loan_of(&st, h), (true, 1), "past half: a full ring");
    let sniffed = rt.block_on(async {
        let look = app.sniff(Duration::from_secs(10), &bytes);
        tokio::pin!(look);
        // Not complete: the look waits for more.
        assert!(
            tokio::time::timeout(Duration::from_millis(20), &mut look)
                .await
                .is_err()
        );
        app_sends(
            &st,
            &mut out,
            &stats,
            k,
            seq,
            sa,
            &head.as_bytes()[cut..],
            Instant::now(),
        );
        look.await
    });
    assert_eq!(sniffed.domain.as_deref(), Some("in.place.test"));
    assert_eq!(
        st.inner.lock().socket(h).recv_queue(),
        head.len(),
        "nothing taken"
    );
    assert!(read_exactly(&rt, &app, head.len(), 64 * 1024) == head.as_bytes());

    // B's head, 3 KiB, while A holds the only full ring: B's 2 KiB ring fills.
    let (kb, hb, sb) = open(&st, &mut out, &stats, "10.0.0.9:40001", "1.1.1.1:80");
    let b = SmolStream::new(st.clone(), hb, kb, None);
    let long = format!(
        "GET / HTTP/1.1\r\nX-Pad: {}\r\nHost: b.test\r\n\r\n",
        "q".repeat(3000)
    );
    app_sends(
        &st,
        &mut out,
        &stats,
        kb,
        1001,
        sb,
        long.as_bytes(),
        Instant::now(),
    );
    assert_eq!(loan_of(&st, hb), (false, 1), "B stays on its small rings");
    let queued = st.inner.lock().socket(hb).recv_queue();
    assert_eq!(queued, 2048, "the small ring is full");
    let started = Instant::now();
    let sniffed = rt.block_on(b.sniff(Duration::from_secs(10), &bytes));
    assert_eq!(sniffed.domain, None);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "ended without the timeout"
    );
    assert!(read_exactly(&rt, &b, queued, 64 * 1024) == long.as_bytes()[..queued]);
}

/// The sockets on full receive rings share the window budget: one alone
/// offers the budget (within its ring), two offer half each, and once one
/// hands its ring back the other is told at once that it may send the
/// whole budget again. What each socket accepts is its ring's room, not
/// its offer: every byte sent inside an older, wider offer is taken.
#[test]
fn sockets_on_full_rings_share_the_window_budget() {
    let st = Arc::new(loan_sockets(4, None).with_window_budget(8192));
    let stats = Stats::default();
    let mut out = Capture::default();
    let rt = runtime();
    let mut t = Instant::now();
    let (ka, ha, sa) = open(&st, &mut out, &stats, "10.0.0.9:40000", "1.1.1.1:443");
    let (kb, hb, sb) = open(&st, &mut out, &stats, "10.0.0.9:40001", "1.1.1.1:443");
    let a = SmolStream::new(st.clone(), ha, ka, None);
    let b = SmolStream::new(st.clone(), hb, kb, None);
    // A fills its small ring past half: a full ring, offering the budget.
    out.0.clear();
    let a_seq = app_sends(&st, &mut out, &stats, ka, 1001, sa, &pattern(1400, 1), t);
    assert_eq!(loan_of(&st, ha), (true, 1));
    let offer = |out: &Capture, k: FlowKey| {
        let p = out
            .0
            .iter()
            .rev()
            .find(|p| seg(p).1 == k.client)
            .expect("a segment");
        window(p)
    };
    let w = offer(&out, ka);
    assert!((7 * 1024..=8192).contains(&(w as usize)), "alone: {w}");
    // B too: each offers half.
    out.0.clear();
    app_sends(&st, &mut out, &stats, kb, 1001, sb, &pattern(1400, 2), t);
    assert_eq!(loan_of(&st, hb), (true, 2));
    let w = offer(&out, kb);
    assert!(w as usize <= 4096, "two: {w}");
    // A's next segment, inside the 8 KiB it was offered, is taken whole,
    // and its ACK offers the new share.
    out.0.clear();
    let more = pattern(5000, 3);
    app_sends(&st, &mut out, &stats, ka, a_seq, sa, &more, t);
    st.poll_once(&mut out, &stats, t);
    assert_eq!(
        last_ack(&out, ka),
        Some(a_seq.wrapping_add(5000)),
        "all taken"
    );
    assert!(offer(&out, ka) as usize <= 4096);
    let got = read_exactly(&rt, &a, 1400 + 5000, 32 * 1024);
    assert!(got[1400..] == more[..]);
    assert!(read_exactly(&rt, &b, 1400, 32 * 1024) == pattern(1400, 2));
    // B goes: its ring back to the pool, and A is told at once that it
    // may send the whole budget again (its app is waiting for that).
    b.abort();
    drop(b);
    st.poll_once(&mut out, &stats, t);
    assert_eq!(loan_of(&st, ha), (true, 1));
    out.0.clear();
    t += Duration::from_millis(1);
    st.poll_once(&mut out, &stats, t);
    let w = offer(&out, ka);
    assert!(
        (7 * 1024..=8192).contains(&(w as usize)),
        "alone again: {w}"
    );
    // Quiet: A's ring back too, its cap lifted with it.
    go_quiet(&st, &mut out, &stats, &mut t);
    assert_eq!(st.inner.lock().loans.lent, 0);
}
