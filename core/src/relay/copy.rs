//! The userspace copy: one direction of a relay, written once and used for
//! every pair of ends (kernel socket to kernel socket, smoltcp socket to
//! kernel socket) and every framing (plain, sealed toward a proxy, opened
//! from it), and by the splice relay when a direction falls back. Only the
//! relay calls it ([`super::run`]); the ends ([`Side`]) are the stacks'.
//!
//! An end that keeps its bytes in rings of its own (smoltcp) and a kernel
//! socket need no buffer between them when nothing transforms the bytes:
//! such a direction writes to the socket straight from the ring, or reads
//! from it straight into the ring ([`Side::OWN_RINGS`]). On the phone
//! profiles this saved 9-24 % of the engine's CPU per byte on uploads
//! (docs/notes.md, "smoltcp: relaying from the rings").
//!
//! A direction holds a buffer only while its source has data: it allocates
//! one when bytes arrive and frees it as soon as the source is drained, so
//! idle connections hold no relay memory. The buffer is the configured size
//! while the relay pool (`Meter::pool`, the `relay` memory budget) has room
//! for it, charged until it is freed; past that, or under memory pressure,
//! a direction copies through a [`RELAY_FALLBACK_BUFFER`] instead: slower,
//! never blocked, and counted in each session's admission cost.
//!
//! A frame an outbound's framing holds because a read cut it (a
//! Shadowsocks chunk of up to 64 KiB, [`Open::held`]) is charged to the
//! same pool while it waits for its rest, past the fallback buffer's size:
//! a server that announces a long chunk and stalls holds pool bytes, not
//! uncounted ones. The charge comes first: the framing starts such a frame
//! only with room for its whole length ([`Open::open`]); without it, the
//! direction finds room (the pool's, or its own read buffer's charge, the
//! buffer then freed) and meanwhile reads nothing more, its cut bytes kept
//! in the read buffer they arrived in. A direction that finds no room
//! within [`FRAME_WAIT`] ends the relay with an `OutOfMemory` error (the
//! session counts it, `relay_frame_refused`).

use std::io;
use std::net::Shutdown;
use std::time::Instant;

use socket2::SockRef;
use tokio::net::TcpStream;

use super::{Fallback, Leg, LegMeter, Meter, Relayed};
use crate::budget::{Admission, ByteBudget, Permit, RELAY_FALLBACK_BUFFER};
use crate::framing::{Open, Seal};

/// A direction's read buffer and what it charged the relay pool (the
/// buffer, and as much again for a codec's output); a fallback buffer of a
/// session admitted without its share ([`Meter::scratch`]) holds its
/// [`Scratch`].
struct LegBuffer<'a> {
    buf: Box<[u8]>,
    pool: Option<&'a ByteBudget>,
    charged: usize,
    /// Boxed: rare, and this buffer lives in every relay's future.
    _scratch: Option<Box<Scratch<'a>>>,
}

impl<'a> LegBuffer<'a> {
    /// `size` bytes if the pool (if any) has room for them now, else the
    /// fallback size; `None` if the session's admission did not pay for a
    /// fallback (`scratch`) and there is no memory for one either.
    fn take(
        size: usize,
        pool: Option<&'a ByteBudget>,
        codec: bool,
        scratch: Option<&'a Admission>,
    ) -> Option<Self> {
        let size = size.max(1);
        let charge = if codec { 2 * size } else { size };
        let now = Instant::now();
        let (len, charged, held) = match pool {
            None => (size, 0, None),
            Some(p) if size > RELAY_FALLBACK_BUFFER && p.take(charge, now) => (size, charge, None),
            Some(p) => {
                let len = size.min(RELAY_FALLBACK_BUFFER);
                match scratch {
                    None => (len, 0, None),
                    Some(a) => {
                        let n = if codec { 2 } else { 1 } * RELAY_FALLBACK_BUFFER;
                        (len, 0, Some(Box::new(Scratch::take(p, a, n, now)?)))
                    }
                }
            }
        };
        Some(LegBuffer {
            buf: vec![0u8; len].into_boxed_slice(),
            pool,
            charged,
            _scratch: held,
        })
    }
}

