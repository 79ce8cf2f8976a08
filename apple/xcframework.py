#!/usr/bin/env python3
"""Write and check an XCFramework of static libraries without Xcode.

Used by apple/assemble-xcframework.sh (python3 standard library only):

  xcframework.py inspect LIB.a            the architectures and Apple platforms of
                                          the objects in a (possibly universal) archive
  xcframework.py assemble OUT.xcframework HEADERS LIPO GROUP=LIB[,LIB]...
                                          write OUT.xcframework (replacing it) from static
                                          libraries: GROUP is ios, ios-simulator or macos;
                                          the libraries of a group are merged with LIPO
                                          (lipo or llvm-lipo; "-" when every group has one);
                                          HEADERS (apple/Headers) is copied into each slice
  xcframework.py verify DIR.xcframework   check the Info.plist against the structure
                                          `xcodebuild -create-xcframework` writes, and
                                          every slice's archive against what the plist says
  xcframework.py fake-archive OUT.a ARCH PLATFORM
                                          a small archive of one Mach-O object with the
                                          build version of PLATFORM (the self-test's
                                          stand-in for a cargo build)

The Info.plist written here has the keys and layout xcodebuild writes for
static libraries (Xcode 15 and later also write BinaryPath): per library
LibraryIdentifier, LibraryPath, BinaryPath, HeadersPath,
SupportedArchitectures, SupportedPlatform and, for a simulator slice,
SupportedPlatformVariant = simulator; at the top CFBundlePackageType = XFWK
and XCFrameworkFormatVersion = 1.0. Keys are sorted and the libraries are in
identifier order, so the same slices always give the same bytes.
"""

import os
import plistlib
import shutil
import struct
import subprocess
import sys

# <mach/machine.h>
CPU_TYPES = {0x01000007: "x86_64", 0x0100000C: "arm64"}
# <mach-o/loader.h>: LC_BUILD_VERSION platforms.
PLATFORMS = {1: "macos", 2: "ios", 6: "maccatalyst", 7: "ios-simulator"}
PLATFORM_IDS = {v: k for k, v in PLATFORMS.items()}
LC_VERSION_MIN_MACOSX = 0x24
LC_VERSION_MIN_IPHONEOS = 0x25
LC_BUILD_VERSION = 0x32
MH_MAGIC_64 = 0xFEEDFACF
FAT_MAGIC = 0xCAFEBABE
FAT_MAGIC_64 = 0xCAFEBABF

# The slices this framework may hold: (SupportedPlatform, variant or None)
# -> the LC_BUILD_VERSION platform of its objects.
SLICE_PLATFORMS = {
    ("ios", None): "ios",
    ("ios", "simulator"): "ios-simulator",
    ("macos", None): "macos",
}
# assemble's group names -> (SupportedPlatform, variant).
GROUPS = {"ios": ("ios", None), "ios-simulator": ("ios", "simulator"), "macos": ("macos", None)}
LIBRARY = "libkerntun_ffi.a"
HEADERS = "Headers"

LIBRARY_KEYS_REQUIRED = {"LibraryIdentifier", "LibraryPath", "SupportedArchitectures", "SupportedPlatform"}
LIBRARY_KEYS_OPTIONAL = {"BinaryPath", "HeadersPath", "SupportedPlatformVariant", "DebugSymbolsPath"}
TOP_KEYS = {"AvailableLibraries", "CFBundlePackageType", "XCFrameworkFormatVersion"}


class Bad(Exception):
    pass


