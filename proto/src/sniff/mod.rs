//! Reading the domain a connection is for from its first bytes (TLS
//! ClientHello SNI, HTTP/1 Host) so domain rules apply to connections made to
//! real addresses; [`quic`] reads the same ClientHello out of a QUIC
//! client's Initial packets.
//!
//! [`sniff`] is sans-I/O: the caller peeks at what the app has sent so far
//! (without consuming it) and calls again with more bytes on
//! [`Sniffed::NeedMore`]. Every answer other than `NeedMore` is final: more
//! bytes never change it (the fuzz target checks exactly that). The scan
//! stops at [`MAX_SNIFF`] bytes, so a client that trickles a huge or endless
//! hello costs a bounded wait, not memory.
//!
//! Names are returned as they appear on the wire (no allocation): not
//! lower-cased, a trailing dot kept. Rule matching is case-insensitive and
//! ignores a trailing dot, so they can be passed on unchanged. A name is only
//! returned when it looks like a DNS name: 1..=253 bytes, labels of 1..=63
//! bytes of ASCII letters, digits, `-` and `_`, and not an IP address
//! literal (an HTTP `Host: 192.0.2.1` names no domain).

/// The most bytes [`sniff`] looks at. A ClientHello is a few hundred bytes
/// to ~2 KiB (post-quantum key shares included), and an HTTP request head
/// rarely passes 8 KiB (many servers' limit); past 16 KiB the connection is
/// routed by its address.
pub const MAX_SNIFF: usize = 16 * 1024;

pub mod quic;

/// Which protocol a name was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sniffer {
    /// The `server_name` extension of a TLS ClientHello.
    Tls,
    /// The `Host` header of an HTTP/1.x request.
    Http,
    /// The `server_name` of the ClientHello in a QUIC client's Initial
    /// packets ([`quic::QuicSniffer`]).
    Quic,
}

/// What the first bytes of a connection say about its domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sniffed<'a> {
    /// A domain, as sent (see the module doc for what is checked).
    Domain { proto: Sniffer, name: &'a str },
    /// A ClientHello or request head that is not complete yet.
    NeedMore,
    /// Not TLS or HTTP/1, no name in it, or a malformed one. Final.
    NoDomain,
}

/// Read the domain from a connection's first bytes (everything received so
/// far, from the first byte on). Never panics, never allocates.
pub fn sniff(first_bytes: &[u8]) -> Sniffed<'_> {
    let capped = first_bytes.len() >= MAX_SNIFF;
    let b = first_bytes.get(..MAX_SNIFF).unwrap_or(first_bytes);
    let r = match b.first() {
        None => Sniffed::NeedMore,
        Some(&TLS_HANDSHAKE) => tls::sniff(b),
        Some(_) => http::sniff(b),
    };
    match r {
        // The hello or head would run past the cap: give up on it.
        Sniffed::NeedMore if capped => Sniffed::NoDomain,
        r => r,
    }
}

/// TLS record content type `handshake` (RFC 8446 section 5.1).
const TLS_HANDSHAKE: u8 = 22;

/// Whether `name` (without a trailing dot) looks like a DNS name and is not
/// an address literal.
fn valid_name(name: &[u8]) -> bool {
    let name = name.strip_suffix(b".").unwrap_or(name);
    if name.is_empty() || name.len() > 253 {
        return false;
    }
    for label in name.split(|&c| c == b'.') {
        if label.is_empty()
            || label.len() > 63
            || !label
                .iter()
                .all(|&c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        {
            return false;
        }
    }
    // All ASCII by now; an IPv4 literal is an address, not a domain (IPv6
    // literals already failed on ':').
    std::str::from_utf8(name).is_ok_and(|s| s.parse::<std::net::Ipv4Addr>().is_err())
}

/// `name` as a `&str` if it is a valid one.
fn checked(proto: Sniffer, name: &[u8]) -> Sniffed<'_> {
    if !valid_name(name) {
        return Sniffed::NoDomain;
    }
    match std::str::from_utf8(name) {
        Ok(name) => Sniffed::Domain { proto, name },
        Err(_) => Sniffed::NoDomain,
    }
}