impl Drop for LegBuffer<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.pool {
            p.give_back(self.charged);
        }
    }
}

/// Memory a session admitted without the relay's fallback share
/// (`Budget::session_cost`: smoltcp's, whose unframed relay needs no
/// buffer) holds while it needs some: bytes of the relay pool, or, with
/// the pool full, a second admission permit, worth a whole session's cost.
/// Given back on drop.
#[derive(Debug)]
pub(crate) enum Scratch<'a> {
    Pool(&'a ByteBudget, usize),
    Permit(#[allow(dead_code)] Permit<'a>),
}

impl<'a> Scratch<'a> {
    /// `n` bytes (at most a session's cost) from `pool`, or a permit from
    /// `admission`; `None` if neither has room now.
    pub(crate) fn take(
        pool: &'a ByteBudget,
        admission: &'a Admission,
        n: usize,
        now: Instant,
    ) -> Option<Self> {
        if pool.take(n, now) {
            return Some(Scratch::Pool(pool, n));
        }
        admission.try_acquire(now).map(Scratch::Permit)
    }

    /// [`Scratch::take`], waiting (holding nothing) until there is room.
    pub(crate) async fn wait(pool: &'a ByteBudget, admission: &'a Admission, n: usize) -> Self {
        loop {
            if let Some(s) = Scratch::take(pool, admission, n, Instant::now()) {
                return s;
            }
            pause().await;
        }
    }
}

/// Wait [`SCRATCH_RETRY`]. The timer is boxed: this wait is rare, and a
/// timer held inline would grow every relay's future, which every
/// connection holds.
async fn pause() {
    Box::pin(tokio::time::sleep(SCRATCH_RETRY)).await
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        if let Scratch::Pool(p, n) = self {
            p.give_back(*n);
        }
    }
}

/// How often a direction with no memory for a buffer looks again.
const SCRATCH_RETRY: std::time::Duration = std::time::Duration::from_millis(10);

/// How long a direction waits for room for a cut frame before it gives up
/// (while it waits, the pool can be held by frames of stalled servers).
pub(crate) const FRAME_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// What a direction's framing holds of a cut frame, charged to the relay
/// pool past [`RELAY_FALLBACK_BUFFER`] bytes; given back as the frame
/// completes, and on drop.
struct HeldFrame<'a> {
    pool: Option<&'a ByteBudget>,
    charged: usize,
}

impl HeldFrame<'_> {
    /// The longest cut frame the framing may start: what is charged for
    /// one, at least the fallback share every session has for it.
    fn room(&self) -> usize {
        match self.pool {
            None => usize::MAX,
            Some(_) => self.charged.max(RELAY_FALLBACK_BUFFER),
        }
    }

    /// Charge a cut frame of `want` bytes before the framing starts it:
    /// from the pool, or else from `read_charge`, what the direction's
    /// read buffer holds of the pool (true: taken from it, so the caller
    /// frees the buffer once the bytes in it are consumed). Waits while
    /// neither has room; an `OutOfMemory` error after [`FRAME_WAIT`].
    async fn reserve(&mut self, want: usize, read_charge: &mut usize) -> io::Result<bool> {
        let Some(pool) = self.pool else {
            return Ok(false);
        };
        let more = want.saturating_sub(self.charged);
        let deadline = tokio::time::Instant::now() + FRAME_WAIT;
        loop {
            if pool.take(more, Instant::now()) {
                self.charged += more;
                return Ok(false);
            }
            if *read_charge >= more {
                *read_charge -= more;
                self.charged += more;
                return Ok(true);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    format!(
                        "no room in the relay pool for a {want}-byte partial frame within {FRAME_WAIT:?}"
                    ),
                ));
            }
            pause().await;
        }
    }

    /// The framing now holds `held` bytes: charge the growth, give back
    /// what it freed. An error if the pool has no room for the growth
    /// (none is expected: a frame starts only within [`HeldFrame::room`]).
    fn set(&mut self, held: usize) -> io::Result<()> {
        let Some(pool) = self.pool else {
            return Ok(());
        };
        // A length header or a short chunk is within the session's
        // fallback share (`Budget::session_cost`).
        let want = if held > RELAY_FALLBACK_BUFFER {
            held
        } else {
            0
        };
        if want > self.charged {
            if !pool.take(want - self.charged, Instant::now()) {
                return Err(io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    format!("no room in the relay pool for a {held}-byte partial frame"),
                ));
            }
        } else {
            pool.give_back(self.charged - want);
        }
        self.charged = want;
        Ok(())
    }
}

