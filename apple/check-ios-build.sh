#!/usr/bin/env bash
# CI on Linux: `cargo build --target aarch64-apple-ios --release -p kerntun-ffi`
# must produce the static library the XCFramework is made of, and that
# library must carry the interface of the committed Swift bindings.
#
#   bash apple/check-ios-build.sh
#
# kerntun-ffi is also a cdylib (for Android and the JVM test), and cargo
# links every crate type. Linux has no Apple linker or SDK, so the iOS
# dylib is linked with rust-lld (ld64 flavour) against an empty libSystem
# stub with `-undefined dynamic_lookup`: it is a link check only and is
# never shipped (the XCFramework uses the .a; build-xcframework.sh on a Mac
# links with Xcode). The staticlib itself involves no linker.
set -euo pipefail
cd "$(dirname "$0")/.."

stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
for lib in System c m iconv resolv objc; do
    cat >"$stub/lib$lib.tbd" <<TBD
--- !tapi-tbd
tbd-version:     4
targets:         [ arm64-ios ]
install-name:    '/usr/lib/lib$lib.dylib'
...
TBD
done
lld="$(rustc --print sysroot)/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin/rust-lld"
[[ -x "$lld" ]] || { echo "rust-lld not found at $lld" >&2; exit 1; }

export CARGO_TARGET_AARCH64_APPLE_IOS_LINKER="$lld"
export CARGO_TARGET_AARCH64_APPLE_IOS_RUSTFLAGS="-Clinker-flavor=ld64.lld -Clink-arg=-L$stub -Clink-arg=-undefined -Clink-arg=dynamic_lookup -Clink-arg=-platform_version -Clink-arg=ios -Clink-arg=15.0 -Clink-arg=17.0"
export IPHONEOS_DEPLOYMENT_TARGET=15.0

cargo build --target aarch64-apple-ios --release -p kerntun-ffi

target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
a="$target_dir/aarch64-apple-ios/release/libkerntun_ffi.a"
[[ -s "$a" ]] || { echo "missing $a" >&2; exit 1; }
echo "staticlib: $a ($(du -h "$a" | cut -f1))"

# The archive's uniffi metadata must produce exactly the committed bindings.
cargo build --quiet -p kerntun-uniffi-bindgen
gen=$(mktemp -d)
trap 'rm -rf "$stub" "$gen"' EXIT
"$target_dir/debug/uniffi-bindgen" generate --library "$a" --language swift --no-format --out-dir "$gen"
diff -u apple/Sources/Kerntun/Kerntun.swift "$gen/Kerntun.swift"
diff -u apple/Headers/KerntunFFI.h "$gen/KerntunFFI.h"
echo "iOS staticlib carries the committed Swift interface"
