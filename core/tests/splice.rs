//! The splice relay against real loopback sockets (Linux/Android): both
//! directions with counts, empty and 1-byte transfers, half-close answered
//! after EOF, a slow reader, every fallback errno (with bytes left in the
//! pipe), pipe failures, urgent data, a reset, 64 parallel connections,
//! which path carried the bytes (counts and the trace log), and idle
//! connections holding no pipe.
//!
//! Errnos are injected through [`SpliceOps`], the relay's system-call seam.
#![cfg(any(target_os = "linux", target_os = "android"))]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kerntun::relay::splice::{self, KernelSplice, Pipe, SpliceOps};
use kerntun::relay::{Fallback, Meter, RelayOptions, Relayed};
use kerntun::stats::Stats;
use kerntun_testkit::pattern;
use kerntun_testkit::tokio_servers::tcp_pair;
use socket2::SockRef;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MIB: usize = 1024 * 1024;
/// Every test finishes well within this; a hang is a failure, not a stuck CI.
const LIMIT: Duration = Duration::from_secs(30);

/// Which splice to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// socket -> pipe
    In,
    /// pipe -> socket
    Out,
}

/// The real system calls, with an errno injected on the `nth` (1-based)
/// splice of one side, or a pipe failure / small pipe.
#[derive(Default)]
struct Faulty {
    fail: Option<(Side, usize, i32)>,
    pipe_errno: Option<i32>,
    pipe_size: Option<usize>,
    pipes: Mutex<Vec<RawFd>>,
    pipes_made: AtomicUsize,
    /// Released pipes, reused like the kernel ops' per-thread pool does, so
    /// `pipes_made` counts the pipes a relay needed, not its bursts.
    pool: Mutex<Vec<Pipe>>,
    ins: AtomicUsize,
    outs: AtomicUsize,
}

impl SpliceOps for Faulty {
    fn pipe(&self, size: usize) -> io::Result<Pipe> {
        if let Some(e) = self.pipe_errno {
            return Err(io::Error::from_raw_os_error(e));
        }
        if let Some(p) = self.pool.lock().expect("lock").pop() {
            return Ok(p);
        }
        let mut p = KernelSplice.pipe(self.pipe_size.unwrap_or(size))?;
        if let Some(s) = self.pipe_size {
            p.size = p.size.min(s);
        }
        self.pipes.lock().expect("lock").push(p.write.as_raw_fd());
        self.pipes_made.fetch_add(1, Relaxed);
        Ok(p)
    }
    fn splice(&self, from: BorrowedFd<'_>, to: BorrowedFd<'_>, len: usize) -> io::Result<usize> {
        let side = if self.pipes.lock().expect("lock").contains(&to.as_raw_fd()) {
            Side::In
        } else {
            Side::Out
        };
        let n = match side {
            Side::In => self.ins.fetch_add(1, Relaxed) + 1,
            Side::Out => self.outs.fetch_add(1, Relaxed) + 1,
        };
        if let Some((s, nth, errno)) = self.fail
            && s == side
            && n == nth
        {
            return Err(io::Error::from_raw_os_error(errno));
        }
        KernelSplice.splice(from, to, len)
    }
    fn release(&self, pipe: Pipe, _size: usize) {
        self.pool.lock().expect("lock").push(pipe);
    }
}

/// client <-> app_side [relay] out_side <-> server.
struct Rig {
    client: TcpStream,
    server: TcpStream,
    relay: tokio::task::JoinHandle<(io::Result<Relayed>, Arc<Stats>)>,
}

async fn rig(ops: Arc<dyn SpliceOps + Send>, opts: RelayOptions) -> Rig {
    let (client, app_side) = tcp_pair().await;
    let (out_side, server) = tcp_pair().await;
    let relay = tokio::spawn(async move {
        let c = Arc::new(Stats::default());
        let r = splice::relay(&app_side, &out_side, &opts, &Meter::tcp(&c, None), &*ops).await;
        (r, c)
    });
    Rig {
        client,
        server,
        relay,
    }
}

