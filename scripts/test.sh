#!/usr/bin/env bash
# The test command from the README: every test of the workspace. Tests that
# need root, /dev/net/tun and `ip netns` (the end-to-end suites) print
# "SKIPPED" and pass when not run as root; CI runs as root.
#
# As a user with sudo, cargo builds as that user and runs the test binaries
# through `sudo -E` (cargo's target runner), so the end-to-end suites run
# too; the Kotlin FFI test, which builds and runs as one script, needs a
# root shell and is skipped. KERNTUN_TEST_SUDO=0 skips the root tests instead.
set -euo pipefail
cd "$(dirname "$0")/.."

if ((EUID != 0)) && [[ ${KERNTUN_TEST_SUDO:-1} == 1 ]] && command -v sudo >/dev/null; then
    host=$(rustc -vV | sed -n 's/^host: //p')
    runner_var="CARGO_TARGET_$(echo "$host" | tr 'a-z-' 'A-Z_')_RUNNER"
    if [[ -z "${!runner_var:-}" ]]; then
        export "$runner_var=sudo -E"
        echo "test.sh: not root: test binaries run through sudo -E ($runner_var)"
    fi
fi
cargo test --workspace --all-targets "$@"
# DNS over TLS and over HTTPS are cargo features (ring needs a C compiler for
# the target): their end-to-end tests run with `doh`, which includes `dot`.
# The fault hook that makes engine tasks panic or end is a test-only cargo
# feature: the tests that use it run with it on. One build for both.
cargo test -p kerntun --features doh,fault-injection --test dns --test faults "$@"
# The FFI as Swift/Kotlin apps see it: generated Kotlin bindings on the JVM
# against the real cdylib, engines on real TUN devices (root; skipped
# otherwise), then the Swift bindings checked for drift against apple/.
bash ffi/tests/kotlin/run.sh
bash scripts/bindings.sh check
