//! kerntun's sans-I/O core: everything the engine decides about a packet
//! without touching a descriptor, a runtime or a clock.
//!
//! * [`packet`]: zero-copy views of IPv4/IPv6/TCP/UDP/ICMP over the caller's
//!   buffer, the in-place 4-tuple rewrite with RFC 1624 checksums, the
//!   builders of RSTs, echo replies and UDP headers, write-back coalescing
//!   and IP fragment reassembly.
//! * [`nat`]: the system netstack's flow table (the NAT mapping and the
//!   whole state of each flow, with the half-open policy) and the
//!   per-packet TCP step over it, [`nat::translate`] (one packet and the
//!   table in, one decision out).
//! * [`sniff`]: the domain a connection is for, from its first bytes.
//! * [`dnswire`]: DNS messages and the length prefix of DNS over TCP.
//! * [`framing`]: stream framings an outbound speaks over TCP (Shadowsocks
//!   AEAD), as the relay's per-chunk seal and open.
//! * [`drops`]: the names of what the engine counts when it drops.
//! * [`nat64`]: IPv4 addresses embedded in a NAT64 prefix (RFC 6052) and
//!   the prefix read from a DNS64's answers (RFC 7050).
//!
//! The engine crate (`core/`) is the I/O shell: it reads the TUN, owns the
//! sockets and timers, and passes `now` in. The compiler keeps this crate
//! pure: its manifest has no async runtime, libc or socket crate, and its
//! `clippy.toml` forbids reading the clock or sleeping.
#![forbid(unsafe_code)]
// The module docs link the private items they describe, for the crate's
// own readers: `cargo doc --document-private-items` resolves them.
#![allow(rustdoc::private_intra_doc_links)]
// Tests may read the real clock for their starting instants.
#![cfg_attr(test, allow(clippy::disallowed_methods))]

#[macro_use]
mod named;

pub mod dnswire;
pub mod drops;
pub mod framing;
pub mod nat;
pub mod nat64;
pub mod packet;
pub mod sniff;
