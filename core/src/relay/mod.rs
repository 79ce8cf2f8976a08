//! Bidirectional TCP relay with `copy_bidirectional` semantics: each direction
//! copies until its source reaches EOF, then shuts down the write half of the
//! other side while the opposite direction carries on (a half-closed
//! connection can still be answered). An error in either direction ends both.
//!
//! [`run`] is the one entry, for both stacks' sessions. It picks one of two
//! ways to move the bytes, per connection:
//!
//! * `splice` (Linux/Android), when both ends are kernel TCP sockets (the
//!   system stack's accepted socket) and the outbound carries the app's bytes
//!   unchanged (direct, SOCKS5 after its handshake, Shadowsocks `none` after
//!   the address header): the payload never enters userspace.
//! * `copy`, everywhere else: one direction written once for every pair of
//!   ends (a kernel or smoltcp socket toward the app) and every framing
//!   (plain, or the two halves of the outbound's [`Framing`]). An unframed
//!   direction between a smoltcp socket and a kernel socket moves the bytes
//!   straight between smoltcp's rings and the kernel, with no buffer of its
//!   own.
//!
//! Userspace buffers exist only while data flows, so ten thousand idle
//! connections hold no relay memory.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;

/// Entry points of the criterion bench, not part of the API.
#[cfg(feature = "bench-internals")]
pub mod bench;
mod copy;
#[cfg(linux_like)]
pub mod splice;

use crate::budget::{Admission, ByteBudget, FRAMING_STATE, RELAY_FALLBACK_BUFFER};
use crate::framing::Framing;
use crate::stats::Stats;
use copy::Codec;
use copy::Scratch;
pub(crate) use copy::{Moved, Side, read_exact};

/// Where a relay reports bytes as they move, so statistics are live during
/// long transfers, and where its userspace buffers are charged.
#[derive(Debug, Clone, Copy)]
pub struct Meter<'a> {
    /// Payload bytes from the app to the outbound.
    pub up: &'a AtomicU64,
    /// Payload bytes from the outbound to the app.
    pub down: &'a AtomicU64,
    /// Bytes (either direction) that went socket -> pipe -> socket in the kernel.
    pub spliced: &'a AtomicU64,
    /// Bytes (either direction) that went through a userspace buffer.
    pub copied: &'a AtomicU64,
    /// The relay pool full-size copy buffers are charged to (`None`: no
    /// bound, every buffer is full size).
    pub pool: Option<&'a ByteBudget>,
    /// The connection's own counters (up, down) in the live connection
    /// list (`conns.rs`), added to per chunk like the engine's.
    pub flow: Option<(&'a AtomicU64, &'a AtomicU64)>,
    /// Set for a session admitted without the relay's fallback share
    /// (smoltcp's): a framed relay's state and short cut frames, and a
    /// framed direction's fallback buffers, are charged to `pool`, or take
    /// a permit from here, and wait while neither has room.
    pub scratch: Option<&'a Admission>,
}

impl<'a> Meter<'a> {
    /// The engine's TCP byte counters (`tcp_bytes_*` of [`Stats`]), buffers
    /// charged to `pool`.
    pub fn tcp(stats: &'a Stats, pool: Option<&'a ByteBudget>) -> Self {
        Meter {
            up: &stats.tcp_bytes_up,
            down: &stats.tcp_bytes_down,
            spliced: &stats.tcp_bytes_spliced,
            copied: &stats.tcp_bytes_copied,
            pool,
            flow: None,
            scratch: None,
        }
    }

    /// This meter, for a session admitted without the relay's fallback
    /// share: its fallback memory comes from `admission` past the pool.
    pub fn unshared(self, admission: &'a Admission) -> Self {
        Meter {
            scratch: Some(admission),
            ..self
        }
    }

    /// This meter, also counting into one connection's `(up, down)`.
    pub fn with_flow(self, up: &'a AtomicU64, down: &'a AtomicU64) -> Self {
        Meter {
            flow: Some((up, down)),
            ..self
        }
    }
}