/// The SNI of a ClientHello (RFC 8446 section 4.1.2, RFC 6066 section 3),
/// which may arrive split over several records.
mod tls {
    use super::{Sniffed, Sniffer, TLS_HANDSHAKE, checked};

    /// Largest plaintext record (RFC 8446 section 5.1: 2^14).
    const MAX_RECORD: usize = 1 << 14;
    /// Handshake type `client_hello`.
    const CLIENT_HELLO: u8 = 1;
    /// Extension type `server_name`.
    const SERVER_NAME: u16 = 0;
    /// `NameType` `host_name`.
    const HOST_NAME: u8 = 0;

    /// Why the walk stopped short of a name.
    enum Stop {
        /// The bytes end before the hello does.
        More,
        /// Not a ClientHello, malformed, or no SNI: final.
        No,
    }

    use Stop::{More, No};

    /// A cursor over the handshake bytes carried by consecutive handshake
    /// records, skipping the 5-byte record headers, so a hello split over
    /// records reads as one stream without being copied. `limit` is the
    /// end (in handshake-stream offsets) of the innermost length-prefixed
    /// structure being read: nothing is read past it. Over bare handshake
    /// bytes (QUIC's CRYPTO stream, which has no records) `rec_end` is
    /// `usize::MAX`: one endless record.
    struct Cursor<'a> {
        buf: &'a [u8],
        /// Next byte in `buf`.
        pos: usize,
        /// End of the current record's payload in `buf` (may lie past
        /// `buf.len()` while the record is still arriving).
        rec_end: usize,
        /// Handshake-stream offset of `pos`.
        off: usize,
        limit: usize,
    }

    impl<'a> Cursor<'a> {
        /// Step into the next record if the current one is used up.
        fn settle(&mut self) -> Result<(), Stop> {
            while self.pos == self.rec_end {
                let h = self.buf.get(self.rec_end..self.rec_end + 5).ok_or(More)?;
                // Handshake records only, legacy_record_version 3.x.
                if h[0] != TLS_HANDSHAKE || h[1] != 3 {
                    return Err(No);
                }
                let len = usize::from(u16::from_be_bytes([h[3], h[4]]));
                // Zero-length handshake fragments are forbidden (RFC 8446 5.1).
                if len == 0 || len > MAX_RECORD {
                    return Err(No);
                }
                self.pos = self.rec_end + 5;
                self.rec_end = self.pos + len;
            }
            Ok(())
        }

        fn take(&mut self, n: usize) -> Result<(), Stop> {
            if self.off + n > self.limit {
                return Err(No);
            }
            Ok(())
        }

        fn u8(&mut self) -> Result<u8, Stop> {
            self.take(1)?;
            self.settle()?;
            let b = *self.buf.get(self.pos).ok_or(More)?;
            self.pos += 1;
            self.off += 1;
            Ok(b)
        }

        fn u16(&mut self) -> Result<u16, Stop> {
            Ok(u16::from_be_bytes([self.u8()?, self.u8()?]))
        }

        fn u24(&mut self) -> Result<usize, Stop> {
            let b = [self.u8()?, self.u8()?, self.u8()?];
            Ok(usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]))
        }

        /// Skip `n` bytes, across record boundaries.
        fn skip(&mut self, mut n: usize) -> Result<(), Stop> {
            self.take(n)?;
            while n > 0 {
                self.settle()?;
                let k = n.min(self.rec_end - self.pos);
                if self.pos + k > self.buf.len() {
                    return Err(More);
                }
                self.pos += k;
                self.off += k;
                n -= k;
            }
            Ok(())
        }

        /// `n` contiguous bytes. A run split between two records (legal,
        /// and a trick some anti-censorship clients use on the SNI) cannot
        /// be returned without copying: it counts as no name.
        fn bytes(&mut self, n: usize) -> Result<&'a [u8], Stop> {
            self.take(n)?;
            if n == 0 {
                return Ok(&[]);
            }
            self.settle()?;
            if self.pos + n > self.rec_end {
                return Err(No);
            }
            let s = self.buf.get(self.pos..self.pos + n).ok_or(More)?;
            self.pos += n;
            self.off += n;
            Ok(s)
        }

        /// Enter a structure of `len` bytes starting here; returns the
        /// enclosing limit to restore.
        fn enter(&mut self, len: usize) -> Result<usize, Stop> {
            let end = self.off + len;
            if end > self.limit {
                return Err(No);
            }
            Ok(std::mem::replace(&mut self.limit, end))
        }
    }

    pub(super) fn sniff(buf: &[u8]) -> Sniffed<'_> {
        walk(buf, 0, Sniffer::Tls)
    }

    /// The SNI of a ClientHello given as a bare handshake message (no
    /// record headers), as QUIC carries it in CRYPTO frames (RFC 9001
    /// section 4.1.3).
    pub(super) fn sniff_handshake(hs: &[u8], proto: Sniffer) -> Sniffed<'_> {
        walk(hs, usize::MAX, proto)
    }

    fn walk(buf: &[u8], rec_end: usize, proto: Sniffer) -> Sniffed<'_> {
        let mut c = Cursor {
            buf,
            pos: 0,
            rec_end,
            off: 0,
            limit: usize::MAX,
        };
        match hello(&mut c) {
            Ok(name) => checked(proto, name),
            Err(More) => Sniffed::NeedMore,
            Err(No) => Sniffed::NoDomain,
        }
    }

    /// Walk the ClientHello to the first `host_name` of its SNI.
    fn hello<'a>(c: &mut Cursor<'a>) -> Result<&'a [u8], Stop> {
        if c.u8()? != CLIENT_HELLO {
            return Err(No);
        }
        let len = c.u24()?;
        c.enter(len)?;
        // legacy_version (2) + random (32).
        c.skip(34)?;
        let sid = usize::from(c.u8()?);
        if sid > 32 {
            return Err(No);
        }
        c.skip(sid)?;
        let suites = usize::from(c.u16()?);
        if suites < 2 || suites % 2 != 0 {
            return Err(No);
        }
        c.skip(suites)?;
        let comp = usize::from(c.u8()?);
        if comp == 0 {
            return Err(No);
        }
        c.skip(comp)?;
        if c.off == c.limit {
            // A hello without extensions has no SNI.
            return Err(No);
        }
        let exts = usize::from(c.u16()?);
        c.enter(exts)?;
        while c.off < c.limit {
            let ty = c.u16()?;
            let len = usize::from(c.u16()?);
            if ty != SERVER_NAME {
                c.skip(len)?;
                continue;
            }
            c.enter(len)?;
            let list = usize::from(c.u16()?);
            c.enter(list)?;
            while c.off < c.limit {
                let kind = c.u8()?;
                let n = usize::from(c.u16()?);
                if kind == HOST_NAME {
                    return c.bytes(n);
                }
                c.skip(n)?;
            }
            return Err(No);
        }
        Err(No)
    }
}

