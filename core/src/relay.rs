//! Bidirectional TCP relay with `copy_bidirectional` semantics: each direction
//! copies until its source reaches EOF, then shuts down the write half of the
//! other side while the opposite direction carries on (a half-closed
//! connection can still be answered). An error in either direction ends both.
//!
//! Buffers exist only while data flows: a direction allocates its buffer when
//! its source becomes readable and frees it as soon as the source has nothing
//! more to give, so ten thousand idle connections hold no relay memory.

use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use socket2::SockRef;
use tokio::net::TcpStream;

/// Bytes moved in each direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Relayed {
    /// From the app to the outbound.
    pub up: u64,
    /// From the outbound to the app.
    pub down: u64,
}

/// Relay until both directions reached EOF (Ok) or one failed (Err). Byte
/// counts are also added to `up_counter`/`down_counter` as they move, so
/// statistics are live for long transfers.
pub async fn relay(
    app: &TcpStream,
    out: &TcpStream,
    buf_size: usize,
    up_counter: &AtomicU64,
    down_counter: &AtomicU64,
) -> io::Result<Relayed> {
    let (up, down) = tokio::try_join!(
        pump(app, out, buf_size, up_counter),
        pump(out, app, buf_size, down_counter)
    )?;
    Ok(Relayed { up, down })
}

/// One direction: `src` -> `dst`, then `shutdown(Write)` on `dst` at EOF.
async fn pump(
    src: &TcpStream,
    dst: &TcpStream,
    buf_size: usize,
    counter: &AtomicU64,
) -> io::Result<u64> {
    let mut total = 0u64;
    let mut buf: Option<Box<[u8]>> = None;
    loop {
        src.readable().await?;
        let b = buf.get_or_insert_with(|| vec![0u8; buf_size].into_boxed_slice());
        match src.try_read(b) {
            Ok(0) => {
                // EOF: pass the half-close on; the other direction may still answer.
                match SockRef::from(dst).shutdown(Shutdown::Write) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotConnected => {}
                    Err(e) => return Err(e),
                }
                return Ok(total);
            }
            Ok(n) => {
                write_all(dst, &b[..n]).await?;
                total += n as u64;
                counter.fetch_add(n as u64, Relaxed);
            }
            // Drained: release the buffer until the next readiness edge.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => buf = None,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

async fn write_all(dst: &TcpStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        dst.writable().await?;
        match dst.try_write(data) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A connected pair of loopback sockets.
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let a = TcpStream::connect(l.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (b, _) = l.accept().await.expect("accept");
        (a, b)
    }

    /// client <-> [app_side | relay | out_side] <-> server, run both ways round
    /// (the relay must be symmetric).
    async fn half_close_then_answer(swap: bool) {
        let (mut client, app_side) = pair().await;
        let (out_side, mut server) = pair().await;
        let (up_c, down_c) = (AtomicU64::new(0), AtomicU64::new(0));
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
        let relay_fut = relay(a, b, 4096, &up_c, &down_c);
        let test = async {
            near.write_all(&payload).await.expect("write");
            near.shutdown().await.expect("half close");
            let mut got = Vec::new();
            far.read_to_end(&mut got).await.expect("read to EOF");
            assert_eq!(got, payload, "bytes in order and complete");
            // The far side answers after EOF; the near side still receives it.
            far.write_all(b"answer after EOF").await.expect("answer");
            far.shutdown().await.expect("close");
            let mut answer = Vec::new();
            near.read_to_end(&mut answer).await.expect("answer read");
            assert_eq!(answer, b"answer after EOF");
        };
        let (r, ()) = tokio::join!(relay_fut, test);
        let r = r.expect("relay ok");
        assert_eq!(r.up, payload.len() as u64);
        assert_eq!(r.down, 16);
        assert_eq!(up_c.load(Relaxed), r.up);
        assert_eq!(down_c.load(Relaxed), r.down);
    }

    #[tokio::test]
    async fn half_close_is_passed_on_and_answered() {
        half_close_then_answer(false).await;
        half_close_then_answer(true).await;
    }

    #[tokio::test]
    async fn empty_transfer_and_reset() {
        let (client, app_side) = pair().await;
        let (out_side, server) = pair().await;
        let c = AtomicU64::new(0);
        drop(client);
        drop(server);
        let r = relay(&app_side, &out_side, 1024, &c, &c).await;
        // Both peers closed without data: either a clean 0/0 or a reset, never a hang.
        if let Ok(r) = r {
            assert_eq!(r, Relayed::default());
        }
    }
}
