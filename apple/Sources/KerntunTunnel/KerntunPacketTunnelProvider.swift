// A Packet Tunnel provider base class that runs a kerntun engine on the
// extension's utun device. Subclass it in your Network Extension target
// (see Example/PacketTunnelProvider.swift and docs/integration-ios.md).
//
// What it does:
// * applies tunnel network settings that agree with the engine config
//   (addresses, v4/v6 default routes, DNS, MTU 4064 by default);
// * finds the utun descriptor once the settings are applied (the
//   `packetFlow` key path stopped working on iOS 15) and starts the engine
//   on it; the engine handles utun's 4-byte address-family header itself;
// * tells the engine whether the tunnel has `includeAllNetworks` on (the
//   system stack cannot run then, so the engine's `auto` picks smoltcp);
// * forwards the system's memory-pressure events to the engine;
// * applies the settings with a deadline (`networkSettingsTimeout`): a
//   completion handler that never comes fails the start with a clear error
//   instead of leaving it hanging;
// * watches the network the extension's own traffic leaves on
//   (NWPathMonitor): tells the engine of every update (networkChanged:
//   new sockets bind to the new interface, stranded connections are reset)
//   and, when it changes in a way that matters (status, interfaces,
//   gateways, IPv4/IPv6/DNS support, expensive/constrained), re-applies the
//   tunnel settings with `reasserting` set;
// * passes the device's sleep and wake to the engine (Engine.sleep/wake:
//   its periodic ticks keep no timer while asleep; connections stay);
// * answers the app's messages (NETunnelProviderSession.sendProviderMessage,
//   docs/messages.md) with the engine's reply (Engine.handleMessage), off
//   the provider's queue; KerntunMessages.swift is the app's side;
// * cancels the tunnel if the engine stops on its own, and stops the engine
//   cleanly in stopTunnel.
//
// This file is not compiled in this repository's CI (there is no Swift
// compiler there); the generated bindings it uses are.

import Foundation
import Kerntun
import Network
import NetworkExtension
import os

public enum KerntunTunnelError: Error, LocalizedError {
    /// No utun descriptor was found after the network settings were applied.
    case noUtunDescriptor
    /// The engine stopped by itself (device gone, listener failed).
    case engineFailed(String)
    /// `setTunnelNetworkSettings` did not call back within this many seconds.
    case networkSettingsTimedOut(TimeInterval)

    public var errorDescription: String? {
        switch self {
        case .noUtunDescriptor:
            return "the utun descriptor of this tunnel was not found"
        case .engineFailed(let why):
            return "the kerntun engine stopped: \(why)"
        case .networkSettingsTimedOut(let seconds):
            return "setTunnelNetworkSettings did not complete within \(seconds) s"
        }
    }
}

/// What the provider knows of the network its own traffic leaves on, from
/// an `NWPath`: what a re-apply of the tunnel settings is decided on, and
/// what the engine will be told about a network change. `NWPath` carries no
/// DNS server list; a change of DNS servers alone (same interfaces, same
/// gateways) is not seen here.
public struct KerntunNetworkInfo: Equatable {
    public var status: NWPath.Status
    /// Physical interfaces in the system's order of preference; utun
    /// (`.other`) and loopback are left out, they are never the underlying
    /// network.
    public var interfaces: [NWInterface]
    public var gateways: [NWEndpoint]
    public var supportsIPv4: Bool
    public var supportsIPv6: Bool
    public var supportsDNS: Bool
    public var isExpensive: Bool
    public var isConstrained: Bool

    public init(_ path: NWPath) {
        status = path.status
        interfaces = path.availableInterfaces.filter { $0.type != .other && $0.type != .loopback }
        gateways = path.gateways
        supportsIPv4 = path.supportsIPv4
        supportsIPv6 = path.supportsIPv6
        supportsDNS = path.supportsDNS
        isExpensive = path.isExpensive
        isConstrained = path.isConstrained
    }

