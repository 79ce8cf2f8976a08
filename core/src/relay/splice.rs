//! The splice relay (Linux/Android): between two plain kernel TCP sockets,
//! each direction moves its bytes socket -> pipe -> socket with `splice(2)`,
//! so the payload never enters userspace.
//!
//! Semantics are those of [`crate::relay`]: EOF on one side shuts the other
//! down for writing while the opposite direction goes on; the result is the
//! byte count of each direction; an error in either ends both.
//!
//! Per direction:
//!
//! * The pipe is taken when the source first has data (a one-byte peek
//!   tells data from EOF), so a direction that carries nothing takes none: `pipe2(O_NONBLOCK |
//!   O_CLOEXEC)` resized to [`RelayOptions::pipe_size`] best effort. A failed
//!   `pipe2` (EMFILE...) or a pipe below [`MIN_PIPE`] (what the kernel gives
//!   a user over `fs.pipe-user-pages-soft`) means the userspace copy.
//! * The pipe is held only while bytes flow: when the source has nothing
//!   more (splice-in answers EAGAIN) the pipe is empty, and the direction
//!   hands it back ([`SpliceOps::release`]) before waiting for readiness;
//!   the next burst takes one again. An idle spliced connection therefore
//!   holds its two sockets and no pipe, like the copy path, which frees its
//!   buffers the same way. Handing back goes to a small per-thread pool
//!   ([`POOL_PER_THREAD`] pipes) rather than closing, because a fresh pipe
//!   (`pipe2`, `F_SETPIPE_SZ`, two `close`s) costs tens of microseconds and
//!   bulk transfers go idle thousands of times per GB (measured:
//!   docs/notes.md, "The splice pipe pool"). The pool costs a
//!   thread-local pop and push; a task that moved to another worker thread
//!   misses it now and then.
//! * Fill, then drain: splice from the source into the empty pipe, then from
//!   the pipe into the destination until the pipe is empty. Readiness goes
//!   through tokio's `readable`/`writable` + `try_io`, so an EAGAIN from
//!   splice clears tokio's cached readiness.
//! * Fallback: EINVAL, ENOSYS or EOPNOTSUPP from either splice before the
//!   direction's first successful splice into the destination switches it to
//!   the userspace copy. The bytes already in the pipe are read out and
//!   written first (a failed splice consumes nothing), then the pipe is
//!   closed. The same errno after a success is an error.
//! * Urgent data: splice from TCP stops in front of the urgent (MSG_OOB)
//!   byte and keeps answering EAGAIN, or 0 once the FIN is in, as long as
//!   nothing reads past it. On every EAGAIN/0 from the source, SIOCATMARK
//!   tells whether the read position is at the mark; if so, a normal recv
//!   reads past it (dropping the urgent byte, as the userspace copy does)
//!   and the bytes it returns are written out through userspace.
//! * SPLICE_F_MORE is never set: it would cork the last segment.
//! * SIGPIPE: splice cannot take MSG_NOSIGNAL. When the process has SIGPIPE
//!   at its default action (a host app that did not ignore it), the relay
//!   copies instead of splicing.

use std::cell::RefCell;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use tokio::io::Interest;
use tokio::net::TcpStream;

use super::copy::{self, Codec};
use super::copy::{shutdown_write, write_all};
use super::{Fallback, Leg, LegMeter, Meter, PLAIN_READ_SIZE, RelayOptions, Relayed};
use crate::sys::splice as sys;

/// Below this a pipe is not worth splicing through: 64 KiB is the kernel's
/// default (16 pages); over the per-user budget it hands out 2 pages.
pub const MIN_PIPE: usize = 64 * 1024;

/// Bytes read past an urgent mark at a time (then splicing resumes).
const URGENT_READ: usize = 4096;

/// Empty pipes kept per thread for the next burst; beyond this they are
/// closed. Bounded so the pool's descriptors and its share of the per-user
/// pipe budget stay a constant (two threads: 16 pipes, 32 descriptors)
/// whatever the number of connections.
pub const POOL_PER_THREAD: usize = 8;

/// Pipes that may exist at once in this process (held by directions
/// moving data, or pooled): past it a direction copies in userspace
/// (`pipe2` is not called; the direction's fallback is
/// `PipeFailed(EMFILE)`). The number and why: [`crate::budget::MAX_PIPES`].
use crate::budget::MAX_PIPES;

/// Pipes in existence, against [`MAX_PIPES`].
static PIPES: AtomicUsize = AtomicUsize::new(0);

