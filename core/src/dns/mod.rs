//! kerntun's DNS service: queries to port 53 of the hijacked addresses are
//! answered here (from the cache, the fake-ip pool, or an upstream reached
//! through the outbound the rules choose) instead of being relayed as
//! ordinary flows. docs/dns.md describes the configuration and behaviour.
//!
//! Every hijacked query gets an answer: a packet that is not a query at all
//! is the only thing dropped (counted as malformed); when every upstream
//! fails the client hears SERVFAIL within the sum of the per-try timeouts.

mod cache;
mod config;
mod fakeip;
/// The `dns` fuzz target's entry point (`cargo fuzz` builds with
/// `--cfg fuzzing`), not part of the API.
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing;
mod upstream;

use crate::dnswire::msg;
pub use crate::dnswire::{Upstream, UpstreamProto};
pub use config::{DnsConfig, DnsConfigError, default_resolver};

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, Query};

use crate::outbound::Outbounds;
use crate::relay::{self, Side};
use crate::stats::Stats;
use cache::Cache;
use fakeip::FakePool;
use msg::{BadReply, Incoming};
use upstream::ExchangeError;

/// TTL of fake-ip answers: short, so a client asks again (and refreshes the
/// domain's place in the pool) rather than holding an address that may have
/// gone to another domain.
const FAKE_TTL: u32 = 1;
/// A DNS-over-TCP client connection that sends nothing for this long is
/// closed (RFC 7766 section 6.2.3 recommends seconds, not minutes, for a
/// server under load).
const TCP_IDLE: Duration = Duration::from_secs(10);

/// The DNS service of one engine.
pub struct Dns {
    outbounds: Arc<Outbounds>,
    upstreams: Vec<Upstream>,
    /// Time allowed to one upstream try.
    timeout: Duration,
    hijack: Vec<IpAddr>,
    hijack_all: bool,
    cache: Cache,
    fake: Option<FakePool>,
    /// Lower-case, without trailing dots.
    filter: Vec<Box<str>>,
    tls: Option<upstream::Tls>,
}

impl std::fmt::Debug for Dns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dns")
            .field("upstreams", &self.upstreams)
            .field("timeout", &self.timeout)
            .field("hijack", &self.hijack)
            .field("hijack_all", &self.hijack_all)
            .field("fake_ip", &self.fake.is_some())
            .finish_non_exhaustive()
    }
}

/// Why a domain could not be resolved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DnsError {
    /// Every upstream failed, timed out or was rejected by the rules.
    #[error("no upstream answered")]
    Upstream,
    /// The upstreams answered, without an address of the family asked for.
    #[error("no address in the answer")]
    NoAddress,
    /// Not a domain name.
    #[error("not a valid domain name")]
    BadName,
}

/// An answer found in the cache or fetched.
enum Found {
    Cached(Arc<Message>, u32),
    /// The decoded reply and its wire form (ID still the upstream one).
    Fresh(Arc<Message>, Vec<u8>),
}

impl Found {
    fn msg(&self) -> &Message {
        match self {
            Found::Cached(m, _) | Found::Fresh(m, _) => m,
        }
    }
}

/// A random query ID for an upstream (RFC 5452: an unpredictable ID is half
/// of what keeps off-path spoofing out). hickory draws it from a seeded
/// RNG when it makes a query.
fn random_id() -> u16 {
    Message::query().metadata.id
}

