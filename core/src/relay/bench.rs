//! Entry points of the relay's criterion bench (`benches/benches/relay.rs`),
//! built with the `bench-internals` feature only: what one relayed chunk's
//! counters cost, with and without the connection's own counters of the
//! live connection list (`conns.rs`).

use std::io;
use std::sync::atomic::AtomicU64;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{Leg, Meter, RelayOptions};
use crate::stats::Stats;

/// The counters one relayed chunk updates, as the copy relay updates them
/// (`LegMeter::add_copied`), `chunks` times over chunks of `len` bytes;
/// with `flow`, the connection's own counter too. Returns the bytes the
/// engine's counter saw.
pub fn count_chunks(chunks: u64, len: usize, flow: bool) -> u64 {
    let stats = Stats::default();
    let conn = (AtomicU64::new(0), AtomicU64::new(0));
    let meter = meter(&stats, flow.then_some(&conn));
    let leg_meter = meter.up_leg();
    let mut leg = Leg::default();
    for _ in 0..chunks {
        leg_meter.add_copied(&mut leg, std::hint::black_box(len));
    }
    stats
        .tcp_bytes_up
        .load(std::sync::atomic::Ordering::Relaxed)
}

/// The engine's TCP meter, counting into a connection's own `(up, down)`
/// too when given.
fn meter<'a>(stats: &'a Stats, conn: Option<&'a (AtomicU64, AtomicU64)>) -> Meter<'a> {
    let meter = Meter::tcp(stats, None);
    match conn {
        Some((up, down)) => meter.with_flow(up, down),
        None => meter,
    }
}

/// Two loopback TCP connections with the engine's userspace copy relay
/// (splice off, 64 KiB reads) between them, on one current-thread
/// runtime: what a relayed byte costs end to end.
#[derive(Debug)]
pub struct CopyRelay {
    rt: tokio::runtime::Runtime,
}

impl CopyRelay {
    pub fn new() -> io::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(CopyRelay { rt })
    }

    /// Relays `total` bytes from a client to a server and their EOF,
    /// counting into the connection's own counters too when `flow`.
    /// Returns the bytes the server read.
    pub fn relay(&self, total: usize, flow: bool) -> io::Result<u64> {
        self.rt.block_on(async {
            let (mut client, app) = pair().await?;
            let (out, mut server) = pair().await?;
            let stats = Stats::default();
            let conn = (AtomicU64::new(0), AtomicU64::new(0));
            let meter = meter(&stats, flow.then_some(&conn));
            let opts = RelayOptions {
                splice: false,
                ..RelayOptions::default()
            };
            let send = async {
                let chunk = vec![0x5au8; 64 * 1024];
                let mut left = total;
                while left > 0 {
                    let n = left.min(chunk.len());
                    client.write_all(&chunk[..n]).await?;
                    left -= n;
                }
                client.shutdown().await?;
                // The relay ends when both directions have: the server's
                // EOF comes back to the client.
                let mut rest = Vec::new();
                client.read_to_end(&mut rest).await?;
                Ok::<_, io::Error>(())
            };
            let receive = async {
                let mut buf = vec![0u8; 64 * 1024];
                let mut got = 0u64;
                loop {
                    let n = server.read(&mut buf).await?;
                    if n == 0 {
                        break;
                    }
                    got += n as u64;
                }
                server.shutdown().await?;
                Ok::<_, io::Error>(got)
            };
            let relay = super::run(&app, &out, None, &opts, &meter);
            let (sent, got, relayed) = tokio::join!(send, receive, relay);
            sent?;
            relayed?;
            got
        })
    }
}

/// A connected loopback pair: (the connecting end, the accepted end).
async fn pair() -> io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (connected, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
    Ok((connected?, accepted?.0))
}