    /// One line for the log: "satisfied en0(wifi) gw 192.168.1.1 v4 v6 dns".
    public var summary: String {
        let names = interfaces.map { "\($0.name)(\($0.type))" }.joined(separator: ",")
        let via = gateways.map { "\($0)" }.joined(separator: ",")
        let flags = [
            supportsIPv4 ? "v4" : nil, supportsIPv6 ? "v6" : nil, supportsDNS ? "dns" : nil,
            isExpensive ? "expensive" : nil, isConstrained ? "constrained" : nil,
        ].compactMap { $0 }.joined(separator: " ")
        return "\(status) \(names.isEmpty ? "-" : names) gw \(via.isEmpty ? "-" : via) \(flags)"
    }
}

/// The provider's hooks: nothing to protect on Apple platforms (the
/// extension's own sockets bypass its tunnel), logs to the unified log.
final class ProviderHooks: PlatformHooks, @unchecked Sendable {
    private let logger = Logger(subsystem: "kerntun", category: "engine")

    func protect(fd: Int32) throws {}

    /// The provider's own messages, next to the engine's.
    func logInfo(_ message: String) {
        logger.info("\(message, privacy: .public)")
    }

    func logError(_ message: String) {
        logger.error("\(message, privacy: .public)")
    }

    func log(level: LogLevel, message: String) throws {
        switch level {
        case .error: logger.error("\(message, privacy: .public)")
        case .warn: logger.warning("\(message, privacy: .public)")
        case .info: logger.info("\(message, privacy: .public)")
        case .debug, .trace: logger.debug("\(message, privacy: .public)")
        }
    }
}

/// Hears the engine's state events (on the listener's own thread) and hands
/// a failure to the provider.
final class ProviderListener: EngineListener, @unchecked Sendable {
    private let onFailure: (String) -> Void

    init(onFailure: @escaping (String) -> Void) {
        self.onFailure = onFailure
    }

    func onEvent(event: EngineEvent) {
        if case let .failed(reason) = event {
            onFailure(reason)
        }
    }
}

open class KerntunPacketTunnelProvider: NEPacketTunnelProvider {
    /// The running engine, if any.
    public private(set) var engine: Engine?

    /// DNS servers announced to the system when the engine's own DNS
    /// service is off (`config.dns.enabled == false`): queries to them go
    /// through the tunnel and are relayed like any UDP flow. With it on, the
    /// addresses the engine answers on (`resolverAddresses(config:)`) are
    /// announced instead.
    open var dnsServers: [String] { ["1.1.1.1", "2606:4700:4700::1111"] }

    /// Whether a change of the network the extension's traffic leaves on
    /// (Wi-Fi to cellular, one Wi-Fi to another, see `KerntunNetworkInfo`)
    /// re-applies the tunnel network settings with `reasserting` set, so the
    /// system re-evaluates routes and DNS on the new network and shows the
    /// tunnel as reconnecting meanwhile.
    open var reassertOnNetworkChange: Bool { true }

    /// How long `setTunnelNetworkSettings` may take before the start (or a
    /// re-apply) fails with `KerntunTunnelError.networkSettingsTimedOut`.
    /// Without a deadline, a completion handler that is never called would
    /// leave the tunnel "connecting" (or "reasserting") for good.
    open var networkSettingsTimeout: TimeInterval { 10 }

    private let queue = DispatchQueue(label: "kerntun.provider")
    /// App messages are answered here, not on `queue`: a `test_latency`
    /// waits up to its timeout, and path, sleep and stop events must not
    /// wait behind it.
    private let messageQueue = DispatchQueue(label: "kerntun.messages", attributes: .concurrent)
    private let hooks = ProviderHooks()
    private var memoryPressure: DispatchSourceMemoryPressure?
    private var pathMonitor: NWPathMonitor?
    /// The network the current tunnel settings were applied on (nil until
    /// the first path report), and the latest one reported.
    private var appliedNetwork: KerntunNetworkInfo?
    private var latestNetwork: KerntunNetworkInfo?
    /// A re-apply is in flight: later changes wait for it.
    private var reapplying = false
    private var activeConfig: EngineConfig?
    private var stopping = false