impl Dns {
    /// The service, or `None` when `[dns]` is off. `c` has passed
    /// [`DnsConfig::validate`]; `tun_nets` are the TUN's prefixes (the
    /// default hijack addresses come from them).
    pub fn new(
        c: &DnsConfig,
        tun_nets: &[ipnet::IpNet],
        outbounds: Arc<Outbounds>,
    ) -> Result<Option<Arc<Self>>, DnsConfigError> {
        if !c.enabled {
            return Ok(None);
        }
        let upstreams = c.parsed_upstreams()?;
        let hijack = if c.hijack.is_empty() {
            tun_nets
                .iter()
                .copied()
                .filter_map(config::default_resolver)
                .collect()
        } else {
            c.hijack.clone()
        };
        let fake = c
            .fake_ip
            .then(|| FakePool::new(c.fake_ip_pool, c.fake_ip_pool6, c.fake_ip_entries));
        let filter = c
            .fake_ip_filter
            .iter()
            .map(|d| {
                d.trim_end_matches('.')
                    .to_ascii_lowercase()
                    .into_boxed_str()
            })
            .collect();
        let tls = if upstreams.iter().any(|u| u.proto == UpstreamProto::Tls) {
            Some(tls_connector(c)?)
        } else {
            None
        };
        Ok(Some(Arc::new(Dns {
            outbounds,
            upstreams,
            timeout: Duration::from_millis(c.timeout_ms.max(1)),
            hijack,
            hijack_all: c.hijack_all,
            cache: Cache::new(c.cache_entries),
            fake,
            filter,
            tls,
        })))
    }

    /// Whether port-53 traffic to `dst` is answered here.
    #[inline]
    pub fn hijacks(&self, dst: SocketAddr) -> bool {
        dst.port() == 53 && (self.hijack_all || self.hijack.contains(&dst.ip()))
    }

    /// The answer to one hijacked query; `None` for a packet that is not a
    /// DNS query (counted as malformed).
    pub async fn answer(&self, query: &[u8], stats: &Stats) -> Option<Vec<u8>> {
        self.answer_limited(query, stats).await.map(|(r, _)| r)
    }

    /// [`Dns::answer`] for a UDP client: a reply longer than the client can
    /// take (its EDNS size or 512 bytes, and `path_max`) is truncated with
    /// TC set, so the client asks again over TCP.
    pub async fn answer_udp(
        &self,
        query: &[u8],
        path_max: usize,
        stats: &Stats,
    ) -> Option<Vec<u8>> {
        let (r, limit) = self.answer_limited(query, stats).await?;
        if r.len() <= limit.min(path_max) {
            return Some(r);
        }
        msg::truncate(&r).filter(|t| t.len() <= path_max)
    }

    async fn answer_limited(&self, query: &[u8], stats: &Stats) -> Option<(Vec<u8>, usize)> {
        let d = &stats.dns;
        let Some(incoming) = msg::parse_query(query) else {
            d.malformed.fetch_add(1, Relaxed);
            return None;
        };
        d.queries.fetch_add(1, Relaxed);
        let q = match incoming {
            Incoming::Refuse(r) => return Some((r, msg::UDP_PLAIN_MAX)),
            Incoming::Query(q) => q,
        };
        let limit = msg::udp_limit(&q);
        let qq = msg::question(&q)?;
        if let (Some(pool), Some(v6)) = (&self.fake, msg::is_address_query(qq)) {
            let name = msg::key_name(&qq.name);
            let domain = name.trim_end_matches('.');
            if !domain.is_empty() && !self.filtered(domain) {
                let (a4, a6) = pool.assign(domain, d);
                d.fakeip_answers.fetch_add(1, Relaxed);
                let addr = if v6 {
                    a6.map(IpAddr::V6)
                } else {
                    Some(IpAddr::V4(a4))
                };
                return Some((msg::fake_answer(&q, addr, FAKE_TTL), limit));
            }
        }
        let reply = match self.lookup(&q, qq, stats).await {
            Ok(Found::Cached(m, age)) => msg::from_cache(&m, &q, age),
            Ok(Found::Fresh(_, mut raw)) => {
                // The upstream saw our ID; the client gets its own back.
                raw[..2].copy_from_slice(&q.metadata.id.to_be_bytes());
                raw
            }
            Err(_) => {
                d.servfail.fetch_add(1, Relaxed);
                msg::servfail(&q)
            }
        };
        Some((reply, limit))
    }

