//! Shared helpers for the kerntun benches (packet fixtures, netns harness).