def macho_object(data):
    """(arch, platform or None) of one thin 64-bit Mach-O object, or None if it is not one."""
    if len(data) < 32 or struct.unpack_from("<I", data, 0)[0] != MH_MAGIC_64:
        return None
    cputype, _subtype, _filetype, ncmds, sizeofcmds = struct.unpack_from("<iiIII", data, 4)
    arch = CPU_TYPES.get(cputype & 0xFFFFFFFF, f"cputype-{cputype & 0xFFFFFFFF:#x}")
    platform = None
    off, end = 32, 32 + sizeofcmds
    if end > len(data):
        raise Bad("Mach-O load commands run past the object")
    for _ in range(ncmds):
        if off + 8 > end:
            raise Bad("truncated Mach-O load command")
        cmd, cmdsize = struct.unpack_from("<II", data, off)
        if cmdsize < 8 or off + cmdsize > end:
            raise Bad(f"bad Mach-O load command size {cmdsize}")
        if cmd == LC_BUILD_VERSION:
            number = struct.unpack_from("<I", data, off + 8)[0]
            platform = PLATFORMS.get(number, f"platform-{number}")
        elif cmd == LC_VERSION_MIN_IPHONEOS:
            # Before LC_BUILD_VERSION, an x86_64 object for iOS was a simulator one.
            platform = "ios-simulator" if arch == "x86_64" else "ios"
        elif cmd == LC_VERSION_MIN_MACOSX:
            platform = "macos"
        off += cmdsize
    return arch, platform


def archive_members(data):
    """The members of a Unix ar archive (BSD `#1/len` and GNU `/offset` names), as (name, bytes)."""
    if not data.startswith(b"!<arch>\n"):
        raise Bad("not an ar archive")
    off, longnames, out = 8, b"", []
    while off + 60 <= len(data):
        header = data[off:off + 60]
        if header[58:60] != b"`\n":
            raise Bad(f"bad ar member header at {off}")
        name = header[0:16].decode("ascii", "replace").rstrip()
        size = int(header[48:58].decode("ascii").strip() or 0)
        body = data[off + 60:off + 60 + size]
        if len(body) != size:
            raise Bad("truncated ar member")
        if name.startswith("#1/"):
            n = int(name[3:])
            name, body = body[:n].rstrip(b"\0").decode("utf-8", "replace"), body[n:]
        elif name == "//":
            longnames = body
        elif name.startswith("/") and name[1:].isdigit():
            start = int(name[1:])
            name = longnames[start:longnames.index(b"\n", start)].decode("utf-8", "replace").rstrip("/")
        out.append((name, body))
        off += 60 + size + (size & 1)
    return out


def thin_archive(data):
    """{arch: {platforms}} of the Mach-O objects of one thin archive."""
    found = {}
    for name, body in archive_members(data):
        obj = macho_object(body)
        if obj is None:
            continue  # symbol table (`__.SYMDEF`, `/`), long names
        arch, platform = obj
        found.setdefault(arch, set())
        if platform is not None:
            found[arch].add(platform)
    if not found:
        raise Bad("no Mach-O object in the archive")
    return found


def inspect(path):
    """{arch: {platforms}} of a thin or universal static library."""
    with open(path, "rb") as f:
        data = f.read()
    magic = struct.unpack_from(">I", data, 0)[0] if len(data) >= 4 else 0
    if magic not in (FAT_MAGIC, FAT_MAGIC_64):
        return thin_archive(data)
    nfat = struct.unpack_from(">I", data, 4)[0]
    found, off = {}, 8
    for _ in range(nfat):
        if magic == FAT_MAGIC:
            cputype, _sub, offset, size, _align = struct.unpack_from(">iiIII", data, off)
            off += 20
        else:
            cputype, _sub, offset, size, _align, _res = struct.unpack_from(">iiQQII", data, off)
            off += 32
        part = thin_archive(data[offset:offset + size])
        want = CPU_TYPES.get(cputype & 0xFFFFFFFF)
        if set(part) != {want}:
            raise Bad(f"universal slice for {want} holds objects for {sorted(part)}")
        found.update(part)
    return found


def identifier(platform, variant, archs):
    """Xcode's library identifier: ios-arm64, ios-arm64_x86_64-simulator, macos-arm64."""
    return f"{platform}-{'_'.join(sorted(archs))}" + (f"-{variant}" if variant else "")