    /// Whether `domain` (or a parent of it) is on the fake-ip filter list.
    fn filtered(&self, domain: &str) -> bool {
        self.filter.iter().any(|f| {
            domain == &**f
                || (domain.len() > f.len()
                    && domain.ends_with(&**f)
                    && domain.as_bytes()[domain.len() - f.len() - 1] == b'.')
        })
    }

    /// DNS over TCP (RFC 7766) on a hijacked connection: length-prefixed
    /// queries answered one after the other, until EOF, a malformed query,
    /// or [`TCP_IDLE`] without one.
    /// Generic over the app's side of the connection: a kernel socket
    /// (system stack) or a smoltcp socket.
    pub(crate) async fn serve_tcp<S: Side>(
        &self,
        stream: &S,
        stats: &Stats,
    ) -> std::io::Result<()> {
        loop {
            let mut len = [0u8; 2];
            match tokio::time::timeout(TCP_IDLE, relay::read_exact(stream, &mut len)).await {
                Err(_) => return Ok(()),
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Ok(Err(e)) => return Err(e),
                Ok(Ok(_)) => {}
            }
            let mut q = vec![0u8; usize::from(u16::from_be_bytes(len))];
            match tokio::time::timeout(TCP_IDLE, relay::read_exact(stream, &mut q)).await {
                Err(_) => return Ok(()),
                Ok(r) => r.map(drop)?,
            }
            stats.dns.tcp_queries.fetch_add(1, Relaxed);
            let Some(r) = self.answer(&q, stats).await else {
                return Ok(());
            };
            let Some(frame) = crate::dnswire::length_prefixed(&r).ok().or_else(|| {
                msg::truncate(&r).and_then(|t| crate::dnswire::length_prefixed(&t).ok())
            }) else {
                return Ok(());
            };
            stream.write_all(&frame).await?;
        }
    }

    /// Whether `ip` lies in the fake-ip pool (held by a domain or not).
    pub fn is_fake(&self, ip: IpAddr) -> bool {
        self.fake.as_ref().is_some_and(|p| p.contains(ip))
    }

    /// The domain a fake address stands for (refreshing its place in the
    /// pool's recency order). A short lock, no await: cheap enough for the
    /// SYN path.
    pub fn fake_domain(&self, ip: IpAddr) -> Option<Arc<str>> {
        self.fake.as_ref()?.domain(ip)
    }

    /// Resolve a domain through the cache and the upstreams (never the fake
    /// pool): the first address of the family asked for.
    pub async fn resolve(&self, domain: &str, v6: bool, stats: &Stats) -> Result<IpAddr, DnsError> {
        let q = msg::build_query(domain, v6).ok_or(DnsError::BadName)?;
        let qq = msg::question(&q).ok_or(DnsError::BadName)?;
        let found = self.lookup(&q, qq, stats).await?;
        msg::addresses(found.msg(), v6)
            .next()
            .ok_or(DnsError::NoAddress)
    }

    /// The cache, else the upstreams in order (each try bounded by the
    /// timeout); a cacheable reply is stored.
    async fn lookup(&self, q: &Message, qq: &Query, stats: &Stats) -> Result<Found, DnsError> {
        let key: cache::Key = (
            msg::key_name(&qq.name).into_boxed_str(),
            u16::from(qq.query_type),
            u16::from(qq.query_class),
        );
        if let Some((m, age)) = self.cache.get(&key, Instant::now()) {
            stats.dns.cache_hits.fetch_add(1, Relaxed);
            return Ok(Found::Cached(m, age));
        }
        let mut up_q = q.clone();
        for up in &self.upstreams {
            let id = random_id();
            up_q.metadata.id = id;
            let Ok(wire) = up_q.to_vec() else {
                return Err(DnsError::BadName);
            };
            match tokio::time::timeout(self.timeout, self.ask(up, &wire, id, qq, stats)).await {
                Ok(Ok((m, raw))) => {
                    let m = Arc::new(m);
                    if let Some(ttl) = msg::cache_ttl(&m) {
                        self.cache.insert(key, m.clone(), ttl, Instant::now());
                    }
                    return Ok(Found::Fresh(m, raw));
                }
                Ok(Err(ExchangeError::Rejected)) => {}
                Ok(Err(e)) => {
                    stats.dns.upstream_failures.fetch_add(1, Relaxed);
                    tracing::debug!("dns upstream {}: {e}", up.addr);
                }
                Err(_) => {
                    stats.dns.upstream_failures.fetch_add(1, Relaxed);
                    tracing::debug!("dns upstream {}: timed out", up.addr);
                }
            }
        }
        Err(DnsError::Upstream)
    }

