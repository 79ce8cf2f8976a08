#!/usr/bin/env bash
# The Android build settings CI can check without an NDK (there is none to
# link with here):
#
#   bash scripts/check-android-config.sh              the configuration checks below
#   bash scripts/check-android-config.sh --elf SO...  every PT_LOAD segment of each
#                                                     shared library aligned to 16 KB
#                                                     (android/build.sh runs this on
#                                                     what it built)
#   bash scripts/check-android-config.sh --self-test  the --elf check on two host
#                                                     libraries linked here with
#                                                     4 KB and 16 KB pages (needs cc)
#
# Configuration checks:
# 1. android/build.sh, android/kerntun/build.gradle.kts (abiFilters) and
#    PackagedAbis.ABIS in android/kerntun/src/main/kotlin/org/kerntun/android/KerntunPolicy.kt
#    name the same ABIs;
# 2. .cargo/config.toml gives the Rust target of each of them the linker
#    flag for 16 KB pages (-Wl,-z,max-page-size=16384), as cargo reads it;
# 3. the module pins a JNA release whose libjnidispatch.so is built for
#    16 KB pages (5.17.0 or newer; older ones crash at load on 16 KB
#    devices).
set -euo pipefail
cd "$(dirname "$0")/.."

PAGE=16384

# --elf FILE...: Python reads the program headers (no binutils needed, any
# ELF class and byte order).
elf_check() {
    python3 - "$PAGE" "$@" <<'PY'
import struct, sys
page = int(sys.argv[1])
bad = 0
for path in sys.argv[2:]:
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF":
        print(f"FAIL {path}: not an ELF file"); bad += 1; continue
    is64 = data[4] == 2
    end = "<" if data[5] == 1 else ">"
    if is64:
        phoff, = struct.unpack_from(end + "Q", data, 0x20)
        phentsize, phnum = struct.unpack_from(end + "HH", data, 0x36)
    else:
        phoff, = struct.unpack_from(end + "I", data, 0x1C)
        phentsize, phnum = struct.unpack_from(end + "HH", data, 0x2A)
    aligns = []
    for i in range(phnum):
        off = phoff + i * phentsize
        p_type, = struct.unpack_from(end + "I", data, off)
        if p_type != 1:  # PT_LOAD
            continue
        if is64:
            p_align, = struct.unpack_from(end + "Q", data, off + 48)
        else:
            p_align, = struct.unpack_from(end + "I", data, off + 28)
        aligns.append(p_align)
    if not aligns:
        print(f"FAIL {path}: no PT_LOAD segment"); bad += 1
    elif min(aligns) < page:
        print(f"FAIL {path}: PT_LOAD aligned to {min(aligns)} bytes, Android 15+ 16 KB devices need {page}"); bad += 1
    else:
        print(f"ok   {path}: {len(aligns)} PT_LOAD segments aligned to >= {page} bytes")
sys.exit(1 if bad else 0)
PY
}

