//! DNS fixtures: a small authoritative DNS server (UDP and TCP on one port,
//! written on hickory-proto's message types) that counts the queries it
//! sees and can be told to go silent, a DNS client for the tests, and a
//! SOCKS5 server that records the addresses it is asked for and echoes the
//! payload back (to see that an outbound was given a domain). With the
//! feature `doh`, a DNS-over-HTTPS server (HTTP/2 over TLS, test CA) in
//! front of a [`Zone`].
//!
//! Everything runs on plain threads inside a namespace, stops when its guard
//! is dropped, and polls its stop flag at least every 50 ms.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, SOA};
use hickory_proto::rr::{Name, RData, Record, RecordType};

use crate::Netns;

const POLL: Duration = Duration::from_millis(50);

/// The names a [`DnsServer`] knows: lower-case, dot-terminated name ->
/// addresses; everything else is NXDOMAIN (with an SOA, negative TTL =
/// `ttl`).
#[derive(Debug, Clone)]
pub struct Zone {
    pub records: HashMap<String, Vec<IpAddr>>,
    pub ttl: u32,
}

impl Zone {
    pub fn new(ttl: u32) -> Zone {
        Zone {
            records: HashMap::new(),
            ttl,
        }
    }

    /// Add `name` (with or without the trailing dot) -> `addr`.
    pub fn with(mut self, name: &str, addr: IpAddr) -> Zone {
        self.records.entry(fqdn(name)).or_default().push(addr);
        self
    }

    /// Answer as a DNS64 with the prefix 64:ff9b::/96 would for
    /// `ipv4only.arpa` (RFC 7050): its two well-known IPv4 addresses
    /// synthesized inside the prefix ([`crate::nat64::IPV4ONLY_ANSWERS`]).
    pub fn with_dns64(self) -> Zone {
        crate::nat64::IPV4ONLY_ANSWERS
            .into_iter()
            .fold(self, |z, a| z.with("ipv4only.arpa", IpAddr::V6(a)))
    }

    /// The reply to `query`, or `None` if it is not a query.
    pub fn answer(&self, query: &[u8]) -> Option<Vec<u8>> {
        let q = Message::from_vec(query).ok()?;
        if q.metadata.message_type != MessageType::Query {
            return None;
        }
        let mut r = Message::response(q.metadata.id, OpCode::Query);
        r.metadata.recursion_desired = q.metadata.recursion_desired;
        r.metadata.recursion_available = true;
        r.metadata.authoritative = true;
        r.queries = q.queries.clone();
        let Some(qq) = q.queries.first() else {
            r.metadata.response_code = ResponseCode::FormErr;
            return r.to_vec().ok();
        };
        let name = fqdn(&qq.name.to_ascii());
        match self.records.get(&name) {
            Some(addrs) => {
                for a in addrs {
                    let data = match (a, qq.query_type) {
                        (IpAddr::V4(v4), RecordType::A) => RData::A(A(*v4)),
                        (IpAddr::V6(v6), RecordType::AAAA) => RData::AAAA(AAAA(*v6)),
                        _ => continue,
                    };
                    r.answers
                        .push(Record::from_rdata(qq.name.clone(), self.ttl, data));
                }
            }
            None => {
                r.metadata.response_code = ResponseCode::NXDomain;
                let soa = SOA::new(
                    Name::from_ascii("ns.test.").ok()?,
                    Name::from_ascii("hostmaster.test.").ok()?,
                    1,
                    3600,
                    600,
                    86400,
                    self.ttl,
                );
                r.authorities.push(Record::from_rdata(
                    Name::from_ascii("test.").ok()?,
                    self.ttl,
                    RData::SOA(soa),
                ));
            }
        }
        r.to_vec().ok()
    }
}

fn fqdn(n: &str) -> String {
    let mut s = n.to_ascii_lowercase();
    if !s.ends_with('.') {
        s.push('.');
    }
    s
}

/// A DNS server on UDP and TCP `addr` in a namespace; stopped on drop.
#[derive(Debug)]
pub struct DnsServer {
    pub addr: SocketAddr,
    queries: Arc<AtomicU64>,
    silent: Arc<AtomicBool>,
    /// What it answers from; [`DnsServer::set_zone`] swaps it in place.
    zone: Arc<Mutex<Arc<Zone>>>,
    stop: Arc<AtomicBool>,
    handles: Vec<JoinHandle<()>>,
}

