//! kerntun: a TUN proxy engine.
//!
//! The crate is layered so the hard parts can be tested without a device:
//!
//! * [`packet`]: pure-bytes packet views, in-place NAT rewrite with RFC 1624
//!   incremental checksums, echo replies. No I/O, no clock, no allocation.
//! * [`nat`]: the system netstack's NAT table (64 shards, HalfOpen / Active /
//!   Closing, generations, budgets). Time is passed in.
//!
//! Everything that touches descriptors lives in `sys` modules; `unsafe` is
//! denied everywhere else.
#![deny(unsafe_code)]

pub mod nat;
pub mod packet;

/// The crate version, as reported by the CLI and the FFI.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
