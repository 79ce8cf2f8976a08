//! DNS over HTTPS upstreams (RFC 8484): `POST PATH` with an
//! `application/dns-message` body, over HTTP/2 over TLS, on a TCP connection
//! from the outbound the rules choose for the upstream's address (the same
//! path `tcp://` and `tls://` upstreams take).
//!
//! Unlike the other upstreams, a connection is kept: DoH servers expect
//! long-lived HTTP/2 connections, and a TLS handshake (through a proxy, two
//! or three round trips) per query would cost more than the query. One
//! connection per upstream, shared by concurrent queries as HTTP/2 streams
//! (at most [`MAX_STREAMS`] at once); made on the first query, and made
//! again when it has died (the server closed it, GOAWAY, a broken proxy
//! stream). A query that fails on a connection made earlier is tried once
//! on a new one. Each exchange is bounded in time by the caller
//! (`dns.timeout_ms`), connecting included, and the reply in size.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use bytes::Bytes;
use h2::client::SendRequest;
use tokio::sync::Semaphore;
use tokio_rustls::{TlsConnector, rustls};

use super::{ExchangeError, MAX_MESSAGE};
use crate::dnswire::Upstream;
use crate::outbound::{Address, Outbounds, Route};
use crate::stats::Stats;

/// Queries one connection carries at once; more wait for a stream (the
/// server's own SETTINGS_MAX_CONCURRENT_STREAMS applies on top).
pub(crate) const MAX_STREAMS: usize = 32;
/// Largest response header block accepted.
const MAX_HEADERS: u32 = 16 * 1024;
/// The media type of RFC 8484 section 6.
const DNS_MESSAGE: &str = "application/dns-message";

/// The DoH connections of one DNS service, one per upstream.
pub(crate) struct Pool {
    /// The service's TLS client with ALPN `h2`.
    connector: TlsConnector,
    slots: parking_lot::Mutex<HashMap<(std::net::SocketAddr, String), Arc<Slot>>>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("upstreams", &self.slots.lock().len())
            .finish()
    }
}

/// One upstream's connection, made by the first query that needs it while
/// the others wait on the lock.
#[derive(Default)]
struct Slot {
    conn: tokio::sync::Mutex<Option<Conn>>,
}

/// A live HTTP/2 connection.
#[derive(Clone)]
struct Conn {
    send: SendRequest<Bytes>,
    streams: Arc<Semaphore>,
    /// Set when the connection task ends (closed, failed, GOAWAY).
    dead: Arc<AtomicBool>,
}

/// How a query failed: on its stream only, or with its connection.
enum Fail {
    Stream(ExchangeError),
    Conn(ExchangeError),
}

impl Pool {
    /// A pool using the service's TLS settings (roots, `tls_ca_file`),
    /// offering HTTP/2 only.
    pub(crate) fn new(tls: &rustls::ClientConfig) -> Pool {
        let mut cfg = tls.clone();
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Pool {
            connector: TlsConnector::from(Arc::new(cfg)),
            slots: parking_lot::Mutex::new(HashMap::new()),
        }
    }

    fn slot(&self, up: &Upstream) -> Arc<Slot> {
        let key = (up.addr, up.server_name.clone().unwrap_or_default());
        self.slots.lock().entry(key).or_default().clone()
    }
}

/// One query to a DoH upstream; the reply carries `id` (the request is
/// sent with ID 0, RFC 8484 section 4.1).
pub(super) async fn exchange(
    pool: &Pool,
    ob: &Outbounds,
    route: Route,
    up: &Upstream,
    wire: &[u8],
    id: u16,
    stats: &Stats,
) -> Result<Vec<u8>, ExchangeError> {
    let slot = pool.slot(up);
    let mut fresh_only = false;
    loop {
        let (conn, fresh) = {
            let mut held = slot.conn.lock().await;
            match held.as_ref() {
                Some(c) if !fresh_only && !c.dead.load(Relaxed) => (c.clone(), false),
                _ => {
                    *held = None;
                    let c = connect(pool, ob, route, up, stats).await?;
                    *held = Some(c.clone());
                    (c, true)
                }
            }
        };
        match request(&conn, up, wire, id).await {
            Ok(reply) => return Ok(reply),
            Err(Fail::Stream(e)) => return Err(e),
            Err(Fail::Conn(e)) => {
                // Forget it (unless another query already replaced it).
                let mut held = slot.conn.lock().await;
                if held
                    .as_ref()
                    .is_some_and(|c| Arc::ptr_eq(&c.dead, &conn.dead))
                {
                    *held = None;
                }
                drop(held);
                if fresh {
                    return Err(e);
                }
                // The kept connection had died unnoticed: once more on a
                // new one.
                tracing::debug!("dns upstream {}: DoH connection lost: {e}", up.addr);
                fresh_only = true;
            }
        }
    }
}

