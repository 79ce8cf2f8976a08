//! [`SmolStream`]: the app's side of one smoltcp connection, read and
//! written by its session like a kernel socket (`relay::Side`,
//! `dispatch::session::App`). One side lives in userspace, so there is
//! nothing to splice: an unframed relay reads and writes the socket's rings
//! straight from and into the outbound's kernel socket
//! (`relay::Side::drain_into`, `fill_from`), a framed one copies.

use std::future::poll_fn;
use std::io;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use smoltcp::socket::tcp::{self, State};
use tokio::net::TcpStream;

use super::sockets::{Id, Sockets};
use crate::budget::OwnedPermit;
use crate::dispatch::session::{self, App};
use crate::nat::FlowKey;
use crate::relay::{Moved, Side};
use crate::sniff::{self, Sniffed};

/// One connection's smoltcp socket. Dropping it hands the socket to the
/// poller, which removes it once closed, together with the connection's
/// admission permit: a closing socket keeps its buffers, so it keeps
/// counting against admission until it is gone.
pub(crate) struct SmolStream {
    sockets: Arc<Sockets>,
    pub(super) h: Id,
    key: FlowKey,
    permit: Option<OwnedPermit>,
}

impl std::fmt::Debug for SmolStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmolStream")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl SmolStream {
    pub(crate) fn new(
        sockets: Arc<Sockets>,
        h: Id,
        key: FlowKey,
        permit: Option<OwnedPermit>,
    ) -> Self {
        SmolStream {
            sockets,
            h,
            key,
            permit,
        }
    }

    /// Read into `buf`; 0 at the app's FIN (tests and the fuzz target; the
    /// relay waits with `Side::readable` and reads with `Side::try_read`).
    #[cfg(any(test, fuzzing))]
    pub(crate) async fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        poll_fn(|cx| self.sockets.poll_recv(self.h, Some(cx), buf)).await
    }

    /// Write all of `data`, waiting for window space (a slow app parks here).
    pub(crate) async fn send_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let n = poll_fn(|cx| self.sockets.poll_send(self.h, cx, data)).await?;
            data = &data[n..];
        }
        Ok(())
    }

    /// Send a FIN after what was queued (half-close toward the app).
    pub(crate) fn close(&self) {
        self.sockets.with_socket(self.h, |s| s.close());
    }

    /// Reset the connection toward the app.
    pub(crate) fn abort(&self) {
        self.sockets.with_socket(self.h, |s| s.abort());
    }
}

impl Drop for SmolStream {
    fn drop(&mut self) {
        self.sockets.detach(self.h, self.key, self.permit.take());
    }
}

impl Side for SmolStream {
    /// A read returns what the socket buffer held: less than asked means it
    /// is drained, so the relay buffer is freed at once.
    const DRAINED_ON_SHORT_READ: bool = true;

    async fn readable(&self) -> io::Result<()> {
        poll_fn(|cx| self.sockets.poll_readable(self.h, cx)).await
    }

    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self.sockets.poll_recv(self.h, None, buf) {
            std::task::Poll::Ready(r) => r,
            std::task::Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    async fn write_all(&self, data: &[u8]) -> io::Result<()> {
        self.send_all(data).await
    }

    fn shutdown_write(&self) -> io::Result<()> {
        self.close();
        Ok(())
    }

    const OWN_RINGS: bool = true;

    fn drain_into(&self, dst: &TcpStream) -> io::Result<Moved> {
        self.sockets.drain_into(self.h, dst)
    }

    fn fill_from(&self, src: &TcpStream) -> io::Result<Moved> {
        self.sockets.fill_from(self.h, src)
    }

    async fn ring_room(&self) -> io::Result<()> {
        poll_fn(|cx| self.sockets.poll_room(self.h, cx)).await
    }
}

/// Sniffing reads the app's first bytes where they are, in the receive
/// ring, and takes nothing out: no buffer, no bytes to send on before the
/// relay. A connection's first bytes start the ring (nothing was read
/// yet), and a ring lent for them keeps them at its start, so they are one
/// slice. First bytes longer than the ring can hold (every full ring lent)
/// end the sniff as soon as they fill it: routed by address, relayed
/// intact.
impl App for SmolStream {
    async fn sniff(&self, timeout: Duration, _pool: &session::SniffBytes<'_>) -> session::Sniff {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut seen = 0;
        let domain = loop {
            let look = poll_fn(|cx| self.sockets.poll_sniff(self.h, cx, seen));
            match tokio::time::timeout_at(deadline, look).await {
                Ok(Sniffing::Domain(d)) => break d,
                Ok(Sniffing::NeedMore(n)) => seen = n,
                Err(_) => break None,
            }
        };
        session::Sniff {
            domain,
            charge: None,
        }
    }

