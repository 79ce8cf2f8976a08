//! Typed errors. Kotlin sees `KerntunException.Config` etc. (subclasses of
//! one sealed exception), Swift a `throws` of `KerntunError.config(...)`.
//! A panic inside the library never crosses the boundary: it is caught and
//! reported as [`KerntunError::Internal`].

use kerntun::StartError;
use kerntun::config::ConfigError;

/// Why an engine call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, uniffi::Error)]
#[non_exhaustive]
pub enum KerntunError {
    /// The configuration was refused before anything was opened. `field`
    /// names it (`tun.ipv4`, `rules[2].ports`, `budget.udp_flows`, ...).
    #[error("invalid configuration: {field}: {reason}")]
    Config { field: String, reason: String },
    /// A share link (`outboundFromUrl`) is not one kerntun can use; the
    /// reason says what is wrong with it (never the password).
    #[error("invalid link: {reason}")]
    Link { reason: String },
    /// The engine's runtime (threads, event loop) could not be created.
    #[error("creating the engine runtime: {reason}")]
    Runtime { reason: String },
    /// The TUN device could not be created or adopted (bad descriptor,
    /// missing permission, device creation unsupported on this platform).
    #[error("opening the TUN device: {reason}")]
    Tun { reason: String },
    /// The device does not carry the configured gateway address(es): the
    /// platform's tunnel settings and `tun.ipv4`/`tun.ipv6` disagree.
    #[error("verifying the TUN addresses: {reason}")]
    Address { reason: String },
    /// The kernel listener could not be bound on the gateway address.
    #[error("binding the kernel listener on {address}: {reason}")]
    Listener { address: String, reason: String },
    /// The process-wide logger could not be installed (another one is).
    #[error("installing the logger: {reason}")]
    Logging { reason: String },
    /// The engine is stopped (or failed): the call needs a running one.
    #[error("the engine is not running: {reason}")]
    NotRunning { reason: String },
    /// `networkChanged` could not use what it was given (`field` names
    /// it: `dns_servers[1]`), or could not read the interfaces' addresses
    /// (`field` is `interfaces`).
    #[error("network info: {field}: {reason}")]
    Network { field: String, reason: String },
    /// `select`: no group has this name.
    #[error("no group named {group:?}")]
    UnknownGroup { group: String },
    /// `select`: the group picks its member itself (`kind` is `url-test`
    /// or `fallback`).
    #[error("group {group:?} is a {kind} group; only select groups take a selection")]
    NotSelectGroup { group: String, kind: String },
    /// `select`: the group has no such member.
    #[error("group {group:?} has no member named {member:?}")]
    UnknownMember { group: String, member: String },
    /// `testLatency`: no outbound or group has this name.
    #[error("no outbound or group named {name:?}")]
    UnknownOutbound { name: String },
    /// `testLatency`: the URL is not `http://host[:port]/path`.
    #[error("url: {reason}")]
    InvalidUrl { reason: String },
    /// `testLatency`: no answer within the timeout.
    #[error("no answer within {timeout_ms} ms")]
    LatencyTimeout { timeout_ms: u64 },
    /// `testLatency`: the outbound or the target failed (connect refused,
    /// proxy handshake, not HTTP, or the outbound is `reject`).
    #[error("unreachable: {reason}")]
    Unreachable { reason: String },
    /// A bug: the library panicked. The engine involved is stopped.
    /// `reload` was given a configuration that changes `field` (the TUN
    /// section, the stack, the driver, the workers, the budget, the
    /// timeouts, the relay options, the direct sockets' options), which only a restart can
    /// change. Nothing changed.
    #[error("{field} cannot change while the engine runs: restart the engine to change it")]
    NeedsRestart { field: String },
    #[error("internal error (please report): {reason}")]
    Internal { reason: String },
}

impl From<StartError> for KerntunError {
    fn from(e: StartError) -> Self {
        match e {
            StartError::Config(c) => c.into(),
            StartError::Runtime(e) => KerntunError::Runtime {
                reason: e.to_string(),
            },
            StartError::Tun(e) => KerntunError::Tun {
                reason: e.to_string(),
            },
            StartError::Address(e) => KerntunError::Address {
                reason: e.to_string(),
            },
            StartError::Listener { addr, source } => KerntunError::Listener {
                address: addr.to_string(),
                reason: source.to_string(),
            },
            // The utun's index is a property of the device.
            StartError::TunIndex => KerntunError::Tun {
                reason: StartError::TunIndex.to_string(),
            },
            // StartError is non_exhaustive: a variant added later still
            // arrives typed, with its message.
            other => KerntunError::Internal {
                reason: other.to_string(),
            },
        }
    }
}

