//! SOCKS5 client (RFC 1928, RFC 1929): CONNECT and UDP ASSOCIATE, no
//! authentication or username/password, IPv4/IPv6/domain addresses.
//!
//! The message codecs are pure functions over byte slices (a fuzz target can
//! drive them); the async part only reads exactly the bytes each message
//! needs, so after CONNECT nothing of the proxied stream sits in a userspace
//! buffer and the socket can go straight to the splice relay.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::addr::{AddrError, Address};

const VERSION: u8 = 0x05;
const METHOD_NONE: u8 = 0x00;
const METHOD_USERPASS: u8 = 0x02;
const METHOD_REFUSED: u8 = 0xff;
/// RFC 1929: the username/password sub-negotiation has its own version.
const USERPASS_VERSION: u8 = 0x01;

/// The request command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Command {
    Connect = 0x01,
    UdpAssociate = 0x03,
}

/// A proxy's answer or behaviour that ends the handshake. Counted per
/// outbound; the app sees a reset.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Socks5Error {
    /// A message with a version other than 5 (or 1 for the auth reply).
    #[error("bad version {0:#04x} in the proxy's reply")]
    BadVersion(u8),
    /// The proxy accepts none of the offered methods.
    #[error("the proxy accepts none of the offered authentication methods")]
    NoAcceptableMethod,
    /// The proxy chose a method that was not offered.
    #[error("the proxy chose method {0:#04x}, which was not offered")]
    UnexpectedMethod(u8),
    /// Username/password refused (status byte).
    #[error("username/password refused (status {0:#04x})")]
    AuthFailed(u8),
    /// A username or password of 0 or more than 255 bytes.
    #[error("username and password must each be 1..=255 bytes")]
    BadCredentials,
    /// The request failed with this reply code (RFC 1928 section 6).
    #[error("request refused: {}", reply_text(*.0))]
    Refused(u8),
    /// The reserved byte of a reply is not zero.
    #[error("non-zero reserved byte {0:#04x}")]
    BadReserved(u8),
    /// A malformed address in a reply or datagram.
    #[error("address: {0}")]
    Address(#[from] AddrError),
    /// A UDP datagram shorter than its header.
    #[error("truncated UDP datagram")]
    Truncated,
    /// A fragmented UDP datagram (FRAG != 0); fragments are not reassembled.
    #[error("fragmented UDP datagram (frag {0})")]
    Fragmented(u8),
}

/// RFC 1928 section 6 reply codes.
pub fn reply_text(code: u8) -> &'static str {
    match code {
        0x01 => "general SOCKS server failure",
        0x02 => "connection not allowed by ruleset",
        0x03 => "network unreachable",
        0x04 => "host unreachable",
        0x05 => "connection refused",
        0x06 => "TTL expired",
        0x07 => "command not supported",
        0x08 => "address type not supported",
        _ => "unassigned reply code",
    }
}

/// Username/password (RFC 1929).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

/// The method-selection message: no-auth, plus username/password when
/// credentials are configured.
pub fn encode_greeting(with_credentials: bool, out: &mut Vec<u8>) {
    if with_credentials {
        out.extend_from_slice(&[VERSION, 2, METHOD_NONE, METHOD_USERPASS]);
    } else {
        out.extend_from_slice(&[VERSION, 1, METHOD_NONE]);
    }
}

/// The method the proxy chose: `true` for username/password, `false` for none.
pub fn parse_method_choice(reply: [u8; 2], with_credentials: bool) -> Result<bool, Socks5Error> {
    if reply[0] != VERSION {
        return Err(Socks5Error::BadVersion(reply[0]));
    }
    match reply[1] {
        METHOD_NONE => Ok(false),
        METHOD_USERPASS if with_credentials => Ok(true),
        METHOD_REFUSED => Err(Socks5Error::NoAcceptableMethod),
        m => Err(Socks5Error::UnexpectedMethod(m)),
    }
}