    fn reset(&self) {
        self.abort();
    }

    const FALLBACK_PAID: bool = false;
}

/// What a session does to its socket, under the sockets' lock for one call
/// at a time.
impl Sockets {
    /// Read what the socket holds into `buf`: `Ok(0)` after the app's FIN.
    /// With nothing to read, register `cx` and pend, or (no `cx`) answer
    /// `WouldBlock`.
    pub(super) fn poll_recv(
        &self,
        id: Id,
        cx: Option<&mut Context<'_>>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let mut g = self.inner.lock();
        if g.socket(id).can_recv() {
            // One read takes what the ring holds, both parts of a wrapped
            // ring (`recv_slice`). Not asked again: once the app's FIN is
            // in, smoltcp answers a read of an empty ring with `Finished`,
            // and a second read after the ring emptied turned the bytes
            // just taken into an EOF, losing the app's last bytes
            // (`tests.rs`, `bytes_before_the_fin_are_read_before_eof`).
            return match g.socket(id).recv_slice(buf) {
                Ok(n) => {
                    // The clock is read only for a read that takes data.
                    g.moved(id, Instant::now());
                    g.mark(id);
                    drop(g);
                    // The window opened: the poller may owe the app an update.
                    self.wake.notify_one();
                    Poll::Ready(Ok(n))
                }
                Err(tcp::RecvError::Finished) => Poll::Ready(Ok(0)),
                Err(tcp::RecvError::InvalidState) => {
                    Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()))
                }
            };
        }
        let s = g.socket(id);
        match recv_readiness(s) {
            Some(Ok(())) => Poll::Ready(Ok(0)),
            Some(Err(e)) => Poll::Ready(Err(e)),
            None => match cx {
                Some(cx) => {
                    s.register_recv_waker(cx.waker());
                    Poll::Pending
                }
                None => Poll::Ready(Err(io::ErrorKind::WouldBlock.into())),
            },
        }
    }

    /// Sniff the first bytes in the receive ring, once it holds more than
    /// `seen`: the domain they name or that they name none (also at the
    /// app's FIN, a reset, or [`sniff::MAX_SNIFF`] bytes), or that they
    /// need more than the ring's bytes now. Nothing leaves the ring.
    pub(super) fn poll_sniff(&self, id: Id, cx: &mut Context<'_>, seen: usize) -> Poll<Sniffing> {
        let mut g = self.inner.lock();
        let s = g.socket(id);
        let queued = s.recv_queue();
        if queued <= seen {
            if recv_readiness(s).is_some() {
                return Poll::Ready(Sniffing::Domain(None));
            }
            s.register_recv_waker(cx.waker());
            return Poll::Pending;
        }
        let full = queued >= s.recv_capacity();
        let Ok(first) = s.peek(sniff::MAX_SNIFF) else {
            return Poll::Ready(Sniffing::Domain(None));
        };
        Poll::Ready(match sniff::sniff(first) {
            Sniffed::Domain { name, .. } => Sniffing::Domain(Some(name.to_owned())),
            Sniffed::NoDomain => Sniffing::Domain(None),
            // At the cap, cut by the ring's end (not at a connection's
            // start; more bytes would not join them), or a full ring (no
            // full one to lend): no domain.
            Sniffed::NeedMore
                if first.len() >= sniff::MAX_SNIFF || first.len() < queued || full =>
            {
                Sniffing::Domain(None)
            }
            Sniffed::NeedMore => Sniffing::NeedMore(queued),
        })
    }

    /// Ready once a read would not pend: data, the app's FIN, or a reset.
    /// Takes no buffer, so a waiting relay direction holds none.
    pub(super) fn poll_readable(&self, id: Id, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut g = self.inner.lock();
        let s = g.socket(id);
        if s.can_recv() {
            return Poll::Ready(Ok(()));
        }
        match recv_readiness(s) {
            Some(_) => Poll::Ready(Ok(())),
            None => {
                s.register_recv_waker(cx.waker());
                Poll::Pending
            }
        }
    }

    /// Write what the receive ring holds (its first contiguous part) to
    /// `dst`, straight from the ring, under the lock: the app's bytes
    /// are copied once, by the kernel, and only what it took leaves the
    /// ring.
    pub(super) fn drain_into(&self, id: Id, dst: &TcpStream) -> io::Result<Moved> {
        let mut g = self.inner.lock();
        let s = g.socket(id);
        if !s.can_recv() {
            return match recv_readiness(s) {
                Some(Ok(())) => Ok(Moved::Eof),
                Some(Err(e)) => Err(e),
                None => Ok(Moved::SourceEmpty),
            };
        }
        let wrote = s.recv(|ring| taken(dst.try_write(ring)));
        match wrote {
            Ok(Ok(0)) => Err(io::ErrorKind::WriteZero.into()),
            Ok(Ok(n)) => {
                g.moved(id, Instant::now());
                g.mark(id);
                drop(g);
                // The window opened: the poller may owe the app an update.
                self.wake.notify_one();
                Ok(Moved::Bytes(n))
            }
            Ok(Err(e)) => kernel_error(e, Moved::DestinationFull),
            Err(tcp::RecvError::Finished) => Ok(Moved::Eof),
            Err(tcp::RecvError::InvalidState) => Err(io::ErrorKind::ConnectionReset.into()),
        }
    }

    /// Read from `src` straight into the send ring's free space (its first
    /// contiguous part), under the lock. A read that leaves the small ring
    /// past half full borrows a full one for the next.
    pub(super) fn fill_from(&self, id: Id, src: &TcpStream) -> io::Result<Moved> {
        let mut g = self.inner.lock();
        let s = g.socket(id);
        if !s.can_send() {
            return match send_readiness(s) {
                Some(e) => Err(e),
                None => Ok(Moved::DestinationFull),
            };
        }
        let read = s.send(|free| taken(src.try_read(free)));
        match read {
            // `can_send`: the ring had room, so 0 is the outbound's EOF.
            Ok(Ok(0)) => Ok(Moved::Eof),
            Ok(Ok(n)) => {
                let now = Instant::now();
                if let Some(which) = g.wants_loan(id, 0) {
                    g.lend(id, which, now);
                }
                g.moved(id, now);
                g.mark(id);
                drop(g);
                self.wake.notify_one();
                Ok(Moved::Bytes(n))
            }
            Ok(Err(e)) => kernel_error(e, Moved::SourceEmpty),
            Err(_) => Err(io::ErrorKind::BrokenPipe.into()),
        }
    }

    /// Ready once the send ring has room, or writing has become an error.
    pub(super) fn poll_room(&self, id: Id, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut g = self.inner.lock();
        let s = g.socket(id);
        if s.can_send() {
            return Poll::Ready(Ok(()));
        }
        match send_readiness(s) {
            Some(e) => Poll::Ready(Err(e)),
            None => {
                s.register_send_waker(cx.waker());
                Poll::Pending
            }
        }
    }

    pub(super) fn poll_send(
        &self,
        id: Id,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut g = self.inner.lock();
        // More than the small send ring holds: a full one, if the pool has
        // one.
        if let Some(which) = g.wants_loan(id, data.len()) {
            g.lend(id, which, Instant::now());
        }
        let s = g.socket(id);
        if s.can_send() {
            return match s.send_slice(data) {
                Ok(n) => {
                    g.mark(id);
                    // The clock is read only for a write that queues data.
                    g.moved(id, Instant::now());
                    drop(g);
                    self.wake.notify_one();
                    Poll::Ready(Ok(n))
                }
                Err(_) => Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
            };
        }
        match send_readiness(s) {
            Some(e) => Poll::Ready(Err(e)),
            None => {
                s.register_send_waker(cx.waker());
                Poll::Pending
            }
        }
    }

    /// The session of `h` ended: close the socket gracefully (unless it is
    /// already closed) and hand it to the poller, which removes it (and
    /// releases `permit`) once the FIN exchange is over or the linger time
    /// has passed.
    pub(super) fn detach(&self, id: Id, key: FlowKey, permit: Option<OwnedPermit>) {
        let mut g = self.inner.lock();
        let s = g.socket(id);
        if !matches!(s.state(), State::Closed | State::TimeWait) {
            s.close();
        }
        g.mark(id);
        g.detached.push((key, id, Instant::now(), permit));
        drop(g);
        self.wake.notify_one();
    }

    pub(super) fn with_socket(&self, id: Id, f: impl FnOnce(&mut tcp::Socket<'static>)) {
        let mut g = self.inner.lock();
        f(g.socket(id));
        g.mark(id);
        drop(g);
        self.wake.notify_one();
    }
}

