#!/usr/bin/env bash
# KerntunFFI.xcframework without Xcode: the static libraries are built with
# cargo, merged with lipo (or LLVM's llvm-lipo) and the framework's
# Info.plist is written by apple/xcframework.py with the layout
# `xcodebuild -create-xcframework` writes. Runs on Linux and on a Mac.
#
#   apple/assemble-xcframework.sh build [--profile P] [--out DIR.xcframework]
#                                       [--arm64-only] [--build-std]
#       builds kerntun-ffi as a staticlib for every slice and writes
#       apple/KerntunFFI.xcframework (or --out), then `verify`s it and checks
#       that the device library carries the committed Swift interface.
#       Profile: release-mobile (Cargo.toml) unless --profile says otherwise.
#       Slices: ios-arm64 (aarch64-apple-ios), ios-arm64_x86_64-simulator
#       (aarch64-apple-ios-sim + x86_64-apple-ios) and macos-arm64_x86_64
#       (aarch64-apple-darwin + x86_64-apple-darwin). Without a lipo, or with
#       --arm64-only, the x86_64 halves are left out: ios-arm64-simulator and
#       macos-arm64 (no Intel Mac, no simulator on an Intel Mac).
#       A target whose rust-std rustup cannot install is an error; with
#       --build-std its std is built from the rust-src component instead
#       (RUSTC_BOOTSTRAP=1 cargo -Zbuild-std, the same compiler as the others).
#   apple/assemble-xcframework.sh assemble OUT.xcframework ios=LIB.a \
#           ios-simulator=LIB.a[,LIB.a] macos=LIB.a[,LIB.a]
#       the same from libraries built elsewhere
#   apple/assemble-xcframework.sh verify DIR.xcframework
#       Info.plist against the structure xcodebuild writes; every slice's
#       archive against it (architectures, and the LC_BUILD_VERSION platform
#       of its objects: iOS, iOS simulator, macOS); headers present
#   apple/assemble-xcframework.sh self-test
#       all of it but cargo, on stand-in archives (a few seconds; CI runs it
#       through apple/release-xcframework.sh self-test)
#
# Then `apple/release-xcframework.sh release-assembled URL` zips it, prints
# the SwiftPM checksum and writes both into Package.swift (docs/shipping.md).
#
# Linking: kerntun-ffi's staticlib needs no linker, but tun-rs (a
# dependency) is also a cdylib and cargo links it; on Linux
# scripts/cross-link.sh stands in for Apple's linker.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
py="$here/xcframework.py"

die() { echo "assemble-xcframework.sh: $*" >&2; exit 1; }

# A lipo: $LIPO ("-" for none), else Xcode's, else LLVM's (Debian's llvm
# package installs llvm-lipo-NN).
find_lipo() {
    local t
    if [[ -n "${LIPO:-}" ]]; then
        [[ $LIPO != - ]] && { echo "$LIPO"; return 0; }
        return 1
    fi
    for t in lipo llvm-lipo llvm-lipo-{20,19,18,17,16,15,14}; do
        command -v "$t" >/dev/null && { command -v "$t"; return 0; }
    done
    for t in /usr/lib/llvm-*/bin/llvm-lipo; do
        [[ -x "$t" ]] && { echo "$t"; return 0; }
    done
    return 1
}

