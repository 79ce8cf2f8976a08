//! Share links for proxies, parsed and written without I/O:
//!
//! - Shadowsocks SIP002, `ss://USERINFO@HOST:PORT[/][?QUERY][#TAG]`. The user
//!   info is base64 of `method:password` (URL-safe or standard alphabet,
//!   padded or not, the padding possibly percent-encoded as `%3D`), or the
//!   plain `method:password` with the password percent-encoded, which is how
//!   AEAD-2022 keys are written (shadowsocks-rust's `ServerConfig::to_url`
//!   does both). A `plugin` query parameter is refused: kerntun runs no
//!   SIP003 plugins, and a link that needs one would not work without it.
//!   Other query parameters are ignored.
//! - The older whole-base64 form, `ss://BASE64(method:password@host:port)[#TAG]`.
//! - `socks5://[USER:PASS@]HOST:PORT[/][#TAG]` (also `socks5h://`: kerntun
//!   hands domains to the proxy whenever it has one either way), with the
//!   user and password percent-decoded.
//!
//! A host is an IPv4 address, a bracketed IPv6 address or a host name. Every
//! input is either a [`Link`] or a [`LinkError`] naming what is wrong; no
//! input panics (the tests at the bottom throw arbitrary strings at it).
//! Errors never repeat a password or key, so they can be logged.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use base64::Engine as _;
use base64::alphabet;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};

use super::addr::Address;
use super::config::ShadowsocksMethod;
use super::shadowsocks::Key;

/// Longest host name (RFC 1035 section 2.3.4: 255 octets on the wire, which
/// is 253 characters written out without the trailing dot).
const MAX_NAME: usize = 253;

/// A parsed share link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Link {
    Shadowsocks(ShadowsocksLink),
    Socks5(Socks5Link),
}

/// A Shadowsocks server from an `ss://` link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShadowsocksLink {
    pub server: Address,
    pub method: ShadowsocksMethod,
    /// The password (AEAD-2017), the base64 key (AEAD-2022), or empty (`none`).
    pub password: String,
    /// The `#fragment`, percent-decoded: the name the link's author gave it.
    pub tag: Option<String>,
}

/// A SOCKS5 proxy from a `socks5://` link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Socks5Link {
    pub server: Address,
    /// Username and password (RFC 1929), both or neither, 1..=255 bytes each.
    pub credentials: Option<(String, String)>,
    pub tag: Option<String>,
}

/// Why a string is not a usable share link.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// No `scheme://` in front.
    #[error("not a link: expected ss://... or socks5://...")]
    NotALink,
    /// A scheme other than `ss`, `socks5`, `socks5h`.
    #[error("unknown scheme {0:?}: expected ss or socks5")]
    UnknownScheme(String),
    /// Nothing where `host:port` should be.
    #[error("no host:port")]
    MissingServer,
    /// The host is neither an IP address nor a host name (the reason says
    /// which character or part is wrong).
    #[error("host: {0}")]
    BadHost(String),
    /// `host` without `:port`.
    #[error("no port after the host")]
    MissingPort,
    /// The port is not a number in 1..=65535.
    #[error("port: a number in 1..=65535 was expected")]
    BadPort,
    /// Something other than `/` between `host:port` and `?` or `#`.
    #[error("unexpected path after host:port")]
    UnexpectedPath,
    /// A `%` not followed by two hex digits.
    #[error("{0}: bad percent-encoding")]
    BadPercent(&'static str),
    /// Decoded bytes that are not UTF-8.
    #[error("{0} is not UTF-8")]
    NotUtf8(&'static str),
    /// `ss://` without `method:password` (base64 or plain) before `@`.
    #[error("user info: expected base64 of method:password, or method:password percent-encoded")]
    BadUserInfo,
    /// The body of a whole-base64 `ss://` link does not decode to
    /// `method:password@host:port`.
    #[error("not base64 of method:password@host:port")]
    BadLegacy,
    /// A Shadowsocks method kerntun does not implement.
    #[error(
        "unsupported method {0:?} (none, aes-128-gcm, aes-256-gcm, chacha20-ietf-poly1305, 2022-blake3-aes-128-gcm, 2022-blake3-aes-256-gcm)"
    )]
    UnknownMethod(String),
    /// A SIP003 plugin is required by the link.
    #[error("plugin {0:?}: kerntun has no Shadowsocks plugin support; use a link without one")]
    Plugin(String),
    /// The password is not a key for the method (AEAD-2022 keys are base64
    /// of the method's key length), or is empty for an encrypting method.
    #[error("password: {0}")]
    BadKey(String),
    /// Half a credential pair, or one of 0 or more than 255 bytes.
    #[error("socks5 user and password go together, 1..=255 bytes each")]
    BadCredentials,
}