/// RFC 1929 request.
pub fn encode_auth(c: &Credentials, out: &mut Vec<u8>) -> Result<(), Socks5Error> {
    let (u, p) = (c.username.as_bytes(), c.password.as_bytes());
    let ulen = u8::try_from(u.len()).map_err(|_| Socks5Error::BadCredentials)?;
    let plen = u8::try_from(p.len()).map_err(|_| Socks5Error::BadCredentials)?;
    if ulen == 0 || plen == 0 {
        return Err(Socks5Error::BadCredentials);
    }
    out.push(USERPASS_VERSION);
    out.push(ulen);
    out.extend_from_slice(u);
    out.push(plen);
    out.extend_from_slice(p);
    Ok(())
}

/// RFC 1929 reply: status 0 is success.
pub fn parse_auth_reply(reply: [u8; 2]) -> Result<(), Socks5Error> {
    if reply[0] != USERPASS_VERSION {
        return Err(Socks5Error::BadVersion(reply[0]));
    }
    match reply[1] {
        0 => Ok(()),
        s => Err(Socks5Error::AuthFailed(s)),
    }
}

/// A CONNECT or UDP ASSOCIATE request.
pub fn encode_request(
    cmd: Command,
    target: &Address,
    out: &mut Vec<u8>,
) -> Result<(), Socks5Error> {
    out.extend_from_slice(&[VERSION, cmd as u8, 0]);
    target.encode(out)?;
    Ok(())
}

/// The first bytes of a reply (VER REP RSV ATYP [domain length]) give its
/// full length; `Ok(None)` asks for more. Checks version, code and reserved
/// byte as soon as they are there, so a refusal is reported without waiting
/// for an address that may never come.
pub fn reply_len(head: &[u8]) -> Result<Option<usize>, Socks5Error> {
    if let Some(&v) = head.first()
        && v != VERSION
    {
        return Err(Socks5Error::BadVersion(v));
    }
    if let Some(&rep) = head.get(1)
        && rep != 0
    {
        return Err(Socks5Error::Refused(rep));
    }
    if let Some(&rsv) = head.get(2)
        && rsv != 0
    {
        return Err(Socks5Error::BadReserved(rsv));
    }
    match head.get(3..) {
        Some(rest) => Ok(Address::wire_len(rest)?.map(|n| 3 + n)),
        None => Ok(None),
    }
}

/// A complete reply: the bound address (where UDP ASSOCIATE wants datagrams).
pub fn parse_reply(buf: &[u8]) -> Result<Option<(Address, usize)>, Socks5Error> {
    let Some(len) = reply_len(buf)? else {
        return Ok(None);
    };
    if buf.len() < len {
        return Ok(None);
    }
    match Address::parse(&buf[3..len])? {
        Some((a, n)) => Ok(Some((a, 3 + n))),
        None => Ok(None),
    }
}

/// The UDP request header (RSV RSV FRAG=0 then the address).
pub fn encode_udp_header(target: &Address, out: &mut Vec<u8>) -> Result<(), Socks5Error> {
    out.extend_from_slice(&[0, 0, 0]);
    target.encode(out)?;
    Ok(())
}

/// A datagram from the relay: the source address and where the payload starts.
pub fn parse_udp(buf: &[u8]) -> Result<(Address, usize), Socks5Error> {
    let Some(head) = buf.get(..3) else {
        return Err(Socks5Error::Truncated);
    };
    if head[2] != 0 {
        return Err(Socks5Error::Fragmented(head[2]));
    }
    match Address::parse(&buf[3..])? {
        Some((a, n)) => Ok((a, 3 + n)),
        None => Err(Socks5Error::Truncated),
    }
}

/// A failed handshake: the socket's error, the proxy's misbehaviour, or time.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Protocol(#[from] Socks5Error),
    #[error("the proxy did not answer within {0:?}")]
    Timeout(Duration),
}

