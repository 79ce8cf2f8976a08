# Sourced, not run: link Apple and Android targets on Linux, without Xcode or
# the NDK, for checks and measurements (apple/check-ios-build.sh,
# apple/assemble-xcframework.sh, scripts/sizes.sh).
#
#   . scripts/cross-link.sh
#   cross_link_env TARGET     exports CARGO_TARGET_<TARGET>_LINKER (and, for
#                             Apple targets, _RUSTFLAGS) for cargo
#
# Why a linker at all: kerntun-ffi is also a cdylib, tun-rs declares one
# too, and cargo links every crate type it builds, dependencies included.
# The shipped artifacts are the staticlibs (the XCFramework) and, on
# Android, a .so that android/build.sh links with the NDK.
#
# * Apple (aarch64-apple-ios, aarch64-apple-ios-sim, x86_64-apple-ios,
#   aarch64-apple-darwin, x86_64-apple-darwin): rust-lld in its ld64 flavour
#   against empty libSystem/libc/... text stubs, with `-undefined
#   dynamic_lookup`. The dylibs it makes have every symbol from the system
#   unresolved: link checks and size measurements, never shipped.
# * Android (aarch64-linux-android, x86_64-linux-android): rust-lld in its
#   GNU flavour against empty libc/libm/libdl/liblog/libunwind archives
#   (a shared library may leave symbols undefined). .cargo/config.toml's
#   `-Wl,-z,max-page-size=16384` stays in force: a small wrapper hands it to
#   lld without the compiler driver's `-Wl,` prefix. The library has no
#   DT_NEEDED entries and lacks the NDK's crtbegin_so/crtend_so and
#   libunwind: a size measurement, never loadable.
#
# The stubs live in a fixed directory under the target directory, so the
# flags (and with them cargo's fingerprints) are the same on every run.

# The host's rust-lld, shipped with every rustup toolchain.
cross_link_lld() {
    local lld
    lld="$(rustc --print sysroot)/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin/rust-lld"
    [[ -x "$lld" ]] || { echo "rust-lld not found at $lld" >&2; return 1; }
    echo "$lld"
}

cross_link_env() {
    local target=$1 target_dir lld stub var platform min sdk tbd_target lib
    target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
    lld=$(cross_link_lld) || return 1
    stub="$target_dir/cross-link/$target"
    var=$(echo "$target" | tr 'a-z-' 'A-Z_')
    mkdir -p "$stub"
    case "$target" in
    *-apple-ios | *-apple-ios-sim | *-apple-darwin)
        case "$target" in
        aarch64-apple-ios) tbd_target=arm64-ios platform=ios min=15.0 sdk=17.0 ;;
        aarch64-apple-ios-sim) tbd_target=arm64-ios-simulator platform=ios-simulator min=15.0 sdk=17.0 ;;
        x86_64-apple-ios) tbd_target=x86_64-ios-simulator platform=ios-simulator min=15.0 sdk=17.0 ;;
        aarch64-apple-darwin) tbd_target=arm64-macos platform=macos min=12.0 sdk=14.0 ;;
        x86_64-apple-darwin) tbd_target=x86_64-macos platform=macos min=12.0 sdk=14.0 ;;
        *) echo "cross_link_env: no Apple stub for $target" >&2; return 1 ;;
        esac
        for lib in System c m iconv resolv objc; do
            cat >"$stub/lib$lib.tbd" <<TBD
--- !tapi-tbd
tbd-version:     4
targets:         [ $tbd_target ]
install-name:    '/usr/lib/lib$lib.dylib'
...
TBD
        done
        export "CARGO_TARGET_${var}_LINKER=$lld"
        export "CARGO_TARGET_${var}_RUSTFLAGS=-Clinker-flavor=ld64.lld -Clink-arg=-L$stub -Clink-arg=-undefined -Clink-arg=dynamic_lookup -Clink-arg=-platform_version -Clink-arg=$platform -Clink-arg=$min -Clink-arg=$sdk"
        ;;
    aarch64-linux-android | x86_64-linux-android)
        for lib in c m dl log unwind; do printf '!<arch>\n' >"$stub/lib$lib.a"; done
        cat >"$stub/ld" <<SH
#!/usr/bin/env bash
# rust-lld for $target with the compiler driver's -Wl, arguments unwrapped
# (scripts/cross-link.sh).
# rustc names the lld flavour itself; say it if it did not.
[[ \${1:-} == -flavor ]] || set -- -flavor gnu "\$@"
args=()
for a in "\$@"; do
    if [[ \$a == -Wl,* ]]; then
        IFS=, read -ra parts <<<"\${a#-Wl,}"
        args+=("\${parts[@]}")
    else
        args+=("\$a")
    fi
done
exec "$lld" "\${args[@]}" -L"$stub"
SH
        chmod +x "$stub/ld"
        export "CARGO_TARGET_${var}_LINKER=$stub/ld"
        # Added to .cargo/config.toml's rustflags for the target (cargo joins
        # the two lists).
        export "CARGO_TARGET_${var}_RUSTFLAGS=-Clinker-flavor=ld.lld"
        ;;
    *)
        echo "cross_link_env: $target is linked by the host toolchain" >&2
        return 1
        ;;
    esac
}