/// One direction's counters.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(
    not(linux_like),
    allow(dead_code) // `spliced` is only written by the splice relay
)]
pub(crate) struct LegMeter<'a> {
    pub bytes: &'a AtomicU64,
    pub spliced: &'a AtomicU64,
    pub copied: &'a AtomicU64,
    pub pool: Option<&'a ByteBudget>,
    /// The connection's own counter for this direction.
    pub flow: Option<&'a AtomicU64>,
    /// [`Meter::scratch`].
    pub scratch: Option<&'a Admission>,
}

impl<'a> Meter<'a> {
    pub(crate) fn up_leg(&self) -> LegMeter<'a> {
        self.leg(self.up, self.flow.map(|f| f.0))
    }
    pub(crate) fn down_leg(&self) -> LegMeter<'a> {
        self.leg(self.down, self.flow.map(|f| f.1))
    }
    /// One direction's meter: its total `bytes` and the connection's
    /// `flow` counter, with the shared ones.
    fn leg(&self, bytes: &'a AtomicU64, flow: Option<&'a AtomicU64>) -> LegMeter<'a> {
        LegMeter {
            bytes,
            spliced: self.spliced,
            copied: self.copied,
            pool: self.pool,
            flow,
            scratch: self.scratch,
        }
    }
}

impl LegMeter<'_> {
    pub(crate) fn add_copied(&self, leg: &mut Leg, n: usize) {
        leg.copied += n as u64;
        self.add(self.copied, n);
    }
    #[cfg_attr(not(linux_like), allow(dead_code))]
    pub(crate) fn add_spliced(&self, leg: &mut Leg, n: usize) {
        leg.spliced += n as u64;
        self.add(self.spliced, n);
    }
    /// `n` bytes moved: into the direction's total, the connection's
    /// counter and `how`'s (copied or spliced).
    fn add(&self, how: &AtomicU64, n: usize) {
        self.bytes.fetch_add(n as u64, Relaxed);
        if let Some(f) = self.flow {
            f.fetch_add(n as u64, Relaxed);
        }
        how.fetch_add(n as u64, Relaxed);
    }
}

/// Why a direction that could have been spliced was copied instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// `relay.splice = false`, or a platform without splice(2).
    Disabled,
    /// SIGPIPE has its default action in this process (splice cannot take
    /// MSG_NOSIGNAL, so a vanished peer would kill the host).
    SigpipeDefault,
    /// `pipe2` failed with this errno (EMFILE, ENFILE...).
    PipeFailed(i32),
    /// The kernel granted only this many bytes of pipe (per-user pipe budget).
    PipeTooSmall(usize),
    /// `splice` failed with EINVAL/ENOSYS/EOPNOTSUPP before its first success.
    Errno(i32),
    /// The urgent-mark probe is not available on this architecture.
    NoUrgentProbe,
}

/// What one direction moved, and how.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Leg {
    /// Bytes moved with splice(2) (never in userspace).
    pub spliced: u64,
    /// Bytes moved through a userspace buffer.
    pub copied: u64,
    /// Set when this direction gave up on splicing.
    pub fallback: Option<Fallback>,
}

impl Leg {
    /// Payload bytes moved in this direction.
    pub fn bytes(&self) -> u64 {
        self.spliced + self.copied
    }
}

/// Bytes moved in each direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Relayed {
    /// From the app to the outbound.
    pub up: Leg,
    /// From the outbound to the app.
    pub down: Leg,
}

/// How the relay (`run`) moves bytes between two plain sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayOptions {
    /// Splice on Linux/Android (`relay.splice` in the TOML).
    pub splice: bool,
    /// Userspace copy buffer per direction, allocated only while data flows.
    pub buffer: usize,
    /// Pipe capacity asked for per spliced direction (best effort).
    pub pipe_size: usize,
}

/// 256 KiB per direction keeps 128 connections spliced both ways within
/// Linux's default 64 MiB per-user pipe budget (`fs.pipe-user-pages-soft`),
/// and moves bulk data within a few percent of a 1 MiB pipe.
pub const PIPE_SIZE: usize = 256 * 1024;