def assemble(framework, headers, lipo, groups):
    """Write FRAMEWORK from GROUP=LIB[,LIB] specs; returns the identifiers written."""
    slices = []
    for spec in groups:
        group, _, libs = spec.partition("=")
        if group not in GROUPS or not libs:
            raise Bad(f"{spec!r}: expected ios=LIB, ios-simulator=LIB[,LIB] or macos=LIB[,LIB]")
        platform, variant = GROUPS[group]
        want = SLICE_PLATFORMS[(platform, variant)]
        archs = []
        for lib in libs.split(","):
            found = inspect(lib)
            for arch, platforms in found.items():
                if platforms != {want}:
                    raise Bad(f"{lib}: {arch} objects built for {sorted(platforms) or 'no platform'}, not {want} ({group})")
                if arch in archs:
                    raise Bad(f"{group}: two libraries for {arch}")
                archs.append(arch)
        slices.append((platform, variant, sorted(archs), libs.split(",")))
    if len({(p, v) for p, v, _, _ in slices}) != len(slices):
        raise Bad("a group is given twice")
    if os.path.lexists(framework):
        shutil.rmtree(framework)
    os.makedirs(framework)
    libraries = []
    for platform, variant, archs, libs in slices:
        ident = identifier(platform, variant, archs)
        os.makedirs(os.path.join(framework, ident))
        out = os.path.join(framework, ident, LIBRARY)
        if len(libs) == 1:
            shutil.copyfile(libs[0], out)
        else:
            if lipo == "-":
                raise Bad(f"{ident}: {len(libs)} libraries to merge and no lipo")
            subprocess.run([lipo, "-create", *libs, "-output", out], check=True)
        os.chmod(out, 0o644)
        shutil.copytree(headers, os.path.join(framework, ident, HEADERS))
        entry = {
            "BinaryPath": LIBRARY,
            "HeadersPath": HEADERS,
            "LibraryIdentifier": ident,
            "LibraryPath": LIBRARY,
            "SupportedArchitectures": archs,
            "SupportedPlatform": platform,
        }
        if variant:
            entry["SupportedPlatformVariant"] = variant
        libraries.append(entry)
    libraries.sort(key=lambda e: e["LibraryIdentifier"])
    info = {
        "AvailableLibraries": libraries,
        "CFBundlePackageType": "XFWK",
        "XCFrameworkFormatVersion": "1.0",
    }
    with open(os.path.join(framework, "Info.plist"), "wb") as f:
        plistlib.dump(info, f, fmt=plistlib.FMT_XML, sort_keys=True)
    return [e["LibraryIdentifier"] for e in libraries]