    /// The engine configuration. Override to change it; keep `tun.ipv4` /
    /// `tun.ipv6` and `tun.mtu` in agreement with `makeNetworkSettings`.
    /// `tun.includeAllNetworks` is set from `protocolConfiguration` after
    /// this returns; leave `stack` unset (or `.smoltcp`) if the tunnel may
    /// run with `includeAllNetworks`, since the engine refuses `.system` then.
    open func makeConfiguration(options: [String: NSObject]?) throws -> EngineConfig {
        var config = defaultConfig()
        config.tun.mtu = 4064
        config.tun.ipv4 = "198.18.0.1/16"
        config.tun.ipv6 = "fd00:18::1/64"
        config.logLevel = .info
        return config
    }

    /// Tunnel network settings matching `config`: the gateway address of each
    /// family with its prefix, default routes, DNS, MTU.
    open func makeNetworkSettings(config: EngineConfig) -> NEPacketTunnelNetworkSettings {
        let settings = NEPacketTunnelNetworkSettings(tunnelRemoteAddress: "127.0.0.1")
        settings.mtu = NSNumber(value: config.tun.mtu == 0 ? 4064 : Int(config.tun.mtu))
        if let cidr = config.tun.ipv4, let (address, prefix) = Self.split(cidr) {
            let ipv4 = NEIPv4Settings(addresses: [address], subnetMasks: [Self.mask(prefix)])
            ipv4.includedRoutes = [NEIPv4Route.default()]
            settings.ipv4Settings = ipv4
        }
        if let cidr = config.tun.ipv6, let (address, prefix) = Self.split(cidr) {
            let ipv6 = NEIPv6Settings(addresses: [address], networkPrefixLengths: [NSNumber(value: prefix)])
            ipv6.includedRoutes = [NEIPv6Route.default()]
            settings.ipv6Settings = ipv6
        }
        let engineResolvers = (try? resolverAddresses(config: config)) ?? []
        settings.dnsSettings = NEDNSSettings(servers: engineResolvers.isEmpty ? dnsServers : engineResolvers)
        return settings
    }

    open override func startTunnel(
        options: [String: NSObject]?,
        completionHandler: @escaping (Error?) -> Void
    ) {
        var config: EngineConfig
        do {
            config = try makeConfiguration(options: options)
        } catch {
            completionHandler(error)
            return
        }
        // With includeAllNetworks everything, loopback included, is routed
        // into the tunnel, so the system stack's kernel listener never sees
        // the rewritten SYNs: the engine then runs smoltcp (stack unset) or
        // refuses an explicit `.system` with a typed config error.
        config.tun.includeAllNetworks = protocolConfiguration.includeAllNetworks
        applyNetworkSettings(makeNetworkSettings(config: config)) { [weak self] error in
            guard let self else { return }
            if let error {
                completionHandler(error)
                return
            }
            // On the provider's queue (applyNetworkSettings calls back
            // there), off the system's callback thread: Engine.start blocks
            // until the engine is ready (well under a second).
            // The descriptor belongs to the system: the engine works on its
            // own duplicate, and the provider never closes this one.
            guard let fd = findTunFd() else {
                completionHandler(KerntunTunnelError.noUtunDescriptor)
                return
            }
            do {
                let engine = try Engine.start(config: config, tunFd: fd, platform: self.hooks)
                self.engine = engine
                self.stopping = false
                self.activeConfig = config
                self.watchMemoryPressure(engine)
                self.watchHealth(engine)
                self.watchPath()
                completionHandler(nil)
            } catch {
                completionHandler(error)
            }
        }
    }

    open override func stopTunnel(
        with reason: NEProviderStopReason,
        completionHandler: @escaping () -> Void
    ) {
        queue.async {
            self.stopping = true
            self.memoryPressure?.cancel()
            self.memoryPressure = nil
            self.engine?.setListener(listener: nil)
            self.pathMonitor?.cancel()
            self.pathMonitor = nil
            self.appliedNetwork = nil
            self.latestNetwork = nil
            self.activeConfig = nil
            // Resets the open connections, closes the engine's copy of the
            // descriptor, joins its threads (bounded).
            self.engine?.stop()
            self.engine = nil
            completionHandler()
        }
    }

    /// The device is going to sleep: the engine's periodic ticks (expiry of
    /// idle flows) stop and keep no timer until `wake()` (`Engine.sleep`);
    /// connections are left as they are. The system waits for the handler.
    open override func sleep(completionHandler: @escaping () -> Void) {
        queue.async {
            do {
                _ = try self.engine?.sleep()
            } catch {
                self.hooks.logError("sleep: \(error)")
            }
            completionHandler()
        }
    }