    /// One try: exchange, check the reply; a truncated UDP reply is asked
    /// again over TCP (same address, same outbound, same time budget).
    async fn ask(
        &self,
        up: &Upstream,
        wire: &[u8],
        id: u16,
        qq: &Query,
        stats: &Stats,
    ) -> Result<(Message, Vec<u8>), ExchangeError> {
        let tls = self.tls.as_ref();
        let raw = upstream::exchange(&self.outbounds, up, tls, wire, id, stats).await?;
        match msg::check_reply(&raw, id, qq) {
            Ok(m) => Ok((m, raw)),
            Err(BadReply::Truncated) if up.proto == UpstreamProto::Udp => {
                let tcp = Upstream {
                    proto: UpstreamProto::Tcp,
                    ..up.clone()
                };
                let raw = upstream::exchange(&self.outbounds, &tcp, tls, wire, id, stats).await?;
                msg::check_reply(&raw, id, qq)
                    .map(|m| (m, raw))
                    .map_err(ExchangeError::Reply)
            }
            Err(e) => Err(ExchangeError::Reply(e)),
        }
    }
}

/// The TLS client for `tls://` upstreams: the Mozilla roots (webpki-roots)
/// plus the PEM certificates of `tls_ca_file`.
#[cfg(feature = "dot")]
fn tls_connector(c: &DnsConfig) -> Result<upstream::Tls, DnsConfigError> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    use tokio_rustls::rustls;
    let bad = |reason: String| DnsConfigError {
        field: "tls_ca_file",
        reason,
    };
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = &c.tls_ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| bad(format!("{}: {e}", path.display())))?;
        let mut n = 0;
        for cert in certs {
            let cert = cert.map_err(|e| bad(format!("{}: {e}", path.display())))?;
            roots
                .add(cert)
                .map_err(|e| bad(format!("{}: {e}", path.display())))?;
            n += 1;
        }
        if n == 0 {
            return Err(bad(format!("{}: no certificate in it", path.display())));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| DnsConfigError {
            field: "upstreams",
            reason: format!("TLS: {e}"),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(cfg)))
}