impl Rig {
    /// Send `up` from the client and `down` from the server at once, the
    /// connection left open; what the server and the client received.
    async fn exchange(&mut self, up: &[u8], down: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let mut got_up = vec![0u8; up.len()];
        let mut got_down = vec![0u8; down.len()];
        let (mut cr, mut cw) = self.client.split();
        let (mut sr, mut sw) = self.server.split();
        let (w1, r1, w2, r2) = tokio::join!(
            cw.write_all(up),
            sr.read_exact(&mut got_up),
            sw.write_all(down),
            cr.read_exact(&mut got_down),
        );
        w1.expect("w up");
        r1.expect("r up");
        w2.expect("w down");
        r2.expect("r down");
        (got_up, got_down)
    }
}

fn opts() -> RelayOptions {
    RelayOptions::default()
}

async fn finish(
    rig_relay: tokio::task::JoinHandle<(io::Result<Relayed>, Arc<Stats>)>,
) -> (io::Result<Relayed>, Arc<Stats>) {
    tokio::time::timeout(LIMIT, rig_relay)
        .await
        .expect("relay finished in time")
        .expect("relay task")
}

/// Write `data` then half-close, from a task.
fn send_then_close(
    mut w: tokio::net::tcp::OwnedWriteHalf,
    data: Vec<u8>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        w.write_all(&data).await.expect("write");
        w.shutdown().await.expect("half-close");
        // Keep the write half alive until the reader is done.
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(w);
    })
}

async fn read_all(r: &mut tokio::net::tcp::OwnedReadHalf) -> Vec<u8> {
    let mut got = Vec::new();
    tokio::time::timeout(LIMIT, r.read_to_end(&mut got))
        .await
        .expect("read in time")
        .expect("read");
    got
}

/// Both directions at once, each checked byte for byte, with counts.
async fn both_ways(up_len: usize, down_len: usize) -> (Relayed, Arc<Stats>) {
    let rig = rig(Arc::new(KernelSplice), opts()).await;
    let (mut cr, cw) = rig.client.into_split();
    let (mut sr, sw) = rig.server.into_split();
    let up = pattern(1, up_len);
    let down = pattern(2, down_len);
    let a = send_then_close(cw, up.clone());
    let b = send_then_close(sw, down.clone());
    let (got_up, got_down) = tokio::join!(read_all(&mut sr), read_all(&mut cr));
    assert!(
        got_up == up,
        "upload intact ({} of {up_len} bytes)",
        got_up.len()
    );
    assert!(
        got_down == down,
        "download intact ({} of {down_len})",
        got_down.len()
    );
    a.await.expect("a");
    b.await.expect("b");
    let (r, c) = finish(rig.relay).await;
    let r = r.expect("relay ok");
    assert_eq!(r.up.bytes(), up_len as u64);
    assert_eq!(r.down.bytes(), down_len as u64);
    assert_eq!(
        c.tcp_bytes_up.load(Relaxed),
        up_len as u64,
        "live up counter"
    );
    assert_eq!(
        c.tcp_bytes_down.load(Relaxed),
        down_len as u64,
        "live down counter"
    );
    (r, c)
}

#[tokio::test]
async fn both_directions_spliced_with_counts() {
    let (r, c) = both_ways(16 * MIB, 8 * MIB).await;
    assert_eq!((r.up.spliced, r.up.copied), (16 * MIB as u64, 0));
    assert_eq!((r.down.spliced, r.down.copied), (8 * MIB as u64, 0));
    assert_eq!((r.up.fallback, r.down.fallback), (None, None));
    assert_eq!(c.tcp_bytes_spliced.load(Relaxed), 24 * MIB as u64);
    assert_eq!(c.tcp_bytes_copied.load(Relaxed), 0);
}

