//! uniffi bindings for kerntun (Swift and Kotlin). The FFI issue fills this crate in:
//! an `Engine` object with synchronous start/stop, stats, memory pressure and logging.

/// The engine's version string, as the bindings will report it.
pub fn version() -> &'static str {
    kerntun::VERSION
}
