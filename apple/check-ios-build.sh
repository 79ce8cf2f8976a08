#!/usr/bin/env bash
# CI on Linux: `cargo build --target aarch64-apple-ios --release -p kerntun-ffi`
# must produce the static library the XCFramework is made of, and that
# library must carry the interface of the committed Swift bindings.
#
#   bash apple/check-ios-build.sh
#
# kerntun-ffi is also a cdylib (for Android and the JVM test), and cargo
# links every crate type. Linux has no Apple linker or SDK, so the iOS
# dylib is linked with rust-lld (ld64 flavour) against empty libSystem
# stubs with `-undefined dynamic_lookup` (scripts/cross-link.sh): it is a
# link check only and is never shipped (the XCFramework uses the .a;
# build-xcframework.sh on a Mac links with Xcode). The staticlib itself
# involves no linker.
#
# This is the `release` profile with every crate type, as CI has always
# built it; the shipped library is the `release-mobile` staticlib of
# apple/assemble-xcframework.sh (or build-xcframework.sh), which checks
# the same interface.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/cross-link.sh
cross_link_env aarch64-apple-ios
export IPHONEOS_DEPLOYMENT_TARGET=15.0

cargo build --target aarch64-apple-ios --release -p kerntun-ffi

target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
a="$target_dir/aarch64-apple-ios/release/libkerntun_ffi.a"
[[ -s "$a" ]] || { echo "missing $a" >&2; exit 1; }
echo "staticlib: $a ($(du -h "$a" | cut -f1))"

# The archive's uniffi metadata must produce exactly the committed bindings.
cargo build --quiet -p kerntun-uniffi-bindgen
gen=$(mktemp -d)
trap 'rm -rf "$gen"' EXIT
"$target_dir/debug/uniffi-bindgen" generate --library "$a" --language swift --no-format --out-dir "$gen"
diff -u apple/Sources/Kerntun/Kerntun.swift "$gen/Kerntun.swift"
diff -u apple/Headers/KerntunFFI.h "$gen/KerntunFFI.h"
echo "iOS staticlib carries the committed Swift interface"
