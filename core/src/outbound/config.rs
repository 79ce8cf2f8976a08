//! The `[direct]` and `[outbounds.NAME]` sections: how direct sockets stay
//! off the TUN, and the proxies rules can send flows to.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::addr::Address;
use super::link::{Link, parse_server};
use crate::dnswire::Upstream;

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
    /// Resolvers for proxy host names (`udp://IP:PORT`, `tcp://IP:PORT`),
    /// asked on direct sockets. Empty: the `[dns]` upstreams, else the
    /// system's (docs/configuration.md, "Host names").
    pub bootstrap: Vec<String>,
    /// How UDP flows are mapped and filtered (docs/configuration.md, "UDP
    /// NAT"): one socket per app source for every destination, replies
    /// from any peer (the default), or a connected socket per destination.
    pub udp_nat: UdpNat,
}

/// The UDP NAT behaviour (RFC 4787), `direct.udp_nat`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UdpNat {
    /// Endpoint-independent mapping and filtering ("full cone", RFC 4787
    /// REQ-1 and REQ-8): an app's source address and port leave from one
    /// unconnected socket for every destination, and a reply from any peer
    /// reaches the app from that peer. A proxied flow passes on replies
    /// from whatever address its proxy names.
    #[default]
    EndpointIndependent,
    /// One connected socket per (app source, destination): only that
    /// destination's replies reach the app; a proxied flow passes on only
    /// replies its proxy names as from the flow's destination.
    Connected,
}

impl DirectConfig {
    /// The parsed `bootstrap` list; the error names the entry.
    pub fn parsed_bootstrap(&self) -> Result<Vec<Upstream>, String> {
        self.bootstrap
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let u: Upstream = b.parse().map_err(|e| format!("bootstrap[{i}]: {e}"))?;
                if u.proto.over_tls() {
                    return Err(format!(
                        "bootstrap[{i}]: {b:?}: udp:// or tcp:// (a bootstrap resolver cannot be DNS over TLS or HTTPS)"
                    ));
                }
                Ok(u)
            })
            .collect()
    }
}

impl Default for DirectConfig {
    fn default() -> Self {
        Self {
            interface: None,
            fwmark: None,
            connect_timeout_ms: 5_000,
            bootstrap: Vec::new(),
            udp_nat: UdpNat::default(),
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
    /// `IP:PORT`, `[IPv6]:PORT` or `NAME:PORT` (a name is resolved on
    /// direct sockets, see [`super::resolve`]).
    #[serde(with = "server_text")]
    pub server: Address,
    pub method: ShadowsocksMethod,
    /// The password (SIP004 methods), or the base64 key (AEAD-2022); ignored by `none`.
    #[serde(default)]
    pub password: String,
    /// What happens to the UDP flows the rules send here.
    #[serde(default)]
    pub udp: OutboundUdp,
}

/// A SOCKS5 proxy (RFC 1928), optionally with username/password (RFC 1929).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Socks5Config {
    /// `IP:PORT`, `[IPv6]:PORT` or `NAME:PORT`.
    #[serde(with = "server_text")]
    pub server: Address,
    /// Username and password go together, 1..=255 bytes each.
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// What happens to the UDP flows the rules send here (relayed with UDP
    /// ASSOCIATE by default).
    #[serde(default)]
    pub udp: OutboundUdp,
}

/// What a proxy outbound does with the UDP flows the rules send it: `udp`
/// in `[outbounds.NAME]`, written `true`, `false` or `"direct"`.
///
/// `false` refuses them rather than sending them around the proxy: a user
/// who routes an app to a proxy expects none of its traffic to leave from
/// the device's own address. Sending them direct is a choice made by name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OutboundUdp {
    /// `true` (the default): relayed through the proxy (SOCKS5 UDP
    /// ASSOCIATE, Shadowsocks UDP).
    #[default]
    Relay,
    /// `false`: refused like a `reject` rule's flow, answered with an ICMP
    /// port unreachable and counted as the drop `udp_outbound_refused`
    /// (`core/src/udp/reject.rs`).
    Refuse,
    /// `"direct"`: sent direct, from the device's own address, outside the
    /// proxy.
    Direct,
}

impl Serialize for OutboundUdp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            OutboundUdp::Relay => s.serialize_bool(true),
            OutboundUdp::Refuse => s.serialize_bool(false),
            OutboundUdp::Direct => s.serialize_str("direct"),
        }
    }
}