#[cfg(not(feature = "dot"))]
fn tls_connector(_: &DnsConfig) -> Result<upstream::Tls, DnsConfigError> {
    Err(config::dot_missing())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::outbound::SocketFactory;
    use hickory_proto::op::ResponseCode;
    use hickory_proto::rr::RecordType;

    fn service(tweak: impl FnOnce(&mut Config)) -> Arc<Dns> {
        let mut c = Config::default();
        c.tun.ipv4 = Some("198.18.0.1/16".parse().expect("net"));
        c.dns.enabled = true;
        // Nothing listens there: every forward fails (refused) at once.
        c.dns.upstreams = vec!["udp://127.0.0.1:9".into()];
        c.dns.timeout_ms = 300;
        tweak(&mut c);
        c.validate().expect("valid");
        let ob = Outbounds::new(
            &c.outbounds,
            &c.rules,
            &c.relay,
            SocketFactory::new(&c.direct, None),
            4096,
            crate::outbound::resolve::Resolvers::default(),
        )
        .expect("outbounds");
        Dns::new(&c.dns, &c.tun.nets(), Arc::new(ob))
            .expect("dns")
            .expect("enabled")
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[test]
    fn hijack_defaults_to_gateway_plus_two() {
        let d = service(|_| {});
        assert!(d.hijacks("198.18.0.3:53".parse().expect("sa")));
        assert!(!d.hijacks("198.18.0.3:54".parse().expect("sa")));
        assert!(
            !d.hijacks("198.18.0.1:53".parse().expect("sa")),
            "the TUN's own address"
        );
        assert!(!d.hijacks("8.8.8.8:53".parse().expect("sa")));
        let all = service(|c| c.dns.hijack_all = true);
        assert!(all.hijacks("8.8.8.8:53".parse().expect("sa")));
    }

    #[test]
    fn fake_ip_filter_and_servfail() {
        let d = service(|c| {
            c.dns.fake_ip = true;
            c.dns.fake_ip_filter = vec!["Real.Test.".into()];
        });
        let stats = Stats::default();
        let rt = rt();
        let q = msg::tests::query("www.example.com.", RecordType::A, 3);
        let r =
            Message::from_vec(&rt.block_on(d.answer(&q, &stats)).expect("answer")).expect("decode");
        let hickory_proto::rr::RData::A(a) = &r.answers[0].data else {
            panic!("an A record")
        };
        assert!(d.is_fake(IpAddr::V4(a.0)));
        assert_eq!(
            d.fake_domain(IpAddr::V4(a.0)).as_deref(),
            Some("www.example.com")
        );
        // AAAA without a v6 pool: empty NOERROR.
        let q6 = msg::tests::query("www.example.com.", RecordType::AAAA, 4);
        let r6 = Message::from_vec(&rt.block_on(d.answer(&q6, &stats)).expect("answer"))
            .expect("decode");
        assert!(r6.answers.is_empty());
        assert_eq!(r6.metadata.response_code, ResponseCode::NoError);
        // Filtered (a subdomain of the filter): forwarded, and the dead
        // upstream makes it a SERVFAIL with the query's ID.
        let qf = msg::tests::query("x.real.test.", RecordType::A, 5);
        let t0 = Instant::now();
        let rf = Message::from_vec(&rt.block_on(d.answer(&qf, &stats)).expect("answer"))
            .expect("decode");
        assert!(t0.elapsed() < Duration::from_millis(1_000));
        assert_eq!(rf.metadata.id, 5);
        assert_eq!(rf.metadata.response_code, ResponseCode::ServFail);
        assert!(!d.filtered("notreal.test"));
        let g = |c: &std::sync::atomic::AtomicU64| c.load(Relaxed);
        let s = &stats.dns;
        assert_eq!(
            (g(&s.queries), g(&s.fakeip_answers), g(&s.servfail)),
            (3, 2, 1),
            "queries, fake answers, servfail"
        );
        assert_eq!(rt.block_on(d.answer(b"\x00\x01junk", &stats)), None);
        assert_eq!(stats.dns.malformed.load(Relaxed), 1);
    }

    #[test]
    fn serve_tcp_answers_frames_until_eof() {
        use tokio::io::AsyncWriteExt;
        let d = service(|c| c.dns.fake_ip = true);
        let stats = Stats::default();
        rt().block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = l.local_addr().expect("addr");
            let client = tokio::spawn(async move {
                let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
                let mut ids = Vec::new();
                let mut wire = Vec::new();
                for id in [11u16, 12] {
                    let q = msg::tests::query("t.test.", RecordType::A, id);
                    wire.extend_from_slice(&crate::dnswire::length_prefixed(&q).expect("frame"));
                }
                // Both queries in one write: the server must split frames.
                s.write_all(&wire).await.expect("write");
                for _ in 0..2 {
                    let r = crate::dnswire::read_frame(&mut s).await.expect("reply");
                    ids.push(Message::from_vec(&r).expect("decode").metadata.id);
                }
                s.shutdown().await.expect("shutdown");
                ids
            });
            let (s, _) = l.accept().await.expect("accept");
            d.serve_tcp(&s, &stats).await.expect("served");
            assert_eq!(client.await.expect("client"), vec![11, 12]);
        });
        assert_eq!(stats.dns.tcp_queries.load(Relaxed), 2);
        assert_eq!(stats.dns.queries.load(Relaxed), 2);
    }
}