    /// The device woke: the engine's ticks resume, the first at once, so
    /// what expired while asleep is closed now (`Engine.wake`).
    open override func wake() {
        queue.async {
            do {
                _ = try self.engine?.wake()
            } catch {
                self.hooks.logError("wake: \(error)")
            }
        }
    }

    /// A message from the app (`NETunnelProviderSession.sendProviderMessage`):
    /// a JSON request of docs/messages.md, answered with the engine's JSON
    /// reply (`Engine.handleMessage`). Without an engine, `status` answers
    /// `running: false` and the other commands a `not_running` error.
    open override func handleAppMessage(_ messageData: Data, completionHandler: ((Data?) -> Void)?) {
        queue.async {
            let engine = self.engine
            self.messageQueue.async {
                let reply = engine?.handleMessage(request: messageData)
                    ?? handleMessageWithoutEngine(request: messageData)
                completionHandler?(reply)
            }
        }
    }

    // The extension is killed at 50 MiB (iOS 15+): on pressure the engine
    // admits fewer new TCP sessions; running ones keep going.
    private func watchMemoryPressure(_ engine: Engine) {
        let source = DispatchSource.makeMemoryPressureSource(
            eventMask: [.normal, .warning, .critical], queue: queue)
        source.setEventHandler { [weak engine, weak source] in
            guard let engine, let event = source?.data else { return }
            let level: MemoryPressure
            if event.contains(.critical) {
                level = .critical
            } else if event.contains(.warning) {
                level = .elevated
            } else {
                level = .normal
            }
            engine.setMemoryPressure(level: level)
        }
        source.resume()
        memoryPressure = source
    }

    /// `setTunnelNetworkSettings` with a deadline: `completion` runs once,
    /// on the provider's queue, with the system's answer or, after
    /// `networkSettingsTimeout`, `KerntunTunnelError.networkSettingsTimedOut`
    /// (an answer after that is ignored).
    private func applyNetworkSettings(
        _ settings: NETunnelNetworkSettings, completion: @escaping (Error?) -> Void
    ) {
        let timeout = networkSettingsTimeout
        let queue = self.queue
        var finished = false  // read and written on `queue` only
        let finish: (Error?) -> Void = { error in
            queue.async {
                guard !finished else { return }
                finished = true
                completion(error)
            }
        }
        queue.asyncAfter(deadline: .now() + timeout) {
            finish(KerntunTunnelError.networkSettingsTimedOut(timeout))
        }
        setTunnelNetworkSettings(settings) { error in finish(error) }
    }

    /// Called on the provider's queue for every path update while the
    /// engine runs. The path is the one the extension's own sockets use
    /// (the provider's traffic bypasses its tunnel): the physical network.
    /// Override to react further, calling super.
    open func networkPathChanged(_ path: NWPath) {
        let info = KerntunNetworkInfo(path)
        latestNetwork = info
        networkChangedForEngine(info)
        // The first report is the network the settings were applied on.
        guard let applied = appliedNetwork else {
            appliedNetwork = info
            return
        }
        reapplyIfChanged(from: applied)
    }

    /// Re-applies the tunnel settings when the latest network differs from
    /// the one they were applied on. Not while there is no usable path
    /// (connections fail until one returns; the engine keeps running), and
    /// one re-apply at a time: a change that arrives meanwhile is handled
    /// when a successful one ends. After a failure the next path update
    /// tries again (never at once: a system that fails at once would
    /// otherwise be asked in a loop).
    private func reapplyIfChanged(from applied: KerntunNetworkInfo) {
        guard reassertOnNetworkChange, !reapplying, !stopping, let info = latestNetwork,
              info.status == .satisfied, info != applied, let config = activeConfig else { return }
        hooks.logInfo("network changed from [\(applied.summary)] to [\(info.summary)]: re-applying tunnel settings")
        reapplying = true
        reasserting = true
        applyNetworkSettings(makeNetworkSettings(config: config)) { [weak self] error in
            guard let self else { return }
            self.reapplying = false
            self.reasserting = false
            if self.stopping { return }
            if let error {
                self.hooks.logError("re-applying tunnel settings failed: \(error.localizedDescription)")
                return
            }
            self.appliedNetwork = info
            self.reapplyIfChanged(from: info)
        }
    }

