#!/usr/bin/env bash
# Generate the Kotlin and Swift bindings of kerntun-ffi with the workspace's
# own uniffi-bindgen (same uniffi version as the library, by construction).
#
#   scripts/bindings.sh swift           regenerate the committed Swift bindings in apple/
#   scripts/bindings.sh check           regenerate Swift into a temp dir and diff against apple/
#                                       (CI's drift check; exit 1 on any difference)
#   scripts/bindings.sh kotlin OUT_DIR  Kotlin bindings into OUT_DIR: the plain JVM
#                                       flavour, used by the JVM test and the Android
#                                       module alike (it picks java.lang.ref.Cleaner
#                                       or JNA's cleaner at run time)
#
# KERNTUN_FFI_FEATURES (kotlin mode only): cargo features of kerntun-ffi to
# build with, e.g. `fault-injection` for the JVM test's fault hook; the
# committed Swift bindings are always generated without.
#
# Bindings are generated from the host build of the library: the interface
# metadata is the same for every target (the XCFramework's staticlib and the
# Android .so carry identical metadata). Runs inside the workspace because
# uniffi-bindgen reads `cargo metadata` (for ffi/uniffi.toml).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-}
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')

build() {
    # Two invocations on purpose: built together, cargo would unify uniffi's
    # `cli` feature into the library.
    cargo build --quiet -p kerntun-ffi ${1:+--features "$1"}
    cargo build --quiet -p kerntun-uniffi-bindgen
}

# The host cdylib: .so on Linux, .dylib on macOS.
lib="$target_dir/debug/libkerntun_ffi.$([[ $(uname) == Darwin ]] && echo dylib || echo so)"

# generate LANGUAGE OUT_DIR
generate() {
    "$target_dir/debug/uniffi-bindgen" generate \
        --library "$lib" \
        --language "$1" --no-format --out-dir "$2"
}

# Swift output: the module source for the Swift package, the C header and
# module map for the XCFramework's Headers/ (renamed module.modulemap there).
swift_into() {
    local out=$1 tmp
    tmp=$(mktemp -d)
    generate swift "$tmp"
    mkdir -p "$out/Sources/Kerntun" "$out/Headers"
    cp "$tmp/Kerntun.swift" "$out/Sources/Kerntun/Kerntun.swift"
    cp "$tmp/KerntunFFI.h" "$out/Headers/KerntunFFI.h"
    cp "$tmp/KerntunFFI.modulemap" "$out/Headers/module.modulemap"
    rm -rf "$tmp"
}

case "$mode" in
swift)
    build
    swift_into apple
    echo "Swift bindings written to apple/Sources/Kerntun and apple/Headers"
    ;;
check)
    build
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    swift_into "$tmp"
    status=0
    for f in Sources/Kerntun/Kerntun.swift Headers/KerntunFFI.h Headers/module.modulemap; do
        if ! diff -u "apple/$f" "$tmp/$f"; then
            echo "DRIFT: apple/$f differs from freshly generated bindings" >&2
            status=1
        fi
    done
    if ((status)); then
        echo "run scripts/bindings.sh swift and commit the result" >&2
        exit 1
    fi
    echo "Swift bindings up to date"
    ;;
kotlin)
    out=${2:?usage: scripts/bindings.sh $mode OUT_DIR}
    build "${KERNTUN_FFI_FEATURES:-}"
    generate kotlin "$out"
    echo "Kotlin bindings written to $out"
    ;;
*)
    sed -n '2,15p' "$0" >&2
    exit 2
    ;;
esac
