//! Stream framings an outbound speaks on top of TCP, sans-I/O: what the
//! relay does to the bytes of each direction when the outbound's socket does
//! not carry the app's bytes unchanged.
//!
//! A framing is a pair of halves, [`Seal`] (app -> outbound) and [`Open`]
//! (outbound -> app), reached together through [`Framing::split`] so that
//! each relay direction drives its own half at the same time. The engine's
//! relay (`core/src/relay/copy.rs`) calls a half once per chunk it read, with
//! buffers it owns; a half keeps only its cipher state and, for `Open`, the
//! bytes of a frame cut by a read.
//!
//! * [`shadowsocks`]: Shadowsocks AEAD (SIP004) and AEAD-2022 (SIP022)
//!   chunks.

use std::fmt;
use std::io;

pub mod shadowsocks;

/// Frames or encrypts the app's bytes toward an outbound.
pub trait Seal: Send {
    /// Append the wire form of `plain` to `out`.
    fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>);
}

/// Unframes or decrypts an outbound's bytes toward the app. Keeps a partial
/// frame across calls.
pub trait Open: Send {
    /// Consume `wire`, appending the plaintext it completes to `out`, and
    /// return how many of its bytes were consumed. A frame the end of
    /// `wire` cuts is kept (its whole length allocated at once, so what is
    /// held is known before the rest arrives) only if that length is at
    /// most `room`; otherwise consuming stops where that frame starts, and
    /// [`Open::wants`] says its length: the caller finds room for it and
    /// calls again with the rest. A frame that does not verify is an error
    /// of kind `InvalidData` (the engine counts it as the outbound's
    /// protocol error).
    fn open(&mut self, wire: &[u8], out: &mut Vec<u8>, room: usize) -> io::Result<usize>;
    /// The outbound reached EOF: an error if it stopped inside a frame.
    fn finish(&mut self) -> io::Result<()>;
    /// Bytes held for a frame cut by a read, until the frame completes.
    /// The relay charges them: a server can announce a long frame and
    /// stall.
    fn held(&self) -> usize {
        0
    }
    /// The whole length of the frame that the bytes an [`Open::open`] left
    /// unconsumed start.
    fn wants(&self) -> usize {
        0
    }
}

/// The framing of one outbound stream: both directions' state.
pub trait Framing: Send + Sync + fmt::Debug {
    /// The two halves, borrowed apart so each relay direction owns one.
    fn split(&mut self) -> (&mut dyn Seal, &mut dyn Open);
}
