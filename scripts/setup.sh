#!/usr/bin/env bash
# Installs everything kerntun's tests, demo and benchmarks need on a fresh
# Debian 12 machine (run as root). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }

# System packages: ip/netns/veth (iproute2), sysctl (procps), traffic tools.
need_apt=()
command -v ip >/dev/null || need_apt+=(iproute2)
command -v sysctl >/dev/null || need_apt+=(procps)
command -v iperf3 >/dev/null || need_apt+=(iperf3)
command -v python3 >/dev/null || need_apt+=(python3)
command -v cc >/dev/null || need_apt+=(build-essential)
# The Kotlin FFI test: Java 17 and JNA (the JVM side of the generated bindings).
command -v java >/dev/null || need_apt+=(openjdk-17-jdk-headless)
[[ -f /usr/share/java/jna.jar ]] || need_apt+=(libjna-java)
command -v npm >/dev/null || need_apt+=(npm)
if ((${#need_apt[@]})); then
    log "apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# The TUN device node (present on the CI machine; created if a container lacks it).
if [[ ! -c /dev/net/tun ]]; then
    mkdir -p /dev/net && mknod /dev/net/tun c 10 200 && chmod 0666 /dev/net/tun
fi

# kotlinc for the FFI test ships in the npm package kotlin-compiler.
if [[ ! -x "$(npm root -g)/kotlin-compiler/bin/kotlinc" ]]; then
    log "npm install -g kotlin-compiler"
    npm install -g --silent kotlin-compiler >/dev/null
fi

log "rust toolchains and targets"
rustup component add rustfmt clippy >/dev/null
rustup target add aarch64-apple-ios aarch64-apple-darwin aarch64-linux-android x86_64-linux-android >/dev/null
if rustup toolchain list | grep -q '^nightly'; then
    rustup component add --toolchain nightly miri rust-src >/dev/null
    cargo +nightly miri setup >/dev/null 2>&1
    if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
        log "cargo install cargo-fuzz"
        cargo install --locked cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz
    fi
fi
log "setup done"
