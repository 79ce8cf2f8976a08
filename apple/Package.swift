// swift-tools-version:5.9
// kerntun for iOS and macOS: the Swift bindings (module `Kerntun`, generated
// by scripts/bindings.sh and checked for drift in CI) over the static
// library in KerntunFFI.xcframework (built by build-xcframework.sh on a Mac),
// and a Packet Tunnel provider base class (module `KerntunTunnel`).
import PackageDescription

let package = Package(
    name: "Kerntun",
    platforms: [.iOS(.v15), .macOS(.v12)],
    products: [
        .library(name: "Kerntun", targets: ["Kerntun"]),
        .library(name: "KerntunTunnel", targets: ["KerntunTunnel"]),
    ],
    targets: [
        // Run ./build-xcframework.sh first; the framework is not committed.
        .binaryTarget(name: "KerntunFFI", path: "KerntunFFI.xcframework"),
        .target(
            name: "Kerntun",
            dependencies: ["KerntunFFI"],
            path: "Sources/Kerntun"
        ),
        .target(
            name: "KerntunTunnel",
            dependencies: ["Kerntun"],
            path: "Sources/KerntunTunnel"
        ),
    ]
)