self_test() {
    command -v cc >/dev/null || { echo "--self-test needs a C compiler (cc)" >&2; exit 1; }
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    echo 'int kerntun_probe(void) { return 16; }' >"$tmp/probe.c"
    cc -shared -fPIC -Wl,-z,max-page-size=16384 -o "$tmp/page16k.so" "$tmp/probe.c"
    cc -shared -fPIC -Wl,-z,max-page-size=4096 -Wl,-z,common-page-size=4096 -o "$tmp/page4k.so" "$tmp/probe.c"
    elf_check "$tmp/page16k.so" || { echo "self-test: a 16 KB library was refused" >&2; exit 1; }
    if elf_check "$tmp/page4k.so"; then
        echo "self-test: a 4 KB library passed" >&2
        exit 1
    fi
    echo "self-test: the --elf check tells 16 KB from 4 KB alignment"

    # The configuration check on broken copies of the four files: each
    # mutation must be caught.
    local files=(android/build.sh android/kerntun/build.gradle.kts .cargo/config.toml
        android/kerntun/src/main/kotlin/org/kerntun/android/KerntunPolicy.kt)
    local mutation n=0
    for mutation in \
        '.cargo/config.toml|/^\[target\.x86_64-linux-android\]/,/^rustflags/d' \
        '.cargo/config.toml|s/max-page-size=16384/max-page-size=4096/' \
        'android/build.sh|s/^abis=(.*)$/abis=(arm64-v8a armeabi-v7a x86_64)/' \
        'android/kerntun/build.gradle.kts|s/jna:5\.17\.0@aar/jna:5.16.0@aar/'; do
        local file=${mutation%%|*} expr=${mutation#*|} copy="$tmp/copy$n"
        n=$((n + 1))
        local f
        for f in "${files[@]}" scripts/check-android-config.sh; do
            mkdir -p "$copy/$(dirname "$f")"
            cp "$f" "$copy/$f"
        done
        sed -i "$expr" "$copy/$file"
        if cmp -s "$file" "$copy/$file"; then
            echo "self-test: mutation '$expr' changed nothing in $file" >&2
            exit 1
        fi
        if (cd "$copy" && bash scripts/check-android-config.sh >"$tmp/out" 2>&1); then
            echo "self-test: the check passed with $file mutated by '$expr'" >&2
            exit 1
        fi
        echo "self-test: caught $file mutated by '$expr': $(grep -m1 FAIL "$tmp/out")"
    done
}

config_check() {
    local status=0
    fail() { echo "FAIL $*"; status=1; }

    # 1. The ABIs, from their three sources.
    local build_abis gradle_abis kotlin_abis
    build_abis=$(sed -n 's/^abis=(\(.*\))$/\1/p' android/build.sh | tr -s ' ' '\n' | sed '/^$/d' | sort | xargs)
    gradle_abis=$(sed -n 's/^val packagedAbis = listOf(\(.*\))$/\1/p' android/kerntun/build.gradle.kts | tr -d '" ' | tr ',' '\n' | sort | xargs)
    kotlin_abis=$(sed -n 's/^ *val ABIS: List<String> = listOf(\(.*\))$/\1/p' \
        android/kerntun/src/main/kotlin/org/kerntun/android/KerntunPolicy.kt | tr -d '" ' | tr ',' '\n' | sort | xargs)
    [[ -n "$build_abis" ]] || fail "android/build.sh: no abis=(...) line"
    if [[ "$build_abis" == "$gradle_abis" && "$build_abis" == "$kotlin_abis" ]]; then
        echo "ok   packaged ABIs agree: $build_abis (android/build.sh, build.gradle.kts, KerntunPolicy.kt)"
    else
        fail "packaged ABIs differ: android/build.sh [$build_abis], build.gradle.kts [$gradle_abis], KerntunPolicy.kt [$kotlin_abis]"
    fi

    # 2. The linker flag per Rust target, read with a TOML parser.
    local abi triple
    for abi in $build_abis; do
        case "$abi" in
        arm64-v8a) triple=aarch64-linux-android ;;
        armeabi-v7a) triple=armv7-linux-androideabi ;;
        x86_64) triple=x86_64-linux-android ;;
        x86) triple=i686-linux-android ;;
        *) fail "unknown ABI $abi"; continue ;;
        esac
        if python3 - "$triple" <<'PY'
import sys, tomllib
triple = sys.argv[1]
with open(".cargo/config.toml", "rb") as f:
    cfg = tomllib.load(f)
flags = cfg.get("target", {}).get(triple, {}).get("rustflags", [])
if isinstance(flags, str):
    flags = flags.split()
# rustflags is a list of separate arguments: ["-C", "link-arg=..."] or ["-Clink-arg=..."].
joined = " ".join(flags).replace("-C ", "-C")
ok = any(a in joined for a in ("-Clink-arg=-Wl,-z,max-page-size=16384", "-Clink-args=-Wl,-z,max-page-size=16384"))
sys.exit(0 if ok else 1)
PY
        then
            echo "ok   .cargo/config.toml: [target.$triple] links with -z max-page-size=16384 ($abi)"
        else
            fail ".cargo/config.toml: [target.$triple] lacks rustflags = [\"-C\", \"link-arg=-Wl,-z,max-page-size=16384\"] ($abi)"
        fi
    done

    # 3. JNA: 5.17.0 is the first release built with 16 KB pages.
    local jna
    jna=$(sed -n 's/.*"net\.java\.dev\.jna:jna:\([0-9.]*\)@aar".*/\1/p' android/kerntun/build.gradle.kts)
    if [[ -z "$jna" ]]; then
        fail "android/kerntun/build.gradle.kts: no net.java.dev.jna:jna:<version>@aar dependency"
    elif printf '%s\n%s\n' 5.17.0 "$jna" | sort -V -C; then
        echo "ok   JNA $jna (>= 5.17.0: libjnidispatch.so built for 16 KB pages)"
    else
        fail "JNA $jna predates 5.17.0: its libjnidispatch.so crashes at load on 16 KB-page devices"
    fi
    return "$status"
}

case "${1:-}" in
--elf)
    shift
    (($#)) || { echo "usage: $0 --elf LIB.so..." >&2; exit 2; }
    elf_check "$@"
    ;;
--self-test)
    self_test
    ;;
"")
    config_check
    ;;
*)
    sed -n '2,22p' "$0" >&2
    exit 2
    ;;
esac
