//! The smoltcp stack without a TUN: packets in, packets out through a vector.

use super::*;
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

fn stack() -> Arc<SmolStack> {
    let nets: Vec<IpNet> = vec![
        "198.18.0.1/16".parse().expect("test input"),
        "fd00:18::1/64".parse().expect("test input"),
    ];
    Arc::new(SmolStack::new(
        &nets,
        1500,
        16 * 1024,
        Duration::from_secs(7440),
        Duration::from_secs(10),
        2,
    ))
}

fn key(c: &str, s: &str) -> Key {
    (
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

fn handshake(
    st: &SmolStack,
    out: &mut Capture,
    stats: &Stats,
    v6: bool,
) -> (Key, SocketHandle, u32) {
    let (c, s) = if v6 {
        ("[fd00:18::9]:40000", "[2001:db8::1]:443")
    } else {
        ("10.0.0.9:40000", "1.1.1.1:443")
    };
    let k = key(c, s);
    let syn = if v6 {
        tcp_v6(c, s, &[], 1000, 0, SYN, &[], &[])
    } else {
        tcp_v4(c, s, 1000, 0, SYN, &[], &[])
    };
    assert_eq!(st.syn(k), Syn::New);
    assert_eq!(
        st.syn(k),
        Syn::Connecting,
        "a retransmit while connecting is absorbed"
    );
    let h = st.accept(k, &syn, Instant::now(), out).expect("accepted");
    let synack = out.0.pop().expect("SYN-ACK sent");
    let (src, dst, sseq, ack, fl, _) = seg(&synack);
    assert_eq!((src, dst), (k.1, k.0), "answered from the server's address");
    assert_eq!(fl & (SYN | ACK), SYN | ACK);
    assert_eq!(ack, 1001);
    assert_eq!(
        st.syn(k),
        Syn::Known,
        "a SYN retransmit now goes to the socket"
    );
    let ack = if v6 {
        tcp_v6(c, s, &[], 1001, sseq.wrapping_add(1), ACK, &[], &[])
    } else {
        tcp_v4(c, s, 1001, sseq.wrapping_add(1), ACK, &[], &[])
    };
    st.input(&ack, Instant::now(), out, stats);
    (k, h, sseq.wrapping_add(1))
}

#[test]
fn handshake_data_and_close_both_families() {
    for v6 in [false, true] {
        let st = stack();
        let stats = Stats::default();
        let mut out = Capture::default();
        let (k, h, srv_seq) = handshake(&st, &mut out, &stats, v6);
        assert_eq!(st.inner.lock().socket(h).state(), State::Established);
        let (c, s) = (k.0.to_string(), k.1.to_string());
        let mk = |seq, fl, data: &[u8]| {
            if v6 {
                tcp_v6(&c, &s, &[], seq, srv_seq, fl, &[], data)
            } else {
                tcp_v4(&c, &s, seq, srv_seq, fl, &[], data)
            }
        };
        st.input(
            &mk(1001, ACK | PSH, b"hello"),
            Instant::now(),
            &mut out,
            &stats,
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("test input");
        let app = SmolStream::new(st.clone(), h, k);
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
    let st = stack();
    let stats = Stats::default();
    let mut out = Capture::default();
    let (k, h, _) = handshake(&st, &mut out, &stats, false);
    let app = SmolStream::new(st.clone(), h, k);
    app.abort();
    drop(app);
    out.0.clear();
    st.poll_once(&mut out, &stats, Instant::now());
    assert!(out.0.iter().any(|p| seg(p).4 & RST != 0), "RST to the app");
    assert_eq!(st.counts(), (0, 0), "socket removed once closed");
    assert_eq!(st.syn(k), Syn::New, "the tuple is free again");
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
    assert_eq!(socket_buffer(Platform::Ios), 64 * 1024);
    assert!(socket_buffer(Platform::Android) <= 128 * 1024);
    assert!(socket_buffer(Platform::Desktop) > socket_buffer(Platform::Android));
}
