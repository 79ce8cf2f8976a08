//! The `[direct]` and `[outbounds.NAME]` sections: how direct sockets stay
//! off the TUN, and the proxies rules can send flows to.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// An outbound the configuration cannot use, named by its key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("outbounds.{name}: {reason}")]
pub struct BadOutbound {
    pub name: String,
    pub reason: String,
}

/// How direct outbound sockets avoid looping back into the TUN.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DirectConfig {
    /// Bind outbound sockets to this interface (`SO_BINDTODEVICE`).
    pub interface: Option<String>,
    /// Mark outbound sockets (`SO_MARK`) for policy routing.
    pub fwmark: Option<u32>,
    /// Upper bound on an outbound TCP connect; the app sees a reset after it.
    pub connect_timeout_ms: u64,
}

impl Default for DirectConfig {
    fn default() -> Self {
        Self {
            interface: None,
            fwmark: None,
            connect_timeout_ms: 5_000,
        }
    }
}

/// A Shadowsocks method (the names shadowsocks-rust uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShadowsocksMethod {
    /// No encryption: the target address, then the application's bytes
    /// unchanged (spliced on Linux/Android).
    #[serde(rename = "none", alias = "plain")]
    None,
    #[serde(rename = "aes-128-gcm")]
    Aes128Gcm,
    #[serde(rename = "aes-256-gcm")]
    Aes256Gcm,
    #[serde(rename = "chacha20-ietf-poly1305")]
    Chacha20IetfPoly1305,
    /// AEAD-2022: the password is a base64 16-byte key.
    #[serde(rename = "2022-blake3-aes-128-gcm")]
    Blake3Aes128Gcm,
    /// AEAD-2022: the password is a base64 32-byte key.
    #[serde(rename = "2022-blake3-aes-256-gcm")]
    Blake3Aes256Gcm,
}

/// A Shadowsocks server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShadowsocksConfig {
    /// The server's IP address and port (not resolved: the engine has no DNS).
    pub server: SocketAddr,
    pub method: ShadowsocksMethod,
    /// The password (SIP004 methods), or the base64 key (AEAD-2022); ignored by `none`.
    #[serde(default)]
    pub password: String,
    /// Relay UDP flows through the server too (else they go direct).
    #[serde(default = "yes")]
    pub udp: bool,
}

/// A SOCKS5 proxy (RFC 1928), optionally with username/password (RFC 1929).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Socks5Config {
    /// The proxy's IP address and port.
    pub server: SocketAddr,
    /// Username and password go together, 1..=255 bytes each.
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// Relay UDP flows with UDP ASSOCIATE (else they go direct).
    #[serde(default = "yes")]
    pub udp: bool,
}

fn yes() -> bool {
    true
}

/// A named proxy outbound that rules can send flows to (`action = "<name>"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutboundConfig {
    Socks5(Socks5Config),
    Shadowsocks(ShadowsocksConfig),
}

impl OutboundConfig {
    /// The proxy's address (where the engine's sockets connect).
    pub fn server(&self) -> SocketAddr {
        match self {
            OutboundConfig::Socks5(c) => c.server,
            OutboundConfig::Shadowsocks(c) => c.server,
        }
    }
}

/// Settings of one outbound that are wrong whatever the platform.
impl OutboundConfig {
    /// Settings that are wrong whatever the platform, named in the error.
    pub fn check(&self, name: &str) -> Result<(), BadOutbound> {
        let bad = |reason: String| BadOutbound {
            name: name.to_owned(),
            reason,
        };
        if name == "direct" || name == "reject" {
            return Err(bad(
                "`direct` and `reject` are built in; pick another name".into()
            ));
        }
        match self {
            OutboundConfig::Socks5(c) => match (&c.username, &c.password) {
                (None, None) => {}
                (Some(u), Some(p)) => {
                    if u.is_empty() || p.is_empty() || u.len() > 255 || p.len() > 255 {
                        return Err(bad("username and password must be 1..=255 bytes".into()));
                    }
                }
                _ => return Err(bad("username and password go together".into())),
            },
            OutboundConfig::Shadowsocks(c) => {
                super::shadowsocks::Key::new(c.method, &c.password)
                    .map_err(|e| bad(e.to_string()))?;
                if c.method != ShadowsocksMethod::None && c.password.is_empty() {
                    return Err(bad("password is empty".into()));
                }
            }
        }
        Ok(())
    }
}