/// Shadowsocks method names as links and shadowsocks-rust write them; the
/// same strings as the TOML names of [`ShadowsocksMethod`] (a test checks).
const METHODS: [(&str, ShadowsocksMethod); 6] = [
    ("none", ShadowsocksMethod::None),
    ("aes-128-gcm", ShadowsocksMethod::Aes128Gcm),
    ("aes-256-gcm", ShadowsocksMethod::Aes256Gcm),
    (
        "chacha20-ietf-poly1305",
        ShadowsocksMethod::Chacha20IetfPoly1305,
    ),
    (
        "2022-blake3-aes-128-gcm",
        ShadowsocksMethod::Blake3Aes128Gcm,
    ),
    (
        "2022-blake3-aes-256-gcm",
        ShadowsocksMethod::Blake3Aes256Gcm,
    ),
];

/// A method by the name a link or a config uses (`plain` is `none`).
pub fn method_from_name(name: &str) -> Option<ShadowsocksMethod> {
    if name.eq_ignore_ascii_case("plain") {
        return Some(ShadowsocksMethod::None);
    }
    METHODS
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, m)| *m)
}

/// The name of a method in links.
pub fn method_name(m: ShadowsocksMethod) -> &'static str {
    METHODS
        .iter()
        .find(|(_, x)| *x == m)
        .map_or("none", |(n, _)| n)
}

fn is_2022(m: ShadowsocksMethod) -> bool {
    matches!(
        m,
        ShadowsocksMethod::Blake3Aes128Gcm | ShadowsocksMethod::Blake3Aes256Gcm
    )
}

impl Link {
    /// Parse a share link (surrounding whitespace is ignored).
    pub fn parse(s: &str) -> Result<Link, LinkError> {
        let s = s.trim();
        let (scheme, rest) = s.split_once("://").ok_or(LinkError::NotALink)?;
        // The fragment comes last and neither base64 nor a percent-encoded
        // field contains '#'.
        let (rest, tag) = match rest.split_once('#') {
            Some((r, t)) => (r, decode_tag(t)?),
            None => (rest, None),
        };
        if scheme.eq_ignore_ascii_case("ss") {
            parse_ss(rest, tag).map(Link::Shadowsocks)
        } else if scheme.eq_ignore_ascii_case("socks5") || scheme.eq_ignore_ascii_case("socks5h") {
            parse_socks5(rest, tag).map(Link::Socks5)
        } else {
            Err(LinkError::UnknownScheme(scheme.chars().take(16).collect()))
        }
    }

    /// The server the link names.
    pub fn server(&self) -> &Address {
        match self {
            Link::Shadowsocks(l) => &l.server,
            Link::Socks5(l) => &l.server,
        }
    }

    /// The link's `#tag`, if it has one.
    pub fn tag(&self) -> Option<&str> {
        match self {
            Link::Shadowsocks(l) => l.tag.as_deref(),
            Link::Socks5(l) => l.tag.as_deref(),
        }
    }

    /// The link in the form [`Link::parse`] reads back: SIP002 with base64
    /// (URL-safe, unpadded) user info for AEAD-2017 and `none`, and with the
    /// plain percent-encoded form for AEAD-2022, as shadowsocks-rust writes
    /// them.
    pub fn to_url(&self) -> String {
        let mut out = String::new();
        let tag = match self {
            Link::Shadowsocks(l) => {
                let method = method_name(l.method);
                out.push_str("ss://");
                if is_2022(l.method) {
                    out.push_str(method);
                    out.push(':');
                    percent_encode(&l.password, &mut out);
                } else {
                    let userinfo = format!("{method}:{}", l.password);
                    out.push_str(
                        &base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(userinfo),
                    );
                }
                out.push('@');
                write_server(&l.server, &mut out);
                &l.tag
            }
            Link::Socks5(l) => {
                out.push_str("socks5://");
                if let Some((u, p)) = &l.credentials {
                    percent_encode(u, &mut out);
                    out.push(':');
                    percent_encode(p, &mut out);
                    out.push('@');
                }
                write_server(&l.server, &mut out);
                &l.tag
            }
        };
        if let Some(t) = tag {
            out.push('#');
            percent_encode(t, &mut out);
        }
        out
    }
}