impl Drop for HeldFrame<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.pool {
            p.give_back(self.charged);
        }
    }
}

/// One end of a relayed connection, as a copy leg reads and writes it.
pub(crate) trait Side {
    /// Whether a read shorter than the buffer means the source is drained,
    /// so the buffer is freed at once. A kernel socket says "drained" with
    /// `WouldBlock` instead (short reads are common while data flows).
    const DRAINED_ON_SHORT_READ: bool;
    /// Wait until a read would not block (data, the peer's FIN, an error).
    /// Takes no buffer: a direction waiting here holds none.
    async fn readable(&self) -> io::Result<()>;
    /// Read without waiting: `Ok(0)` at the peer's FIN, `WouldBlock` when
    /// the source is drained.
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// Write all of `data`, waiting for room (a slow reader parks here).
    async fn write_all(&self, data: &[u8]) -> io::Result<()>;
    /// Pass the other side's EOF on: a half-close toward this end.
    fn shutdown_write(&self) -> io::Result<()>;
    /// The kernel socket this end is, if it is one: [`super::run`] splices
    /// between two of them.
    fn kernel_socket(&self) -> Option<&TcpStream> {
        None
    }
    /// Whether this end keeps the bytes it moves in rings of its own
    /// (smoltcp's socket buffers): an unframed direction between it and a
    /// kernel socket then moves them between those rings and the socket
    /// ([`Side::drain_into`], [`Side::fill_from`]), with no relay buffer.
    const OWN_RINGS: bool = false;
    /// Move what this end holds of the app's bytes into `dst`, one write
    /// straight from the ring.
    fn drain_into(&self, _dst: &TcpStream) -> io::Result<Moved> {
        Err(io::ErrorKind::Unsupported.into())
    }
    /// Read from `src` straight into this end's ring, one read.
    fn fill_from(&self, _src: &TcpStream) -> io::Result<Moved> {
        Err(io::ErrorKind::Unsupported.into())
    }
    /// Wait until this end's ring has room (only ends with
    /// [`Side::OWN_RINGS`] are asked).
    async fn ring_room(&self) -> io::Result<()> {
        Ok(())
    }
}

/// What one move between an end's own ring and a kernel socket did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Moved {
    /// This many bytes (0: interrupted, nothing moved; try again).
    Bytes(usize),
    /// The source reached its EOF.
    Eof,
    /// The source has nothing now: wait until it is readable.
    SourceEmpty,
    /// The destination has no room now: wait until it has.
    DestinationFull,
}

impl Side for TcpStream {
    const DRAINED_ON_SHORT_READ: bool = false;

    async fn readable(&self) -> io::Result<()> {
        TcpStream::readable(self).await
    }

    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        TcpStream::try_read(self, buf)
    }

    async fn write_all(&self, data: &[u8]) -> io::Result<()> {
        write_all(self, data).await
    }

    fn shutdown_write(&self) -> io::Result<()> {
        shutdown_write(self)
    }

    fn kernel_socket(&self) -> Option<&TcpStream> {
        Some(self)
    }
}