#[tokio::test]
async fn empty_and_one_byte_transfers() {
    let (r, _) = both_ways(0, 0).await;
    assert_eq!(r.up.bytes() + r.down.bytes(), 0);
    let (r, _) = both_ways(1, 1).await;
    assert_eq!((r.up.spliced, r.down.spliced), (1, 1));
    let (r, _) = both_ways(1, 0).await;
    assert_eq!((r.up.spliced, r.down.spliced), (1, 0));
}

#[tokio::test]
async fn an_idle_direction_takes_no_pipe() {
    let ops = Arc::new(Faulty::default());
    let rig = rig(ops.clone(), opts()).await;
    let (mut cr, cw) = rig.client.into_split();
    let (mut sr, sw) = rig.server.into_split();
    let a = send_then_close(cw, pattern(3, 100_000));
    assert_eq!(read_all(&mut sr).await, pattern(3, 100_000));
    // The server closes without sending: the down direction sees only EOF.
    drop(sw);
    assert!(read_all(&mut cr).await.is_empty());
    a.await.expect("a");
    let (r, _) = finish(rig.relay).await;
    assert_eq!(r.expect("ok").up.spliced, 100_000);
    assert_eq!(
        ops.pipes_made.load(Relaxed),
        1,
        "only the direction that carried bytes made a pipe"
    );
}

/// The client half-closes; the server reads to EOF, then answers; the
/// answer still reaches the client. Run from both ends (the relay is symmetric).
#[tokio::test]
async fn half_close_answered_after_eof_both_ways_round() {
    for swap in [false, true] {
        let rig = rig(Arc::new(KernelSplice), opts()).await;
        let (near, far) = if swap {
            (rig.server, rig.client)
        } else {
            (rig.client, rig.server)
        };
        let (mut nr, mut nw) = near.into_split();
        let (mut fr, mut fw) = far.into_split();
        let data = pattern(4, 3 * MIB);
        nw.write_all(&data).await.expect("w");
        nw.shutdown().await.expect("half-close");
        assert_eq!(read_all(&mut fr).await, data);
        fw.write_all(b"answer after EOF").await.expect("answer");
        fw.shutdown().await.expect("close");
        assert_eq!(read_all(&mut nr).await, b"answer after EOF");
        let (r, _) = finish(rig.relay).await;
        let r = r.expect("ok");
        let (fwd, back) = if swap { (r.down, r.up) } else { (r.up, r.down) };
        assert_eq!((fwd.spliced, back.spliced), (3 * MIB as u64, 16));
    }
}

