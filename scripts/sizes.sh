#!/usr/bin/env bash
# Sizes of what kerntun ships, per target, feature set and profile, as a
# Markdown table (docs/shipping.md holds one, with the machine it ran on).
#
#   bash scripts/sizes.sh                          release and release-mobile
#   bash scripts/sizes.sh --profiles release-mobile
#   bash scripts/sizes.sh --only ios,android       rows: ios, android, linux, cli,
#                                                  linux-dot, cli-dot,
#                                                  linux-doh, cli-doh
#   OPT_LEVEL=z bash scripts/sizes.sh --profiles release-mobile
#                                                  the same with another opt-level
#                                                  (CARGO_PROFILE_<P>_OPT_LEVEL)
#
# Every library is built the way it ships: `cargo rustc -p kerntun-ffi --lib
# --crate-type staticlib|cdylib`. One crate type per build is what lets the
# profile's LTO run: cargo drops `lto` for a crate that is also an rlib,
# and kerntun-ffi's manifest lists `lib` (for its tests and the bindgen)
# next to `cdylib` and `staticlib`.
#
# What each row measures:
# * ios .a      the static library of the XCFramework (aarch64-apple-ios); an
#               archive of objects, not what an app grows by: the app's linker
#               keeps only what the Swift bindings reach;
# * ios dylib   the same code linked into a dylib by rust-lld with dead-code
#               stripping, the Swift bindings' entry points as its exports:
#               close to what an app's binary grows by (scripts/cross-link.sh;
#               system libraries are stubs, nothing of theirs is counted);
# * android .so the arm64-v8a library (aarch64-linux-android), linked here by
#               rust-lld instead of the NDK's clang (scripts/cross-link.sh): the
#               NDK would add its crtbegin_so/crtend_so and libunwind
#               (not measured here);
# * linux .so   the host cdylib (what the Kotlin JVM test loads);
# * cli         the `kerntun` executable.
# Columns: the file as the build wrote it; after llvm-strip (--strip-debug
# for an archive, --strip-all for a linked file: what a store or an app
# bundle carries); and the machine code alone (.text / __text).
#
# The dot and doh features (DNS over TLS and over HTTPS, ring) need a C
# compiler for the target: measured for the Linux rows only.
#
# Needs: rustup targets aarch64-apple-ios and aarch64-linux-android, llvm-size
# and llvm-strip (Debian: llvm). Builds go to the workspace's target
# directory, niced; a first run builds each target and profile from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cross-link.sh

profiles=(release release-mobile)
only=ios,android,linux,cli,linux-dot,cli-dot,linux-doh,cli-doh
while (($#)); do
    case "$1" in
    --profiles) read -ra profiles <<<"$2"; shift 2 ;;
    --only) only=$2; shift 2 ;;
    *) sed -n '2,42p' "$0" >&2; exit 2 ;;
    esac
done

tool() {
    local t
    for t in "$1" "$1"-{20,19,18,17,16,15,14}; do
        command -v "$t" >/dev/null && { command -v "$t"; return; }
    done
    echo "scripts/sizes.sh: $1 not found (Debian: apt-get install llvm)" >&2
    exit 1
}
size_tool=$(tool llvm-size)
strip_tool=$(tool llvm-strip)
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log="$work/build.log"

# text_bytes FILE: the machine code, summed over an archive's members.
text_bytes() {
    "$size_tool" -A "$1" | awk '$1 == ".text" || $1 == "__text" { n += $2 } END { print n + 0 }'
}

# row LABEL TARGET FEATURES PROFILE FILE COMMAND
row() {
    local label=$1 target=$2 features=$3 profile=$4 file=$5 cmd=$6 copy="$work/stripped" built stripped
    built=$(stat -c %s "$file")
    cp "$file" "$copy"
    if [[ $file == *.a ]]; then
        "$strip_tool" --strip-debug "$copy"
    else
        "$strip_tool" --strip-all "$copy"
    fi
    stripped=$(stat -c %s "$copy")
    printf '| %s | %s | %s | %s | %s | %s | %s | `%s` |\n' "$label" "$target" "${features:-default}" "$profile$opt_note" \
        "$(mib "$built")" "$(mib "$stripped")" "$(mib "$(text_bytes "$file")")" "$cmd"
}