build() {
    local profile=release-mobile out="$here/KerntunFFI.xcframework" arm64_only=0 build_std=0
    while (($#)); do
        case "$1" in
        --profile) profile=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --arm64-only) arm64_only=1; shift ;;
        --build-std) build_std=1; shift ;;
        *) die "unknown option $1 (see the top of $0)" ;;
        esac
    done
    local lipo=-
    if ((!arm64_only)); then
        lipo=$(find_lipo) || {
            echo "assemble-xcframework.sh: no lipo or llvm-lipo: building arm64 slices only (no x86_64 simulator, no Intel Mac)" >&2
            lipo=-
            arm64_only=1
        }
    fi
    local sim=(aarch64-apple-ios-sim) mac=(aarch64-apple-darwin)
    ((arm64_only)) || { sim+=(x86_64-apple-ios); mac+=(x86_64-apple-darwin); }
    local targets=(aarch64-apple-ios "${sim[@]}" "${mac[@]}")

    cd "$root"
    export IPHONEOS_DEPLOYMENT_TARGET=${IPHONEOS_DEPLOYMENT_TARGET:-15.0}
    export MACOSX_DEPLOYMENT_TARGET=${MACOSX_DEPLOYMENT_TARGET:-12.0}
    local target_dir dir
    target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
    dir=$([[ $profile == dev ]] && echo debug || echo "$profile")
    [[ $(uname) == Darwin ]] || . "$root/scripts/cross-link.sh"

    local t std
    for t in "${targets[@]}"; do
        std=()
        if [[ ! -d "$(rustc --print sysroot)/lib/rustlib/$t/lib" ]] && ! rustup target add "$t" >/dev/null 2>&1; then
            ((build_std)) || die "rustup cannot install the standard library for $t here; add --build-std to build it from rust-src (rustup component add rust-src)"
            [[ -d "$(rustc --print sysroot)/lib/rustlib/src/rust/library" ]] || die "--build-std needs the rust-src component: rustup component add rust-src"
            std=(-Zbuild-std=std,panic_unwind)
            echo "== $t: no prebuilt std; building it from rust-src" >&2
        fi
        echo "== cargo rustc -p kerntun-ffi --lib --crate-type staticlib --profile $profile --target $t ${std[*]}" >&2
        (
            [[ $(uname) == Darwin ]] || cross_link_env "$t"
            if ((${#std[@]})); then export RUSTC_BOOTSTRAP=1; fi
            cargo rustc -p kerntun-ffi --lib --crate-type staticlib --profile "$profile" --target "$t" "${std[@]}"
        ) || die "cargo failed for $t"
    done

    lib() { echo "$target_dir/$1/$dir/libkerntun_ffi.a"; }
    join() { local IFS=,; echo "$*"; }
    local sims=() macs=()
    for t in "${sim[@]}"; do sims+=("$(lib "$t")"); done
    for t in "${mac[@]}"; do macs+=("$(lib "$t")"); done
    python3 "$py" assemble "$out" "$root/apple/Headers" "$lipo" \
        "ios=$(lib aarch64-apple-ios)" "ios-simulator=$(join "${sims[@]}")" "macos=$(join "${macs[@]}")"
    python3 "$py" verify "$out"

    # The device library must carry exactly the committed Swift interface
    # (what apple/check-ios-build.sh checks for CI's release build).
    cargo build --quiet -p kerntun-uniffi-bindgen
    local gen
    gen=$(mktemp -d)
    "$target_dir/debug/uniffi-bindgen" generate --library "$(lib aarch64-apple-ios)" --language swift --no-format --out-dir "$gen"
    if ! diff -u "$root/apple/Sources/Kerntun/Kerntun.swift" "$gen/Kerntun.swift" || ! diff -u "$root/apple/Headers/KerntunFFI.h" "$gen/KerntunFFI.h"; then
        rm -rf "$gen"
        die "the built library's interface differs from the committed bindings (scripts/bindings.sh swift)"
    fi
    rm -rf "$gen"
    echo "$out ready ($profile): the device library carries the committed Swift interface"
}

self_test() {
    selftest_tmp=$(mktemp -d)
    trap 'rm -rf "$selftest_tmp"' EXIT
    local tmp=$selftest_tmp lipo fw="$selftest_tmp/KerntunFFI.xcframework"
    ok() { echo "ok   $*"; }
    for spec in ios:arm64:ios sim-arm64:arm64:ios-simulator sim-x86:x86_64:ios-simulator \
        mac-arm64:arm64:macos mac-x86:x86_64:macos; do
        IFS=: read -r name arch platform <<<"$spec"
        python3 "$py" fake-archive "$tmp/$name.a" "$arch" "$platform"
    done

    lipo=$(find_lipo) || lipo=-
    if [[ $lipo != - ]]; then
        python3 "$py" assemble "$fw" "$root/apple/Headers" "$lipo" \
            "ios=$tmp/ios.a" "ios-simulator=$tmp/sim-arm64.a,$tmp/sim-x86.a" "macos=$tmp/mac-arm64.a,$tmp/mac-x86.a" >"$tmp/out"
        [[ "$(xargs -n1 basename <"$tmp/out" | xargs)" == "ios-arm64 ios-arm64_x86_64-simulator macos-arm64_x86_64" ]] \
            || die "self-test: unexpected slices: $(cat "$tmp/out")"
        ok "assembled with $(basename "$lipo"): $(xargs -n1 basename <"$tmp/out" | xargs)"
    else
        python3 "$py" assemble "$fw" "$root/apple/Headers" - \
            "ios=$tmp/ios.a" "ios-simulator=$tmp/sim-arm64.a" "macos=$tmp/mac-arm64.a" >/dev/null
        ok "assembled arm64-only (no lipo here: the universal slices are not tested)"
    fi
    python3 "$py" verify "$fw" >/dev/null || die "self-test: verify refused the framework just assembled: $(python3 "$py" verify "$fw")"
    ok "verify accepts it"

    # The plist: what xcodebuild writes, key for key.
    python3 - "$fw" "$lipo" <<'PY' || die "self-test: Info.plist is not shaped as xcodebuild writes it"
import plistlib, sys
fw, lipo = sys.argv[1], sys.argv[2]
raw = open(fw + "/Info.plist", "rb").read()
assert raw.startswith(b'<?xml version="1.0" encoding="UTF-8"?>\n<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">\n<plist version="1.0">\n<dict>\n\t<key>AvailableLibraries</key>'), raw[:200]
info = plistlib.loads(raw)
assert info["CFBundlePackageType"] == "XFWK" and info["XCFrameworkFormatVersion"] == "1.0"
libs = {l["LibraryIdentifier"]: l for l in info["AvailableLibraries"]}
sim = "ios-arm64_x86_64-simulator" if lipo != "-" else "ios-arm64-simulator"
assert libs["ios-arm64"] == {"BinaryPath": "libkerntun_ffi.a", "HeadersPath": "Headers", "LibraryIdentifier": "ios-arm64",
    "LibraryPath": "libkerntun_ffi.a", "SupportedArchitectures": ["arm64"], "SupportedPlatform": "ios"}, libs["ios-arm64"]
assert libs[sim]["SupportedPlatform"] == "ios" and libs[sim]["SupportedPlatformVariant"] == "simulator"
assert "SupportedPlatformVariant" not in libs[[k for k in libs if k.startswith("macos")][0]]
assert [l["LibraryIdentifier"] for l in info["AvailableLibraries"]] == sorted(libs)
PY
    ok "Info.plist: XML header, keys and values as xcodebuild writes them, libraries in identifier order"

    local again="$tmp/again.xcframework"
    python3 "$py" assemble "$again" "$root/apple/Headers" "$lipo" "ios=$tmp/ios.a" \
        "ios-simulator=$tmp/sim-arm64.a$([[ $lipo != - ]] && echo ",$tmp/sim-x86.a")" \
        "macos=$tmp/mac-arm64.a$([[ $lipo != - ]] && echo ",$tmp/mac-x86.a")" >/dev/null
    diff -r "$fw" "$again" >/dev/null || die "self-test: assembling the same libraries twice gave different trees"
    ok "the same libraries give the same tree, byte for byte"

    # Mistakes verify and assemble must catch.
    local sim_id
    sim_id=$(cd "$fw" && ls -d ios-*-simulator)
    bad() {  # bad WHAT EXPECTED-TEXT MUTATION...
        local what=$1 want=$2 copy="$tmp/bad"
        shift 2
        rm -rf "$copy" && cp -a "$fw" "$copy"
        (cd "$copy" && eval "$*")
        if python3 "$py" verify "$copy" >"$tmp/verify" 2>&1; then die "self-test: verify accepted $what"; fi
        grep -q -- "$want" "$tmp/verify" || die "self-test: verify refused $what without saying '$want': $(cat "$tmp/verify")"
        ok "verify refuses $what: $(grep -m1 FAIL "$tmp/verify" | sed "s|$copy: ||" | cut -c1-110)"
    }
    # The simulator slice with its arm64 half taken from the device library:
    # the architectures still match, the platform does not.
    if [[ $lipo != - ]]; then
        "$lipo" -create "$tmp/ios.a" "$tmp/sim-x86.a" -output "$tmp/wrong-sim.a"
    else
        cp "$tmp/ios.a" "$tmp/wrong-sim.a"
    fi
    bad "device objects in the simulator slice" "arm64 objects are built for \['ios'\], not ios-simulator" \
        cp "$tmp/wrong-sim.a" "$sim_id/libkerntun_ffi.a"
    bad "a slice missing its header" "KerntunFFI.h is missing" rm ios-arm64/Headers/KerntunFFI.h
    bad "a wrong package type" "CFBundlePackageType" \
        "python3 -c \"import plistlib; p = plistlib.load(open('Info.plist', 'rb')); p['CFBundlePackageType'] = 'FMWK'; plistlib.dump(p, open('Info.plist', 'wb'))\""
    bad "a simulator slice without its variant" "Xcode names this slice" \
        "python3 -c \"import plistlib; p = plistlib.load(open('Info.plist', 'rb')); [l.pop('SupportedPlatformVariant', None) for l in p['AvailableLibraries']]; plistlib.dump(p, open('Info.plist', 'wb'))\""
    bad "an unlisted directory" "does not list" mkdir watchos-arm64
    if [[ $lipo != - ]]; then
        bad "an architecture the library lacks" "the library holds" \
            "python3 -c \"import plistlib; p = plistlib.load(open('Info.plist', 'rb')); l = [l for l in p['AvailableLibraries'] if l['LibraryIdentifier'] == 'ios-arm64'][0]; l['SupportedArchitectures'] = ['arm64', 'x86_64']; l['LibraryIdentifier'] = 'ios-arm64_x86_64'; plistlib.dump(p, open('Info.plist', 'wb'))\"; mv ios-arm64 ios-arm64_x86_64"
    fi
    if python3 "$py" assemble "$tmp/wrong.xcframework" "$root/apple/Headers" - "ios=$tmp/sim-arm64.a" >"$tmp/err" 2>&1; then
        die "self-test: assemble put a simulator library into the device slice"
    fi
    ok "assemble refuses a simulator library for the device slice: $(cut -c1-100 "$tmp/err")"

    # release-xcframework.sh's zip takes the assembled framework as it is.
    bash "$here/release-xcframework.sh" zip "$fw" "$tmp/fw.zip" >/dev/null
    python3 - "$tmp/fw.zip" <<'PY' || die "self-test: the zip does not hold the assembled framework"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "KerntunFFI.xcframework/Info.plist" in names and "KerntunFFI.xcframework/ios-arm64/libkerntun_ffi.a" in names, names
PY
    ok "release-xcframework.sh zip packs it (KerntunFFI.xcframework/ at the top)"
    echo "assemble-xcframework.sh self-test passed"
}

case "${1:-}" in
build) shift; build "$@" ;;
assemble) shift; (($# >= 2)) || die "usage: $0 assemble OUT.xcframework GROUP=LIB[,LIB]..."
    out=$1; shift
    lipo=$(find_lipo) || lipo=-
    python3 "$py" assemble "$out" "$root/apple/Headers" "$lipo" "$@"
    python3 "$py" verify "$out" ;;
verify) (($# == 2)) || die "usage: $0 verify DIR.xcframework"; python3 "$py" verify "$2" ;;
self-test) self_test ;;
*) sed -n '2,38p' "$0" >&2; exit 2 ;;
esac
