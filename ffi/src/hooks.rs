//! What the host platform provides to an engine.

use std::fmt;
use std::sync::Arc;

use crate::config::LogLevel;
use crate::error::HookError;

/// Implemented by the app (Kotlin/Swift) and passed to [`crate::Engine::start`].
///
/// Both methods may be called from the engine's own threads, concurrently,
/// while the engine runs; they should return quickly.
#[uniffi::export(foreign)]
pub trait PlatformHooks: Send + Sync {
    /// Exempt an outbound socket from the VPN before it connects: Android's
    /// `VpnService.protect(fd)`. Called once per outbound socket. Return
    /// `HookError.Refused` to abort that connection (counted; the app sees a
    /// reset). On iOS and desktop return success: routing or
    /// `direct.interface` keeps those sockets off the tunnel.
    fn protect(&self, fd: i32) -> Result<(), HookError>;

    /// A log line of this engine, when `EngineConfig.log_level` is set
    /// (otherwise never called). Errors are ignored.
    fn log(&self, level: LogLevel, message: String) -> Result<(), HookError>;
}

/// Adapts the hooks to the core's [`kerntun::Protect`].
pub(crate) struct HookProtect(pub Arc<dyn PlatformHooks>);

impl fmt::Debug for HookProtect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HookProtect")
    }
}

impl kerntun::Protect for HookProtect {
    fn protect(&self, fd: i32) -> Result<(), String> {
        // Foreign code: a panic in the binding layer must not unwind
        // through the engine's socket path.
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.protect(fd))) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(p) => Err(format!(
                "protect hook panicked: {}",
                crate::error::panic_message(p.as_ref())
            )),
        }
    }
}

/// A flow's transport, as [`OwnerHooks::connection_owner`] is asked about
/// it (Android: `OsConstants.IPPROTO_TCP` / `IPPROTO_UDP`). Not named
/// `Protocol`: Swift's Objective-C runtime has a class of that name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum)]
pub enum FlowProtocol {
    Tcp,
    Udp,
}

/// The app that owns a flow.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record)]
pub struct FlowOwner {
    /// Its user id (Android: `getConnectionOwnerUid`).
    pub uid: u32,
    /// Its package name (Android: the first of `getPackagesForUid`);
    /// `null`/`nil` when the uid has none.
    pub package: Option<String>,
}

/// The app's lookup of which app owns a flow, passed to
/// [`crate::Engine::start_with_owner`] (Android 10+; see
/// `docs/integration-android.md`). A trait of its own, not a method of
/// [`PlatformHooks`]: a foreign trait must implement every method, so a
/// new one there would break every app's existing hooks, and platforms
/// without a lookup (iOS, desktop) pass nothing instead of answering
/// `null` for every flow.
#[uniffi::export(foreign)]
pub trait OwnerHooks: Send + Sync {
    /// The app that owns the flow from `source` (the app's address and
    /// port, `10.0.0.2:40000`, `[fd00::2]:40000`) to `destination` (the
    /// address it sent to); `null`/`nil` when none is known. Called from
    /// one engine thread of its own, one flow at a time, as flows start;
    /// an answer later than 250 ms is not waited for, and an error counts
    /// as no owner (`EngineStats.owner_failed`).
    fn connection_owner(
        &self,
        protocol: FlowProtocol,
        source: String,
        destination: String,
    ) -> Result<Option<FlowOwner>, HookError>;
}

/// Adapts the owner hooks to the core's [`kerntun::OwnerLookup`].
pub(crate) struct HookOwner(pub Arc<dyn OwnerHooks>);

impl fmt::Debug for HookOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HookOwner")
    }
}

impl kerntun::OwnerLookup for HookOwner {
    fn owner(
        &self,
        network: kerntun::rules::Network,
        source: std::net::SocketAddr,
        destination: std::net::SocketAddr,
    ) -> Result<Option<kerntun::Owner>, String> {
        let protocol = match network {
            kerntun::rules::Network::Tcp => FlowProtocol::Tcp,
            kerntun::rules::Network::Udp => FlowProtocol::Udp,
        };
        // Foreign code: a panic in the binding layer stays on this side.
        let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            (self.0).connection_owner(protocol, source.to_string(), destination.to_string())
        }));
        match answer {
            Ok(Ok(owner)) => Ok(owner.map(|o| kerntun::Owner {
                uid: o.uid,
                package: o.package,
            })),
            Ok(Err(e)) => Err(e.to_string()),
            Err(p) => Err(format!(
                "owner hook panicked: {}",
                crate::error::panic_message(p.as_ref())
            )),
        }
    }
}
