#!/usr/bin/env bash
# Build what the Android module packages: libkerntun_ffi.so for arm64-v8a
# and x86_64 (cargo-ndk) and the Kotlin bindings (the workspace's
# uniffi-bindgen), both under android/kerntun/build/generated/.
#
#   android/build.sh              release native libraries
#   PROFILE=debug android/build.sh
#
# Then: cd android && gradle :kerntun:assembleRelease (or include the module
# in your app's Gradle build).
#
# Needs: the Android NDK (ANDROID_NDK_HOME, r26 or newer), `cargo install
# cargo-ndk`, `rustup target add aarch64-linux-android x86_64-linux-android`.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=${PROFILE:-release}
flag=$([[ $profile == release ]] && echo --release || true)
# API 26 (Android 8.0) is the module's minSdk.
api=${ANDROID_API:-26}
gen=android/kerntun/build/generated

command -v cargo-ndk >/dev/null || { echo "cargo-ndk missing: cargo install cargo-ndk" >&2; exit 1; }
[[ -n "${ANDROID_NDK_HOME:-}" ]] || { echo "set ANDROID_NDK_HOME to the NDK" >&2; exit 1; }
rustup target add aarch64-linux-android x86_64-linux-android >/dev/null

rm -rf "$gen/jniLibs" "$gen/uniffi"
cargo ndk -t arm64-v8a -t x86_64 -P "$api" -o "$gen/jniLibs" build $flag -p kerntun-ffi
# The plain Kotlin flavour: the same bindings CI compiles and runs on the JVM.
bash scripts/bindings.sh kotlin "$gen/uniffi/kotlin"
find "$gen" -name '*.so' -o -name '*.kt' | sort