impl std::str::FromStr for Link {
    type Err = LinkError;
    fn from_str(s: &str) -> Result<Link, LinkError> {
        Link::parse(s)
    }
}

fn decode_tag(t: &str) -> Result<Option<String>, LinkError> {
    let t = percent_decode(t, "tag")?;
    Ok((!t.is_empty()).then_some(t))
}

fn parse_ss(rest: &str, tag: Option<String>) -> Result<ShadowsocksLink, LinkError> {
    let (main, query) = match rest.split_once('?') {
        Some((m, q)) => (m, Some(q)),
        None => (rest, None),
    };
    for pair in query.into_iter().flat_map(|q| q.split('&')) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if percent_decode(k, "query")? == "plugin" {
            let v = percent_decode(v, "plugin")?;
            // SIP003: `name;opt=value;...`; the options may hold secrets.
            let name = v.split(';').next().unwrap_or_default().trim();
            if !name.is_empty() {
                return Err(LinkError::Plugin(name.chars().take(64).collect()));
            }
        }
    }
    let main = main.strip_suffix('/').unwrap_or(main);
    // The last '@' separates the user info from the host: a password that
    // should have been percent-encoded may still hold one.
    let (method, password, server) = match main.rsplit_once('@') {
        Some((userinfo, hostport)) => {
            let (m, p) = decode_userinfo(userinfo)?;
            (m, p, parse_server(hostport)?)
        }
        None => {
            if main.is_empty() {
                return Err(LinkError::MissingServer);
            }
            let body = decode_base64(&percent_decode(main, "link")?).ok_or(LinkError::BadLegacy)?;
            let body = String::from_utf8(body).map_err(|_| LinkError::NotUtf8("link"))?;
            let (mp, hostport) = body.trim().rsplit_once('@').ok_or(LinkError::BadLegacy)?;
            let (m, p) = mp.split_once(':').ok_or(LinkError::BadLegacy)?;
            (m.to_owned(), p.to_owned(), parse_server(hostport)?)
        }
    };
    let m = method_from_name(&method)
        .ok_or_else(|| LinkError::UnknownMethod(method.chars().take(40).collect()))?;
    if m != ShadowsocksMethod::None && password.is_empty() {
        return Err(LinkError::BadKey("empty".into()));
    }
    Key::new(m, &password).map_err(|e| LinkError::BadKey(e.to_string()))?;
    Ok(ShadowsocksLink {
        server,
        method: m,
        password,
        tag,
    })
}

/// SIP002 user info: plain `method:password` (each percent-encoded) when it
/// holds a ':', which base64 never does; else base64 of `method:password`.
fn decode_userinfo(u: &str) -> Result<(String, String), LinkError> {
    if let Some((m, p)) = u.split_once(':') {
        return Ok((percent_decode(m, "method")?, percent_decode(p, "password")?));
    }
    // Python's URL-safe base64 keeps its '=' padding, which some encoders
    // then percent-encode.
    let plain = percent_decode(u, "user info")?;
    let bytes = decode_base64(&plain).ok_or(LinkError::BadUserInfo)?;
    let s = String::from_utf8(bytes).map_err(|_| LinkError::NotUtf8("user info"))?;
    let (m, p) = s.split_once(':').ok_or(LinkError::BadUserInfo)?;
    Ok((m.to_owned(), p.to_owned()))
}

fn parse_socks5(rest: &str, tag: Option<String>) -> Result<Socks5Link, LinkError> {
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (credentials, hostport) = match rest.rsplit_once('@') {
        Some((userinfo, hostport)) => {
            let (u, p) = userinfo.split_once(':').ok_or(LinkError::BadCredentials)?;
            let u = percent_decode(u, "user")?;
            let p = percent_decode(p, "password")?;
            if !(1..=255).contains(&u.len()) || !(1..=255).contains(&p.len()) {
                return Err(LinkError::BadCredentials);
            }
            (Some((u, p)), hostport)
        }
        None => (None, rest),
    };
    Ok(Socks5Link {
        server: parse_server(hostport)?,
        credentials,
        tag,
    })
}

