#!/usr/bin/env bash
# Build what the Android module packages: libkerntun_ffi.so for the ABIs in
# `abis` below (cargo-ndk) and the Kotlin bindings (the workspace's
# uniffi-bindgen), both under android/kerntun/build/generated/.
#
# Every library is linked for 16 KB pages (.cargo/config.toml) and checked
# after the build (scripts/check-android-config.sh --elf).
#
#   android/build.sh                  native libraries with the release-mobile
#                                     profile (Cargo.toml: size-optimised, fat LTO)
#   PROFILE=release android/build.sh  the desktop release profile; PROFILE=debug
#
# Each library is built with `cargo rustc --crate-type cdylib`: with one
# crate type the profile's LTO runs (cargo leaves LTO out for a crate that is
# also an rlib, and kerntun-ffi lists `lib` for its tests; scripts/sizes.sh).
#
# Then: cd android && gradle :kerntun:assembleRelease (or include the module
# in your app's Gradle build).
#
# Needs: the Android NDK (ANDROID_NDK_HOME, r26 or newer), `cargo install
# cargo-ndk`, `rustup target add aarch64-linux-android x86_64-linux-android`.
set -euo pipefail
cd "$(dirname "$0")/.."

# 64-bit only: Google Play requires 64-bit code and the 32-bit ABIs are left
# out. Keep in step with abiFilters in kerntun/build.gradle.kts and
# PackagedAbis in KerntunPolicy.kt (scripts/check-android-config.sh checks).
abis=(arm64-v8a x86_64)
profile=${PROFILE:-release-mobile}
cargo_profile=$([[ $profile == debug ]] && echo dev || echo "$profile")
# API 26 (Android 8.0) is the module's minSdk.
api=${ANDROID_API:-26}
gen=android/kerntun/build/generated

command -v cargo-ndk >/dev/null || { echo "cargo-ndk missing: cargo install cargo-ndk" >&2; exit 1; }
[[ -n "${ANDROID_NDK_HOME:-}" ]] || { echo "set ANDROID_NDK_HOME to the NDK" >&2; exit 1; }
rustup target add aarch64-linux-android x86_64-linux-android >/dev/null
# RUSTFLAGS / CARGO_ENCODED_RUSTFLAGS replace the rustflags of
# .cargo/config.toml, the 16 KB page flag with them.
for var in RUSTFLAGS CARGO_ENCODED_RUSTFLAGS; do
    if [[ -n "${!var:-}" && "${!var}" != *max-page-size=16384* ]]; then
        echo "$var is set and would drop -Wl,-z,max-page-size=16384 from .cargo/config.toml: unset it or add the flag" >&2
        exit 1
    fi
done
bash scripts/check-android-config.sh

rm -rf "$gen/jniLibs" "$gen/uniffi"
targets=()
for abi in "${abis[@]}"; do targets+=(-t "$abi"); done
cargo ndk "${targets[@]}" -P "$api" -o "$gen/jniLibs" \
    rustc -p kerntun-ffi --lib --crate-type cdylib --profile "$cargo_profile"
mapfile -t libs < <(find "$gen/jniLibs" -name '*.so' | sort)
((${#libs[@]} == ${#abis[@]})) || { echo "expected ${#abis[@]} libraries, got: ${libs[*]}" >&2; exit 1; }
bash scripts/check-android-config.sh --elf "${libs[@]}"
# The plain Kotlin flavour: the same bindings CI compiles and runs on the JVM.
bash scripts/bindings.sh kotlin "$gen/uniffi/kotlin"
find "$gen" -name '*.so' -o -name '*.kt' | sort