/// How a direction transforms the bytes it moves.
pub(super) enum Codec<'a> {
    /// Unchanged.
    Plain,
    /// Toward a proxy: frame/encrypt what the app sent.
    Seal(&'a mut (dyn Seal + 'a)),
    /// From a proxy: decrypt/unframe toward the app.
    Open(&'a mut (dyn Open + 'a)),
}

impl Codec<'_> {
    /// Transform `input` into `out` (left empty for `Plain`), starting no
    /// cut frame longer than `room` ([`Open::open`]): the bytes of `input`
    /// consumed, and the plaintext byte count, what the app sent (seal) or
    /// receives (open).
    fn apply(
        &mut self,
        input: &[u8],
        out: &mut Vec<u8>,
        room: usize,
    ) -> io::Result<(usize, usize)> {
        out.clear();
        match self {
            Codec::Plain => Ok((input.len(), input.len())),
            Codec::Seal(s) => {
                s.seal(input, out);
                Ok((input.len(), input.len()))
            }
            Codec::Open(o) => {
                let used = o.open(input, out, room)?;
                Ok((used, out.len()))
            }
        }
    }

    /// The length of the cut frame an [`Codec::apply`] stopped before.
    fn wants(&self) -> usize {
        match self {
            Codec::Open(o) => o.wants(),
            Codec::Plain | Codec::Seal(_) => 0,
        }
    }

    /// Bytes the codec holds of a frame cut by a read.
    fn held(&self) -> usize {
        match self {
            Codec::Open(o) => o.held(),
            Codec::Plain | Codec::Seal(_) => 0,
        }
    }

    /// The source reached EOF: an error if it stopped inside a frame.
    fn finish(&mut self) -> io::Result<()> {
        match self {
            Codec::Open(o) => o.finish(),
            Codec::Plain | Codec::Seal(_) => Ok(()),
        }
    }
}

