// Example Network Extension principal class (NSExtensionPrincipalClass =
// $(PRODUCT_MODULE_NAME).PacketTunnelProvider). Link the KerntunTunnel
// product into the extension target.

import Kerntun
import KerntunTunnel
import NetworkExtension

final class PacketTunnelProvider: KerntunPacketTunnelProvider {
    override func makeConfiguration(options: [String: NSObject]?) throws -> EngineConfig {
        var config = try super.makeConfiguration(options: options)
        // Refuse a destination outright: the app gets an RST at SYN time.
        config.rules = [RuleOptions(cidr: "203.0.113.0/24", ports: nil, action: .reject)]
        // Stay well inside the 50 MiB extension limit.
        config.budget.tcpSessions = 64
        return config
    }
}

// In the containing app: read the statistics through the provider's
// message channel (docs/messages.md; KerntunMessages.swift).
//
//   let session = manager.connection as! NETunnelProviderSession
//   KerntunMessages.send("stats", to: session) { result in
//       guard case .success(let stats) = result else { return }
//       print("up", stats["tcp_bytes_up"] ?? 0, "down", stats["tcp_bytes_down"] ?? 0)
//   }