#[tokio::test]
async fn slow_reader_backpressure() {
    let rig = rig(Arc::new(KernelSplice), opts()).await;
    let (_cr, cw) = rig.client.into_split();
    let (mut sr, _sw) = rig.server.into_split();
    let data = pattern(5, 8 * MIB);
    let w = send_then_close(cw, data.clone());
    // Read in small pieces with pauses: the relay meets EAGAIN on the write
    // side again and again and must neither lose bytes nor spin.
    let mut got = Vec::with_capacity(data.len());
    let mut buf = vec![0u8; 64 * 1024];
    let mut pauses = 0;
    loop {
        let n = tokio::time::timeout(LIMIT, sr.read(&mut buf))
            .await
            .expect("in time")
            .expect("read");
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
        if pauses < 40 {
            pauses += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    assert!(got == data, "slow read intact ({} bytes)", got.len());
    w.await.expect("w");
    drop(_sw);
    let (r, _) = finish(rig.relay).await;
    assert_eq!(r.expect("ok").up.spliced, 8 * MIB as u64);
}

/// Inject `errno` on the `nth` splice of `side` while 4 MiB go up.
async fn inject(side: Side, nth: usize, errno: i32) -> (io::Result<Relayed>, Vec<u8>, Vec<u8>) {
    let ops = Arc::new(Faulty {
        fail: Some((side, nth, errno)),
        ..Faulty::default()
    });
    let rig = rig(ops, opts()).await;
    let (mut cr, cw) = rig.client.into_split();
    let (mut sr, sw) = rig.server.into_split();
    let data = pattern(6, 4 * MIB);
    let w = send_then_close(cw, data.clone());
    let mut got = Vec::new();
    let _ = tokio::time::timeout(LIMIT, sr.read_to_end(&mut got))
        .await
        .expect("in time");
    drop(sw);
    let mut back = Vec::new();
    let _ = tokio::time::timeout(LIMIT, cr.read_to_end(&mut back)).await;
    w.abort();
    let (r, _) = finish(rig.relay).await;
    (r, got, data)
}

#[tokio::test]
async fn each_fallback_errno_before_first_success_keeps_every_byte() {
    for errno in [libc::EINVAL, libc::ENOSYS, libc::EOPNOTSUPP] {
        // On the first pipe -> socket splice: the pipe holds the bytes of the
        // first socket -> pipe splice, which must be written out first.
        let (r, got, data) = inject(Side::Out, 1, errno).await;
        let r = r.expect("fallback is not an error");
        assert!(got == data, "errno {errno}: bytes intact and in order");
        assert_eq!(r.up.fallback, Some(Fallback::Errno(errno)));
        assert_eq!(r.up.spliced, 0, "nothing reached the socket by splice");
        assert_eq!(r.up.copied, data.len() as u64);
        // On the first socket -> pipe splice: nothing is in the pipe yet.
        let (r, got, data) = inject(Side::In, 1, errno).await;
        let r = r.expect("fallback is not an error");
        assert!(got == data, "errno {errno} on the way in: bytes intact");
        assert_eq!(r.up.fallback, Some(Fallback::Errno(errno)));
        assert_eq!(r.up.copied, data.len() as u64);
    }
}

#[tokio::test]
async fn the_same_errno_after_a_success_is_an_error() {
    for side in [Side::In, Side::Out] {
        let (r, got, data) = inject(side, 3, libc::EINVAL).await;
        let e = r.expect_err("EINVAL after a successful splice is an error");
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{side:?}");
        assert!(got.len() < data.len(), "the transfer was cut");
        assert!(data.starts_with(&got), "what arrived is a prefix");
    }
}

#[tokio::test]
async fn pipe_failures_mean_copying() {
    for (ops, want) in [
        (
            Faulty {
                pipe_errno: Some(libc::EMFILE),
                ..Faulty::default()
            },
            Fallback::PipeFailed(libc::EMFILE),
        ),
        (
            Faulty {
                pipe_size: Some(8192),
                ..Faulty::default()
            },
            Fallback::PipeTooSmall(8192),
        ),
    ] {
        let rig = rig(Arc::new(ops), opts()).await;
        let (mut cr, cw) = rig.client.into_split();
        let (mut sr, sw) = rig.server.into_split();
        let data = pattern(7, 2 * MIB);
        let w = send_then_close(cw, data.clone());
        assert!(read_all(&mut sr).await == data);
        let w2 = send_then_close(sw, b"back".to_vec());
        assert_eq!(read_all(&mut cr).await, b"back");
        w.await.expect("w");
        w2.await.expect("w2");
        let (r, c) = finish(rig.relay).await;
        let r = r.expect("ok");
        assert_eq!(r.up.fallback, Some(want));
        assert_eq!((r.up.spliced, r.up.copied), (0, 2 * MIB as u64));
        assert_eq!(c.tcp_bytes_copied.load(Relaxed), 2 * MIB as u64 + 4);
    }
}

/// Send `before`, one urgent byte, `after`, then the FIN; the far side must
/// get `before ++ after` (the urgent byte dropped, as a userspace copy does)
/// and the relay must not stall at the mark.
async fn urgent(before: &[u8], after: &[u8], splice: bool) -> Relayed {
    let o = RelayOptions { splice, ..opts() };
    let rig = rig(Arc::new(KernelSplice), o).await;
    let (mut sr, sw) = rig.server.into_split();
    let mut c = rig.client;
    c.write_all(before).await.expect("before");
    // Let the first part arrive on its own segment.
    tokio::time::sleep(Duration::from_millis(30)).await;
    SockRef::from(&c).send_out_of_band(b"!").expect("oob");
    tokio::time::sleep(Duration::from_millis(30)).await;
    c.write_all(after).await.expect("after");
    c.shutdown().await.expect("fin");
    let got = read_all(&mut sr).await;
    let mut want = before.to_vec();
    want.extend_from_slice(after);
    assert_eq!(got, want, "splice={splice}");
    drop(sw);
    let mut rest = Vec::new();
    let (mut cr, _cw) = c.into_split();
    let _ = cr.read_to_end(&mut rest).await;
    let (r, _) = finish(rig.relay).await;
    r.expect("relay ok")
}

#[tokio::test]
async fn urgent_data_mid_stream_and_right_before_fin() {
    let big = pattern(8, 300_000);
    for splice in [true, false] {
        let r = urgent(b"before", b"after", splice).await;
        assert_eq!(r.up.bytes(), 11);
        let r = urgent(&big, b"tail", splice).await;
        assert_eq!(r.up.bytes(), big.len() as u64 + 4);
        let r = urgent(b"just before the fin", b"", splice).await;
        assert_eq!(r.up.bytes(), 19);
        if splice {
            assert!(r.up.spliced > 0, "the part before the mark was spliced");
        }
    }
}

#[tokio::test]
async fn reset_during_transfer_ends_the_relay_with_an_error() {
    let rig = rig(Arc::new(KernelSplice), opts()).await;
    let (_cr, mut cw) = rig.client.into_split();
    let server = rig.server;
    let writer = tokio::spawn(async move {
        let chunk = pattern(9, MIB);
        // Until the relay breaks the connection (bounded: 512 MiB).
        for _ in 0..512 {
            if cw.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let mut buf = vec![0u8; MIB];
    let mut server = server;
    let mut seen = 0;
    while seen < 2 * MIB {
        seen += server.read(&mut buf).await.expect("read");
    }
    // Reset from the server's side while bytes are in flight.
    SockRef::from(&server)
        .set_linger(Some(Duration::ZERO))
        .expect("linger");
    drop(server);
    let (r, _) = finish(rig.relay).await;
    assert!(r.is_err(), "a reset is an error: {r:?}");
    writer.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_parallel_connections() {
    let mut tasks = Vec::new();
    for i in 0..64u64 {
        tasks.push(tokio::spawn(async move {
            let rig = rig(Arc::new(KernelSplice), opts()).await;
            let (mut cr, cw) = rig.client.into_split();
            let (mut sr, sw) = rig.server.into_split();
            let up = pattern(100 + i, MIB);
            let down = pattern(200 + i, MIB / 2);
            let a = send_then_close(cw, up.clone());
            let b = send_then_close(sw, down.clone());
            let (gu, gd) = tokio::join!(read_all(&mut sr), read_all(&mut cr));
            assert!(gu == up && gd == down, "connection {i} intact");
            a.await.expect("a");
            b.await.expect("b");
            let (r, _) = finish(rig.relay).await;
            let r = r.expect("ok");
            assert_eq!((r.up.spliced, r.down.spliced), (MIB as u64, MIB as u64 / 2));
        }));
    }
    for t in tasks {
        t.await.expect("connection task");
    }
}

/// The trace log names the path: with splicing on, "spliced" counts carry
/// the bytes; with it off, "copied" and the reason.
#[test]
fn the_trace_log_says_which_path_carried_the_bytes() {
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl io::Write for Sink {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink::default();
    let w = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || w.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("rt");
        rt.block_on(async {
            let (r, _) = both_ways(MIB, 10).await;
            assert_eq!(r.up.spliced, MIB as u64);
        });
    });
    let log = String::from_utf8(sink.0.lock().expect("lock").clone()).expect("utf8");
    assert!(
        log.contains(&format!("up {} B spliced + 0 B copied", MIB)),
        "trace log names the splice path: {log}"
    );
    assert!(log.contains("down 10 B spliced + 0 B copied"), "{log}");
}

/// Pipe descriptors open in this process.
fn count_pipes() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().starts_with("pipe:"))
        })
        .count()
}

/// Set in the child process that runs the body of
/// [`idle_spliced_connections_hold_no_pipes`].
const FD_CHILD: &str = "KERNTUN_SPLICE_FD_CHILD";

/// Idle spliced connections hold no pipe: after bursts both ways on 40
/// connections, the only pipes left in the process are the per-thread pool's
/// (at most `POOL_PER_THREAD`), not two per connection; a direction blocked
/// on a full destination does hold its pipe; bytes stay exact over idle ->
/// burst -> idle -> burst. Counting descriptors needs a process of its own
/// (other tests open pipes concurrently), so the test re-runs itself, alone,
/// in a child.
#[test]
fn idle_spliced_connections_hold_no_pipes() {
    rerun_in_child(
        "idle_spliced_connections_hold_no_pipes",
        FD_CHILD,
        idle_pipes_body,
    );
}

/// Run the test `name` of this binary again, alone, in a child process with
/// `env` set (the test then runs its body), and check that it passed. In
/// that child (`env` set), run `body` instead.
fn rerun_in_child(name: &str, env: &str, body: fn()) {
    if std::env::var_os(env).is_some() {
        body();
        return;
    }
    let exe = std::env::current_exe().expect("test executable");
    let out = std::process::Command::new(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(env, "1")
        .output()
        .expect("child test process");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "child failed ({:?}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("1 passed"),
        "the child ran the test:\n{stdout}"
    );
}

fn idle_pipes_body() {
    const N: usize = 40;
    const UP: usize = 300_000;
    const DOWN: usize = 100_000;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        tokio::time::timeout(LIMIT * 2, async {
            // The child's stdio are pipes of its own: count relative to them.
            let base = count_pipes();
            let mut rigs = Vec::new();
            for _ in 0..N {
                rigs.push(rig(Arc::new(KernelSplice), opts()).await);
            }
            assert_eq!(count_pipes(), base, "no pipe before the first byte");
            for round in 0..2u64 {
                for (i, r) in rigs.iter_mut().enumerate() {
                    let seed = 1000 * (round + 1) + i as u64;
                    let (up, down) = (pattern(seed, UP), pattern(seed + 500, DOWN));
                    let (got_up, got_down) = r.exchange(&up, &down).await;
                    assert!(got_up == up, "round {round} conn {i}: upload intact");
                    assert!(got_down == down, "round {round} conn {i}: download intact");
                }
                // Idle: every relay task has met EAGAIN and is parked.
                tokio::time::sleep(Duration::from_millis(20)).await;
                let pooled = splice::pooled_pipes();
                assert!(pooled <= splice::POOL_PER_THREAD, "pool bounded: {pooled}");
                assert_eq!(
                    count_pipes() - base,
                    2 * pooled,
                    "round {round}: idle connections hold no pipe (only the pool's {pooled})"
                );
            }
            // A direction stuck on a full destination keeps its (full) pipe.
            let stuck = &mut rigs[0];
            let big = pattern(7, 64 * MIB);
            let blocked =
                tokio::time::timeout(Duration::from_millis(300), stuck.client.write_all(&big));
            assert!(blocked.await.is_err(), "64 MiB cannot fit in the buffers");
            let pooled = splice::pooled_pipes();
            assert_eq!(
                count_pipes() - base,
                2 * pooled + 2,
                "the busy direction holds one pipe"
            );
            let mut sink = vec![0u8; MIB];
            let n = tokio::time::timeout(LIMIT, stuck.server.read(&mut sink))
                .await
                .expect("in time")
                .expect("read");
            assert!(
                n > 0 && big.starts_with(&sink[..n]),
                "the stuck bytes are the pattern's start"
            );
            // Close everything; each relay reports what it moved.
            let mut totals = Vec::new();
            for r in rigs {
                let (cr, mut cw) = r.client.into_split();
                let (mut sr, mut sw) = r.server.into_split();
                cw.shutdown().await.expect("client fin");
                sw.shutdown().await.expect("server fin");
                let mut rest = Vec::new();
                let _ = tokio::time::timeout(LIMIT, sr.read_to_end(&mut rest)).await;
                drop((cr, cw, sr, sw));
                let (res, _) = finish(r.relay).await;
                totals.push(res);
            }
            for (i, t) in totals.into_iter().enumerate().skip(1) {
                let t = t.expect("relay ok");
                assert_eq!(
                    (t.up.spliced, t.down.spliced),
                    (2 * UP as u64, 2 * DOWN as u64),
                    "conn {i}"
                );
                assert_eq!(t.up.copied + t.down.copied, 0, "conn {i}");
            }
            assert_eq!(
                count_pipes() - base,
                2 * splice::pooled_pipes(),
                "after close"
            );
        })
        .await
    })
    .expect("the idle-pipe test finished in time");
}