/// One direction: `src` -> `dst` until `src`'s EOF, then a half-close of
/// `dst`. `leg` carries what an earlier phase (splice) moved; the result
/// adds what this copy moved (plaintext bytes).
pub(super) async fn leg<S: Side, D: Side>(
    src: &S,
    dst: &D,
    buf_size: usize,
    mut codec: Codec<'_>,
    meter: LegMeter<'_>,
    mut leg: Leg,
) -> io::Result<Leg> {
    let coded = !matches!(codec, Codec::Plain);
    if !coded {
        if S::OWN_RINGS
            && let Some(k) = dst.kernel_socket()
        {
            return drain_rings(src, k, meter, leg).await;
        }
        if D::OWN_RINGS
            && let Some(k) = src.kernel_socket()
        {
            return fill_rings(k, dst, meter, leg).await;
        }
    }
    let mut buf: Option<LegBuffer<'_>> = None;
    let mut out: Vec<u8> = Vec::new();
    let mut held = HeldFrame {
        pool: meter.pool,
        charged: 0,
    };
    loop {
        src.readable().await?;
        if buf.is_none() {
            buf = LegBuffer::take(buf_size, meter.pool, coded, meter.scratch);
        }
        let Some(LegBuffer {
            buf: b,
            charged: read_charge,
            ..
        }) = buf.as_mut()
        else {
            // No memory for even a fallback buffer: wait, holding none.
            pause().await;
            continue;
        };
        let n = match src.try_read(b) {
            Ok(0) => {
                codec.finish()?;
                dst.shutdown_write()?;
                return Ok(leg);
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                // Drained: hold no buffer until the next burst.
                buf = None;
                out = Vec::new();
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        // The read, in one pass unless it cuts a frame longer than the
        // room charged for one: then the part before that frame, and the
        // rest once room is found.
        let (mut at, mut reserved, mut spent) = (0, false, false);
        while at < n {
            let (used, plain) = codec.apply(&b[at..n], &mut out, held.room())?;
            if used == 0 && reserved {
                return Err(io::Error::other("the framing took none of its room"));
            }
            held.set(codec.held())?;
            if matches!(codec, Codec::Plain) {
                dst.write_all(&b[at..at + used]).await?;
            } else {
                dst.write_all(&out).await?;
            }
            meter.add_copied(&mut leg, plain);
            at += used;
            reserved = at < n;
            if reserved {
                spent |= held.reserve(codec.wants(), read_charge).await?;
            }
        }
        if spent || S::DRAINED_ON_SHORT_READ && n < b.len() {
            // Spent: part of the buffer's charge went to the cut frame.
            buf = None;
            out = Vec::new();
        }
    }
}

/// An unframed direction from an end with rings of its own to a kernel
/// socket: each write goes straight from the ring, so the direction holds
/// no buffer and the bytes are copied once in userspace (by the kernel's
/// `send`) instead of twice.
async fn drain_rings<S: Side>(
    src: &S,
    dst: &TcpStream,
    meter: LegMeter<'_>,
    mut leg: Leg,
) -> io::Result<Leg> {
    loop {
        src.readable().await?;
        match src.drain_into(dst)? {
            Moved::Bytes(n) => meter.add_copied(&mut leg, n),
            Moved::Eof => {
                shutdown_write(dst)?;
                return Ok(leg);
            }
            Moved::SourceEmpty => {}
            Moved::DestinationFull => dst.writable().await?,
        }
    }
}

/// An unframed direction from a kernel socket to an end with rings of its
/// own: each read lands in the ring, no buffer between.
async fn fill_rings<D: Side>(
    src: &TcpStream,
    dst: &D,
    meter: LegMeter<'_>,
    mut leg: Leg,
) -> io::Result<Leg> {
    loop {
        src.readable().await?;
        match dst.fill_from(src)? {
            Moved::Bytes(n) => meter.add_copied(&mut leg, n),
            Moved::Eof => {
                dst.shutdown_write()?;
                return Ok(leg);
            }
            // `try_read` cleared the socket's readiness.
            Moved::SourceEmpty => {}
            Moved::DestinationFull => dst.ring_room().await?,
        }
    }
}

/// Both directions through userspace until both reached EOF (Ok) or one
/// failed (Err). `why` marks each direction as a fallback from splicing.
/// The relay's own: sessions go through [`super::run`].
pub(super) async fn both<A: Side, B: Side>(
    app: &A,
    out: &B,
    seal: Codec<'_>,
    open: Codec<'_>,
    buf_size: usize,
    meter: &Meter<'_>,
    why: Option<Fallback>,
) -> io::Result<Relayed> {
    let start = Leg {
        fallback: why,
        ..Leg::default()
    };
    let (up, down) = tokio::try_join!(
        leg(app, out, buf_size, seal, meter.up_leg(), start),
        leg(out, app, buf_size, open, meter.down_leg(), start),
    )?;
    Ok(Relayed { up, down })
}

/// Wait for data and read it into `buf`: `Ok(0)` at the peer's FIN.
pub(crate) async fn read<S: Side>(src: &S, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        src.readable().await?;
        match src.try_read(buf) {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            r => return r,
        }
    }
}

/// Fill `buf` exactly from `src`, waiting as needed; `UnexpectedEof` if it
/// closes first.
pub(crate) async fn read_exact<S: Side>(src: &S, mut buf: &mut [u8]) -> io::Result<()> {
    while !buf.is_empty() {
        match read(src, buf).await? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => buf = &mut buf[n..],
        }
    }
    Ok(())
}

/// Pass a source's EOF on as a half-close of the destination. A peer that
/// already reset counts as shut down (ENOTCONN), as in tokio.
pub(crate) fn shutdown_write(dst: &TcpStream) -> io::Result<()> {
    match SockRef::from(dst).shutdown(Shutdown::Write) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
        Err(e) => Err(e),
    }
}