/// Run the handshake for `cmd` on a connected stream and return the bound
/// address of the reply. Reads exactly what each message needs.
pub async fn handshake(
    s: &mut TcpStream,
    creds: Option<&Credentials>,
    cmd: Command,
    target: &Address,
    timeout: Duration,
) -> Result<Address, HandshakeError> {
    match tokio::time::timeout(timeout, handshake_inner(s, creds, cmd, target)).await {
        Ok(r) => r,
        Err(_) => Err(HandshakeError::Timeout(timeout)),
    }
}

async fn handshake_inner(
    s: &mut TcpStream,
    creds: Option<&Credentials>,
    cmd: Command,
    target: &Address,
) -> Result<Address, HandshakeError> {
    let mut msg = Vec::with_capacity(64);
    encode_greeting(creds.is_some(), &mut msg);
    s.write_all(&msg).await?;
    let mut two = [0u8; 2];
    s.read_exact(&mut two).await?;
    if parse_method_choice(two, creds.is_some())? {
        let Some(c) = creds else {
            return Err(Socks5Error::UnexpectedMethod(METHOD_USERPASS).into());
        };
        msg.clear();
        encode_auth(c, &mut msg)?;
        s.write_all(&msg).await?;
        s.read_exact(&mut two).await?;
        parse_auth_reply(two)?;
    }
    msg.clear();
    encode_request(cmd, target, &mut msg)?;
    s.write_all(&msg).await?;
    // VER REP RSV ATYP + the domain length byte (or the first address
    // byte): every reply is at least 8 bytes (a one-byte domain), so reading
    // 5 never reads into the proxied stream. The longest reply is
    // VER REP RSV ATYP LEN + 255 bytes of domain + the port.
    let mut reply = [0u8; 4 + 1 + 255 + 2];
    s.read_exact(&mut reply[..5]).await?;
    let len = match reply_len(&reply[..5])? {
        Some(n) => n,
        None => return Err(Socks5Error::Truncated.into()),
    };
    let Some(rest) = reply.get_mut(5..len) else {
        return Err(Socks5Error::Truncated.into());
    };
    s.read_exact(rest).await?;
    match parse_reply(&reply[..len])? {
        Some((bound, _)) => Ok(bound),
        None => Err(Socks5Error::Truncated.into()),
    }
}

