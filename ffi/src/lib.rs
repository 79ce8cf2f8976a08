//! uniffi bindings for kerntun: the front door for Swift and Kotlin apps.
//!
//! * [`Engine`]: `start(config, tun_fd, platform)` (synchronous, returns
//!   once the engine is ready), `stop()`, `stats()`,
//!   `set_memory_pressure(level)`.
//! * [`EngineConfig`] and its records: the core configuration, every field
//!   defaulted.
//! * [`PlatformHooks`]: the app's `protect(fd)` and optional log sink;
//!   [`OwnerHooks`]: the app's lookup of a flow's owning app (Android,
//!   `Engine::start_with_owner`).
//! * [`KerntunError`]: typed errors (Kotlin exceptions, Swift `throws`).
//! * [`init_logging`]: the process-wide logger, installed only on request.
//! * `Engine.handle_message` and [`handle_message_without_engine`]: the same
//!   run-time control as versioned JSON messages, for an app whose UI runs
//!   in another process (docs/messages.md).
//!
//! No panic crosses the boundary: fallible exports return `Result` and turn
//! a panic into [`KerntunError::Internal`]; the others catch it and answer
//! a neutral value.

// Docs link the private items they describe, for the crate's own readers:
// `cargo doc --document-private-items` resolves them.
#![allow(rustdoc::private_intra_doc_links)]

uniffi::setup_scaffolding!("kerntun");

/// Moves a value of one struct into another field by field (a core
/// snapshot or configuration into its record, or back). The pattern has no
/// `..`, so a field added to one side fails to compile here until the other
/// has it too. `converted` fields change type on the way; `added` ones are
/// the target's alone. Without a value it writes the `From` impl (`both`:
/// both ways).
macro_rules! moved {
    (both $a:path, $b:path { $($same:ident),* $(,)? }) => {
        moved!($a => $b { $($same,)* });
        moved!($b => $a { $($same,)* });
    };
    ($from:path => $to:path { $($same:ident),* $(,)? }) => {
        impl From<$from> for $to {
            fn from(s: $from) -> Self {
                moved!(s; $from => $to { $($same,)* })
            }
        }
    };
    ($value:expr; $from:path => $to:path { $($same:ident),* $(,)? }
        $(converted { $($field:ident: $conv:expr),* $(,)? })?
        $(added { $($extra:ident),* $(,)? })?
    ) => {{
        let $from { $($same,)* $($($field,)*)? } = $value;
        $to { $($same,)* $($($field: $conv,)*)? $($($extra,)*)? }
    }};
}

/// One pairing of two enums' unit variants, written once: the `From` impls
/// both ways (a record's enum and the core's). Neither match has a
/// wildcard, so a variant added to either side fails to compile here until
/// it is paired.
macro_rules! paired {
    ($a:ty, $b:ty { $($va:ident => $vb:ident),* $(,)? }) => {
        impl From<$a> for $b {
            fn from(v: $a) -> Self {
                type A = $a;
                match v {
                    $(A::$va => Self::$vb,)*
                }
            }
        }
        impl From<$b> for $a {
            fn from(v: $b) -> Self {
                type B = $b;
                match v {
                    $(B::$vb => Self::$va,)*
                }
            }
        }
    };
}

mod config;
mod connections;
mod engine;
mod error;
mod events;
mod groups;
mod hooks;
mod logging;
mod messages;
mod stats;
#[cfg(any(target_os = "ios", target_os = "macos"))]
#[allow(unsafe_code)]
mod sys;

pub use config::{
    BudgetOptions, DirectOptions, DnsOptions, DnsStrategy, Driver, EngineConfig, LogLevel,
    MemoryPressure, Outbound, OutboundUdp, Platform, RelayOptions, RuleAction, RuleOptions,
    ShadowsocksMethod, SniffOptions, Stack, TimeoutOptions, TunOptions, default_config,
    outbound_from_url, resolver_addresses,
};
pub use connections::{
    ConnectionNetwork, ConnectionRecord, ConnectionState, DomainSource, MAX_CONNECTIONS,
};
pub use engine::{Engine, NetworkInfo, ReloadReport};
#[cfg(feature = "fault-injection")]
pub use engine::{FaultKind, FaultTask};
pub use error::{HookError, KerntunError};
pub use events::{EngineEvent, EngineListener};
pub use groups::{GroupMember, GroupOptions, GroupState, GroupType, MemberHealth};
pub use hooks::{FlowOwner, FlowProtocol, OwnerHooks, PlatformHooks};
pub use logging::{LogRecord, init_logging};
pub use messages::{
    MAX_LATENCY_TIMEOUT_MS, MAX_MESSAGE_CONNECTIONS, MAX_REQUEST_BYTES, MESSAGE_VERSION,
    handle_message_without_engine,
};
pub use stats::{DropCount, EngineStats, OutboundStats, TcpFlowStats};

/// The library version (`kerntun` crate version).
#[uniffi::export]
pub fn version() -> String {
    kerntun::VERSION.to_string()
}

/// The descriptor of this process's utun device (iOS/macOS Packet Tunnel
/// extension), found by scanning descriptors for a `com.apple.net.utun_control`
/// socket. Call it after `setTunnelNetworkSettings` completed; `null`/`nil`
/// when there is none, and always on other platforms.
#[uniffi::export]
pub fn find_tun_fd() -> Option<i32> {
    std::panic::catch_unwind(kerntun::tun::find_platform_tun_fd).unwrap_or(None)
}