impl DnsServer {
    /// Start serving `zone` on UDP and TCP `addr` (port 0 picks one; both
    /// protocols then share it).
    pub fn start(ns: &Netns, addr: SocketAddr, zone: Zone) -> io::Result<DnsServer> {
        let queries = Arc::new(AtomicU64::new(0));
        let silent = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let zone = Arc::new(Mutex::new(Arc::new(zone)));
        let (q, s, st, z) = (queries.clone(), silent.clone(), stop.clone(), zone.clone());
        let bind = move || {
            let sock = UdpSocket::bind(addr)?;
            sock.set_read_timeout(Some(POLL))?;
            let a = sock.local_addr()?;
            Ok((sock, a))
        };
        let (addr, udp) = ns.serve(bind, move |sock| {
            let mut buf = vec![0u8; 65_535];
            while !st.load(Relaxed) {
                let Ok((n, from)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                q.fetch_add(1, Relaxed);
                if s.load(Relaxed) {
                    continue;
                }
                if let Some(r) = current(&z).answer(&buf[..n]) {
                    let _ = sock.send_to(&r, from);
                }
            }
        })?;
        let (q, s, st, z) = (queries.clone(), silent.clone(), stop.clone(), zone.clone());
        let tcp = ns.serve(
            move || Ok((crate::servers::listen(addr)?.0, ())),
            move |l| {
                while !st.load(Relaxed) {
                    match l.accept() {
                        Ok((c, _)) => {
                            let (q, s, st, z) = (q.clone(), s.clone(), st.clone(), z.clone());
                            std::thread::spawn(move || serve_tcp(c, &z, &q, &s, &st));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            },
        );
        let tcp = match tcp {
            Ok(((), tcp)) => tcp,
            Err(e) => {
                // The UDP side is already serving: stop it before failing.
                stop.store(true, Relaxed);
                let _ = udp.join();
                return Err(e);
            }
        };
        Ok(DnsServer {
            addr,
            queries,
            silent,
            zone,
            stop,
            handles: vec![udp, tcp],
        })
    }

    /// Answer from `zone` from now on, on the same sockets. A test that
    /// moves a name needs no new bind: a rebind of the port just closed
    /// failed with `EADDRINUSE` in 2 of 13 runs beside other tests (likely
    /// a child process another test forked, which holds the socket until
    /// it execs; not confirmed).
    pub fn set_zone(&self, zone: Zone) {
        *self.zone.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(zone);
    }

    /// Queries received so far (UDP and TCP, answered or not).
    pub fn queries(&self) -> u64 {
        self.queries.load(Relaxed)
    }

    /// Stop answering (queries are still counted) or resume.
    pub fn set_silent(&self, silent: bool) {
        self.silent.store(silent, Relaxed);
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// The zone in force now.
fn current(zone: &Mutex<Arc<Zone>>) -> Arc<Zone> {
    zone.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

fn serve_tcp(
    mut c: TcpStream,
    zone: &Mutex<Arc<Zone>>,
    q: &AtomicU64,
    silent: &AtomicBool,
    stop: &AtomicBool,
) {
    let _ = c.set_nonblocking(false);
    let _ = c.set_read_timeout(Some(POLL));
    let mut pending = Vec::new();
    let mut buf = [0u8; 4096];
    while !stop.load(Relaxed) {
        match c.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
            Err(e) if crate::servers::is_timeout(&e) => continue,
            Err(_) => return,
        }
        while pending.len() >= 2 {
            let len = usize::from(u16::from_be_bytes([pending[0], pending[1]]));
            if pending.len() < 2 + len {
                break;
            }
            let query: Vec<u8> = pending.drain(..2 + len).skip(2).collect();
            q.fetch_add(1, Relaxed);
            if silent.load(Relaxed) {
                continue;
            }
            if let Some(r) = current(zone).answer(&query) {
                let mut out = (r.len() as u16).to_be_bytes().to_vec();
                out.extend_from_slice(&r);
                if c.write_all(&out).is_err() {
                    return;
                }
            }
        }
    }
}

/// A query for `name` of type `qtype` with ID `id`.
pub fn query(name: &str, qtype: RecordType, id: u16) -> Vec<u8> {
    let mut m = Message::new(id, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    let name = Name::from_ascii(fqdn(name)).expect("test names are valid");
    m.queries.push(Query::query(name, qtype));
    m.to_vec().expect("a query encodes")
}

/// Ask `server` over UDP (from an unbound socket in the calling thread's
/// namespace); `None` when nothing came back within `timeout`.
pub fn ask_udp(server: SocketAddr, query: &[u8], timeout: Duration) -> io::Result<Option<Message>> {
    let bind: SocketAddr = if server.is_ipv6() {
        "[::]:0".parse().expect("static")
    } else {
        "0.0.0.0:0".parse().expect("static")
    };
    let s = UdpSocket::bind(bind)?;
    s.connect(server)?;
    s.set_read_timeout(Some(timeout))?;
    s.send(query)?;
    let mut buf = vec![0u8; 65_535];
    match crate::uninterrupted(|| s.recv(&mut buf)) {
        Ok(n) => Message::from_vec(&buf[..n])
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Ask `queries` one after the other on one TCP connection (RFC 7766
/// framing) and return the replies.
pub fn ask_tcp(
    server: SocketAddr,
    queries: &[Vec<u8>],
    timeout: Duration,
) -> io::Result<Vec<Message>> {
    let mut s = TcpStream::connect_timeout(&server, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    let mut out = Vec::new();
    for q in queries {
        let mut f = (q.len() as u16).to_be_bytes().to_vec();
        f.extend_from_slice(q);
        s.write_all(&f)?;
        let mut len = [0u8; 2];
        s.read_exact(&mut len)?;
        let mut r = vec![0u8; usize::from(u16::from_be_bytes(len))];
        s.read_exact(&mut r)?;
        out.push(
            Message::from_vec(&r)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?,
        );
    }
    Ok(out)
}

/// The first A/AAAA address of an answer.
pub fn first_addr(m: &Message) -> Option<IpAddr> {
    m.answers.iter().find_map(|r| match &r.data {
        RData::A(a) => Some(IpAddr::V4(a.0)),
        RData::AAAA(a) => Some(IpAddr::V6(a.0)),
        _ => None,
    })
}

/// A SOCKS5 server (no authentication) that records the target of every
/// CONNECT and UDP datagram, as text (`host:port`), and echoes: a CONNECT
/// stream gets its bytes back, a datagram comes back with the same header.
#[derive(Debug)]
pub struct Socks5Recorder {
    pub addr: SocketAddr,
    asked: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Socks5Recorder {
    pub fn start(ns: &Netns, addr: SocketAddr) -> io::Result<Socks5Recorder> {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, st) = (asked.clone(), stop.clone());
        let (bound, handle) = ns.serve(
            move || crate::servers::listen(addr),
            move |l| {
                let mut conns = Vec::new();
                while !st.load(Relaxed) {
                    match l.accept() {
                        Ok((c, _)) => {
                            let (a, st) = (a.clone(), st.clone());
                            let ip = addr.ip();
                            conns.push(std::thread::spawn(move || {
                                let _ = socks_conn(c, ip, &a, &st);
                            }));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
                for c in conns {
                    let _ = c.join();
                }
            },
        )?;
        Ok(Socks5Recorder {
            addr: bound,
            asked,
            stop,
            handle: Some(handle),
        })
    }

    /// The targets asked for so far.
    pub fn asked(&self) -> Vec<String> {
        self.asked.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl Drop for Socks5Recorder {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Parse a SOCKS5 address (ATYP onwards): text and length.
fn socks_addr(b: &[u8]) -> Option<(String, usize)> {
    match *b.first()? {
        1 => {
            let ip: [u8; 4] = b.get(1..5)?.try_into().ok()?;
            let port = u16::from_be_bytes(b.get(5..7)?.try_into().ok()?);
            Some((SocketAddr::from((ip, port)).to_string(), 7))
        }
        4 => {
            let ip: [u8; 16] = b.get(1..17)?.try_into().ok()?;
            let port = u16::from_be_bytes(b.get(17..19)?.try_into().ok()?);
            Some((SocketAddr::from((ip, port)).to_string(), 19))
        }
        3 => {
            let n = usize::from(*b.get(1)?);
            let host = std::str::from_utf8(b.get(2..2 + n)?).ok()?;
            let port = u16::from_be_bytes(b.get(2 + n..4 + n)?.try_into().ok()?);
            Some((format!("{host}:{port}"), 4 + n))
        }
        _ => None,
    }
}

fn socks_conn(
    mut c: TcpStream,
    ip: IpAddr,
    asked: &Mutex<Vec<String>>,
    stop: &AtomicBool,
) -> io::Result<()> {
    c.set_nonblocking(false)?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut hello = [0u8; 2];
    c.read_exact(&mut hello)?;
    let mut methods = vec![0u8; usize::from(hello[1])];
    c.read_exact(&mut methods)?;
    c.write_all(&[5, 0])?;
    let mut req = [0u8; 262];
    let n = crate::uninterrupted(|| c.read(&mut req))?;
    let (target, _) = socks_addr(req.get(3..n).unwrap_or_default())
        .ok_or_else(|| io::Error::other("bad request"))?;
    let reply = |port: u16| -> Vec<u8> {
        let mut r = vec![5, 0, 0];
        match ip {
            IpAddr::V4(a) => {
                r.push(1);
                r.extend_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                r.push(4);
                r.extend_from_slice(&a.octets());
            }
        }
        r.extend_from_slice(&port.to_be_bytes());
        r
    };
    match req[1] {
        1 => {
            if let Ok(mut v) = asked.lock() {
                v.push(target);
            }
            c.write_all(&reply(0))?;
            c.set_read_timeout(Some(POLL))?;
            let mut buf = [0u8; 4096];
            while !stop.load(Relaxed) {
                match c.read(&mut buf) {
                    Ok(0) => return Ok(()),
                    Ok(n) => c.write_all(&buf[..n])?,
                    Err(e) if crate::servers::is_timeout(&e) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        }
        3 => {
            let u = UdpSocket::bind(SocketAddr::new(ip, 0))?;
            c.write_all(&reply(u.local_addr()?.port()))?;
            u.set_read_timeout(Some(POLL))?;
            c.set_nonblocking(true)?;
            let mut buf = vec![0u8; 65_535];
            while !stop.load(Relaxed) {
                // The association ends with its TCP connection.
                match c.read(&mut [0u8; 16]) {
                    Ok(0) => return Ok(()),
                    Err(e) if e.kind() != io::ErrorKind::WouldBlock => return Ok(()),
                    _ => {}
                }
                let Ok((n, from)) = u.recv_from(&mut buf) else {
                    continue;
                };
                // RSV RSV FRAG ATYP...
                if n < 4 || buf[2] != 0 {
                    continue;
                }
                if let Some((t, _)) = socks_addr(&buf[3..n]) {
                    if let Ok(mut v) = asked.lock() {
                        v.push(t);
                    }
                    let _ = u.send_to(&buf[..n], from);
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// A DNS-over-HTTPS server (RFC 8484: `POST` of `application/dns-message`
/// over HTTP/2 over TLS) answering from a [`Zone`], with a certificate for
/// its name signed by a CA of its own ([`DohServer::ca_pem`]). It counts
/// the connections it accepted and the queries it answered, so a test can
/// see queries share a connection, and can close every connection it has
/// ([`DohServer::drop_connections`]). Stopped on drop.
#[cfg(feature = "doh")]
#[derive(Debug)]
pub struct DohServer {
    pub addr: SocketAddr,
    /// The CA certificate (PEM) that signed the server's certificate.
    pub ca_pem: String,
    connections: Arc<AtomicU64>,
    queries: Arc<AtomicU64>,
    /// Bumped to close the connections open at that moment.
    kill: tokio::sync::watch::Sender<u64>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

#[cfg(feature = "doh")]
impl DohServer {
    /// Serve `zone` at `https://NAME{path}` on `addr` (port 0 picks one).
    /// Requests to another path, or not a `POST` of a DNS message, get 404
    /// or 415.
    pub fn start(
        ns: &Netns,
        addr: SocketAddr,
        name: &str,
        path: &str,
        zone: Zone,
    ) -> io::Result<DohServer> {
        use tokio_rustls::rustls;
        let err = |e: &dyn std::fmt::Display| io::Error::other(e.to_string());
        let ca_key = rcgen::KeyPair::generate().map_err(|e| err(&e))?;
        let mut ca_params =
            rcgen::CertificateParams::new(Vec::<String>::new()).map_err(|e| err(&e))?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).map_err(|e| err(&e))?;
        let key = rcgen::KeyPair::generate().map_err(|e| err(&e))?;
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .map_err(|e| err(&e))?
            .signed_by(&key, &rcgen::Issuer::new(ca_params, ca_key))
            .map_err(|e| err(&e))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| err(&e))?
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .map_err(|e| err(&e))?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let connections = Arc::new(AtomicU64::new(0));
        let queries = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let (c, q, st) = (connections.clone(), queries.clone(), stop.clone());
        let (kill, killed) = tokio::sync::watch::channel(0u64);
        let zone = Arc::new(zone);
        let path: Arc<str> = path.into();
        let handle = ns.spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            rt.block_on(async move {
                let l = match tokio::net::TcpListener::bind(addr).await {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let _ = tx.send(l.local_addr());
                while !st.load(Relaxed) {
                    let Ok(Ok((s, _))) = tokio::time::timeout(POLL, l.accept()).await else {
                        continue;
                    };
                    let (acceptor, zone, path, q) =
                        (acceptor.clone(), zone.clone(), path.clone(), q.clone());
                    let mut killed = killed.clone();
                    killed.mark_unchanged();
                    c.fetch_add(1, Relaxed);
                    tokio::spawn(async move {
                        let serve = async {
                            let Ok(tls) = acceptor.accept(s).await else {
                                return;
                            };
                            let Ok(mut conn) = h2::server::handshake(tls).await else {
                                return;
                            };
                            while let Some(Ok((req, respond))) = conn.accept().await {
                                let (zone, path, q) = (zone.clone(), path.clone(), q.clone());
                                tokio::spawn(doh_request(req, respond, zone, path, q));
                            }
                        };
                        // Dropping the connection closes its socket.
                        tokio::select! {
                            () = serve => {}
                            _ = killed.changed() => {}
                        }
                    });
                }
            });
        })?;
        let addr = rx
            .recv()
            .map_err(|_| io::Error::other("doh server thread died"))??;
        Ok(DohServer {
            addr,
            ca_pem: ca.pem(),
            connections,
            queries,
            kill,
            stop,
            handle: Some(handle),
        })
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(Relaxed)
    }

    /// Queries answered so far.
    pub fn queries(&self) -> u64 {
        self.queries.load(Relaxed)
    }

    /// Close every connection open now (new ones are still accepted), as
    /// a server restarting or timing out idle clients does.
    pub fn drop_connections(&self) {
        self.kill.send_modify(|n| *n += 1);
    }
}

#[cfg(feature = "doh")]
impl Drop for DohServer {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// One DoH request: the query from the body, the zone's answer back.
#[cfg(feature = "doh")]
async fn doh_request(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
    zone: Arc<Zone>,
    path: Arc<str>,
    answered: Arc<AtomicU64>,
) {
    let reply = |status: u16| {
        http::Response::builder()
            .status(status)
            .header("content-type", "application/dns-message")
            .body(())
    };
    let is_dns = req
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/dns-message");
    let status = if req.uri().path() != &*path {
        404
    } else if req.method() != http::Method::POST || !is_dns {
        415
    } else {
        200
    };
    let mut body = req.into_body();
    let mut query = Vec::new();
    while let Some(Ok(chunk)) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk.len());
        query.extend_from_slice(&chunk);
        if query.len() > 65_535 {
            return;
        }
    }
    let answer = if status == 200 {
        zone.answer(&query)
    } else {
        None
    };
    let (Ok(head), Some(answer)) = (reply(status), answer.or_else(|| Some(Vec::new()))) else {
        return;
    };
    let end = answer.is_empty();
    let Ok(mut out) = respond.send_response(head, end) else {
        return;
    };
    if !end {
        answered.fetch_add(1, Relaxed);
        let _ = out.send_data(answer.into(), true);
    }
}
