#!/usr/bin/env bash
# Installs everything kerntun's tests, demo and benchmarks need on a fresh
# Debian 12 machine. Idempotent: a second run only checks.
#
#   bash scripts/setup.sh     as root (a fresh Debian has no sudo), or as a
#                             user: the system steps (apt-get, the TUN node,
#                             npm -g) then run through sudo, the Rust steps
#                             (rustup) for the user who builds.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }
die() { printf 'setup.sh: %s\n' "$*" >&2; exit 1; }

# Run a system step as root: directly when root, through sudo when it is
# there, otherwise stop and say so.
as_root() {
    if ((EUID == 0)); then
        "$@"
    elif command -v sudo >/dev/null; then
        sudo "$@"
    else
        die "'$*' needs root: run setup.sh as root (no sudo found)"
    fi
}

# A command on PATH, or in the sbin directories a user's PATH may lack.
have() { command -v "$1" >/dev/null || [[ -x /usr/sbin/$1 || -x /sbin/$1 ]]; }

# System packages: ip/netns/veth (iproute2), sysctl (procps), traffic tools,
# curl for the rustup installer.
need_apt=()
have ip || need_apt+=(iproute2)
have sysctl || need_apt+=(procps)
command -v curl >/dev/null || need_apt+=(curl ca-certificates)
command -v iperf3 >/dev/null || need_apt+=(iperf3)
command -v python3 >/dev/null || need_apt+=(python3)
command -v cc >/dev/null || need_apt+=(build-essential)
# The Kotlin FFI test: Java 17 and JNA (the JVM side of the generated bindings).
command -v java >/dev/null || need_apt+=(openjdk-17-jdk-headless)
[[ -f /usr/share/java/jna.jar ]] || need_apt+=(libjna-java)
command -v npm >/dev/null || need_apt+=(npm)
if ((${#need_apt[@]})); then
    log "apt-get install ${need_apt[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# The TUN device node (present on the CI machine; created if a container lacks it).
if [[ ! -c /dev/net/tun ]]; then
    as_root sh -c 'mkdir -p /dev/net && mknod /dev/net/tun c 10 200 && chmod 0666 /dev/net/tun'
fi

# kotlinc for the FFI test ships in the npm package kotlin-compiler.
if [[ ! -x "$(npm root -g)/kotlin-compiler/bin/kotlinc" ]]; then
    log "npm install -g kotlin-compiler"
    as_root npm install -g --silent kotlin-compiler >/dev/null
fi

# The Rust toolchain comes from rustup, installed by the user who builds
# (root on CI): setup.sh adds components and targets to it.
command -v rustup >/dev/null && command -v cargo >/dev/null \
    || die "no Rust toolchain on PATH: install rustup (https://rustup.rs) as the user who builds, open a new shell (or: . \"\$HOME/.cargo/env\"), then re-run setup.sh"

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
