// The app's side of the provider's messages (docs/messages.md): a v1
// request written with JSONSerialization, sent with
// NETunnelProviderSession.sendProviderMessage, its reply read back as the
// command's `ok` object or a typed error. The provider answers them in
// KerntunPacketTunnelProvider.handleAppMessage (Engine.handleMessage).
// It imports only Foundation and NetworkExtension, so a containing app that
// should not link the engine can copy this file into its own target.
//
// This file is not compiled in this repository's CI (there is no Swift
// compiler there).

import Foundation
import NetworkExtension

/// Why a message failed. `kind` is the stable name to match on: the
/// engine's (`not_running`, `unknown_group`, `needs_restart`, ...;
/// docs/messages.md, "Errors"), or this side's own: `bad_request` (args
/// that are not JSON), `not_connected` (the session refused to send),
/// `no_reply` (the provider answered nothing: it is not running),
/// `bad_reply`.
public struct KerntunMessageError: Error, LocalizedError, Equatable {
    public let kind: String
    public let message: String
    /// The argument or configuration field at fault, when there is one.
    public let field: String?

    public init(kind: String, message: String, field: String? = nil) {
        self.kind = kind
        self.message = message
        self.field = field
    }

    public var errorDescription: String? { "\(kind): \(message)" }
}

public enum KerntunMessages {
    /// The schema version written into requests.
    public static let version = 1

    /// A request, `{"v":1,"id":id,"cmd":cmd,"args":args}`, as bytes;
    /// `args` must be a JSON object (`JSONSerialization.isValidJSONObject`).
    public static func request(_ cmd: String, args: [String: Any] = [:], id: Int = 0)
        -> Result<Data, KerntunMessageError>
    {
        let envelope: [String: Any] = ["v": version, "id": id, "cmd": cmd, "args": args]
        // JSONSerialization raises an Objective-C exception, not a Swift
        // error, on what it cannot write: check first.
        guard JSONSerialization.isValidJSONObject(envelope),
              let data = try? JSONSerialization.data(withJSONObject: envelope)
        else {
            return .failure(KerntunMessageError(kind: "bad_request", message: "args are not JSON", field: "args"))
        }
        return .success(data)
    }

    /// A reply read: the command's `ok` object, or the error it carries.
    public static func reply(_ data: Data?) -> Result<[String: Any], KerntunMessageError> {
        guard let data else {
            return .failure(KerntunMessageError(kind: "no_reply", message: "the provider sent no reply"))
        }
        guard let object = (try? JSONSerialization.jsonObject(with: data)) as? [String: Any] else {
            return .failure(KerntunMessageError(kind: "bad_reply", message: "the reply is not a JSON object"))
        }
        if let error = object["error"] as? [String: Any] {
            return .failure(KerntunMessageError(
                kind: error["kind"] as? String ?? "bad_reply",
                message: error["message"] as? String ?? "",
                field: error["field"] as? String
            ))
        }
        guard let ok = object["ok"] as? [String: Any] else {
            return .failure(KerntunMessageError(kind: "bad_reply", message: "the reply has neither ok nor error"))
        }
        return .success(ok)
    }

    /// Send `cmd` to the tunnel's provider; `completion` gets its reply
    /// (on a queue of the system's). Example:
    /// `KerntunMessages.send("select", args: ["group": "proxy", "member": "tokyo"], to: session) { ... }`.
    public static func send(
        _ cmd: String,
        args: [String: Any] = [:],
        to session: NETunnelProviderSession,
        completion: @escaping (Result<[String: Any], KerntunMessageError>) -> Void
    ) {
        let data: Data
        switch request(cmd, args: args) {
        case .success(let d): data = d
        case .failure(let e):
            completion(.failure(e))
            return
        }
        do {
            try session.sendProviderMessage(data) { reply in
                completion(Self.reply(reply))
            }
        } catch {
            completion(.failure(KerntunMessageError(kind: "not_connected", message: error.localizedDescription)))
        }
    }
}
