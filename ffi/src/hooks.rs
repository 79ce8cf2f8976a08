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