/// One of the [`MAX_PIPES`] places, given back when its pipe closes.
#[derive(Debug)]
pub struct PipeSlot(&'static AtomicUsize);

impl PipeSlot {
    /// A place, if fewer than `max` pipes are counted in `pipes`.
    fn take(pipes: &'static AtomicUsize, max: usize) -> Option<PipeSlot> {
        pipes
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| PipeSlot(pipes))
    }
}

impl Drop for PipeSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// A pipe for one direction.
#[derive(Debug)]
pub struct Pipe {
    pub read: OwnedFd,
    pub write: OwnedFd,
    /// Capacity granted by the kernel.
    pub size: usize,
    /// Its place among the [`MAX_PIPES`], given back when it closes.
    _slot: PipeSlot,
}

/// The system calls the relay makes, as a seam: tests wrap
/// [`KernelSplice`] to inject errnos (`EINVAL` on the Nth call...) and pipe
/// failures; production uses [`KernelSplice`] itself.
pub trait SpliceOps: Sync {
    /// A non-blocking pipe of (at least trying for) `size` bytes.
    fn pipe(&self, size: usize) -> io::Result<Pipe>;
    /// One non-blocking splice of at most `len` bytes.
    fn splice(&self, from: BorrowedFd<'_>, to: BorrowedFd<'_>, len: usize) -> io::Result<usize>;
    /// Take back an empty pipe that [`SpliceOps::pipe`] handed out for
    /// `size`: its direction went idle. The relay never releases a pipe with
    /// bytes in it (those are dropped, i.e. closed). Default: close it.
    fn release(&self, pipe: Pipe, size: usize) {
        let _ = size;
        drop(pipe);
    }
}

/// The real system calls.
#[derive(Debug, Clone, Copy, Default)]
pub struct KernelSplice;

thread_local! {
    /// Empty pipes with the size each was asked for. Per thread, so taking
    /// and returning one never locks; a tokio worker's pool is closed when
    /// the runtime stops and the thread exits.
    static POOL: RefCell<Vec<(usize, Pipe)>> = const { RefCell::new(Vec::new()) };
}

/// Empty pipes in this thread's pool (for tests and diagnostics).
pub fn pooled_pipes() -> usize {
    POOL.try_with(|p| p.try_borrow().map_or(0, |p| p.len()))
        .unwrap_or(0)
}

impl SpliceOps for KernelSplice {
    fn pipe(&self, size: usize) -> io::Result<Pipe> {
        let pooled = POOL
            .try_with(|pool| {
                let mut pool = pool.try_borrow_mut().ok()?;
                let i = pool.iter().rposition(|(asked, _)| *asked == size)?;
                Some(pool.swap_remove(i).1)
            })
            .ok()
            .flatten();
        if let Some(p) = pooled {
            return Ok(p);
        }
        let Some(slot) = PipeSlot::take(&PIPES, MAX_PIPES) else {
            return Err(io::Error::from_raw_os_error(libc::EMFILE));
        };
        let (read, write, size) = sys::pipe(size)?;
        Ok(Pipe {
            read,
            write,
            size,
            _slot: slot,
        })
    }
    fn splice(&self, from: BorrowedFd<'_>, to: BorrowedFd<'_>, len: usize) -> io::Result<usize> {
        sys::splice(from, to, len)
    }
    fn release(&self, pipe: Pipe, size: usize) {
        let _ = POOL.try_with(|pool| {
            let mut pool = pool.try_borrow_mut().ok()?;
            if pool.len() >= POOL_PER_THREAD {
                return None;
            }
            if pool.capacity() == 0 {
                // Once per thread, so the hot path never grows the vector.
                pool.reserve_exact(POOL_PER_THREAD);
            }
            pool.push((size, pipe));
            Some(())
        });
        // A full pool (or one being torn down) drops the pipe here: closed.
    }
}

/// Whether an errno means "this pair of descriptors cannot be spliced"
/// rather than a connection failure.
fn is_fallback_errno(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)
    )
}

