//! The live connection list as the app sees it (`Engine.connections`):
//! the core's records (`core/src/conns.rs`), addresses as text.

/// Records one `Engine.connections()` call returns at most.
pub const MAX_CONNECTIONS: u64 = kerntun::conns::LIST_CAP as u64;

/// A connection's transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectionNetwork {
    Tcp,
    Udp,
}

/// Where a connection's domain came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DomainSource {
    /// No domain: the app connected to an address. (Not `None`: Swift
    /// would confuse `.none` with an absent optional.)
    NoDomain,
    /// A fake-ip address handed out by kerntun's DNS.
    FakeIp,
    /// Read from the first bytes (TLS SNI, HTTP Host).
    Sniffed,
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectionState {
    /// Reading its first bytes for a domain, then connecting.
    Sniffing,
    /// Relaying.
    Relaying,
    /// Closed by `Engine.closeConnection`; ending.
    Closing,
}

/// One live connection.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Serialize)]
pub struct ConnectionRecord {
    /// Unique for the engine's life; what `Engine.closeConnection` takes.
    pub id: u64,
    pub network: ConnectionNetwork,
    /// The app's address and port (`198.18.0.1:50000`, `[fd00::1]:50000`).
    pub source: String,
    /// The address the app connected to.
    pub destination: String,
    /// The domain the connection was routed by, if any.
    pub domain: Option<String>,
    pub domain_source: DomainSource,
    /// The rule that matched: its `name`, or its place and conditions
    /// (`rules[2] domain_suffix=b.test ports=443`). `None` while a sniffing
    /// connection is not routed yet, and when no rule matched (the default
    /// route, direct).
    pub rule: Option<String>,
    /// The groups it went through to its outbound, outermost first (empty
    /// when a rule named the outbound itself).
    pub chain: Vec<String>,
    /// The outbound's name (`direct`, or a proxy's); `None` while a
    /// sniffing connection is not routed yet.
    pub outbound: Option<String>,
    /// Payload bytes from the app, and to it.
    pub bytes_up: u64,
    pub bytes_down: u64,
    /// When it started, in milliseconds since the Unix epoch.
    pub started_unix_ms: u64,
    pub state: ConnectionState,
    /// The uid of the app that owns it, as the app's `OwnerHooks` named it
    /// (Android, `Engine.startWithOwner`); `null`/`nil` without hooks,
    /// before the lookup answered, or when it failed.
    pub uid: Option<u32>,
    /// That app's package name, when the hooks named one (not `package`:
    /// a Kotlin keyword).
    pub package_name: Option<String>,
}

paired!(ConnectionNetwork, kerntun::rules::Network {
    Tcp => Tcp,
    Udp => Udp,
});

impl From<kerntun::conns::Connection> for ConnectionRecord {
    fn from(c: kerntun::conns::Connection) -> Self {
        use kerntun::conns::{ConnState, DomainSource as Source};
        ConnectionRecord {
            id: c.id,
            network: c.network.into(),
            source: c.source.to_string(),
            destination: c.destination.to_string(),
            domain: c.domain,
            domain_source: match c.domain_source {
                Source::None => DomainSource::NoDomain,
                Source::FakeIp => DomainSource::FakeIp,
                Source::Sniffed => DomainSource::Sniffed,
            },
            rule: c.rule,
            chain: c.chain,
            outbound: c.outbound,
            bytes_up: c.bytes_up,
            bytes_down: c.bytes_down,
            started_unix_ms: c.started_unix_ms,
            state: match c.state {
                ConnState::Sniffing => ConnectionState::Sniffing,
                ConnState::Relaying => ConnectionState::Relaying,
                ConnState::Closing => ConnectionState::Closing,
            },
            uid: c.uid,
            package_name: c.package,
        }
    }
}

/// Which connections `Engine.closeConnections` closes: every condition
/// given must hold; with none given, every connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, uniffi::Record, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConnectionFilter {
    #[uniffi(default = None)]
    pub network: Option<ConnectionNetwork>,
    /// The outbound's name (`direct`, a proxy's).
    #[uniffi(default = None)]
    pub outbound: Option<String>,
    /// A group in the connection's chain.
    #[uniffi(default = None)]
    pub group: Option<String>,
    /// The connection's domain is this one or under it (`b.test` matches
    /// `a.b.test`), case-insensitive.
    #[uniffi(default = None)]
    pub domain_suffix: Option<String>,
    /// The address the app connected to (`93.184.216.34`, `2001:db8::1`).
    #[uniffi(default = None)]
    pub destination_ip: Option<String>,
}

impl ConnectionFilter {
    /// The engine's filter; `None` when `destination_ip` is not an address.
    pub(crate) fn to_core(&self) -> Option<kerntun::conns::ConnectionFilter> {
        let destination_ip = match &self.destination_ip {
            Some(ip) => Some(ip.parse().ok()?),
            None => None,
        };
        Some(kerntun::conns::ConnectionFilter {
            network: self.network.map(Into::into),
            outbound: self.outbound.clone(),
            group: self.group.clone(),
            domain_suffix: self.domain_suffix.clone(),
            destination_ip,
        })
    }
}
