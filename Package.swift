// swift-tools-version:5.9
// kerntun for iOS and macOS: the Swift bindings (module `Kerntun`, generated
// by scripts/bindings.sh and checked for drift in CI) over the static
// library in KerntunFFI.xcframework, and a Packet Tunnel provider base class
// (module `KerntunTunnel`).
//
// The manifest sits at the repository's root so an app adds the package by
// the repository's URL (SwiftPM reads only a root Package.swift); everything
// it names lives under apple/.
//
// Where KerntunFFI.xcframework comes from (docs/integration-ios.md):
// * development: apple/KerntunFFI.xcframework, built by build-xcframework.sh
//   on a Mac (not committed). Used while the release section below is
//   empty, or whenever KERNTUN_LOCAL_XCFRAMEWORK=1 is in the environment of
//   the SwiftPM / Xcode process that reads this manifest;
// * releases: the zip published at `releaseURL`, verified by SwiftPM
//   against `releaseChecksum` (the SHA-256 of the zip). release-xcframework.sh
//   builds the zip, prints both values and writes them here.
import Foundation
import PackageDescription

// BEGIN release (written by apple/release-xcframework.sh set-release)
let releaseURL = ""
let releaseChecksum = ""
// END release

let useLocalFramework = releaseURL.isEmpty
    || ProcessInfo.processInfo.environment["KERNTUN_LOCAL_XCFRAMEWORK"] == "1"

let ffiTarget: Target = useLocalFramework
    ? .binaryTarget(name: "KerntunFFI", path: "apple/KerntunFFI.xcframework")
    : .binaryTarget(name: "KerntunFFI", url: releaseURL, checksum: releaseChecksum)

let package = Package(
    name: "Kerntun",
    platforms: [.iOS(.v15), .macOS(.v12)],
    products: [
        .library(name: "Kerntun", targets: ["Kerntun"]),
        .library(name: "KerntunTunnel", targets: ["KerntunTunnel"]),
    ],
    targets: [
        ffiTarget,
        .target(
            name: "Kerntun",
            dependencies: ["KerntunFFI"],
            path: "apple/Sources/Kerntun"
        ),
        .target(
            name: "KerntunTunnel",
            dependencies: ["Kerntun"],
            path: "apple/Sources/KerntunTunnel"
        ),
    ]
)