/// Relay between two plain TCP sockets, splicing where the kernel allows.
/// `ops` is [`KernelSplice`] outside tests.
pub async fn relay(
    app: &TcpStream,
    out: &TcpStream,
    opts: &RelayOptions,
    meter: &Meter<'_>,
    ops: &dyn SpliceOps,
) -> io::Result<Relayed> {
    if sys::sigpipe_is_default() {
        let why = Some(Fallback::SigpipeDefault);
        let (seal, open) = (Codec::Plain, Codec::Plain);
        return copy::both(app, out, seal, open, opts.buffer, meter, why).await;
    }
    let (up, down) = tokio::try_join!(
        leg(app, out, opts, meter.up_leg(), ops),
        leg(out, app, opts, meter.down_leg(), ops)
    )?;
    tracing::trace!(
        "relay done: up {} B spliced + {} B copied{}, down {} B spliced + {} B copied{}",
        up.spliced,
        up.copied,
        fallback_note(&up),
        down.spliced,
        down.copied,
        fallback_note(&down),
    );
    Ok(Relayed { up, down })
}

fn fallback_note(leg: &Leg) -> String {
    match leg.fallback {
        Some(f) => format!(" (fell back to copy: {f:?})"),
        None => String::new(),
    }
}

/// What the source side of one splice attempt found.
enum Fill {
    /// This many bytes are now in the pipe.
    Bytes(usize),
    /// Nothing now; wait for readiness.
    Again,
    /// The source reached EOF.
    Eof,
    /// Give up splicing this direction.
    Fallback(Fallback),
}

