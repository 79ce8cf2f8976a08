//! What the unit tests of several modules share.

/// A current-thread runtime with I/O and timers, for a unit test that
/// blocks on the engine's async parts.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a test runtime")
}