fn h2_error(e: h2::Error) -> ExchangeError {
    ExchangeError::Io(match e.into_io() {
        Some(io) => io,
        None => io::Error::other("HTTP/2 error"),
    })
}

/// A new connection: the outbound's TCP stream, TLS with ALPN `h2`, the
/// HTTP/2 handshake; the connection itself runs in a task of its own.
async fn connect(
    pool: &Pool,
    ob: &Outbounds,
    route: Route,
    up: &Upstream,
    stats: &Stats,
) -> Result<Conn, ExchangeError> {
    let out = ob.connect(route, &Address::Ip(up.addr), stats).await?;
    if out.framing.is_some() {
        return Err(ExchangeError::Unsupported(
            "DNS over HTTPS through a Shadowsocks AEAD outbound",
        ));
    }
    let name = up.server_name.clone().unwrap_or_default();
    let name = rustls::pki_types::ServerName::try_from(name)
        .map_err(|_| ExchangeError::Unsupported("bad TLS server name"))?;
    let tls = pool.connector.connect(name, out.stream).await?;
    if tls.get_ref().1.alpn_protocol() != Some(b"h2") {
        return Err(ExchangeError::Unsupported(
            "the DNS-over-HTTPS server did not agree to HTTP/2 (ALPN h2)",
        ));
    }
    let (send, connection) = h2::client::Builder::new()
        .enable_push(false)
        .max_header_list_size(MAX_HEADERS)
        .handshake::<_, Bytes>(tls)
        .await
        .map_err(h2_error)?;
    let dead = Arc::new(AtomicBool::new(false));
    let flag = dead.clone();
    let addr = up.addr;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!("dns upstream {addr}: DoH connection ended: {e}");
        }
        flag.store(true, Relaxed);
    });
    Ok(Conn {
        send,
        streams: Arc::new(Semaphore::new(MAX_STREAMS)),
        dead,
    })
}

/// One POST on its own stream.
async fn request(conn: &Conn, up: &Upstream, wire: &[u8], id: u16) -> Result<Vec<u8>, Fail> {
    let _stream = conn
        .streams
        .acquire()
        .await
        .map_err(|_| Fail::Conn(ExchangeError::Unsupported("DoH connection closed")))?;
    let mut body = wire.to_vec();
    if let Some(h) = body.get_mut(..2) {
        h.copy_from_slice(&[0, 0]);
    }
    let uri = format!(
        "https://{}{}",
        up.server_name.as_deref().unwrap_or_default(),
        up.path.as_deref().unwrap_or("/dns-query")
    );
    let req = http::Request::post(uri)
        .header(http::header::CONTENT_TYPE, DNS_MESSAGE)
        .header(http::header::ACCEPT, DNS_MESSAGE)
        .header(http::header::CONTENT_LENGTH, body.len())
        .body(())
        .map_err(|_| Fail::Stream(ExchangeError::Unsupported("bad DoH server name or path")))?;
    let conn_err = |e: h2::Error| Fail::Conn(h2_error(e));
    let mut send = conn.send.clone().ready().await.map_err(conn_err)?;
    let (response, mut out) = send.send_request(req, false).map_err(conn_err)?;
    // Stream errors (a reset of this request) leave the connection usable.
    let classify = |e: h2::Error| {
        if e.is_reset() {
            Fail::Stream(h2_error(e))
        } else {
            Fail::Conn(h2_error(e))
        }
    };
    out.send_data(Bytes::from(body), true).map_err(classify)?;
    let response = response.await.map_err(classify)?;
    let status = response.status();
    if status != http::StatusCode::OK {
        return Err(Fail::Stream(ExchangeError::Io(io::Error::other(format!(
            "DoH server answered HTTP {status}"
        )))));
    }
    let mut body = response.into_body();
    let mut reply = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(classify)?;
        let _ = body.flow_control().release_capacity(chunk.len());
        if reply.len() + chunk.len() > MAX_MESSAGE {
            return Err(Fail::Stream(ExchangeError::Io(io::Error::from(
                io::ErrorKind::InvalidData,
            ))));
        }
        reply.extend_from_slice(&chunk);
    }
    // The reply answers ID 0; the caller checks it against `id`.
    match reply.get_mut(..2) {
        Some(h) if h == [0, 0] => h.copy_from_slice(&id.to_be_bytes()),
        _ => {
            return Err(Fail::Stream(ExchangeError::Reply(
                crate::dnswire::msg::BadReply::Mismatch,
            )));
        }
    }
    Ok(reply)
}
