//! [`SmolStream`]: the app's side of one smoltcp connection, read and
//! written by its session like a kernel socket (`relay::Side`,
//! `dispatch::session::App`). The relay copies it (`relay::run`): one side
//! lives in userspace, so there is nothing to splice.

use std::future::poll_fn;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use super::stack::{Id, Key, SmolStack};
use crate::budget::OwnedPermit;
use crate::dispatch::session::{self, App};
use crate::relay::Side;

/// One connection's smoltcp socket. Dropping it hands the socket to the
/// poller, which removes it once closed, together with the connection's
/// admission permit: a closing socket keeps its buffers, so it keeps
/// counting against admission until it is gone.
pub(crate) struct SmolStream {
    stack: Arc<SmolStack>,
    pub(super) h: Id,
    key: Key,
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
    pub(crate) fn new(stack: Arc<SmolStack>, h: Id, key: Key, permit: Option<OwnedPermit>) -> Self {
        SmolStream {
            stack,
            h,
            key,
            permit,
        }
    }

    /// Read into `buf`; 0 at the app's FIN (tests and the fuzz target; the
    /// relay waits with `Side::readable` and reads with `Side::try_read`).
    #[cfg(any(test, fuzzing))]
    pub(crate) async fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        poll_fn(|cx| self.stack.poll_recv(self.h, Some(cx), buf)).await
    }

    /// Write all of `data`, waiting for window space (a slow app parks here).
    pub(crate) async fn send_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let n = poll_fn(|cx| self.stack.poll_send(self.h, cx, data)).await?;
            data = &data[n..];
        }
        Ok(())
    }

    /// Send a FIN after what was queued (half-close toward the app).
    pub(crate) fn close(&self) {
        self.stack.with_socket(self.h, |s| s.close());
    }

    /// Reset the connection toward the app.
    pub(crate) fn abort(&self) {
        self.stack.with_socket(self.h, |s| s.abort());
    }
}

impl Drop for SmolStream {
    fn drop(&mut self) {
        self.stack.detach(self.h, self.key, self.permit.take());
    }
}

impl Side for SmolStream {
    /// A read returns what the socket buffer held: less than asked means it
    /// is drained, so the relay buffer is freed at once.
    const DRAINED_ON_SHORT_READ: bool = true;

    async fn readable(&self) -> io::Result<()> {
        poll_fn(|cx| self.stack.poll_readable(self.h, cx)).await
    }

    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self.stack.poll_recv(self.h, None, buf) {
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
}

/// A smoltcp socket cannot be peeked, so sniffing keeps what it read for
/// the outbound.
impl App for SmolStream {
    async fn sniff(&self, timeout: Duration) -> (Option<String>, Vec<u8>) {
        session::sniff_read(self, timeout).await
    }

    fn reset(&self) {
        self.abort();
    }
}