/// One direction, `src` -> `dst`.
async fn leg(
    src: &TcpStream,
    dst: &TcpStream,
    opts: &RelayOptions,
    meter: LegMeter<'_>,
    ops: &dyn SpliceOps,
) -> io::Result<Leg> {
    let mut leg = Leg::default();
    // Held only while bytes flow (see the module docs).
    let mut pipe: Option<Pipe> = None;
    let mut peeked = false;
    // Once a splice into `dst` succeeded, fallback errnos are real errors.
    let mut committed = false;
    loop {
        src.readable().await?;
        if pipe.is_none() {
            if !peeked {
                // Before the first pipe: a direction whose first event is EOF
                // (an idle direction at close) needs none. One peek per
                // direction; later bursts splice straight away (a 0 then is
                // the EOF).
                let mut one = [0u8; 1];
                if src.peek(&mut one).await? == 0 {
                    shutdown_write(dst)?;
                    return Ok(leg);
                }
                peeked = true;
            }
            match ops.pipe(opts.pipe_size) {
                Ok(p) if p.size >= MIN_PIPE => pipe = Some(p),
                Ok(p) => {
                    let why = Fallback::PipeTooSmall(p.size);
                    return copy_rest(src, dst, opts, meter, leg, why).await;
                }
                Err(e) => {
                    let why = Fallback::PipeFailed(e.raw_os_error().unwrap_or(0));
                    return copy_rest(src, dst, opts, meter, leg, why).await;
                }
            }
        }
        let Some(p) = &pipe else {
            return Err(io::Error::other("splice relay lost its pipe"));
        };
        let filled = fill(src, dst, p, ops, committed, meter, &mut leg).await?;
        let mut in_pipe = match filled {
            Fill::Bytes(n) => n,
            Fill::Again => {
                // The source is drained and the pipe empty (fill only runs on
                // an empty pipe): hand it back before waiting, so an idle
                // direction holds none.
                if let Some(p) = pipe.take() {
                    ops.release(p, opts.pipe_size);
                }
                continue;
            }
            Fill::Eof => {
                if let Some(p) = pipe.take() {
                    ops.release(p, opts.pipe_size);
                }
                shutdown_write(dst)?;
                return Ok(leg);
            }
            Fill::Fallback(why) => {
                // Nothing is in the pipe here (fill only runs on an empty one).
                drop(pipe.take());
                return copy_rest(src, dst, opts, meter, leg, why).await;
            }
        };
        while in_pipe > 0 {
            dst.writable().await?;
            let r = dst.try_io(Interest::WRITABLE, || {
                ops.splice(p.read.as_fd(), dst.as_fd(), in_pipe)
            });
            match r {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    let n = n.min(in_pipe);
                    in_pipe -= n;
                    committed = true;
                    meter.add_spliced(&mut leg, n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if !committed && is_fallback_errno(&e) => {
                    let why = Fallback::Errno(e.raw_os_error().unwrap_or(0));
                    let Some(p) = pipe.take() else {
                        return Err(io::Error::other("splice relay lost its pipe"));
                    };
                    Box::pin(drain_pipe(p, in_pipe, dst, meter, &mut leg)).await?;
                    return copy_rest(src, dst, opts, meter, leg, why).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Splice what the source has into the (empty) pipe, handling the urgent
/// mark. Bytes read past a mark are written to `dst` here, through userspace.
async fn fill(
    src: &TcpStream,
    dst: &TcpStream,
    p: &Pipe,
    ops: &dyn SpliceOps,
    committed: bool,
    meter: LegMeter<'_>,
    leg: &mut Leg,
) -> io::Result<Fill> {
    let r = src.try_io(Interest::READABLE, || {
        ops.splice(src.as_fd(), p.write.as_fd(), p.size)
    });
    let eof = match r {
        Ok(0) => true,
        Ok(n) => return Ok(Fill::Bytes(n)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
        Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(Fill::Again),
        Err(e) if !committed && is_fallback_errno(&e) => {
            return Ok(Fill::Fallback(Fallback::Errno(
                e.raw_os_error().unwrap_or(0),
            )));
        }
        Err(e) => return Err(e),
    };
    // EAGAIN or 0: either really nothing (or EOF), or splice stopped at an
    // urgent mark with data (or the FIN) behind it.
    let at_mark = match sys::at_urgent_mark(src.as_fd()) {
        Ok(m) => m,
        // No probe on this architecture: copying is the only safe choice.
        Err(_) if !committed => return Ok(Fill::Fallback(Fallback::NoUrgentProbe)),
        Err(e) => return Err(e),
    };
    if !at_mark {
        return Ok(if eof { Fill::Eof } else { Fill::Again });
    }
    // A normal recv skips the urgent byte (SO_OOBINLINE is off) and returns
    // what follows; reading one byte past the mark clears it for splice.
    // On the heap: an array here would live inside every leg's future (it is
    // held across the write below), 4 KiB per direction of every idle
    // connection, for a path almost no connection takes.
    let mut buf = vec![0u8; URGENT_READ];
    match src.try_read(&mut buf) {
        Ok(0) => Ok(Fill::Eof), // the urgent byte was the last before the FIN
        Ok(n) => {
            tracing::trace!("relay read {n} B past an urgent mark");
            write_all(dst, &buf[..n]).await?;
            meter.add_copied(leg, n);
            Ok(Fill::Again)
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Fill::Again),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(Fill::Again),
        Err(e) => Err(e),
    }
}

/// Fallback with bytes in the pipe: read them out and write them to `dst`
/// first, so nothing is lost or reordered, then close the pipe.
async fn drain_pipe(
    p: Pipe,
    mut left: usize,
    dst: &TcpStream,
    meter: LegMeter<'_>,
    leg: &mut Leg,
) -> io::Result<()> {
    let mut reader = File::from(p.read);
    let mut buf = vec![0u8; left.min(PLAIN_READ_SIZE)];
    while left > 0 {
        let want = left.min(buf.len());
        // The bytes are already in the pipe: this read does not block.
        let n = match reader.read(&mut buf[..want]) {
            Ok(0) => return Err(io::Error::other("pipe emptied under the relay")),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        write_all(dst, &buf[..n]).await?;
        meter.add_copied(leg, n);
        left -= n;
    }
    Ok(())
}

/// The rest of the direction through userspace.
async fn copy_rest(
    src: &TcpStream,
    dst: &TcpStream,
    opts: &RelayOptions,
    meter: LegMeter<'_>,
    mut leg: Leg,
    why: Fallback,
) -> io::Result<Leg> {
    tracing::trace!("relay direction falls back to userspace copy: {why:?}");
    leg.fallback = Some(why);
    // Boxed: a fallback is rare, and inline its state would size every
    // spliced connection's future (docs/benchmarks.md, idle connections).
    Box::pin(copy::leg(src, dst, opts.buffer, Codec::Plain, meter, leg)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cap counts pipes in existence: past it no place is given, and a
    /// pipe that closes gives its place back. (A counter of the test's
    /// own: the process-wide one is shared with the relay tests running
    /// beside this one.)
    #[test]
    fn pipe_places_stop_at_the_cap_and_come_back_on_close() {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let held: Vec<PipeSlot> = (0..3)
            .map(|_| PipeSlot::take(&COUNT, 3).expect("below the cap"))
            .collect();
        assert!(PipeSlot::take(&COUNT, 3).is_none(), "at the cap");
        assert_eq!(COUNT.load(Relaxed), 3);
        drop(held);
        assert_eq!(COUNT.load(Relaxed), 0);
        assert!(PipeSlot::take(&COUNT, 3).is_some(), "places came back");
    }
}
