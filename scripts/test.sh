#!/usr/bin/env bash
# The test command from the README: every test of the workspace. Tests that
# need root, /dev/net/tun and `ip netns` (the end-to-end suites) print
# "SKIPPED" and pass when not run as root; CI runs as root.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --all-targets "$@"
# DNS over TLS is a cargo feature (ring needs a C compiler for the target):
# its end-to-end test runs with the feature on.
cargo test -p kerntun --features dot --test dns "$@"
# The FFI as Swift/Kotlin apps see it: generated Kotlin bindings on the JVM
# against the real cdylib, engines on real TUN devices (root; skipped
# otherwise), then the Swift bindings checked for drift against apple/.
bash ffi/tests/kotlin/run.sh
bash scripts/bindings.sh check
