//! The [`Engine`] object: a running kerntun engine owned by the app.

use std::sync::Arc;

use kerntun::{StartOptions, TunSource};
use parking_lot::RwLock;

use crate::config::{EngineConfig, MemoryPressure};
use crate::error::{KerntunError, guard, panic_message};
use crate::hooks::{HookProtect, PlatformHooks};
use crate::logging::hook_dispatch;
use crate::stats::EngineStats;

/// A running engine. Several may run in one process; each owns its own
/// runtime threads. Stopping (or dropping) one never affects the others and
/// never exits the process.
#[derive(uniffi::Object)]
pub struct Engine {
    inner: RwLock<kerntun::Engine>,
    /// The engine's own log dispatcher (`EngineConfig.log_level`), also used
    /// for the lines `stop` logs on the caller's thread.
    dispatch: Option<tracing::Dispatch>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}

fn scoped<T>(dispatch: &Option<tracing::Dispatch>, f: impl FnOnce() -> T) -> T {
    match dispatch {
        Some(d) => tracing::dispatcher::with_default(d, f),
        None => f(),
    }
}

#[uniffi::export]
impl Engine {
    /// Start an engine and return once it is ready (device adopted, addresses
    /// verified, kernel listeners bound). Blocks for at most ~1 s; call it off
    /// the main thread.
    ///
    /// `tun_fd`: the platform's TUN descriptor (iOS: [`crate::find_tun_fd`]
    /// after the tunnel settings are applied; Android: `establish()` then
    /// `detachFd()`). The engine duplicates it, so the app keeps (and may
    /// close) its own copy; on iOS never close the utun descriptor. Pass `-1`
    /// to have the engine create the device named `config.tun.name` itself
    /// (desktop Linux/macOS, needs CAP_NET_ADMIN/root).
    #[uniffi::constructor]
    pub fn start(
        config: EngineConfig,
        tun_fd: i32,
        platform: Arc<dyn PlatformHooks>,
    ) -> Result<Arc<Self>, KerntunError> {
        guard(|| {
            let core = config.to_core()?;
            let dispatch = config
                .log_level
                .map(|level| hook_dispatch(platform.clone(), level));
            let options = match &dispatch {
                Some(d) => StartOptions::with_dispatch(d.clone()),
                None => StartOptions::default(),
            };
            let protect = Arc::new(HookProtect(platform));
            let engine = crate::sys::with_lent_fd(tun_fd, |lent| {
                let source = match lent {
                    _ if tun_fd < 0 => TunSource::Create,
                    Some(fd) => TunSource::Fd(fd),
                    None => {
                        return Err(KerntunError::Tun {
                            reason: format!("tun_fd {tun_fd} is not an open descriptor"),
                        });
                    }
                };
                scoped(&dispatch, || {
                    kerntun::Engine::start_with(core, source, Some(protect), options)
                })
                .map_err(KerntunError::from)
            })?;
            Ok(Arc::new(Engine {
                inner: RwLock::new(engine),
                dispatch,
            }))
        })
    }

    /// Stop: reset the connections, close the device copy and the listeners,
    /// join the engine's threads (bounded: a few seconds at worst).
    /// Idempotent; `stats()` keeps answering with the final counts.
    pub fn stop(&self) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            scoped(&self.dispatch, || self.inner.write().stop());
        }));
        if let Err(p) = r {
            tracing::error!("kerntun stop panicked: {}", panic_message(p.as_ref()));
        }
    }

    /// A snapshot of every counter (the final one after `stop`).
    pub fn stats(&self) -> EngineStats {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            EngineStats::from(self.inner.read().stats())
        }))
        .unwrap_or_default()
    }

    /// Forward the platform's memory pressure (iOS dispatch source, Android
    /// `onTrimMemory`): new TCP sessions are admitted against a lower limit;
    /// running ones keep going.
    pub fn set_memory_pressure(&self, level: MemoryPressure) {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            scoped(&self.dispatch, || {
                self.inner.read().set_memory_pressure(level.into())
            });
        }));
    }

    /// Whether the engine is running (not stopped, no fatal error).
    pub fn is_running(&self) -> bool {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.inner.read().is_running()
        }))
        .unwrap_or(false)
    }

    /// The fatal error that stopped the engine on its own (device gone,
    /// listener failed), if any.
    pub fn error(&self) -> Option<String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.inner.read().error()))
            .unwrap_or_else(|p| Some(panic_message(p.as_ref())))
    }

    /// The TUN interface name, when known (`utun4`, `kerntun0`).
    pub fn tun_name(&self) -> Option<String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.inner.read().tun_name()
        }))
        .unwrap_or(None)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The foreign side released its last reference: stop like `stop()`.
        self.stop();
    }
}
