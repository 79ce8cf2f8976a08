#!/usr/bin/env bash
# Release KerntunFFI.xcframework for SwiftPM: build it, zip it, print the
# checksum SwiftPM verifies, and write URL + checksum into the root Package.swift.
#
#   apple/release-xcframework.sh release URL     on a Mac with Xcode: build-xcframework.sh,
#                                                zip, checksum, set-release URL CHECKSUM.
#                                                URL is where the zip will be downloadable
#                                                (e.g. a release asset .../KerntunFFI.xcframework.zip)
#   apple/release-xcframework.sh release-assembled URL [XCFRAMEWORK] [-- BUILD-OPTIONS]
#                                                the same without Xcode, on Linux or a Mac:
#                                                assemble-xcframework.sh build (BUILD-OPTIONS
#                                                passed on) unless an assembled XCFRAMEWORK is
#                                                given, then verify, zip, checksum, set-release
#   apple/release-xcframework.sh zip XCFRAMEWORK OUT.zip
#                                                zip an .xcframework the way SwiftPM expects
#                                                (the .xcframework directory at the top of the
#                                                archive), reproducibly, and print its checksum
#   apple/release-xcframework.sh checksum FILE.zip
#                                                the SwiftPM checksum of a zip: the hex SHA-256 of
#                                                its bytes, what `swift package compute-checksum`
#                                                prints
#   apple/release-xcframework.sh set-release URL CHECKSUM
#                                                write the release section of the root Package.swift
#                                                (PACKAGE_SWIFT=path for another file);
#                                                set-release "" "" goes back to the local framework
#   apple/release-xcframework.sh self-test       every part that needs no Xcode, on a fake
#                                                framework (runs on Linux), and
#                                                assemble-xcframework.sh self-test
#
# Only `release` needs macOS and Xcode (xcodebuild, lipo); `release-assembled`
# needs cargo (and llvm-lipo for the x86_64 slices); the rest needs python3.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)

die() { echo "release-xcframework.sh: $*" >&2; exit 1; }

# checksum FILE.zip
checksum() {
    local file=$1
    [[ -f "$file" ]] || die "no such file: $file"
    [[ "$file" == *.zip ]] || die "$file: SwiftPM binary targets are .zip archives"
    python3 - "$file" <<'PY'
import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
print(h.hexdigest())
PY
}