/// The userspace copy of an unframed stream reads 64 KiB at a time: a
/// quarter of the system calls of 16 KiB reads on bulk transfers.
pub const PLAIN_READ_SIZE: usize = 64 * 1024;

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            splice: true,
            buffer: PLAIN_READ_SIZE,
            pipe_size: PIPE_SIZE,
        }
    }
}

/// How TCP bytes move between the app's socket and the outbound's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RelayConfig {
    /// Linux/Android: relay plain kernel sockets (direct, SOCKS5, Shadowsocks
    /// `none`) with splice(2), so the payload never enters userspace. `false`
    /// forces the userspace copy (for comparisons). Ignored elsewhere.
    pub splice: bool,
    /// Pipe capacity asked for per spliced direction (best effort; a smaller
    /// pipe than 64 KiB means the userspace copy).
    pub pipe_size: usize,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            splice: true,
            pipe_size: PIPE_SIZE,
        }
    }
}

/// Relay between the app's side and the outbound's socket until both
/// directions reached EOF (Ok) or one failed (Err). Splices when both ends
/// are kernel sockets, `framing` is `None` and `opts.splice` is on
/// (Linux/Android); copies through userspace otherwise, each direction
/// through its half of `framing` if there is one. Counts plaintext bytes.
pub(crate) async fn run<A: Side>(
    app: &A,
    out: &TcpStream,
    framing: Option<&mut (dyn Framing + 'static)>,
    opts: &RelayOptions,
    meter: &Meter<'_>,
) -> io::Result<Relayed> {
    if let Some(f) = framing {
        // The framing's state and a short cut frame (a longer one is
        // charged to the pool as it is held), for a session whose
        // admission left them out.
        let _state = match (meter.pool, meter.scratch) {
            (Some(pool), Some(admission)) => {
                // Boxed: only framed smoltcp sessions hold it (one
                // allocation per session), and this lives in every relay's
                // future.
                Some(Box::new(
                    Scratch::wait(pool, admission, FRAMING_STATE + RELAY_FALLBACK_BUFFER).await,
                ))
            }
            _ => None,
        };
        let (seal, open) = f.split();
        let (seal, open) = (Codec::Seal(seal), Codec::Open(open));
        return copy::both(app, out, seal, open, opts.buffer, meter, None).await;
    }
    // A userspace end (smoltcp) cannot be spliced: its copy is no fallback.
    let Some(kernel) = app.kernel_socket() else {
        let plain = (Codec::Plain, Codec::Plain);
        return copy::both(app, out, plain.0, plain.1, opts.buffer, meter, None).await;
    };
    #[cfg(linux_like)]
    if opts.splice {
        return splice::relay(kernel, out, opts, meter, &splice::KernelSplice).await;
    }
    let why = Some(Fallback::Disabled);
    copy::both(
        kernel,
        out,
        Codec::Plain,
        Codec::Plain,
        opts.buffer,
        meter,
        why,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framing::{Open, Seal};
    use kerntun_testkit::tokio_servers::tcp_pair;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// `near` sends `up` and half-closes; `far` reads to EOF, then answers
    /// `down` and closes; `near` reads to EOF. What `far` and `near` read.
    async fn half_close_then_reply(
        near: &mut TcpStream,
        far: &mut TcpStream,
        up: &[u8],
        down: &[u8],
    ) -> (Vec<u8>, Vec<u8>) {
        near.write_all(up).await.expect("write");
        near.shutdown().await.expect("half close");
        let mut got = Vec::new();
        far.read_to_end(&mut got).await.expect("read to EOF");
        far.write_all(down).await.expect("answer");
        far.shutdown().await.expect("close");
        let mut answer = Vec::new();
        near.read_to_end(&mut answer).await.expect("answer read");
        (got, answer)
    }

    /// client <-> [app_side | relay | out_side] <-> server, run both ways round
    /// (the relay must be symmetric).
    async fn half_close_then_answer(swap: bool) {
        let (mut client, app_side) = tcp_pair().await;
        let (out_side, mut server) = tcp_pair().await;
        let c = Stats::default();
        let (a, b) = if swap {
            (&out_side, &app_side)
        } else {
            (&app_side, &out_side)
        };
        let (near, far) = if swap {
            (&mut server, &mut client)
        } else {
            (&mut client, &mut server)
        };
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let meter = Meter::tcp(&c, None);
        let relay_fut = copy::both(
            a,
            b,
            Codec::Plain,
            Codec::Plain,
            4096,
            &meter,
            Some(Fallback::Disabled),
        );
        let test = async {
            let (got, answer) =
                half_close_then_reply(near, far, &payload, b"answer after EOF").await;
            assert_eq!(got, payload, "bytes in order and complete");
            // The far side answered after EOF; the near side still received it.
            assert_eq!(answer, b"answer after EOF");
        };
        let (r, ()) = tokio::join!(relay_fut, test);
        let r = r.expect("relay ok");
        assert_eq!(r.up.bytes(), payload.len() as u64);
        assert_eq!(r.down.bytes(), 16);
        assert_eq!(r.up.spliced + r.down.spliced, 0);
        assert_eq!(c.tcp_bytes_up.load(Relaxed), r.up.bytes());
        assert_eq!(c.tcp_bytes_down.load(Relaxed), r.down.bytes());
        assert_eq!(
            c.tcp_bytes_copied.load(Relaxed),
            r.up.bytes() + r.down.bytes()
        );
    }

    #[tokio::test]
    async fn half_close_is_passed_on_and_answered() {
        half_close_then_answer(false).await;
        half_close_then_answer(true).await;
    }

    #[tokio::test]
    async fn empty_transfer_and_reset() {
        let (client, app_side) = tcp_pair().await;
        let (out_side, server) = tcp_pair().await;
        let c = Stats::default();
        drop(client);
        drop(server);
        let opts = RelayOptions {
            splice: false,
            ..RelayOptions::default()
        };
        let r = run(&app_side, &out_side, None, &opts, &Meter::tcp(&c, None)).await;
        // Both peers closed without data: either a clean 0/0 or a reset, never a hang.
        if let Ok(r) = r {
            assert_eq!(r.up.bytes() + r.down.bytes(), 0);
        }
    }

    /// A toy framing: XOR on the way out, XOR back on the way in, so the
    /// test can check that both transforms ran on every byte.
    #[derive(Debug)]
    struct Xor(u8);
    impl Seal for Xor {
        fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>) {
            out.extend(plain.iter().map(|b| b ^ self.0));
        }
    }
    impl Open for Xor {
        fn open(&mut self, wire: &[u8], out: &mut Vec<u8>, _room: usize) -> io::Result<usize> {
            out.extend(wire.iter().map(|b| b ^ self.0));
            Ok(wire.len())
        }
        fn finish(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    #[derive(Debug)]
    struct XorFraming(Xor, Xor);
    impl Framing for XorFraming {
        fn split(&mut self) -> (&mut dyn Seal, &mut dyn Open) {
            (&mut self.0, &mut self.1)
        }
    }

    /// A framed outbound is copied (never spliced, even between two kernel
    /// sockets with splicing on), through its framing both ways.
    #[tokio::test]
    async fn framed_relay_transforms_both_ways_and_half_closes() {
        let (mut client, app_side) = tcp_pair().await;
        let (out_side, mut server) = tcp_pair().await;
        let c = Stats::default();
        let mut framing = XorFraming(Xor(0x5a), Xor(0x5a));
        let meter = Meter::tcp(&c, None);
        let opts = RelayOptions {
            splice: true,
            buffer: 1024,
            ..RelayOptions::default()
        };
        let relay_fut = run(&app_side, &out_side, Some(&mut framing), &opts, &meter);
        let test = async {
            let (got, back) = half_close_then_reply(
                &mut client,
                &mut server,
                b"hello",
                &b"world".map(|b| b ^ 0x5a),
            )
            .await;
            assert_eq!(got, b"hello".map(|b| b ^ 0x5a));
            assert_eq!(back, b"world");
        };
        let (r, ()) = tokio::join!(relay_fut, test);
        let r = r.expect("relay");
        assert_eq!((r.up.copied, r.down.copied), (5, 5));
        assert_eq!((r.up.spliced, r.down.spliced), (0, 0));
        assert_eq!(
            (r.up.fallback, r.down.fallback),
            (None, None),
            "no fallback"
        );
    }
}