/// What one look at a socket's first bytes found.
pub(super) enum Sniffing {
    /// The domain they name, or `None`: they name none, or the look ended
    /// (the app's FIN, a reset, the cap).
    Domain(Option<String>),
    /// They need more than the ring's this many bytes.
    NeedMore(usize),
}

/// A kernel socket's read or write into or out of a ring, as smoltcp's
/// `send`/`recv` take it: the bytes the ring gains or gives up (none on an
/// error), and the result.
#[inline]
fn taken(r: io::Result<usize>) -> (usize, io::Result<usize>) {
    match r {
        Ok(n) => (n, Ok(n)),
        Err(e) => (0, Err(e)),
    }
}

/// A kernel socket's error in `Sockets::drain_into` and `fill_from`:
/// `WouldBlock` is `blocked`, an interrupted call moved nothing, the
/// others are errors.
fn kernel_error(e: io::Error, blocked: Moved) -> io::Result<Moved> {
    match e.kind() {
        io::ErrorKind::WouldBlock => Ok(blocked),
        io::ErrorKind::Interrupted => Ok(Moved::Bytes(0)),
        _ => Err(e),
    }
}

/// What a write to a socket whose send ring is full finds: an error once
/// it can no longer send (reset, or its FIN queued), else `None` (wait).
fn send_readiness(s: &tcp::Socket<'_>) -> Option<io::Error> {
    match s.state() {
        State::Listen | State::SynReceived | State::SynSent => None,
        State::Closed => Some(io::ErrorKind::ConnectionReset.into()),
        _ if !s.may_send() => Some(io::ErrorKind::BrokenPipe.into()),
        _ => None,
    }
}

/// What a read of a socket with an empty receive buffer finds: the app's
/// FIN (`Ok`), a reset (`Err`), or nothing yet (`None`: wait).
fn recv_readiness(s: &tcp::Socket<'_>) -> Option<io::Result<()>> {
    match s.state() {
        State::Closed => Some(Err(io::ErrorKind::ConnectionReset.into())),
        State::Listen | State::SynReceived | State::SynSent => None,
        _ if !s.may_recv() => Some(Ok(())),
        _ => None,
    }
}