/// Write all of `data`, waiting for writability (a slow reader parks here).
pub(crate) async fn write_all(dst: &TcpStream, mut data: &[u8]) -> io::Result<()> {
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
    use std::sync::Arc;

    use super::*;
    use crate::budget::{MemoryPressure, Pressure};

    /// A buffer for a session admitted with its fallback share.
    fn take(size: usize, pool: Option<&ByteBudget>, codec: bool) -> LegBuffer<'_> {
        LegBuffer::take(size, pool, codec, None).expect("a shared session always gets one")
    }

    /// A session admitted without the fallback share (smoltcp): past the
    /// pool's full-size buffers, a fallback buffer is charged to the pool
    /// (a codec's output too), then takes a second admission permit, then
    /// there is none (the direction waits); each is given back with the
    /// buffer.
    #[test]
    fn an_unshared_session_pays_for_its_fallback() {
        let now = Instant::now();
        let pool = ByteBudget::new(
            64 * 1024 + 3 * RELAY_FALLBACK_BUFFER,
            Arc::new(Pressure::default()),
        );
        let admission = Admission::new([2; 3]);
        let _session = admission.try_acquire(now).expect("the session's own");
        let some = Some(&admission);
        let full = LegBuffer::take(32 * 1024, Some(&pool), true, some).expect("full size");
        assert_eq!((full.buf.len(), pool.used()), (32 * 1024, 64 * 1024));
        let a = LegBuffer::take(32 * 1024, Some(&pool), true, some).expect("from the pool");
        assert_eq!(a.buf.len(), RELAY_FALLBACK_BUFFER);
        assert_eq!(
            pool.used(),
            64 * 1024 + 2 * RELAY_FALLBACK_BUFFER,
            "read and output"
        );
        let b = LegBuffer::take(32 * 1024, Some(&pool), true, some).expect("a permit");
        assert_eq!(
            (b.buf.len(), admission.active()),
            (RELAY_FALLBACK_BUFFER, 2)
        );
        assert!(
            LegBuffer::take(32 * 1024, Some(&pool), true, some).is_none(),
            "no memory"
        );
        // Unframed, one buffer's worth fits the pool's rest.
        let c = LegBuffer::take(32 * 1024, Some(&pool), false, some).expect("from the pool");
        assert_eq!(pool.used(), 64 * 1024 + 3 * RELAY_FALLBACK_BUFFER);
        drop((full, a, b, c));
        assert_eq!((pool.used(), admission.active()), (0, 1));
    }

    /// Full-size buffers while the relay pool has room (a codec's output
    /// counted too), the fallback size past it, under pressure too, and
    /// every charge given back when the buffer goes.
    #[test]
    fn buffers_come_from_the_pool_then_fall_back() {
        let now = Instant::now();
        let pressure = Arc::new(Pressure::default());
        let pool = ByteBudget::new(64 * 1024, pressure.clone());
        let plain = take(16 * 1024, Some(&pool), false);
        let coded = take(16 * 1024, Some(&pool), true);
        assert_eq!((plain.buf.len(), coded.buf.len()), (16 * 1024, 16 * 1024));
        assert_eq!(pool.used(), 48 * 1024, "a codec's output is charged too");
        let more = take(16 * 1024, Some(&pool), true);
        assert_eq!(more.buf.len(), RELAY_FALLBACK_BUFFER, "no room for 32 KiB");
        assert_eq!(pool.used(), 48 * 1024, "the fallback is not charged");
        drop((plain, coded, more));
        assert_eq!(pool.used(), 0);
        // Critical pressure: a quarter of the pool.
        pressure.report(MemoryPressure::Critical, now);
        let a = take(16 * 1024, Some(&pool), false);
        let b = take(16 * 1024, Some(&pool), false);
        assert_eq!(
            (a.buf.len(), b.buf.len()),
            (16 * 1024, RELAY_FALLBACK_BUFFER)
        );
        // Without a pool (tests, benchmarks): always the configured size;
        // a size below the fallback's is never charged.
        assert_eq!(take(64 * 1024, None, true).buf.len(), 64 * 1024);
        drop(take(1024, Some(&pool), false));
        assert_eq!(pool.used(), 16 * 1024);
    }

    /// A Shadowsocks server's stream (SIP004 frames the same way in both
    /// directions, so another client's salt and chunks stand for it):
    /// salt, header, one whole chunk of 9s; and a reader for it.
    fn server_stream() -> (Vec<u8>, kerntun_proto::framing::shadowsocks::AeadStream) {
        use kerntun_proto::framing::shadowsocks::{AEAD_MAX_CHUNK, AeadKey, AeadStream, Request};
        use shadowsocks_crypto::CipherKind;

        let kind = CipherKind::AES_256_GCM;
        // A key (and salt filter) of its own per stream: the same server
        // stream twice under one key is a replay.
        let stream = |salt: u8| {
            let key = AeadKey::new(kind, vec![3u8; kind.key_len()].into_boxed_slice());
            let req = Request {
                address: &[1, 198, 19, 1, 2, 0, 7],
                salt: &[salt; 32],
                padding: 1,
            };
            let mut header = Vec::new();
            let s = AeadStream::client(&key, req, || 0, &mut header).expect("an AEAD method");
            (header, s)
        };
        let (mut down, mut server) = stream(1);
        server.seal.seal(&[9u8; AEAD_MAX_CHUNK], &mut down);
        (down, stream(2).1)
    }

    /// Server and app connections: (the server's end, the relay's end
    /// toward it, the relay's end toward the app, the app's end).
    async fn ends() -> (TcpStream, TcpStream, TcpStream, TcpStream) {
        use kerntun_testkit::tokio_servers::tcp_pair;
        let (srv, to_server) = tcp_pair().await;
        let (app_end, app) = tcp_pair().await;
        (srv, to_server, app_end, app)
    }

    /// The relay's direction from the server to the app, through `open`,
    /// with 16 KiB read buffers.
    fn downlink<'a>(
        to_server: &'a TcpStream,
        app_end: &'a TcpStream,
        open: &'a mut (dyn Open + 'a),
        meter: LegMeter<'a>,
    ) -> std::pin::Pin<Box<impl Future<Output = io::Result<Leg>> + 'a>> {
        Box::pin(leg(
            to_server,
            app_end,
            16 * 1024,
            Codec::Open(open),
            meter,
            Leg::default(),
        ))
    }

    /// Poll `relay` for 300 ms: `None` if it is still running.
    async fn for_a_while<F: std::future::Future + Unpin>(relay: &mut F) -> Option<F::Output> {
        tokio::select! {
            r = relay => Some(r),
            () = tokio::time::sleep(std::time::Duration::from_millis(300)) => None,
        }
    }

    /// A stalling Shadowsocks server: it sends its stream's salt and header
    /// and then 2,000 bytes of a 16 KiB chunk, and nothing more. While the
    /// relay waits for the rest, the pool holds the whole chunk's bytes;
    /// the relay's read buffers are gone. With no room for the frame, in
    /// the pool or in the read buffer's own charge, the direction waits,
    /// charging nothing, and ends with `OutOfMemory` after [`FRAME_WAIT`].
    /// Once the connection goes, the pool is back to what it was.
    #[tokio::test]
    async fn a_frame_cut_by_a_stalling_server_is_charged_to_the_pool() {
        use kerntun_proto::framing::shadowsocks::AEAD_MAX_CHUNK;

        use crate::relay::Meter;
        use crate::stats::Stats;

        let (down, _) = server_stream();
        let cut = down.len() - AEAD_MAX_CHUNK - 16 + 2000;
        let held = AEAD_MAX_CHUNK + 16;
        for (pool_size, room) in [(256 * 1024, true), (held - 1, false)] {
            let (srv, to_server, app_end, _app) = ends().await;
            let pool = ByteBudget::new(pool_size, Arc::new(Pressure::default()));
            let stats = Stats::default();
            let meter = Meter::tcp(&stats, Some(&pool));
            let (_, mut client) = server_stream();
            srv.write_all(&down[..cut]).await.expect("server writes");
            let mut relay = downlink(&to_server, &app_end, &mut client.open, meter.down_leg());
            let r = for_a_while(&mut relay).await;
            assert!(
                r.is_none(),
                "the relay waits for the rest or for room: {r:?}"
            );
            if room {
                assert_eq!(pool.used(), held, "the cut frame is charged");
            } else {
                assert_eq!(pool.used(), 0, "nothing charged while it waits");
                // The wait is bounded: on a paused clock it ends at once.
                tokio::time::pause();
                let e = relay.as_mut().await.expect_err("no room");
                tokio::time::resume();
                assert_eq!(e.kind(), io::ErrorKind::OutOfMemory, "{e}");
            }
            drop(relay);
            assert_eq!(pool.used(), 0, "given back with the connection");
        }
    }

    /// The pool full when a read cuts a 16 KiB frame: the direction stops
    /// before that frame and waits, its bytes kept in the read buffer;
    /// once room comes, the rest of the chunk arrives and every byte
    /// reaches the app. And a direction whose read buffer is charged to
    /// the pool pays for the frame with that charge, and frees the buffer.
    #[tokio::test]
    async fn a_cut_frame_waits_for_room_and_loses_nothing() {
        use kerntun_proto::framing::shadowsocks::AEAD_MAX_CHUNK;
        use tokio::io::AsyncReadExt;

        use crate::relay::Meter;
        use crate::stats::Stats;

        let (down, _) = server_stream();
        let cut = down.len() - AEAD_MAX_CHUNK - 16 + 2000;
        let held = AEAD_MAX_CHUNK + 16;

        // Room comes later.
        let (srv, to_server, app_end, mut app) = ends().await;
        let pool = ByteBudget::new(256 * 1024, Arc::new(Pressure::default()));
        let t0 = Instant::now();
        let blocker = 256 * 1024 - 1000;
        assert!(pool.take(blocker, t0));
        let stats = Stats::default();
        let meter = Meter::tcp(&stats, Some(&pool));
        let (_, mut client) = server_stream();
        srv.write_all(&down[..cut]).await.expect("server writes");
        let mut relay = downlink(&to_server, &app_end, &mut client.open, meter.down_leg());
        let r = for_a_while(&mut relay).await;
        assert!(r.is_none(), "waits for room: {r:?}");
        assert_eq!(pool.used(), blocker, "nothing charged while it waits");
        pool.give_back(blocker);
        srv.write_all(&down[cut..]).await.expect("the rest");
        let r = for_a_while(&mut relay).await;
        assert!(r.is_none(), "reads on: {r:?}");
        // What the stream carries: the header's plaintext, then the 9s.
        let mut want = Vec::new();
        server_stream()
            .1
            .open
            .feed(&down, &mut want)
            .expect("opens");
        assert!(want.ends_with(&[9u8; AEAD_MAX_CHUNK]));
        let mut got = vec![0u8; want.len()];
        app.read_exact(&mut got).await.expect("the whole stream");
        assert_eq!(got, want, "every byte, in order");
        assert_eq!(pool.used(), 0, "the frame done, the buffers drained");
        drop(relay);

        // The read buffer's charge pays: a pool of exactly that charge.
        let (srv, to_server, app_end, _app) = ends().await;
        let pool = ByteBudget::new(32 * 1024, Arc::new(Pressure::default()));
        let meter = Meter::tcp(&stats, Some(&pool));
        let (_, mut client) = server_stream();
        srv.write_all(&down[..cut]).await.expect("server writes");
        let mut relay = downlink(&to_server, &app_end, &mut client.open, meter.down_leg());
        let r = for_a_while(&mut relay).await;
        assert!(r.is_none(), "waits for the rest: {r:?}");
        assert_eq!(
            pool.used(),
            held,
            "the frame holds the buffer's charge, the buffer is gone"
        );
        drop(relay);
        assert_eq!(pool.used(), 0);
    }
}