mib() { python3 -c "import sys; n = int(sys.argv[1]); print(f'{n / 1048576:.2f} MiB ({n})')" "$1"; }

# build TARGET PROFILE FEATURES CARGO-ARGS...: run cargo (niced, output to
# the log), print nothing.
build() {
    local target=$1 profile=$2 features=$3
    shift 3
    local args=("$@" --profile "$profile")
    [[ -n "$features" ]] && args+=(--features "$features")
    [[ "$target" != host ]] && args+=(--target "$target")
    echo "== cargo ${args[*]}" >>"$log"
    if ! (
        [[ "$target" == host ]] || cross_link_env "$target"
        [[ -n "${OPT_LEVEL:-}" ]] && export "CARGO_PROFILE_$(echo "$profile" | tr 'a-z-' 'A-Z_')_OPT_LEVEL=$OPT_LEVEL"
        nice -n 5 cargo "${args[@]}"
    ) >>"$log" 2>&1; then
        tail -n 30 "$log" >&2
        echo "scripts/sizes.sh: cargo ${args[*]} failed (log above)" >&2
        exit 1
    fi
}

out_dir() { local t=$1 p=$2; [[ $t == host ]] && echo "$target_dir/$p" || echo "$target_dir/$t/$p"; }

opt_note=${OPT_LEVEL:+ (opt-level $OPT_LEVEL)}
echo "| artifact | target | features | profile | as built | stripped | .text | built with |"
echo "|---|---|---|---|---|---|---|---|"
for profile in "${profiles[@]}"; do
    lib=(rustc -p kerntun-ffi --lib --crate-type)
    if [[ ,$only, == *,ios,* ]]; then
        build aarch64-apple-ios "$profile" "" "${lib[@]}" staticlib
        row "ios .a" aarch64-apple-ios "" "$profile" "$(out_dir aarch64-apple-ios "$profile")/libkerntun_ffi.a" \
            "cargo rustc -p kerntun-ffi --lib --crate-type staticlib --profile $profile --target aarch64-apple-ios"
        build aarch64-apple-ios "$profile" "" "${lib[@]}" cdylib
        row "ios dylib" aarch64-apple-ios "" "$profile" "$(out_dir aarch64-apple-ios "$profile")/libkerntun_ffi.dylib" \
            "cargo rustc -p kerntun-ffi --lib --crate-type cdylib --profile $profile --target aarch64-apple-ios"
    fi
    if [[ ,$only, == *,android,* ]]; then
        build aarch64-linux-android "$profile" "" "${lib[@]}" cdylib
        row "android .so" aarch64-linux-android "" "$profile" "$(out_dir aarch64-linux-android "$profile")/libkerntun_ffi.so" \
            "cargo rustc -p kerntun-ffi --lib --crate-type cdylib --profile $profile --target aarch64-linux-android"
    fi
    for features in "" kerntun/dot kerntun/doh; do
        suffix=${features#kerntun/}
        suffix=${suffix:+-$suffix}
        if [[ ,$only, == *,linux$suffix,* ]]; then
            build host "$profile" "$features" "${lib[@]}" cdylib
            row "linux .so" x86_64-unknown-linux-gnu "$features" "$profile" "$(out_dir host "$profile")/libkerntun_ffi.so" \
                "cargo rustc -p kerntun-ffi --lib --crate-type cdylib --profile $profile${features:+ --features $features}"
        fi
        if [[ ,$only, == *,cli$suffix,* ]]; then
            build host "$profile" "$features" build -p kerntun-cli
            row "cli" x86_64-unknown-linux-gnu "$features" "$profile" "$(out_dir host "$profile")/kerntun" \
                "cargo build -p kerntun-cli --profile $profile${features:+ --features $features}"
        fi
    done
done