/// Where to send UDP ASSOCIATE datagrams: the bound address of the reply, or
/// the proxy's own address when the reply names the unspecified address (or
/// a domain, which the engine does not resolve).
pub fn udp_relay_addr(bound: &Address, proxy: SocketAddr) -> SocketAddr {
    match bound.canonical_ip() {
        Some(a) if !a.ip().is_unspecified() => a,
        Some(a) => SocketAddr::new(proxy.ip(), a.port()),
        None => proxy,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_choice() {
        assert_eq!(parse_method_choice([5, 0], false), Ok(false));
        assert_eq!(parse_method_choice([5, 2], true), Ok(true));
        assert_eq!(
            parse_method_choice([5, 2], false),
            Err(Socks5Error::UnexpectedMethod(2))
        );
        assert_eq!(
            parse_method_choice([5, 0xff], true),
            Err(Socks5Error::NoAcceptableMethod)
        );
        assert_eq!(
            parse_method_choice([4, 0], true),
            Err(Socks5Error::BadVersion(4))
        );
    }

    #[test]
    fn auth_messages() {
        let c = Credentials {
            username: "u".into(),
            password: "pw".into(),
        };
        let mut out = Vec::new();
        encode_auth(&c, &mut out).expect("encode");
        assert_eq!(out, b"\x01\x01u\x02pw");
        assert_eq!(parse_auth_reply([1, 0]), Ok(()));
        assert_eq!(parse_auth_reply([1, 1]), Err(Socks5Error::AuthFailed(1)));
        assert_eq!(parse_auth_reply([5, 0]), Err(Socks5Error::BadVersion(5)));
        let long = Credentials {
            username: "x".repeat(256),
            password: "p".into(),
        };
        assert_eq!(
            encode_auth(&long, &mut Vec::new()),
            Err(Socks5Error::BadCredentials)
        );
    }

    #[test]
    fn replies() {
        let ok = [5, 0, 0, 1, 127, 0, 0, 1, 0x1f, 0x90, 0xaa];
        assert_eq!(reply_len(&ok[..4]), Ok(Some(10)));
        assert_eq!(
            parse_reply(&ok),
            Ok(Some((
                Address::Ip("127.0.0.1:8080".parse().expect("a")),
                10
            )))
        );
        assert_eq!(parse_reply(&ok[..9]), Ok(None));
        assert_eq!(reply_len(&[5, 5]), Err(Socks5Error::Refused(5)));
        assert_eq!(reply_len(&[5, 0, 1]), Err(Socks5Error::BadReserved(1)));
        assert_eq!(reply_len(&[6]), Err(Socks5Error::BadVersion(6)));
        assert_eq!(
            reply_len(&[5, 0, 0, 7]),
            Err(Socks5Error::Address(AddrError::BadType(7)))
        );
        let dom = b"\x05\x00\x00\x03\x04host\x00\x01";
        assert_eq!(reply_len(&dom[..5]), Ok(Some(dom.len())));
        assert_eq!(
            parse_reply(dom),
            Ok(Some((Address::Domain("host".into(), 1), dom.len())))
        );
    }

    /// A proxy that answers with a 255-byte domain, after garbage-free
    /// method selection: the longest possible reply is read in full.
    #[tokio::test]
    async fn longest_reply_is_read_exactly() {
        use tokio::io::AsyncWriteExt as _;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let name = "d".repeat(255);
        let reply = {
            let mut r = vec![5, 0, 0, 3, 255];
            r.extend_from_slice(name.as_bytes());
            r.extend_from_slice(&[0, 80]);
            r.extend_from_slice(b"stream bytes after the reply");
            r
        };
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.expect("accept");
            let mut b = [0u8; 64];
            let _ = s.read(&mut b).await;
            s.write_all(&[5, 0]).await.expect("method");
            let _ = s.read(&mut b).await;
            s.write_all(&reply).await.expect("reply");
        });
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let target = Address::Ip("1.2.3.4:80".parse().expect("a"));
        let bound = handshake(
            &mut s,
            None,
            Command::Connect,
            &target,
            Duration::from_secs(5),
        )
        .await
        .expect("handshake");
        assert_eq!(bound, Address::Domain(name, 80));
        let mut rest = [0u8; 12];
        s.read_exact(&mut rest).await.expect("rest");
        assert_eq!(
            &rest, b"stream bytes",
            "nothing after the reply was consumed"
        );
    }

    #[test]
    fn udp_datagrams() {
        let a = Address::Ip("[fd00::2]:53".parse().expect("a"));
        let mut d = Vec::new();
        encode_udp_header(&a, &mut d).expect("hdr");
        let off = d.len();
        d.extend_from_slice(b"dns");
        assert_eq!(parse_udp(&d), Ok((a, off)));
        assert_eq!(parse_udp(&[0, 0]), Err(Socks5Error::Truncated));
        assert_eq!(parse_udp(&[0, 0, 1, 1]), Err(Socks5Error::Fragmented(1)));
        assert_eq!(parse_udp(&[0, 0, 0, 1, 1]), Err(Socks5Error::Truncated));
    }

    #[test]
    fn relay_address_falls_back_to_the_proxy() {
        let proxy: SocketAddr = "198.19.1.2:1080".parse().expect("a");
        let unspec = Address::Ip("0.0.0.0:4000".parse().expect("a"));
        assert_eq!(
            udp_relay_addr(&unspec, proxy),
            "198.19.1.2:4000".parse().expect("a")
        );
        let real = Address::Ip("198.19.1.3:4001".parse().expect("a"));
        assert_eq!(
            udp_relay_addr(&real, proxy),
            "198.19.1.3:4001".parse().expect("a")
        );
    }
}