/// `HOST:PORT` where HOST is an IPv4 address, `[IPv6]` or a host name
/// (lower-cased, a trailing dot dropped). Also what `server = "..."` in the
/// TOML is read with.
pub fn parse_server(s: &str) -> Result<Address, LinkError> {
    if s.is_empty() {
        return Err(LinkError::MissingServer);
    }
    if s.contains(['/', '?']) {
        return Err(LinkError::UnexpectedPath);
    }
    if let Some(v6) = s.strip_prefix('[') {
        let (ip, port) = v6
            .split_once(']')
            .ok_or_else(|| LinkError::BadHost("'[' without ']'".into()))?;
        let ip: Ipv6Addr = ip
            .parse()
            .map_err(|_| LinkError::BadHost("not an IPv6 address inside [...]".into()))?;
        let port = port.strip_prefix(':').ok_or(LinkError::MissingPort)?;
        return Ok(Address::Ip(SocketAddr::new(
            IpAddr::V6(ip),
            parse_port(port)?,
        )));
    }
    let (host, port) = s.rsplit_once(':').ok_or(LinkError::MissingPort)?;
    if host.contains(':') {
        return Err(LinkError::BadHost(
            "an IPv6 address goes in brackets: [2001:db8::1]:port".into(),
        ));
    }
    let port = parse_port(port)?;
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(Address::Ip(SocketAddr::new(ip, port)));
    }
    Ok(Address::Domain(check_host_name(host)?, port))
}

fn parse_port(p: &str) -> Result<u16, LinkError> {
    if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
        return Err(LinkError::BadPort);
    }
    match p.parse::<u16>() {
        Ok(0) | Err(_) => Err(LinkError::BadPort),
        Ok(n) => Ok(n),
    }
}

/// A host name: labels of ASCII letters, digits, `-` and `_`, 1..=63
/// characters each, at most 253 in all, the last one not all digits (then
/// it was meant as an IPv4 address). Internationalized names go in punycode.
pub fn check_host_name(host: &str) -> Result<String, LinkError> {
    let n = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    if n.is_empty() {
        return Err(LinkError::BadHost("empty".into()));
    }
    if n.len() > MAX_NAME {
        return Err(LinkError::BadHost(format!(
            "a host name has at most {MAX_NAME} characters"
        )));
    }
    for label in n.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(LinkError::BadHost(
                "empty or over-long (>63) label in a host name".into(),
            ));
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            return Err(LinkError::BadHost(format!(
                "{c:?} is not allowed in a host name (letters, digits, '-', '_'; IDNs in punycode)"
            )));
        }
    }
    if n.rsplit('.')
        .next()
        .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(LinkError::BadHost(
            "neither an IP address nor a host name (the last label is all digits)".into(),
        ));
    }
    Ok(n)
}

fn write_server(a: &Address, out: &mut String) {
    // `SocketAddr` writes IPv6 in brackets, and `Address::Domain` is a
    // checked name: both are valid URL authorities.
    let _ = write!(out, "{a}");
}

/// Base64 in either alphabet, with or without padding.
fn decode_base64(s: &str) -> Option<Vec<u8>> {
    const CFG: GeneralPurposeConfig =
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
    const URL: GeneralPurpose = GeneralPurpose::new(&alphabet::URL_SAFE, CFG);
    const STD: GeneralPurpose = GeneralPurpose::new(&alphabet::STANDARD, CFG);
    URL.decode(s).or_else(|_| STD.decode(s)).ok()
}