/// The `Host` header of an HTTP/1.x request head (RFC 9112 sections 3, 5;
/// RFC 9110 section 7.2).
mod http {
    use super::{Sniffed, Sniffer, checked};

    /// Request methods that start a sniffable request (RFC 9110 section 9
    /// plus PATCH), each with its separating space.
    const METHODS: [&[u8]; 9] = [
        b"GET ",
        b"POST ",
        b"HEAD ",
        b"PUT ",
        b"DELETE ",
        b"OPTIONS ",
        b"PATCH ",
        b"CONNECT ",
        b"TRACE ",
    ];

    pub(super) fn sniff(b: &[u8]) -> Sniffed<'_> {
        let mut known = false;
        for m in METHODS {
            if b.starts_with(m) {
                known = true;
                break;
            }
            if m.starts_with(b) {
                return Sniffed::NeedMore;
            }
        }
        if !known {
            return Sniffed::NoDomain;
        }
        let mut lines = Lines { rest: b };
        // The request line must say HTTP/1.x (not 0.9, not the h2 preface).
        match lines.next() {
            None => return Sniffed::NeedMore,
            Some(l) if l.ends_with(b" HTTP/1.1") || l.ends_with(b" HTTP/1.0") => {}
            Some(_) => return Sniffed::NoDomain,
        }
        loop {
            let Some(line) = lines.next() else {
                return Sniffed::NeedMore;
            };
            if line.is_empty() {
                // End of the head without a Host (HTTP/1.0).
                return Sniffed::NoDomain;
            }
            let Some(colon) = line.iter().position(|&c| c == b':') else {
                return Sniffed::NoDomain;
            };
            let (name, value) = (&line[..colon], &line[colon + 1..]);
            if name.eq_ignore_ascii_case(b"host") {
                // The first Host decides; a server would refuse a request
                // with two anyway (RFC 9112 section 3.2).
                return host(value.trim_ascii());
            }
        }
    }

    /// `uri-host [ ":" port ]` to its host.
    fn host(v: &[u8]) -> Sniffed<'_> {
        // `[v6]` literals name no domain.
        if v.first() == Some(&b'[') {
            return Sniffed::NoDomain;
        }
        let name = match v.iter().position(|&c| c == b':') {
            Some(i) => {
                let port = &v[i + 1..];
                if port.is_empty() || port.len() > 5 || !port.iter().all(u8::is_ascii_digit) {
                    return Sniffed::NoDomain;
                }
                &v[..i]
            }
            None => v,
        };
        checked(Sniffer::Http, name)
    }

    /// Complete lines (without their CRLF or bare LF, which recipients may
    /// accept: RFC 9112 section 2.2); an unterminated tail is not a line.
    struct Lines<'a> {
        rest: &'a [u8],
    }

    impl<'a> Iterator for Lines<'a> {
        type Item = &'a [u8];
        fn next(&mut self) -> Option<&'a [u8]> {
            let i = self.rest.iter().position(|&c| c == b'\n')?;
            let line = &self.rest[..i];
            self.rest = &self.rest[i + 1..];
            Some(line.strip_suffix(b"\r").unwrap_or(line))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;
    use rustls::pki_types::ServerName;

    use super::*;

    /// A rustls client config for `versions` with no roots and no client
    /// certificate: enough to write a ClientHello.
    pub(super) fn rustls_client(
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> rustls::ClientConfig {
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(versions)
        .expect("versions")
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth()
    }

    /// What a client with `cfg` connecting to `server` writes first: its
    /// ClientHello record(s).
    pub(super) fn first_flight(cfg: rustls::ClientConfig, server: &str) -> Vec<u8> {
        let name = ServerName::try_from(server.to_owned()).expect("server name");
        let mut conn = rustls::ClientConnection::new(Arc::new(cfg), name).expect("client");
        let mut out = Vec::new();
        while conn.wants_write() {
            conn.write_tls(&mut out).expect("write_tls");
        }
        out
    }

    /// The first flight of a rustls client: its ClientHello record(s).
    fn rustls_hello(tls12_only: bool, server: &str, sni: bool) -> Vec<u8> {
        let versions: &[&rustls::SupportedProtocolVersion] = if tls12_only {
            &[&rustls::version::TLS12]
        } else {
            rustls::ALL_VERSIONS
        };
        let mut cfg = rustls_client(versions);
        cfg.enable_sni = sni;
        let out = first_flight(cfg, server);
        assert_eq!(out[0], TLS_HANDSHAKE, "a handshake record");
        out
    }

    /// The handshake bytes of single-record `hello`, re-sent as records
    /// that end at each of `cuts` (offsets into the handshake bytes).
    fn refragment(hello: &[u8], cuts: &[usize]) -> Vec<u8> {
        let len = usize::from(u16::from_be_bytes([hello[3], hello[4]]));
        assert_eq!(hello.len(), 5 + len, "one record");
        let hs = &hello[5..];
        let bounds: Vec<usize> = std::iter::once(0)
            .chain(cuts.iter().copied())
            .chain(std::iter::once(hs.len()))
            .collect();
        records(bounds.windows(2).map(|w| &hs[w[0]..w[1]]))
    }

    pub(super) fn find(hay: &[u8], needle: &[u8]) -> usize {
        hay.windows(needle.len())
            .position(|w| w == needle)
            .expect("needle present")
    }

    /// Every prefix gives `NeedMore` until the answer, then that answer.
    fn check_prefixes(b: &[u8], want: Sniffed<'_>) {
        let mut decided = None;
        for k in 0..=b.len() {
            let r = sniff(&b[..k]);
            match (decided, r) {
                (None, Sniffed::NeedMore) => {}
                (None, r) => {
                    assert_eq!(r, want, "first answer at {k} of {}", b.len());
                    decided = Some(k);
                }
                (Some(at), r) => assert_eq!(r, want, "answer changed at {k} (given at {at})"),
            }
        }
        assert!(decided.is_some(), "no answer from all {} bytes", b.len());
    }

    fn tls(name: &str) -> Sniffed<'_> {
        Sniffed::Domain {
            proto: Sniffer::Tls,
            name,
        }
    }

    fn http(name: &str) -> Sniffed<'_> {
        Sniffed::Domain {
            proto: Sniffer::Http,
            name,
        }
    }

    #[test]
    fn rustls_hellos_tls13_and_tls12() {
        for tls12_only in [false, true] {
            let h = rustls_hello(tls12_only, "video.example.com", true);
            assert_eq!(
                sniff(&h),
                tls("video.example.com"),
                "tls12_only {tls12_only}"
            );
            check_prefixes(&h, tls("video.example.com"));
            // Data after the hello (a pipelined record) changes nothing.
            let mut more = h.clone();
            more.extend_from_slice(&[23, 3, 3, 0, 4, 1, 2, 3, 4]);
            assert_eq!(sniff(&more), tls("video.example.com"));
        }
    }

    #[test]
    fn rustls_hellos_without_sni() {
        for tls12_only in [false, true] {
            // SNI turned off, and a server named by address (never sent).
            for h in [
                rustls_hello(tls12_only, "video.example.com", false),
                rustls_hello(tls12_only, "192.0.2.7", true),
            ] {
                assert_eq!(sniff(&h), Sniffed::NoDomain);
                check_prefixes(&h, Sniffed::NoDomain);
            }
        }
    }

    #[test]
    fn hello_split_over_records_at_every_point() {
        let name = "split.example.org";
        let h = rustls_hello(false, name, true);
        let hs_len = h.len() - 5;
        let at = find(&h[5..], name.as_bytes());
        for cut in 1..hs_len {
            let b = refragment(&h, &[cut]);
            // A cut inside the name leaves it in two pieces: no copy, no name.
            let want = if cut > at && cut < at + name.len() {
                Sniffed::NoDomain
            } else {
                tls(name)
            };
            assert_eq!(sniff(&b), want, "cut at {cut}");
        }
        // Many small records, the name in one of them.
        // The name can end the handshake (seen in about one run in four:
        // rustls's hellos vary); the cut after it is only made where it fits.
        let after = Some(at + name.len() + 1).filter(|&c| c < hs_len);
        let cuts: Vec<usize> = (1..at).step_by(5).chain(after).collect();
        let b = refragment(&h, &cuts);
        check_prefixes(&b, tls(name));
        // One byte per record: the name straddles.
        let cuts: Vec<usize> = (1..hs_len).collect();
        assert_eq!(sniff(&refragment(&h, &cuts)), Sniffed::NoDomain);
    }

    /// A hand-built ClientHello handshake message: `exts` are (type,
    /// body) pairs.
    pub(super) fn client_hello_message(exts: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one suite
        body.extend_from_slice(&[1, 0]); // null compression
        let mut e = Vec::new();
        for (ty, data) in exts {
            e.extend_from_slice(&ty.to_be_bytes());
            e.extend_from_slice(&u16::try_from(data.len()).expect("ext").to_be_bytes());
            e.extend_from_slice(data);
        }
        body.extend_from_slice(&u16::try_from(e.len()).expect("exts").to_be_bytes());
        body.extend_from_slice(&e);
        let mut hs = vec![CLIENT_HELLO_TYPE];
        hs.extend_from_slice(&u32::try_from(body.len()).expect("hs").to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        hs
    }

    /// [`client_hello_message`] in records of at most 2^14 bytes.
    fn hello_with(exts: &[(u16, Vec<u8>)]) -> Vec<u8> {
        records(client_hello_message(exts).chunks(1 << 14))
    }

    /// Each of `parts` (handshake bytes) in a TLS handshake record of its own.
    fn records<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
        let mut out = Vec::new();
        for part in parts {
            out.extend_from_slice(&[TLS_HANDSHAKE, 3, 1]);
            out.extend_from_slice(&u16::try_from(part.len()).expect("rec").to_be_bytes());
            out.extend_from_slice(part);
        }
        out
    }

    const CLIENT_HELLO_TYPE: u8 = 1;

    pub(super) fn sni_ext(entries: &[(u8, &[u8])]) -> (u16, Vec<u8>) {
        let mut list = Vec::new();
        for (kind, name) in entries {
            list.push(*kind);
            list.extend_from_slice(&u16::try_from(name.len()).expect("n").to_be_bytes());
            list.extend_from_slice(name);
        }
        let mut data = u16::try_from(list.len()).expect("l").to_be_bytes().to_vec();
        data.extend_from_slice(&list);
        (0, data)
    }

    #[test]
    fn hand_built_hellos() {
        // Case kept as sent; other extensions before it skipped; a name
        // type other than host_name skipped.
        let h = hello_with(&[(10, vec![0, 2, 0, 29]), sni_ext(&[(0, b"MiXed.Example.")])]);
        assert_eq!(sniff(&h), tls("MiXed.Example."));
        let h = hello_with(&[sni_ext(&[(9, b"junk"), (0, b"b.example")])]);
        assert_eq!(sniff(&h), tls("b.example"));
        // Bad names are no domain.
        for bad in [
            &b"a..b"[..],
            b"",
            b"1.2.3.4",
            b"a b.com",
            b"\xffx.com",
            b"-",
        ] {
            let h = hello_with(&[sni_ext(&[(0, bad)])]);
            let r = sniff(&h);
            if bad == b"-" {
                // A lone hyphen label is odd but not worth refusing.
                assert_eq!(r, tls("-"));
            } else {
                assert_eq!(r, Sniffed::NoDomain, "{bad:?}");
            }
        }
        // No extensions at all, and extensions without SNI.
        let mut h = hello_with(&[]);
        // Drop the empty extensions block: fix up both lengths.
        h.truncate(h.len() - 2);
        h[4] -= 2;
        h[8] -= 2;
        assert_eq!(sniff(&h), Sniffed::NoDomain);
        assert_eq!(sniff(&hello_with(&[(10, vec![0, 0])])), Sniffed::NoDomain);
        // An SNI extension whose list overruns it.
        let (ty, mut data) = sni_ext(&[(0, b"x.com")]);
        data[1] += 3;
        assert_eq!(sniff(&hello_with(&[(ty, data)])), Sniffed::NoDomain);
    }

    #[test]
    fn not_a_client_hello() {
        let h = rustls_hello(false, "a.example", true);
        let mut b = h.clone();
        b[5] = 2; // ServerHello
        assert_eq!(sniff(&b), Sniffed::NoDomain);
        let mut b = h.clone();
        b[1] = 2; // SSL 2 record version
        assert_eq!(sniff(&b), Sniffed::NoDomain);
        let mut b = h.clone();
        b[3] = 0x40; // record longer than 2^14
        assert_eq!(sniff(&b), Sniffed::NoDomain);
        // A second record of another type mid-hello.
        let mut b = refragment(&h, &[10]);
        b[5 + 10] = 23;
        assert_eq!(sniff(&b), Sniffed::NoDomain);
        // Handshake length beyond what its record holds is fine (more
        // records follow), but one that ends inside the fixed fields is not.
        let mut b = h;
        b[6..9].copy_from_slice(&[0, 0, 20]);
        assert_eq!(sniff(&b), Sniffed::NoDomain);
    }

    #[test]
    fn bounded_at_16_kib() {
        // 20 KB of padding before the SNI: the hello spans records and the
        // name lies past the cap.
        let h = hello_with(&[(21, vec![0; 20_000]), sni_ext(&[(0, b"late.example")])]);
        assert!(h.len() > MAX_SNIFF);
        assert_eq!(sniff(&h[..MAX_SNIFF - 1]), Sniffed::NeedMore);
        assert_eq!(sniff(&h[..MAX_SNIFF]), Sniffed::NoDomain);
        assert_eq!(sniff(&h), Sniffed::NoDomain);
        // Under the cap, padding spanning two records is walked through.
        let h = hello_with(&[(21, vec![0; 14_000]), sni_ext(&[(0, b"ok.example")])]);
        assert!(h.len() < MAX_SNIFF);
        assert_eq!(sniff(&h), tls("ok.example"));
        // An HTTP head that never ends.
        let mut b = b"GET / HTTP/1.1\r\n".to_vec();
        while b.len() < MAX_SNIFF + 100 {
            b.extend_from_slice(b"X-Filler: aaaaaaaaaaaaaaaaaaaaaaaa\r\n");
        }
        assert_eq!(sniff(&b[..MAX_SNIFF - 1]), Sniffed::NeedMore);
        assert_eq!(sniff(&b), Sniffed::NoDomain);
    }

    #[test]
    fn http_hosts() {
        let cases: &[(&[u8], Sniffed<'_>)] = &[
            (
                b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
                http("example.com"),
            ),
            (
                b"POST /x HTTP/1.1\r\nUser-Agent: t\r\nhOsT:\t Api.Example.com:8080 \r\n\r\n",
                http("Api.Example.com"),
            ),
            // Bare LF line ends; an answer before the head is complete.
            (b"HEAD / HTTP/1.0\nHost: a.example\n", http("a.example")),
            (
                b"CONNECT a.example:443 HTTP/1.1\r\nHost: a.example:443\r\n",
                http("a.example"),
            ),
            (
                b"OPTIONS * HTTP/1.1\r\nHost: a.example.\r\n\r\n",
                http("a.example."),
            ),
            // Address literals and bad values name no domain.
            (
                b"GET / HTTP/1.1\r\nHost: [fd00::1]:80\r\n\r\n",
                Sniffed::NoDomain,
            ),
            (
                b"GET / HTTP/1.1\r\nHost: 198.19.1.2:80\r\n\r\n",
                Sniffed::NoDomain,
            ),
            (b"GET / HTTP/1.1\r\nHost: a.com:\r\n\r\n", Sniffed::NoDomain),
            (
                b"GET / HTTP/1.1\r\nHost: a.com:99999x\r\n\r\n",
                Sniffed::NoDomain,
            ),
            (
                b"GET / HTTP/1.1\r\nHost: a/b.com\r\n\r\n",
                Sniffed::NoDomain,
            ),
            (b"GET / HTTP/1.1\r\nHost:\r\n\r\n", Sniffed::NoDomain),
            // No Host by the end of the head (HTTP/1.0 allows it).
            (
                b"GET / HTTP/1.0\r\nAccept: */*\r\n\r\nHost: late.com\r\n",
                Sniffed::NoDomain,
            ),
            // Not HTTP/1.x, unknown or lower-case method, garbage header.
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Sniffed::NoDomain),
            (b"GET /\r\n", Sniffed::NoDomain),
            (b"get / HTTP/1.1\r\nHost: a.com\r\n\r\n", Sniffed::NoDomain),
            (b"BREW / HTTP/1.1\r\nHost: a.com\r\n\r\n", Sniffed::NoDomain),
            (
                b"GET / HTTP/1.1\r\nno colon here\r\nHost: a.com\r\n",
                Sniffed::NoDomain,
            ),
            (b"SSH-2.0-OpenSSH_9.6\r\n", Sniffed::NoDomain),
        ];
        for (b, want) in cases {
            assert_eq!(sniff(b), *want, "{:?}", String::from_utf8_lossy(b));
            check_prefixes(b, *want);
        }
        // Partial methods wait; a partial non-method does not.
        for p in [&b"G"[..], b"GE", b"GET", b"DELE", b"GET / HTTP/1.1\r\nHo"] {
            assert_eq!(sniff(p), Sniffed::NeedMore, "{p:?}");
        }
        assert_eq!(sniff(b"GX"), Sniffed::NoDomain);
        assert_eq!(sniff(b""), Sniffed::NeedMore);
    }

    #[test]
    fn name_checks() {
        let l63 = "a".repeat(63);
        assert!(valid_name(format!("{l63}.com").as_bytes()));
        assert!(!valid_name(format!("{l63}b.com").as_bytes()));
        // 253 bytes in four labels: valid; one more byte is not.
        let n253 = format!("{l63}.{l63}.{l63}.{}", "c".repeat(61));
        assert_eq!(n253.len(), 253);
        assert!(valid_name(n253.as_bytes()));
        assert!(valid_name(format!("{n253}.").as_bytes()));
        assert!(!valid_name(format!("{n253}c").as_bytes()));
        assert!(valid_name(b"_dmarc.example.com"));
        for bad in [
            &b"."[..],
            b"..",
            b"a.",
            b".a",
            b"a..b",
            b"a:b",
            b"1.2.3.4",
            b"1.2.3.4.",
        ] {
            let ok = bad == b"a.";
            assert_eq!(valid_name(bad), ok, "{bad:?}");
        }
        // Dotted digits that are not an IPv4 literal are names.
        assert!(valid_name(b"1.2.3"));
    }

    proptest! {
        /// Hostile bytes: never a panic, a name is always a valid slice of
        /// the input, and an answer other than NeedMore never changes when
        /// more bytes arrive.
        #[test]
        fn arbitrary_bytes(b in proptest::collection::vec(any::<u8>(), 0..600), cut in 0usize..600) {
            let cut = cut.min(b.len());
            check_final(&b, cut);
        }

        /// Real hellos with a few bytes flipped.
        #[test]
        fn mutated_hellos(flips in proptest::collection::vec((0usize..400, any::<u8>()), 1..4), cut in 0usize..600) {
            let mut h = rustls_hello(false, "m.example.net", true);
            for (i, v) in flips {
                let i = i % h.len();
                h[i] = v;
            }
            let cut = cut.min(h.len());
            check_final(&h, cut);
        }
    }

    fn check_final(b: &[u8], cut: usize) {
        let full = sniff(b);
        if let Sniffed::Domain { name, .. } = full {
            assert!(valid_name(name.as_bytes()));
            let range = b.as_ptr_range();
            assert!(
                range.contains(&name.as_ptr()),
                "name borrowed from the input"
            );
        }
        let part = sniff(&b[..cut]);
        if part != Sniffed::NeedMore {
            assert_eq!(part, full, "final answer at {cut} changed");
        }
    }
}