    /// Tells the engine of every path update (`Engine.networkChanged`):
    /// new direct sockets bind to the path's first interface (IP_BOUND_IF),
    /// and connections whose source address the move took away are reset
    /// at once instead of waiting for TCP keepalive. The engine ignores a
    /// report that changes nothing. `NWPath` carries no DNS servers, so
    /// none are passed.
    private func networkChangedForEngine(_ info: KerntunNetworkInfo) {
        hooks.logInfo("network: \(info.summary)")
        guard let engine else { return }
        let primary = info.status == .satisfied ? info.interfaces.first : nil
        let report = NetworkInfo(
            interfaceName: primary?.name,
            interfaceIndex: UInt32(clamping: primary?.index ?? 0),
            hasIpv4: primary != nil && info.supportsIPv4,
            hasIpv6: primary != nil && info.supportsIPv6,
            dnsServers: [],
            expensive: info.isExpensive,
            constrained: info.isConstrained
        )
        do {
            _ = try engine.networkChanged(info: report)
        } catch {
            hooks.logError("networkChanged: \(error)")
        }
    }

    private func watchPath() {
        let monitor = NWPathMonitor()
        monitor.pathUpdateHandler = { [weak self] path in
            guard let self, !self.stopping, self.engine != nil else { return }
            self.networkPathChanged(path)
        }
        monitor.start(queue: queue)
        pathMonitor = monitor
    }

    /// The engine tells of its own failure (device gone, a task died): the
    /// tunnel is cancelled with the reason, with no polling.
    private func watchHealth(_ engine: Engine) {
        engine.setListener(listener: ProviderListener { [weak self] reason in
            guard let self else { return }
            self.queue.async {
                guard !self.stopping, self.engine === engine else { return }
                self.cancelTunnelWithError(KerntunTunnelError.engineFailed(reason))
            }
        })
    }

    /// "198.18.0.1/16" -> ("198.18.0.1", 16).
    static func split(_ cidr: String) -> (String, Int)? {
        let parts = cidr.split(separator: "/", maxSplits: 1)
        guard parts.count == 2, let prefix = Int(parts[1]) else { return nil }
        return (String(parts[0]), prefix)
    }

    /// 16 -> "255.255.0.0".
    static func mask(_ prefix: Int) -> String {
        let p = max(0, min(32, prefix))
        let bits: UInt32 = p == 0 ? 0 : ~UInt32(0) << (32 - p)
        return [24, 16, 8, 0].map { String((bits >> UInt32($0)) & 0xff) }.joined(separator: ".")
    }

    /// The statistics as a JSON-ready dictionary (for the app's UI).
    public static func dictionary(_ s: EngineStats) -> [String: Any] {
        var drops: [String: UInt64] = [:]
        for d in s.drops { drops[d.reason] = d.count }
        return [
            "stack": s.stack,
            "driver": s.driver,
            "uptime_ms": s.uptimeMs,
            "packets_up": s.packetsUp,
            "bytes_up": s.bytesUp,
            "packets_down": s.packetsDown,
            "bytes_down": s.bytesDown,
            "tcp_sessions_active": s.tcpSessionsActive,
            "tcp_sessions_total": s.tcpSessionsTotal,
            "tcp_bytes_up": s.tcpBytesUp,
            "tcp_bytes_down": s.tcpBytesDown,
            "tcp_connect_failed": s.tcpConnectFailed,
            "admission_limit": s.admissionLimit,
            "admission_refused": s.admissionRefused,
            "udp_flows_active": s.udpFlowsActive,
            "udp_bytes_up": s.udpBytesUp,
            "udp_bytes_down": s.udpBytesDown,
            "tcp_flows_active": s.tcpFlows.active,
            "tcp_flows_closing": s.tcpFlows.closing,
            "tun_read_max_batch": s.tunReadMaxBatch,
            "total_drops": s.totalDrops,
            "drops": drops,
        ]
    }
}
