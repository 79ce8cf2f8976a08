//! kerntun: a TUN proxy engine.
//!
//! The crate is layered so the hard parts can be tested without a device:
//!
//! * [`packet`]: pure-bytes packet views, in-place NAT rewrite with RFC 1624
//!   incremental checksums, echo replies. No I/O, no clock, no allocation.
//! * [`nat`]: the system netstack's NAT table (64 shards, HalfOpen / Active /
//!   Closing, generations, budgets). Time is passed in.
//!
//! * [`Engine`]: the system netstack on a TUN device: drivers, kernel
//!   listener, dispatcher, direct outbound, UDP flows, statistics.
//!
//! Everything that touches raw descriptors lives in `sys` modules; `unsafe`
//! is denied everywhere else.
#![deny(unsafe_code)]

pub mod budget;
pub mod config;
mod dispatch;
pub mod dns;
mod driver;
mod engine;
/// Entry points of the fuzz targets (`fuzz/`), not part of the API.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::smol::fuzzing as smol;
}
pub mod nat;
pub mod outbound;
pub mod packet;
pub mod relay;
pub mod rules;
mod smol;
pub mod sniff;
#[cfg(any(target_os = "linux", target_os = "android"))]
pub mod splice;
pub mod stats;
#[allow(unsafe_code)]
mod sys;
mod system;
pub mod translate;
pub mod tun;
mod udp;
pub mod utun;

pub use budget::MemoryPressure;
pub use config::Config;
pub use driver::DriverKind;
pub use engine::{Engine, StartError, StartOptions};
pub use outbound::Protect;
pub use stats::StatsSnapshot;
pub use tun::TunSource;

/// The crate version, as reported by the CLI and the FFI.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