impl<'de> Deserialize<'de> for OutboundUdp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = OutboundUdp;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("`udp` = true, false or \"direct\"")
            }
            fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<OutboundUdp, E> {
                Ok(if b {
                    OutboundUdp::Relay
                } else {
                    OutboundUdp::Refuse
                })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<OutboundUdp, E> {
                match v {
                    "direct" => Ok(OutboundUdp::Direct),
                    _ => Err(E::custom(format!(
                        "udp: {v:?} is not one of true, false, \"direct\""
                    ))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// `server = "host:port"` in the TOML: read with [`parse_server`], written
/// as [`Address`] displays itself.
mod server_text {
    use super::*;

    pub fn serialize<S: Serializer>(a: &Address, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(a)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Address, D::Error> {
        let text = String::deserialize(d)?;
        parse_server(&text).map_err(serde::de::Error::custom)
    }
}

/// A named proxy outbound that rules can send flows to (`action = "<name>"`).
/// In the TOML either a table with `type` and the fields, or
/// `url = "ss://..."` / `url = "socks5://..."` (with `udp` as the only other
/// field).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", try_from = "OutboundToml")]
pub enum OutboundConfig {
    Socks5(Socks5Config),
    Shadowsocks(ShadowsocksConfig),
}

/// What an `[outbounds.NAME]` table may hold, before the type is known.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OutboundToml {
    #[serde(rename = "type")]
    kind: Option<OutboundKind>,
    url: Option<String>,
    #[serde(default, with = "opt_server_text")]
    server: Option<Address>,
    method: Option<ShadowsocksMethod>,
    username: Option<String>,
    password: Option<String>,
    udp: Option<OutboundUdp>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum OutboundKind {
    Socks5,
    Shadowsocks,
}

mod opt_server_text {
    use super::*;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Address>, D::Error> {
        super::server_text::deserialize(d).map(Some)
    }
}

impl TryFrom<OutboundToml> for OutboundConfig {
    type Error = String;
    fn try_from(t: OutboundToml) -> Result<Self, String> {
        let udp = t.udp.unwrap_or_default();
        if let Some(url) = t.url {
            if t.kind.is_some()
                || t.server.is_some()
                || t.method.is_some()
                || t.username.is_some()
                || t.password.is_some()
            {
                return Err("url: the link says it all; only `udp` may go with it".into());
            }
            let mut o = OutboundConfig::from(Link::parse(&url).map_err(|e| format!("url: {e}"))?);
            o.set_udp(udp);
            return Ok(o);
        }
        let kind = t
            .kind
            .ok_or("type (\"socks5\" or \"shadowsocks\") or url is needed")?;
        let server = t.server.ok_or("server is needed")?;
        Ok(match kind {
            OutboundKind::Socks5 => {
                if t.method.is_some() {
                    return Err("method: not a socks5 field".into());
                }
                OutboundConfig::Socks5(Socks5Config {
                    server,
                    username: t.username,
                    password: t.password,
                    udp,
                })
            }
            OutboundKind::Shadowsocks => {
                if t.username.is_some() {
                    return Err("username: not a shadowsocks field".into());
                }
                OutboundConfig::Shadowsocks(ShadowsocksConfig {
                    server,
                    method: t.method.ok_or("method is needed")?,
                    password: t.password.unwrap_or_default(),
                    udp,
                })
            }
        })
    }
}

impl From<Link> for OutboundConfig {
    /// A share link's proxy, UDP on (the link's tag is not kept: the
    /// outbound's name is its key in `[outbounds]`).
    fn from(l: Link) -> Self {
        match l {
            Link::Shadowsocks(l) => OutboundConfig::Shadowsocks(ShadowsocksConfig {
                server: l.server,
                method: l.method,
                password: l.password,
                udp: OutboundUdp::Relay,
            }),
            Link::Socks5(l) => {
                let (username, password) = l.credentials.unzip();
                OutboundConfig::Socks5(Socks5Config {
                    server: l.server,
                    username,
                    password,
                    udp: OutboundUdp::Relay,
                })
            }
        }
    }
}

impl OutboundConfig {
    /// The proxy's address (where the engine's sockets connect).
    pub fn server(&self) -> &Address {
        match self {
            OutboundConfig::Socks5(c) => &c.server,
            OutboundConfig::Shadowsocks(c) => &c.server,
        }
    }

    /// What the outbound does with UDP flows.
    pub fn udp(&self) -> OutboundUdp {
        match self {
            OutboundConfig::Socks5(c) => c.udp,
            OutboundConfig::Shadowsocks(c) => c.udp,
        }
    }

    fn set_udp(&mut self, udp: OutboundUdp) {
        match self {
            OutboundConfig::Socks5(c) => c.udp = udp,
            OutboundConfig::Shadowsocks(c) => c.udp = udp,
        }
    }
}

/// An `[outbounds]` or `[groups]` key: any name but those of the built-in
/// routes, `direct` and `reject`.
pub(crate) fn check_key(name: &str) -> Result<(), String> {
    if name == "direct" || name == "reject" {
        return Err("`direct` and `reject` are built in; pick another name".into());
    }
    Ok(())
}

/// Settings of one outbound that are wrong whatever the platform.
impl OutboundConfig {
    /// Settings that are wrong whatever the platform, named in the error.
    pub fn check(&self, name: &str) -> Result<(), BadOutbound> {
        let bad = |reason: String| BadOutbound {
            name: name.to_owned(),
            reason,
        };
        check_key(name).map_err(bad)?;
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn outbounds(text: &str) -> Result<BTreeMap<String, OutboundConfig>, String> {
        crate::config::toml_tables(text, "outbounds")
    }

    #[test]
    fn host_names_and_urls_in_toml() {
        let o = outbounds(
            r#"
            [outbounds.byname]
            type = "shadowsocks"
            server = "SS.Example.com:8388"
            method = "aes-256-gcm"
            password = "pw"
            [outbounds.link]
            url = "ss://2022-blake3-aes-128-gcm:AAECAwQFBgcICQoLDA0ODw%3D%3D@[2001:db8::1]:443#tag"
            udp = false
            [outbounds.corp]
            url = "socks5://me:p%40ss@proxy.corp:1080"
            "#,
        )
        .expect("parse");
        assert_eq!(
            o["byname"].server(),
            &Address::Domain("ss.example.com".into(), 8388)
        );
        match &o["link"] {
            OutboundConfig::Shadowsocks(c) => {
                assert_eq!(c.method, ShadowsocksMethod::Blake3Aes128Gcm);
                assert_eq!(c.password, "AAECAwQFBgcICQoLDA0ODw==");
                assert_eq!(c.udp, OutboundUdp::Refuse, "udp = false next to url");
                assert_eq!(
                    c.server,
                    Address::Ip("[2001:db8::1]:443".parse().expect("a"))
                );
            }
            other => panic!("{other:?}"),
        }
        match &o["corp"] {
            OutboundConfig::Socks5(c) => {
                assert_eq!(c.username.as_deref(), Some("me"));
                assert_eq!(c.password.as_deref(), Some("p@ss"));
                assert_eq!(c.udp, OutboundUdp::Relay);
            }
            other => panic!("{other:?}"),
        }
        // Written back as a table with `type`, read back the same.
        #[derive(Serialize)]
        struct T<'a> {
            outbounds: &'a BTreeMap<String, OutboundConfig>,
        }
        let text = toml::to_string(&T { outbounds: &o }).expect("serialize");
        assert_eq!(outbounds(&text).expect("reparse"), o);
    }

    /// `udp` takes `true`, `false` and `"direct"`, next to a table's fields
    /// and next to `url`, and is written back the same; absent, it relays.
    #[test]
    fn udp_is_relay_refuse_or_direct() {
        let socks = "type = \"socks5\"\nserver = \"192.0.2.1:1080\"";
        let link = "url = \"socks5://192.0.2.1:1080\"";
        for (head, udp, want) in [
            (socks, "", OutboundUdp::Relay),
            (socks, "udp = true", OutboundUdp::Relay),
            (socks, "udp = false", OutboundUdp::Refuse),
            (socks, "udp = \"direct\"", OutboundUdp::Direct),
            (link, "", OutboundUdp::Relay),
            (link, "udp = false", OutboundUdp::Refuse),
            (link, "udp = \"direct\"", OutboundUdp::Direct),
        ] {
            let text = format!("[outbounds.x]\n{head}\n{udp}\n");
            let o = outbounds(&text).expect(&text);
            assert_eq!(o["x"].udp(), want, "{text}");
            #[derive(Serialize)]
            struct T<'a> {
                outbounds: &'a BTreeMap<String, OutboundConfig>,
            }
            let back = toml::to_string(&T { outbounds: &o }).expect("serialize");
            assert_eq!(outbounds(&back).expect(&back), o, "{back}");
        }
        let ss = "type = \"shadowsocks\"\nserver = \"192.0.2.1:8388\"\nmethod = \"none\"";
        let o = outbounds(&format!("[outbounds.x]\n{ss}\nudp = \"direct\"\n")).expect("ss");
        assert_eq!(o["x"].udp(), OutboundUdp::Direct);
        // Anything else is an error that names the field and the choices.
        for bad in ["\"Direct\"", "\"yes\"", "1", "\"\""] {
            let text = format!("[outbounds.x]\n{socks}\nudp = {bad}\n");
            let e = outbounds(&text).expect_err(&text);
            assert!(e.contains("udp"), "{text}: {e}");
            assert!(e.contains("\"direct\""), "{text}: {e}");
            assert!(e.contains("line "), "{text}: {e}");
        }
    }

    #[test]
    fn toml_errors_say_what_is_wrong() {
        for (text, want) in [
            ("url = \"ss://x\"\ntype = \"socks5\"", "only `udp`"),
            ("url = \"ss://none:@h:1/?plugin=obfs\"", "plugin \"obfs\""),
            ("url = \"http://h:1\"", "unknown scheme"),
            ("server = \"h:1\"", "type"),
            ("type = \"socks5\"", "server is needed"),
            ("type = \"socks5\"\nserver = \"h\"", "no port"),
            (
                "type = \"socks5\"\nserver = \"h:1\"\nmethod = \"none\"",
                "not a socks5 field",
            ),
            (
                "type = \"shadowsocks\"\nserver = \"h:1\"",
                "method is needed",
            ),
            (
                "type = \"shadowsocks\"\nserver = \"h:1\"\nmethod = \"none\"\nusername = \"u\"",
                "not a shadowsocks field",
            ),
            ("type = \"socks5\"\nserver = \"h:1\"\ncolour = 1", "colour"),
        ] {
            let e = outbounds(&format!("[outbounds.x]\n{text}\n")).expect_err(text);
            assert!(e.contains(want), "{text}: {e}");
            assert!(e.contains("line "), "{text}: {e}");
        }
    }
}