impl From<ConfigError> for KerntunError {
    fn from(e: ConfigError) -> Self {
        let field = match &e {
            ConfigError::NoAddress => "tun".to_string(),
            ConfigError::NoRoomForNat { field, .. } => format!("tun.{field}"),
            ConfigError::BadMtu(_) => "tun.mtu".to_string(),
            ConfigError::ZeroBudget(f) => format!("budget.{f}"),
            ConfigError::UnsupportedStack(_) => "stack".to_string(),
            ConfigError::UnknownOutbound { rule, .. } => format!("rules[{rule}].action"),
            ConfigError::BadOutbound { name, .. } => format!("outbounds.{name}"),
            ConfigError::BadGroup { name, .. } => format!("groups.{name}"),
            ConfigError::BadRule { rule, .. } => format!("rules[{rule}]"),
            ConfigError::Dns { field, .. } => format!("dns.{field}"),
            ConfigError::Sniff { field, .. } => format!("sniff.{field}"),
            ConfigError::Direct(reason) => {
                format!("direct.{}", reason.split(':').next().unwrap_or_default())
            }
            _ => String::new(),
        };
        KerntunError::Config {
            field,
            reason: e.to_string(),
        }
    }
}

impl From<kerntun::ReloadError> for KerntunError {
    fn from(e: kerntun::ReloadError) -> Self {
        use kerntun::ReloadError;
        match e {
            ReloadError::NotRunning => KerntunError::NotRunning {
                reason: "reload needs a running engine".into(),
            },
            ReloadError::Config(c) => KerntunError::from(c),
            ReloadError::NeedsRestart { field } => KerntunError::NeedsRestart {
                field: field.into(),
            },
            // ReloadError is non_exhaustive: a later variant still arrives
            // typed, with its message.
            other => KerntunError::Internal {
                reason: other.to_string(),
            },
        }
    }
}

impl From<kerntun::network::NetworkError> for KerntunError {
    fn from(e: kerntun::network::NetworkError) -> Self {
        use kerntun::network::NetworkError;
        match e {
            NetworkError::NotRunning => KerntunError::NotRunning {
                reason: "networkChanged needs a running engine".into(),
            },
            NetworkError::Interfaces(_) => KerntunError::Network {
                field: "interfaces".into(),
                reason: e.to_string(),
            },
            // NetworkError is non_exhaustive: a later variant still
            // arrives typed, with its message.
            other => KerntunError::Network {
                field: String::new(),
                reason: other.to_string(),
            },
        }
    }
}

impl From<kerntun::SleepError> for KerntunError {
    fn from(e: kerntun::SleepError) -> Self {
        match e {
            kerntun::SleepError::NotRunning => KerntunError::NotRunning {
                reason: "sleep and wake need a running engine".into(),
            },
            // SleepError is non_exhaustive: a later variant still arrives
            // typed, with its message.
            other => KerntunError::Internal {
                reason: other.to_string(),
            },
        }
    }
}

/// What a platform hook reports back to the engine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, uniffi::Error)]
pub enum HookError {
    /// The platform refused (e.g. `VpnService.protect` returned false): the
    /// connection is aborted, counted, and the app sees a reset.
    #[error("refused: {reason}")]
    Refused { reason: String },
    /// The hook threw something it did not declare (mapped by uniffi).
    #[error("unexpected error in the hook: {reason}")]
    Unexpected { reason: String },
}

impl From<uniffi::UnexpectedUniFFICallbackError> for HookError {
    fn from(e: uniffi::UnexpectedUniFFICallbackError) -> Self {
        HookError::Unexpected { reason: e.reason }
    }
}

/// Text of a caught panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

/// Run `f`, turning a panic into [`KerntunError::Internal`].
pub(crate) fn guard<T>(f: impl FnOnce() -> Result<T, KerntunError>) -> Result<T, KerntunError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(KerntunError::Internal {
            reason: panic_message(p.as_ref()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_errors_name_the_field() {
        let e: KerntunError = ConfigError::BadMtu(5).into();
        assert!(matches!(e, KerntunError::Config { ref field, .. } if field == "tun.mtu"));
        let e: KerntunError = StartError::Config(ConfigError::ZeroBudget("udp_flows")).into();
        assert!(
            matches!(e, KerntunError::Config { ref field, .. } if field == "budget.udp_flows"),
            "{e:?}"
        );
    }

    #[test]
    fn panics_become_internal_errors() {
        let r: Result<(), _> = guard(|| panic!("boom {}", 7));
        assert_eq!(
            r,
            Err(KerntunError::Internal {
                reason: "boom 7".into()
            })
        );
    }
}
