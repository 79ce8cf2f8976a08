//! kerntun: a TUN proxy engine.
//!
//! An app hands the engine a TUN device; the engine turns its packets back
//! into TCP streams and UDP flows and relays them to outbounds chosen by
//! rules. This crate is the I/O shell around the sans-I/O core in
//! `kerntun-proto` (packet views and rewrite, the system stack's flow table
//! and translation, sniffing, the DNS wire format, stream framings;
//! re-exported here as [`packet`], [`nat`], [`translate`] (= `nat::translate`),
//! [`framing`]), which the compiler keeps pure (no
//! runtime, sockets or clock in its dependencies). The modules here are
//! layers, listed in the order a packet meets them; imports never form a
//! cycle (`scripts/check-layers.py` checks it in CI; docs/architecture.md
//! draws the map):
//!
//! * [`stats`]: the counters (relaxed atomics, driver-local batches).
//! * `driver`: one task reads the TUN (per-packet, Linux GRO/GSO or Darwin
//!   `recvmsg_x`) and writes back; every packet it reads goes to `demux`.
//! * `demux`: every packet parsed once and handed on: TCP to the stack, UDP
//!   to the flow table, pings to the gateway answered, fragments reassembled.
//! * `stack`: the two TCP stacks behind one entry, the system netstack
//!   (kernel TCP behind the NAT, the mobile default) and smoltcp.
//! * `udp`: datagram flows (direct, proxied, hijacked DNS), one folder:
//!   the flow table, GSO gathering, the reply loops per platform.
//! * `dispatch`: the plan of every new flow (TCP connection or UDP flow),
//!   connect-first admission and the sessions that serve a connection,
//!   written once for both stacks.
//! * [`outbound`], [`rules`], [`dns`], [`sniff`]: where flows go; `dnswire`
//!   reads DNS over TCP for the DNS service and the proxy-name resolver;
//!   [`owner`]: the app that owns a flow, asked of the host off the
//!   driver's path.
//! * [`relay`]: moving bytes between the app's side and the outbound
//!   (splice on Linux/Android, a userspace copy elsewhere).
//! * [`tun`]: the device, one file per OS; `sys`: the only `unsafe`.
//! * [`Engine`]: lifecycle (start, stop, statistics) over all of it;
//!   [`config`] collects every module's configuration section.
//!
//! Everything that touches raw descriptors lives in `sys`; `unsafe` is
//! denied everywhere else.
#![deny(unsafe_code)]
// The module docs link the private items they describe, for the engine's
// own readers: `cargo doc --document-private-items` resolves them.
#![allow(rustdoc::private_intra_doc_links)]

pub mod budget;
pub mod config;
pub mod conns;
mod demux;
mod dispatch;
pub mod dns;
mod dnswire;
mod driver;
mod engine;
#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod housekeeping;
pub use kerntun_proto::framing;
/// Entry points of the fuzz targets (`fuzz/`), not part of the API.
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::stack::smoltcp::fuzzing as smol;
}
/// Entry points of the criterion benches (`benches/benches/smoltcp.rs`,
/// `benches/benches/relay.rs`),
/// not part of the API: built with the `bench-internals` feature only.
#[cfg(feature = "bench-internals")]
#[doc(hidden)]
pub mod bench {
    pub use crate::conns::bench as conns;
    pub use crate::relay::bench as relay;
    pub use crate::stack::smoltcp::bench as smol;
}
mod lifecycle;
pub use kerntun_proto::nat;
pub mod network;
pub mod outbound;
pub mod owner;
pub use kerntun_proto::packet;
pub mod relay;
pub mod rules;
pub mod sniff;
mod stack;
pub mod stats;
#[allow(unsafe_code)]
mod sys;
pub use kerntun_proto::nat::translate;
#[cfg(test)]
mod testutil;
pub mod tun;
mod udp;

pub use budget::MemoryPressure;
pub use config::Config;
pub use driver::DriverKind;
pub use engine::{
    Engine, LatencyError, ReloadError, ReloadReport, SelectionError, SleepError, StartError,
    StartOptions,
};
pub use lifecycle::{EngineEvent, EventSink};
/// The test-only fault hook's vocabulary (`Engine::inject_fault`).
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub use lifecycle::{EngineTask, Fault};
pub use outbound::Protect;
pub use owner::{Owner, OwnerLookup};
pub use stats::StatsSnapshot;
pub use sys::limit_malloc_arenas;
pub use tun::TunSource;

/// The crate version, as reported by the CLI and the FFI.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
