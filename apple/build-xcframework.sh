#!/usr/bin/env bash
# Build KerntunFFI.xcframework (static library + C headers) for the Swift
# package in this directory. Runs on macOS with Xcode and rustup.
#
#   apple/build-xcframework.sh            the release-mobile profile (Cargo.toml)
#   PROFILE=release apple/build-xcframework.sh, PROFILE=debug ...
#
# apple/assemble-xcframework.sh build makes the same framework without
# Xcode (and on Linux).
#
# Slices: iOS device (arm64), iOS simulator (arm64 + x86_64), macOS
# (arm64 + x86_64). The headers are the committed apple/Headers, which CI
# keeps in sync with the library (scripts/bindings.sh check); this script
# re-checks that first.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $(uname) == Darwin ]] || { echo "build-xcframework.sh needs macOS and Xcode" >&2; exit 1; }

profile=${PROFILE:-release-mobile}
cargo_profile=$([[ $profile == debug ]] && echo dev || echo "$profile")
export IPHONEOS_DEPLOYMENT_TARGET=${IPHONEOS_DEPLOYMENT_TARGET:-15.0}
export MACOSX_DEPLOYMENT_TARGET=${MACOSX_DEPLOYMENT_TARGET:-12.0}
targets=(aarch64-apple-ios aarch64-apple-ios-sim x86_64-apple-ios aarch64-apple-darwin x86_64-apple-darwin)

bash scripts/bindings.sh check

rustup target add "${targets[@]}" >/dev/null
# One crate type per build, so that the profile's LTO runs (cargo leaves it
# out for a crate that is also an rlib; scripts/sizes.sh).
for t in "${targets[@]}"; do
    echo "== cargo rustc -p kerntun-ffi --lib --crate-type staticlib --profile $cargo_profile --target $t"
    cargo rustc -p kerntun-ffi --lib --crate-type staticlib --profile "$cargo_profile" --target "$t"
done

target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
lib() { echo "$target_dir/$1/$profile/libkerntun_ffi.a"; }
out=apple/build
rm -rf "$out" apple/KerntunFFI.xcframework
mkdir -p "$out/ios" "$out/ios-sim" "$out/macos"
cp "$(lib aarch64-apple-ios)" "$out/ios/"
lipo -create "$(lib aarch64-apple-ios-sim)" "$(lib x86_64-apple-ios)" -output "$out/ios-sim/libkerntun_ffi.a"
lipo -create "$(lib aarch64-apple-darwin)" "$(lib x86_64-apple-darwin)" -output "$out/macos/libkerntun_ffi.a"

xcodebuild -create-xcframework \
    -library "$out/ios/libkerntun_ffi.a" -headers apple/Headers \
    -library "$out/ios-sim/libkerntun_ffi.a" -headers apple/Headers \
    -library "$out/macos/libkerntun_ffi.a" -headers apple/Headers \
    -output apple/KerntunFFI.xcframework
echo "apple/KerntunFFI.xcframework ready ($profile)"