const SIGPIPE_CHILD: &str = "KERNTUN_SPLICE_SIGPIPE_CHILD";

/// A host app that left SIGPIPE at its default action (terminate): splice
/// cannot take MSG_NOSIGNAL, so the relay must not splice there. It copies
/// instead (the fallback says why), moves every byte, and a peer that resets
/// mid-transfer ends the relay with an error, not the process. Rust test
/// binaries ignore SIGPIPE at startup, so the test re-runs itself in a child
/// that restores the default first.
#[test]
fn sigpipe_at_its_default_action_means_copy_and_no_crash() {
    rerun_in_child(
        "sigpipe_at_its_default_action_means_copy_and_no_crash",
        SIGPIPE_CHILD,
        sigpipe_default_body,
    );
}

#[allow(unsafe_code)]
fn restore_default_sigpipe() {
    // SAFETY: setting a signal's disposition to SIG_DFL installs no handler
    // code; the child test process is single-threaded at this point
    // (--test-threads=1, before its runtime starts).
    let prev = unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    assert_ne!(prev, libc::SIG_ERR, "signal(SIGPIPE, SIG_DFL)");
}

fn sigpipe_default_body() {
    restore_default_sigpipe();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        tokio::time::timeout(LIMIT, async {
            // Bytes both ways, then a clean close: all copied, none spliced.
            let mut r = rig(Arc::new(KernelSplice), opts()).await;
            let up = pattern(71, 2 * MIB);
            let down = pattern(72, MIB);
            let (got_up, got_down) = r.exchange(&up, &down).await;
            assert!(got_up == up && got_down == down, "bytes intact");
            r.client.shutdown().await.expect("client fin");
            r.server.shutdown().await.expect("server fin");
            let (res, _) = finish(r.relay).await;
            let done = res.expect("relay ok");
            for leg in [done.up, done.down] {
                assert_eq!(leg.spliced, 0, "{done:?}");
                assert_eq!(leg.fallback, Some(Fallback::SigpipeDefault), "{done:?}");
            }
            assert_eq!(done.up.copied, up.len() as u64);
            assert_eq!(done.down.copied, down.len() as u64);

            // A peer that resets while the relay writes to it: an error for
            // the relay, and this process (SIGPIPE at default) lives on.
            let mut r = rig(Arc::new(KernelSplice), opts()).await;
            SockRef::from(&r.server)
                .set_linger(Some(Duration::ZERO))
                .expect("linger");
            drop(r.server);
            let chunk = pattern(73, 256 * 1024);
            for _ in 0..16 {
                if r.client.write_all(&chunk).await.is_err() {
                    break;
                }
            }
            let (res, _) = finish(r.relay).await;
            assert!(res.is_err(), "writing to a reset peer is an error: {res:?}");
        })
        .await
        .expect("within the limit");
    });
}
