//! Packet layer of the system netstack: zero-copy views over caller-owned
//! buffers, the in-place 4-tuple rewrite, and the disposition every I/O driver
//! acts on.
//!
//! Untrusted input (anything read from the TUN) goes through [`parse_ip`] and
//! the `parse_*` functions, which perform every length check once; after
//! that, accessors and rewrites index without further checks and cannot
//! panic.
//!
//! CONTRACT (the engine is written against these signatures; internals free):

use std::net::{IpAddr, SocketAddr};

/// Why a packet was rejected. Every variant is counted by the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Reject {
    /// Placeholder: the packet helper replaces this list.
    Truncated,
}

impl Reject {
    /// Number of variants (size of the engine's counter array).
    pub const COUNT: usize = 1;
    /// Every variant, in `index()` order.
    pub const ALL: [Reject; Self::COUNT] = [Reject::Truncated];
    /// Stable snake_case name used in stats and logs.
    pub fn as_str(self) -> &'static str {
        "truncated"
    }
    /// Index into a `[_; Reject::COUNT]` counter array.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What the I/O driver does with a packet after processing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// The first `len` bytes of the buffer were rewritten in place; write them to the TUN.
    WriteBack(usize),
    /// A UDP datagram for the datagram dispatcher; the buffer is unchanged.
    ForwardUdp,
    /// Nothing to write (consumed or dropped; drops are counted by the processor).
    Done,
}

/// Summary of a validated IP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpInfo {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// Transport protocol after the IPv6 extension-header walk (6, 17, 1, 58, ...).
    pub protocol: u8,
    /// Offset of the transport header.
    pub l4_offset: usize,
    /// Packet length per the IP header (<= buffer length; trailing bytes ignored).
    pub len: usize,
}