/// Decode `%XX` escapes (a '+' stays a '+': user info and fragments are not
/// form data). The result must be UTF-8.
fn percent_decode(s: &str, field: &'static str) -> Result<String, LinkError> {
    if !s.contains('%') {
        return Ok(s.to_owned());
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        if c == b'%' {
            let hex = |j: usize| {
                b.get(j)
                    .and_then(|h| char::from(*h).to_digit(16))
                    .ok_or(LinkError::BadPercent(field))
            };
            let v = hex(i + 1)? * 16 + hex(i + 2)?;
            out.push(u8::try_from(v).map_err(|_| LinkError::BadPercent(field))?);
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| LinkError::NotUtf8(field))
}

/// Everything but RFC 3986 unreserved characters as `%XX`.
fn percent_encode(s: &str, out: &mut String) {
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KEY32: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

    fn ss(l: &Link) -> &ShadowsocksLink {
        match l {
            Link::Shadowsocks(s) => s,
            Link::Socks5(_) => panic!("not ss: {l:?}"),
        }
    }

    fn socks(l: &Link) -> &Socks5Link {
        match l {
            Link::Socks5(s) => s,
            Link::Shadowsocks(_) => panic!("not socks5: {l:?}"),
        }
    }

    fn sa(s: &str) -> Address {
        Address::Ip(s.parse().expect("socket address"))
    }

    #[test]
    fn sip002_base64_forms() {
        // base64("aes-256-gcm:pa?ss/word>") holds '_' and '-' in the
        // URL-safe alphabet, '/' and '+' in the standard one.
        let userinfo = "aes-256-gcm:pa?ss/word>";
        let url_safe = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(userinfo);
        let std_pad = base64::engine::general_purpose::STANDARD.encode(userinfo);
        assert!(std_pad.contains(['/', '+']) && url_safe.contains(['_', '-']));
        let pct_pad = std_pad.replace('=', "%3D");
        for u in [&url_safe, &std_pad, &pct_pad] {
            let l =
                Link::parse(&format!("ss://{u}@198.51.100.7:8388/?group=x#My%20Server")).expect(u);
            let s = ss(&l);
            assert_eq!(s.method, ShadowsocksMethod::Aes256Gcm);
            assert_eq!(s.password, "pa?ss/word>");
            assert_eq!(s.server, sa("198.51.100.7:8388"));
            assert_eq!(s.tag.as_deref(), Some("My Server"));
        }
    }

    #[test]
    fn sip002_plain_2022_and_hosts() {
        let enc = KEY32
            .replace('/', "%2F")
            .replace('+', "%2B")
            .replace('=', "%3D");
        let l = Link::parse(&format!(
            "ss://2022-blake3-aes-256-gcm:{enc}@[2001:db8::5]:443"
        ))
        .expect("2022");
        let s = ss(&l);
        assert_eq!(s.method, ShadowsocksMethod::Blake3Aes256Gcm);
        assert_eq!(s.password, KEY32);
        assert_eq!(s.server, sa("[2001:db8::5]:443"));
        assert_eq!(s.tag, None);
        // A host name, lower-cased, its trailing dot dropped.
        let l = Link::parse(&format!(
            "  ss://2022-blake3-aes-256-gcm:{KEY32}@SS.Example.COM.:8388  "
        ))
        .expect("name");
        assert_eq!(
            ss(&l).server,
            Address::Domain("ss.example.com".into(), 8388)
        );
        // `none` needs no password.
        let l = Link::parse("ss://none:@10.0.0.1:1").expect("none");
        assert_eq!(ss(&l).method, ShadowsocksMethod::None);
        let l = Link::parse("SS://plain:x@10.0.0.1:1").expect("plain");
        assert_eq!(ss(&l).method, ShadowsocksMethod::None);
    }

    #[test]
    fn legacy_whole_base64() {
        let body = base64::engine::general_purpose::STANDARD
            .encode("chacha20-ietf-poly1305:p@ss:w@ss.example.org:8389");
        let l = Link::parse(&format!("ss://{body}#legacy")).expect("legacy");
        let s = ss(&l);
        assert_eq!(s.method, ShadowsocksMethod::Chacha20IetfPoly1305);
        assert_eq!(s.password, "p@ss:w");
        assert_eq!(s.server, Address::Domain("ss.example.org".into(), 8389));
        assert_eq!(s.tag.as_deref(), Some("legacy"));
        let bad = base64::engine::general_purpose::STANDARD.encode("no at sign");
        assert_eq!(
            Link::parse(&format!("ss://{bad}")),
            Err(LinkError::BadLegacy)
        );
        assert_eq!(Link::parse("ss://!!!"), Err(LinkError::BadLegacy));
    }

    #[test]
    fn socks5_links() {
        let l = Link::parse("socks5://me%40corp:p%3As%2Fs@proxy.corp:1080/#corp").expect("auth");
        let s = socks(&l);
        assert_eq!(
            s.credentials,
            Some(("me@corp".to_owned(), "p:s/s".to_owned()))
        );
        assert_eq!(s.server, Address::Domain("proxy.corp".into(), 1080));
        assert_eq!(s.tag.as_deref(), Some("corp"));
        let l = Link::parse("socks5h://127.0.0.1:1080").expect("no auth");
        assert_eq!(socks(&l).credentials, None);
        assert_eq!(socks(&l).server, sa("127.0.0.1:1080"));
        for bad in ["socks5://user@h:1", "socks5://:p@h:1", "socks5://u:@h:1"] {
            assert_eq!(Link::parse(bad), Err(LinkError::BadCredentials), "{bad}");
        }
        let long = "u".repeat(256);
        assert_eq!(
            Link::parse(&format!("socks5://{long}:p@h:1")),
            Err(LinkError::BadCredentials)
        );
    }

    #[test]
    fn errors_name_the_problem() {
        let cases: &[(&str, LinkError)] = &[
            ("", LinkError::NotALink),
            ("example.com:80", LinkError::NotALink),
            ("http://x:1", LinkError::UnknownScheme("http".into())),
            ("socks5://", LinkError::MissingServer),
            ("socks5://host", LinkError::MissingPort),
            ("socks5://host:", LinkError::BadPort),
            ("socks5://host:0", LinkError::BadPort),
            ("socks5://host:65536", LinkError::BadPort),
            ("socks5://host:+80", LinkError::BadPort),
            ("socks5://host:80/path", LinkError::UnexpectedPath),
            (
                "socks5://[::1:80",
                LinkError::BadHost("'[' without ']'".into()),
            ),
            ("socks5://[::1]80", LinkError::MissingPort),
            ("ss://none:@:1", LinkError::BadHost("empty".into())),
            ("ss://aes-256-gcm:@h:1", LinkError::BadKey("empty".into())),
            (
                "ss://rc4-md5:x@h:1",
                LinkError::UnknownMethod("rc4-md5".into()),
            ),
            ("ss://a%zz:x@h:1", LinkError::BadPercent("method")),
            ("ss://none:%ff@h:1", LinkError::NotUtf8("password")),
            ("ss://none:@h:1#%", LinkError::BadPercent("tag")),
            ("ss://$$$@h:1", LinkError::BadUserInfo),
            ("ss://@h:1", LinkError::BadUserInfo),
        ];
        for (link, want) in cases {
            assert_eq!(Link::parse(link).as_ref(), Err(want), "{link}");
        }
        let e = Link::parse("socks5://2001:db8::1:1080").expect_err("bare v6");
        assert!(e.to_string().contains("brackets"), "{e}");
        let e = Link::parse("socks5://1.2.3.256:1").expect_err("not ipv4");
        assert!(e.to_string().contains("all digits"), "{e}");
        let e = Link::parse("socks5://a b:1").expect_err("space");
        assert!(e.to_string().contains("' '"), "{e}");
        let e = Link::parse(&format!("socks5://{}.com:1", "a".repeat(64))).expect_err("label");
        assert!(e.to_string().contains("63"), "{e}");
        // A 2022 key of the wrong length: the key's problem, not the key.
        let e = Link::parse("ss://2022-blake3-aes-256-gcm:c2hvcnQ=@h:1").expect_err("short");
        assert!(matches!(e, LinkError::BadKey(_)), "{e:?}");
        assert!(e.to_string().contains("32-byte"), "{e}");
        assert!(!e.to_string().contains("c2hvcnQ"), "no key material: {e}");
    }

    #[test]
    fn plugins_are_refused_by_name_only() {
        let u = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("aes-128-gcm:secret");
        let e = Link::parse(&format!(
            "ss://{u}@h.example:8388/?plugin=obfs-local%3Bobfs%3Dhttp%3Bobfs-host%3Dsecret.example#t"
        ))
        .expect_err("plugin");
        assert_eq!(e, LinkError::Plugin("obfs-local".into()));
        let msg = e.to_string();
        assert!(
            msg.contains("obfs-local") && msg.contains("plugin"),
            "{msg}"
        );
        assert!(!msg.contains("secret"), "plugin options stay out: {msg}");
        // An empty plugin parameter asks for nothing.
        assert!(Link::parse(&format!("ss://{u}@h.example:8388/?plugin=")).is_ok());
    }

    #[test]
    fn method_names_match_the_toml_names() {
        #[derive(serde::Deserialize)]
        struct M {
            m: ShadowsocksMethod,
        }
        for (name, m) in METHODS {
            let parsed: M = toml::from_str(&format!("m = \"{name}\"")).expect(name);
            assert_eq!(parsed.m, m, "{name}");
            assert_eq!(method_from_name(name), Some(m));
            assert_eq!(method_name(m), name);
        }
        assert_eq!(method_from_name("PLAIN"), Some(ShadowsocksMethod::None));
        assert_eq!(method_from_name("aes-256-cfb"), None);
    }

    #[test]
    fn round_trips() {
        let links = [
            Link::Shadowsocks(ShadowsocksLink {
                server: Address::Domain("ss.example.com".into(), 8388),
                method: ShadowsocksMethod::Blake3Aes256Gcm,
                password: KEY32.into(),
                tag: Some("Tokyo #1 / 東京".into()),
            }),
            Link::Shadowsocks(ShadowsocksLink {
                server: sa("[2001:db8::1]:443"),
                method: ShadowsocksMethod::Chacha20IetfPoly1305,
                password: "p@ss:w/rd#?%".into(),
                tag: None,
            }),
            Link::Shadowsocks(ShadowsocksLink {
                server: sa("203.0.113.7:8389"),
                method: ShadowsocksMethod::None,
                password: String::new(),
                tag: None,
            }),
            Link::Socks5(Socks5Link {
                server: Address::Domain("proxy.corp".into(), 1080),
                credentials: Some(("me@corp".into(), "p:s/s#?%".into())),
                tag: Some("corp".into()),
            }),
            Link::Socks5(Socks5Link {
                server: sa("[::1]:1080"),
                credentials: None,
                tag: None,
            }),
        ];
        for l in links {
            let url = l.to_url();
            assert_eq!(Link::parse(&url).as_ref(), Ok(&l), "{url}");
        }
    }

    /// Interop: links written by shadowsocks-rust's own encoder parse to the
    /// same server, method and key, and ours parse there.
    #[test]
    fn shadowsocks_rust_links() {
        use shadowsocks_service::shadowsocks::config::{ServerAddr, ServerConfig};
        use shadowsocks_service::shadowsocks::crypto::CipherKind;
        let cases = [
            (
                CipherKind::AES_256_GCM,
                ShadowsocksMethod::Aes256Gcm,
                "correct horse/battery+staple",
            ),
            (
                CipherKind::CHACHA20_POLY1305,
                ShadowsocksMethod::Chacha20IetfPoly1305,
                "pässwörd",
            ),
            (
                CipherKind::AEAD2022_BLAKE3_AES_256_GCM,
                ShadowsocksMethod::Blake3Aes256Gcm,
                KEY32,
            ),
            (
                CipherKind::AEAD2022_BLAKE3_AES_128_GCM,
                ShadowsocksMethod::Blake3Aes128Gcm,
                "AAECAwQFBgcICQoLDA0ODw==",
            ),
        ];
        let servers = [
            ServerAddr::DomainName("ss.example.com".into(), 8388),
            ServerAddr::SocketAddr("[2001:db8::7]:443".parse().expect("addr")),
            ServerAddr::SocketAddr("203.0.113.9:8389".parse().expect("addr")),
        ];
        for (kind, method, password) in cases {
            for server in &servers {
                let mut theirs =
                    ServerConfig::new(server.clone(), password, kind).expect("their config");
                theirs.set_remarks("Node A/1");
                let url = theirs.to_url();
                let ours = Link::parse(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
                let s = ss(&ours);
                assert_eq!(s.method, method, "{url}");
                assert_eq!(s.password, password, "{url}");
                assert_eq!(s.tag.as_deref(), Some("Node A/1"), "{url}");
                match (server, &s.server) {
                    (ServerAddr::DomainName(n, p), Address::Domain(m, q)) => {
                        assert_eq!((n, p), (m, q), "{url}");
                    }
                    (ServerAddr::SocketAddr(a), Address::Ip(b)) => assert_eq!(a, b, "{url}"),
                    (a, b) => panic!("{url}: {a:?} vs {b:?}"),
                }
                let key = Key::new(method, &s.password).expect("key");
                assert_eq!(key.bytes(), theirs.key(), "same key: {url}");
                // Theirs reads ours back to the same server, method and key.
                let back = ServerConfig::from_url(&ours.to_url()).expect("they parse ours");
                assert_eq!(back.method(), kind);
                assert_eq!(back.key(), theirs.key());
                assert_eq!(back.addr(), theirs.addr());
                // Their older QR-code form (whole base64) parses too.
                let qr = ServerConfig::new(server.clone(), password, kind)
                    .expect("config")
                    .to_qrcode_url();
                let l = Link::parse(&qr).unwrap_or_else(|e| panic!("{qr}: {e}"));
                assert_eq!(
                    (ss(&l).method, ss(&l).password.as_str()),
                    (method, password)
                );
            }
        }
    }

    fn any_method() -> impl Strategy<Value = ShadowsocksMethod> {
        prop::sample::select(METHODS.map(|(_, m)| m).to_vec())
    }

    fn any_server() -> impl Strategy<Value = Address> {
        prop_oneof![
            any::<(std::net::Ipv4Addr, u16)>()
                .prop_map(|(ip, p)| Address::Ip(SocketAddr::new(IpAddr::V4(ip), p.max(1)))),
            any::<(std::net::Ipv6Addr, u16)>()
                .prop_map(|(ip, p)| Address::Ip(SocketAddr::new(IpAddr::V6(ip), p.max(1)))),
            (
                "[a-z0-9-]{1,20}(\\.[a-z0-9_-]{1,20}){0,3}\\.[a-z][a-z0-9]{0,5}",
                1u16..
            )
                .prop_map(|(n, p)| Address::Domain(n, p)),
        ]
    }

    fn key_for(m: ShadowsocksMethod, seed: &[u8; 32], text: &str) -> String {
        match m {
            ShadowsocksMethod::None => String::new(),
            ShadowsocksMethod::Blake3Aes128Gcm => {
                base64::engine::general_purpose::STANDARD.encode(&seed[..16])
            }
            ShadowsocksMethod::Blake3Aes256Gcm => {
                base64::engine::general_purpose::STANDARD.encode(seed)
            }
            _ => format!("x{text}"),
        }
    }

    proptest! {
        /// No string panics the parser, and whatever parses writes back to
        /// a link that parses to the same thing.
        #[test]
        fn arbitrary_strings_never_panic(s in "\\PC{0,80}") {
            for prefix in ["", "ss://", "socks5://", "ss://none:@", "socks5://u:p@"] {
                if let Ok(l) = Link::parse(&format!("{prefix}{s}")) {
                    prop_assert_eq!(Link::parse(&l.to_url()), Ok(l));
                }
            }
        }

        /// Link-shaped noise: the characters links are made of.
        #[test]
        fn link_shaped_noise_never_panics(s in "[a-zA-Z0-9:@/?#%=&\\[\\]._+-]{0,60}") {
            for prefix in ["ss://", "socks5://"] {
                if let Ok(l) = Link::parse(&format!("{prefix}{s}")) {
                    prop_assert_eq!(Link::parse(&l.to_url()), Ok(l));
                }
            }
        }

        #[test]
        fn ss_round_trip(
            server in any_server(),
            method in any_method(),
            seed in any::<[u8; 32]>(),
            text in "\\PC{0,24}",
            tag in proptest::option::of("\\PC{1,24}"),
        ) {
            let l = Link::Shadowsocks(ShadowsocksLink {
                server,
                method,
                password: key_for(method, &seed, &text),
                tag,
            });
            prop_assert_eq!(Link::parse(&l.to_url()), Ok(l));
        }

        #[test]
        fn socks5_round_trip(
            server in any_server(),
            creds in proptest::option::of(("\\PC{1,40}", "\\PC{1,40}")),
            tag in proptest::option::of("\\PC{1,24}"),
        ) {
            let l = Link::Socks5(Socks5Link { server, credentials: creds, tag });
            prop_assert_eq!(Link::parse(&l.to_url()), Ok(l));
        }
    }
}