# zip_framework XCFRAMEWORK OUT.zip: entries sorted, timestamps fixed, modes
# kept, symlinks stored as links: the same tree always gives the same bytes,
# so the same build gives the same checksum.
zip_framework() {
    local src=$1 out=$2
    [[ -d "$src" && "$src" == *.xcframework ]] || die "$src: not an .xcframework directory"
    [[ -f "$src/Info.plist" ]] || die "$src: no Info.plist (not built by xcodebuild -create-xcframework?)"
    python3 - "$src" "$out" <<'PY'
import os, stat, sys, zipfile
src, out = os.path.abspath(sys.argv[1]), sys.argv[2]
base = os.path.dirname(src)
entries = []
for dirpath, dirnames, filenames in os.walk(src):
    dirnames.sort()
    for name in sorted(dirnames) + sorted(filenames):
        entries.append(os.path.join(dirpath, name))
entries.sort()
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
    top = zipfile.ZipInfo(os.path.basename(src) + "/", date_time=(1980, 1, 1, 0, 0, 0))
    top.external_attr = (stat.S_IFDIR | 0o755) << 16
    z.writestr(top, b"")
    for path in entries:
        rel = os.path.relpath(path, base)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            info = zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            info.create_system = 3
            z.writestr(info, os.readlink(path))
        elif stat.S_ISDIR(st.st_mode):
            info = zipfile.ZipInfo(rel + "/", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (stat.S_IFDIR | 0o755) << 16
            info.create_system = 3
            z.writestr(info, b"")
        else:
            info = zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (stat.S_IFREG | (0o755 if st.st_mode & 0o111 else 0o644)) << 16
            info.create_system = 3
            info.compress_type = zipfile.ZIP_DEFLATED
            with open(path, "rb") as f:
                z.writestr(info, f.read())
PY
    echo "$out"
    echo "checksum: $(checksum "$out")"
}

# set_release URL CHECKSUM
set_release() {
    local url=$1 sum=$2 manifest=${PACKAGE_SWIFT:-$here/../Package.swift}
    if [[ -n "$url$sum" ]]; then
        [[ "$url" == https://*.zip ]] || die "URL must be an https:// address of the .zip: $url"
        [[ "$sum" =~ ^[0-9a-f]{64}$ ]] || die "checksum must be 64 lowercase hex digits (SHA-256): $sum"
    fi
    python3 - "$manifest" "$url" "$sum" <<'PY'
import re, sys
path, url, checksum = sys.argv[1:4]
text = open(path).read()
begin, end = "// BEGIN release", "// END release"
if text.count(begin) != 1 or text.count(end) != 1:
    sys.exit(f"{path}: expected one '{begin}' ... '{end}' section")
head, rest = text.split(begin, 1)
section, tail = rest.split(end, 1)
first_line = section.split("\n", 1)[0]
section = first_line + "\n" + f'let releaseURL = "{url}"\nlet releaseChecksum = "{checksum}"\n'
open(path, "w").write(head + begin + section + end + tail)
PY
    if [[ -n "$url" ]]; then
        echo "$manifest: release $url ($sum)"
    else
        echo "$manifest: release section cleared (the local KerntunFFI.xcframework is used)"
    fi
}

# zip_release XCFRAMEWORK OUT.zip: the zip made afresh (its folder
# created if need be); prints its checksum.
zip_release() {
    local fw=$1 out=$2
    mkdir -p "$(dirname "$out")"
    rm -f "$out"
    zip_framework "$fw" "$out" >/dev/null
    checksum "$out"
}

# release_summary OUT.zip CHECKSUM URL [LINE...]: what was made and what
# to do next; each LINE is one more line of it.
release_summary() {
    local out=$1 sum=$2 url=$3
    shift 3
    cat <<EOF

zip:      $out
checksum: $sum
url:      $url

Next: upload the zip to exactly that URL, commit Package.swift, tag.
EOF
    (($# == 0)) || printf '%s\n' "$@"
}

release() {
    local url=${1:-}
    [[ -n "$url" ]] || die "usage: $0 release URL (where the zip will be published)"
    [[ $(uname) == Darwin ]] || die "release builds the xcframework and needs macOS with Xcode; here: $(uname). The zip, checksum and set-release steps run anywhere (see $0 self-test)"
    command -v xcodebuild >/dev/null || die "xcodebuild not found: install Xcode and run xcode-select"
    command -v lipo >/dev/null || die "lipo not found: install the Xcode command line tools"
    bash "$here/build-xcframework.sh"
    local out="$here/build/KerntunFFI.xcframework.zip" sum
    sum=$(zip_release "$here/KerntunFFI.xcframework" "$out")
    # Cross-check with SwiftPM's own computation where it is available.
    if command -v swift >/dev/null; then
        local swiftpm
        swiftpm=$(cd "$here" && swift package compute-checksum "$out")
        [[ "$swiftpm" == "$sum" ]] || die "swift package compute-checksum says $swiftpm, sha256 says $sum"
    fi
    set_release "$url" "$sum"
    release_summary "$out" "$sum" "$url" \
        "Apps then resolve KerntunFFI by URL; KERNTUN_LOCAL_XCFRAMEWORK=1 (or" \
        'set-release "" "") switches back to apple/KerntunFFI.xcframework.'
}

# release_assembled URL [XCFRAMEWORK] [-- BUILD-OPTIONS]
release_assembled() {
    local url=${1:-} fw="" sum
    [[ -n "$url" ]] || die "usage: $0 release-assembled URL [XCFRAMEWORK] [-- BUILD-OPTIONS]"
    shift
    if [[ $# -gt 0 && $1 != -- ]]; then
        fw=$1
        shift
    fi
    [[ ${1:-} == -- ]] && shift
    # Refuse a bad URL before minutes of building.
    [[ "$url" == https://*.zip ]] || die "URL must be an https:// address of the .zip: $url"
    if [[ -z "$fw" ]]; then
        fw="$here/KerntunFFI.xcframework"
        bash "$here/assemble-xcframework.sh" build --out "$fw" "$@"
    else
        (($# == 0)) || die "build options ($*) apply only when the framework is built here"
        bash "$here/assemble-xcframework.sh" verify "$fw" >/dev/null || die "$fw: $(bash "$here/assemble-xcframework.sh" verify "$fw")"
    fi
    local out=${RELEASE_ZIP:-$here/build/KerntunFFI.xcframework.zip}
    sum=$(zip_release "$fw" "$out")
    set_release "$url" "$sum"
    release_summary "$out" "$sum" "$url"
}

self_test() {
    selftest_tmp=$(mktemp -d)
    trap 'rm -rf "$selftest_tmp"' EXIT
    local tmp=$selftest_tmp
    ok() { echo "ok   $*"; }
    # A fake framework with the layout xcodebuild produces for static libraries.
    local fw="$tmp/KerntunFFI.xcframework"
    mkdir -p "$fw/ios-arm64/Headers" "$fw/macos-arm64_x86_64/Headers"
    printf '<?xml version="1.0"?><plist version="1.0"><dict/></plist>\n' >"$fw/Info.plist"
    head -c 100000 /dev/urandom >"$fw/ios-arm64/libkerntun_ffi.a"
    cp "$root/apple/Headers/KerntunFFI.h" "$fw/ios-arm64/Headers/"
    cp "$root/apple/Headers/module.modulemap" "$fw/ios-arm64/Headers/"
    head -c 50000 /dev/urandom >"$fw/macos-arm64_x86_64/libkerntun_ffi.a"
    ln -s ../ios-arm64/Headers "$fw/macos-arm64_x86_64/Headers/link"

    zip_framework "$fw" "$tmp/a.zip" >"$tmp/zip.out"
    sleep 1
    touch "$fw/Info.plist"
    zip_framework "$fw" "$tmp/b.zip" >/dev/null
    cmp -s "$tmp/a.zip" "$tmp/b.zip" || die "self-test: zipping the same tree twice gave different bytes"
    ok "zip is reproducible (same tree, later mtimes: same bytes)"

    local sum
    sum=$(checksum "$tmp/a.zip")
    [[ "$sum" == "$(sha256sum "$tmp/a.zip" | cut -d' ' -f1)" ]] || die "self-test: checksum is not the SHA-256 of the zip"
    grep -q "checksum: $sum" "$tmp/zip.out" || die "self-test: zip did not print the checksum"
    ok "checksum = sha256 of the zip ($sum)"

    python3 - "$tmp/a.zip" "$fw" <<'PY' || die "self-test: the zip does not hold the framework as SwiftPM expects"
import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = z.namelist()
assert all(n.startswith("KerntunFFI.xcframework/") for n in names), names
assert "KerntunFFI.xcframework/Info.plist" in names
for rel in ("ios-arm64/libkerntun_ffi.a", "ios-arm64/Headers/KerntunFFI.h", "macos-arm64_x86_64/libkerntun_ffi.a"):
    with open(os.path.join(sys.argv[2], rel), "rb") as f:
        assert z.read("KerntunFFI.xcframework/" + rel) == f.read(), rel
link = z.getinfo("KerntunFFI.xcframework/macos-arm64_x86_64/Headers/link")
assert (link.external_attr >> 16) & 0o170000 == 0o120000 and z.read(link) == b"../ios-arm64/Headers"
PY
    ok "the archive holds KerntunFFI.xcframework/ at its top, contents and symlinks intact"

    if command -v unzip >/dev/null; then
        mkdir "$tmp/unz" && (cd "$tmp/unz" && unzip -q "$tmp/a.zip")
        cmp -s "$fw/ios-arm64/libkerntun_ffi.a" "$tmp/unz/KerntunFFI.xcframework/ios-arm64/libkerntun_ffi.a" \
            || die "self-test: unzip(1) does not restore the library"
        ok "unzip(1), which SwiftPM uses to extract, restores it"
    fi

    if (checksum "$tmp/KerntunFFI.xcframework/Info.plist" >/dev/null 2>&1); then die "self-test: a non-zip was accepted"; fi
    ok "checksum refuses a file that is not a .zip"

    cp "$here/../Package.swift" "$tmp/Package.swift"
    PACKAGE_SWIFT="$tmp/Package.swift" set_release "https://example.com/v1/KerntunFFI.xcframework.zip" "$sum" >/dev/null
    grep -qx 'let releaseURL = "https://example.com/v1/KerntunFFI.xcframework.zip"' "$tmp/Package.swift" \
        && grep -qx "let releaseChecksum = \"$sum\"" "$tmp/Package.swift" \
        || die "self-test: set-release did not write the section"
    grep -q 'binaryTarget(name: "KerntunFFI", url: releaseURL, checksum: releaseChecksum)' "$tmp/Package.swift" \
        || die "self-test: Package.swift lost its url + checksum target"
    ok "set-release writes URL and checksum into Package.swift's release section"
    PACKAGE_SWIFT="$tmp/Package.swift" set_release "" "" >/dev/null
    cmp -s "$here/../Package.swift" "$tmp/Package.swift" || die "self-test: set-release \"\" \"\" did not restore the committed manifest"
    ok "set-release \"\" \"\" restores the committed (local framework) manifest byte for byte"
    if (PACKAGE_SWIFT="$tmp/Package.swift" set_release "http://example.com/x.zip" "$sum" >/dev/null 2>&1); then
        die "self-test: a plain-http URL was accepted"
    fi
    if (PACKAGE_SWIFT="$tmp/Package.swift" set_release "https://example.com/x.zip" "ABC" >/dev/null 2>&1); then
        die "self-test: a malformed checksum was accepted"
    fi
    ok "set-release refuses a non-https URL and a malformed checksum"

    if [[ $(uname) != Darwin ]]; then
        if (release "https://example.com/x.zip" >/dev/null 2>"$tmp/err"); then die "self-test: release ran without Xcode"; fi
        grep -q 'needs macOS with Xcode' "$tmp/err" || die "self-test: release failed without saying why: $(cat "$tmp/err")"
        ok "release without macOS stops with: $(head -c 80 "$tmp/err")..."
    fi

    # release-assembled on an assembled framework (the cargo builds of
    # `assemble-xcframework.sh build` are left out: minutes, not seconds).
    local afw="$tmp/assembled/KerntunFFI.xcframework"
    mkdir -p "$tmp/assembled"
    python3 "$here/xcframework.py" fake-archive "$tmp/ios.a" arm64 ios
    python3 "$here/xcframework.py" fake-archive "$tmp/sim.a" arm64 ios-simulator
    python3 "$here/xcframework.py" fake-archive "$tmp/mac.a" arm64 macos
    python3 "$here/xcframework.py" assemble "$afw" "$root/apple/Headers" - \
        "ios=$tmp/ios.a" "ios-simulator=$tmp/sim.a" "macos=$tmp/mac.a" >/dev/null
    cp "$here/../Package.swift" "$tmp/Package.swift"
    PACKAGE_SWIFT="$tmp/Package.swift" RELEASE_ZIP="$tmp/assembled.zip" \
        release_assembled "https://example.com/v2/KerntunFFI.xcframework.zip" "$afw" >"$tmp/rel.out"
    sum=$(checksum "$tmp/assembled.zip")
    grep -qx 'let releaseURL = "https://example.com/v2/KerntunFFI.xcframework.zip"' "$tmp/Package.swift" \
        && grep -qx "let releaseChecksum = \"$sum\"" "$tmp/Package.swift" && grep -q "checksum: $sum" "$tmp/rel.out" \
        || die "self-test: release-assembled did not zip, checksum and set the release"
    ok "release-assembled on an assembled framework: zip, checksum, Package.swift"
    rm -f "$afw/ios-arm64/Headers/module.modulemap"
    if (PACKAGE_SWIFT="$tmp/Package.swift" RELEASE_ZIP="$tmp/broken.zip" \
        release_assembled "https://example.com/v3/KerntunFFI.xcframework.zip" "$afw" >/dev/null 2>"$tmp/err"); then
        die "self-test: release-assembled released a framework verify refuses"
    fi
    [[ ! -e "$tmp/broken.zip" ]] && grep -q "module.modulemap is missing" "$tmp/err" \
        || die "self-test: release-assembled failed without saying why: $(cat "$tmp/err")"
    ok "release-assembled refuses a framework verify refuses, before zipping"

    echo "== assemble-xcframework.sh self-test"
    bash "$here/assemble-xcframework.sh" self-test
    echo "release-xcframework.sh self-test passed"
}

case "${1:-}" in
release) shift; release "$@" ;;
release-assembled) shift; release_assembled "$@" ;;
zip) (($# == 3)) || die "usage: $0 zip XCFRAMEWORK OUT.zip"; zip_framework "$2" "$3" ;;
checksum) (($# == 2)) || die "usage: $0 checksum FILE.zip"; checksum "$2" ;;
set-release) (($# == 3)) || die "usage: $0 set-release URL CHECKSUM"; set_release "$2" "$3" ;;
self-test) self_test ;;
*) sed -n '2,31p' "$0" >&2; exit 2 ;;
esac