def verify(framework):
    """Problems found in an .xcframework (empty: none)."""
    problems = []
    try:
        with open(os.path.join(framework, "Info.plist"), "rb") as f:
            info = plistlib.load(f)
    except (OSError, plistlib.InvalidFileException, ValueError) as e:
        return [f"Info.plist: {e}"]
    if not isinstance(info, dict):
        return ["Info.plist: the top level is not a dictionary"]
    if set(info) != TOP_KEYS:
        problems.append(f"Info.plist: top-level keys {sorted(info)}, expected {sorted(TOP_KEYS)}")
    if info.get("CFBundlePackageType") != "XFWK":
        problems.append(f"CFBundlePackageType is {info.get('CFBundlePackageType')!r}, not 'XFWK'")
    if info.get("XCFrameworkFormatVersion") != "1.0":
        problems.append(f"XCFrameworkFormatVersion is {info.get('XCFrameworkFormatVersion')!r}, not '1.0'")
    libraries = info.get("AvailableLibraries")
    if not isinstance(libraries, list) or not libraries:
        return problems + ["AvailableLibraries is missing or empty"]
    seen_ids, seen_platforms = set(), set()
    for i, lib in enumerate(libraries):
        where = f"AvailableLibraries[{i}]"
        if not isinstance(lib, dict):
            problems.append(f"{where} is not a dictionary")
            continue
        missing = LIBRARY_KEYS_REQUIRED - set(lib)
        unknown = set(lib) - LIBRARY_KEYS_REQUIRED - LIBRARY_KEYS_OPTIONAL
        if missing or unknown:
            problems.append(f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
            continue
        ident, platform = lib["LibraryIdentifier"], lib["SupportedPlatform"]
        variant, archs = lib.get("SupportedPlatformVariant"), lib["SupportedArchitectures"]
        where = f"{where} ({ident})"
        if ident in seen_ids:
            problems.append(f"{where}: identifier used twice")
        seen_ids.add(ident)
        if (platform, variant) in seen_platforms:
            problems.append(f"{where}: a second library for {platform} {variant or 'device'} (Xcode refuses that)")
        seen_platforms.add((platform, variant))
        if (platform, variant) not in SLICE_PLATFORMS:
            problems.append(f"{where}: platform {platform!r} variant {variant!r} is not one kerntun ships")
            continue
        if not isinstance(archs, list) or not archs or archs != sorted(set(archs)):
            problems.append(f"{where}: SupportedArchitectures {archs!r} is not a sorted list of distinct names")
            continue
        if identifier(platform, variant, archs) != ident:
            problems.append(f"{where}: Xcode names this slice {identifier(platform, variant, archs)}")
        if "BinaryPath" in lib and lib["BinaryPath"] != lib["LibraryPath"]:
            problems.append(f"{where}: BinaryPath {lib['BinaryPath']!r} differs from LibraryPath (a static library is its own binary)")
        path = os.path.join(framework, ident, lib["LibraryPath"])
        try:
            found = inspect(path)
        except (OSError, Bad) as e:
            problems.append(f"{where}: {lib['LibraryPath']}: {e}")
            continue
        if sorted(found) != archs:
            problems.append(f"{where}: the library holds {sorted(found)}, the plist says {archs}")
        want = SLICE_PLATFORMS[(platform, variant)]
        for arch, platforms in sorted(found.items()):
            if platforms != {want}:
                problems.append(f"{where}: {arch} objects are built for {sorted(platforms) or 'no platform'}, not {want}")
        headers = lib.get("HeadersPath")
        if headers is None:
            problems.append(f"{where}: no HeadersPath (the Swift module KerntunFFI needs its header and module map)")
        else:
            for name in ("KerntunFFI.h", "module.modulemap"):
                if not os.path.isfile(os.path.join(framework, ident, headers, name)):
                    problems.append(f"{where}: {headers}/{name} is missing")
    extra = sorted(set(os.listdir(framework)) - seen_ids - {"Info.plist"})
    if extra:
        problems.append(f"entries the plist does not list: {extra}")
    return problems


def fake_archive(out, arch, platform):
    """An ar archive (BSD names, as Apple's tools write) of one Mach-O object built for PLATFORM."""
    cputype = {v: k for k, v in CPU_TYPES.items()}[arch]
    subtype = 0 if arch == "arm64" else 3  # CPU_SUBTYPE_ARM64_ALL, CPU_SUBTYPE_X86_64_ALL
    build_version = struct.pack("<IIIIII", LC_BUILD_VERSION, 24, PLATFORM_IDS[platform], 15 << 16, 17 << 16, 0)
    header = struct.pack("<IiiIIIII", MH_MAGIC_64, cputype, subtype, 1, 1, len(build_version), 0, 0)
    obj = header + build_version
    name = b"kerntun_fake.o"
    padded = name + b"\0" * (-len(name) % 8)
    body = padded + obj
    member = (
        f"#1/{len(padded):<13}".encode()
        + b"0           "
        + b"0     0     "
        + b"100644  "
        + f"{len(body):<10}".encode()
        + b"`\n"
    )
    assert len(member) == 60
    with open(out, "wb") as f:
        f.write(b"!<arch>\n" + member + body + (b"\n" if len(body) & 1 else b""))


def main(argv):
    try:
        if len(argv) == 3 and argv[1] == "inspect":
            for arch, platforms in sorted(inspect(argv[2]).items()):
                print(arch, " ".join(sorted(platforms)) or "-")
        elif len(argv) >= 6 and argv[1] == "assemble":
            for ident in assemble(argv[2], argv[3], argv[4], argv[5:]):
                print(f"{argv[2]}/{ident}")
        elif len(argv) == 3 and argv[1] == "verify":
            problems = verify(argv[2])
            for p in problems:
                print(f"FAIL {argv[2]}: {p}")
            if problems:
                return 1
            print(f"ok   {argv[2]}: Info.plist as xcodebuild writes it, every slice's archive matches it")
        elif len(argv) == 5 and argv[1] == "fake-archive":
            fake_archive(argv[2], argv[3], argv[4])
        else:
            print(__doc__.split("\n\n")[1], file=sys.stderr)
            return 2
    except (OSError, Bad, ValueError, subprocess.CalledProcessError) as e:
        print(f"xcframework.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
