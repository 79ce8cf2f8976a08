//! The life of an accepted connection, written once for both stacks and
//! generic over the app's side ([`App`]): a kernel socket accepted by the
//! system stack's listener, or a smoltcp socket.
//!
//! * [`run`]: one of the three below, as the connection's plan says;
//! * [`relay()`]: relay to the outbound connected at SYN time;
//! * [`dns`]: DNS over TCP, answered by the engine;
//! * [`sniff()`]: read the domain from the first bytes and/or look up the
//!   owning app (`owner.rs`), route, connect, relay.
//!
//! Every session ends when the engine starts draining (the app then sees a
//! reset at once), and holds `hold` (its admission permit, and on the
//! system stack its NAT guard) until it ends. A relay also ends, resetting
//! both sides, when its hold says the connection went idle ([`Hold::idle`]).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use super::{Dispatcher, Network, Next};
use crate::budget::{ByteBudget, Charge, RELAY_FALLBACK_BUFFER};
use crate::conns::{DomainSource, Registered};
use crate::framing::Framing;
use crate::lifecycle::Phase;
use crate::outbound::{Address, OutboundStream, Route, reset_on_close};
use crate::relay::{self, Meter, Side};
use crate::sniff::{self, Sniffed};
use crate::stats::{EngineDrop, OutboundCounters, Stats};

/// The app's side of a connection, as a session needs it besides relaying
/// it ([`Side`], which `relay::run` takes).
pub(crate) trait App: Side {
    /// The domain the first bytes name, looked at within `timeout` where
    /// they wait (nothing is consumed: the relay moves every byte), with
    /// what a larger look charged to `pool` ([`SniffBytes`]).
    async fn sniff(&self, timeout: Duration, pool: &SniffBytes<'_>) -> Sniff;

    /// Reset the connection toward the app.
    fn reset(&self);

    /// Whether this side's sessions were admitted with the relay's
    /// fallback share (`Budget::session_cost`). smoltcp's were not: their
    /// unframed relay needs no buffer, and a framed one charges what it
    /// holds as it goes ([`Meter::unshared`]).
    const FALLBACK_PAID: bool = true;
}

/// The system stack's side: a kernel socket (the relay splices it to a
/// plain outbound on Linux/Android); sniffing peeks, so nothing is consumed.
impl App for TcpStream {
    async fn sniff(&self, timeout: Duration, pool: &SniffBytes<'_>) -> Sniff {
        let (domain, charge) = sniff_peek(self, timeout, pool).await;
        Sniff { domain, charge }
    }

    fn reset(&self) {
        reset_on_close(self);
    }
}

/// What a session holds until it ends, and how it learns that its
/// connection went idle.
pub(crate) trait Hold {
    /// Resolves once the connection has been idle for `timeouts.tcp_idle_s`
    /// and the session should end (the system stack's NAT entry; see its
    /// impl in `stack/system/listener.rs`).
    async fn idle(&self);
}

/// smoltcp's sessions hold nothing here (their stream carries the permit,
/// and hands it to the closing socket): smoltcp itself aborts a connection
/// that hears nothing for `timeouts.tcp_idle_s`, and the relay then ends
/// with it.
impl Hold for () {
    async fn idle(&self) {
        std::future::pending().await
    }
}

/// How long sniffing waits between looks when the first bytes are
/// incomplete (peek cannot wait for *more* data than it already saw).
const SNIFF_RETRY: Duration = Duration::from_millis(5);

/// Bytes a system-stack sniffing session peeks into of its own: the
/// relay's fallback buffers it is charged for (`Budget::session_cost`) are
/// not allocated until it relays, so sniffing may use as much (smoltcp's
/// sessions look at the bytes in the ring, with no buffer). Almost every ClientHello and HTTP
/// request head fits; a longer one needs its buffer grown to
/// [`sniff::MAX_SNIFF`] (and a read chunk), charged to the relay pool.
pub(crate) const SNIFF_OWN: usize = 4 * RELAY_FALLBACK_BUFFER;

/// What sniffing found: the domain, and the charge for a buffer grown
/// past [`SNIFF_OWN`], held until the outbound is connected.
pub(crate) struct Sniff {
    pub domain: Option<String>,
    pub charge: Option<Charge>,
}

/// The pool a sniffing buffer grows from, and what counts its refusals.
pub(crate) struct SniffBytes<'a> {
    pub pool: &'a Arc<ByteBudget>,
    pub stats: &'a Stats,
}

impl SniffBytes<'_> {
    /// Charge `n` bytes, or count the refusal: sniffing then ends with
    /// what it has (the flow is routed by address, unless that named a
    /// domain already).
    fn charge(&self, n: usize) -> Option<Charge> {
        let charge = self.pool.try_charge(n, Instant::now());
        if charge.is_none() {
            self.stats.dns.sniff_unbudgeted.fetch_add(1, Relaxed);
        }
        charge
    }
}

/// Sniff a kernel socket without consuming anything (MSG_PEEK): the relay
/// later moves every byte, spliced or copied. Peeks into [`SNIFF_OWN`]
/// bytes, then into [`sniff::MAX_SNIFF`] charged to the pool while the
/// first bytes still need more.
async fn sniff_peek(
    app: &TcpStream,
    timeout: Duration,
    pool: &SniffBytes<'_>,
) -> (Option<String>, Option<Charge>) {
    let mut buf = vec![0u8; SNIFF_OWN];
    let mut charge = None;
    let domain = tokio::time::timeout(timeout, async {
        loop {
            let n = app.peek(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            match sniff::sniff(&buf[..n]) {
                Sniffed::Domain { name, .. } => return Some(name.to_owned()),
                Sniffed::NoDomain => return None,
                Sniffed::NeedMore if n == buf.len() && buf.len() < sniff::MAX_SNIFF => {
                    charge = Some(pool.charge(sniff::MAX_SNIFF)?);
                    buf = vec![0u8; sniff::MAX_SNIFF];
                }
                Sniffed::NeedMore if n == buf.len() => return None,
                Sniffed::NeedMore => tokio::time::sleep(SNIFF_RETRY).await,
            }
        }
    })
    .await
    .ok()
    .flatten();
    (domain, charge)
}

/// Serve an accepted connection from `client` to `server` as its plan
/// said. Spawn this future itself (not inside another async block): every
/// idle connection holds one, so its size is the engine's memory per
/// connection. A relayed or sniffed connection is in the live connection
/// list (`conns.rs`) while it lives; DNS over TCP, answered here, is not.
pub(crate) async fn run<A: App, H: Hold>(
    d: Arc<Dispatcher>,
    app: A,
    next: Next,
    client: SocketAddr,
    server: SocketAddr,
    hold: H,
) {
    match next {
        Next::Relay(out) => {
            let flow = d.conns.register(Network::Tcp, client, server);
            // Routed already: the owner is for the connection list only.
            d.record_owner(&flow.record, Network::Tcp, client, server);
            // Routed at SYN time: by a fake address's domain, or by address.
            if let Some(dns) = &d.routing().dns
                && dns.is_fake(server.ip())
                && let Some(domain) = dns.fake_domain(server.ip())
            {
                flow.record.set_domain(&domain, DomainSource::FakeIp);
            }
            relay(&d, app, out, hold, flow).await
        }
        // Boxed: rare, and their state would otherwise size every session's
        // future (docs/benchmarks.md, idle connections).
        Next::Dns => Box::pin(dns(&d, app, hold)).await,
        Next::Sniff => {
            let flow = d.conns.register(Network::Tcp, client, server);
            // Waited for only where an owner rule could match; otherwise
            // asked for the list alone, without holding up the route.
            let ask = d.needs_owner(Network::Tcp, server);
            if !ask {
                d.record_owner(&flow.record, Network::Tcp, client, server);
            }
            Box::pin(sniff(&d, app, (client, server), (true, ask), hold, flow)).await
        }
        Next::Owner => {
            let flow = d.conns.register(Network::Tcp, client, server);
            Box::pin(sniff(&d, app, (client, server), (false, true), hold, flow)).await
        }
    }
}

/// Counts a session as active for as long as it lives (also when aborted).
struct Active<'a>(&'a Stats);

impl<'a> Active<'a> {
    fn new(stats: &'a Stats) -> Self {
        stats.tcp_sessions_total.fetch_add(1, Relaxed);
        stats.tcp_sessions_active.fetch_add(1, Relaxed);
        Active(stats)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.tcp_sessions_active.fetch_sub(1, Relaxed);
    }
}

/// Relay `app` to the outbound connected for it, counting its bytes into
/// its record in the connection list (`flow`). A failure, or the host
/// closing it, resets both sides; a frame of the outbound's framing that
/// does not verify counts as the proxy's protocol error.
///
/// Not `async` itself: the record takes the outbound's name and why it was
/// chosen here, and the future holds only the parts the relay uses (an
/// async fn keeps its parameters for its whole life, and this future is
/// memory per connection).
pub(crate) fn relay<'a, A: App + 'a, H: Hold + 'a>(
    d: &'a Dispatcher,
    app: A,
    mut out: OutboundStream,
    hold: H,
    flow: Registered,
) -> impl Future<Output = ()> + 'a {
    // Named by the stream's own outbound, not by `route` (an index into
    // the generation that connected it, which a reload may have replaced).
    let why = out.why.take();
    flow.record.relaying(out.outbound_name(), why);
    let OutboundStream {
        stream,
        framing,
        counters,
        ..
    } = out;
    relay_stream(d, app, stream, framing, counters, hold, flow)
}

/// [`relay()`]'s future.
async fn relay_stream<A: App, H: Hold>(
    d: &Dispatcher,
    app: A,
    out: TcpStream,
    mut framing: Option<Box<dyn Framing>>,
    counters: Option<Arc<OutboundCounters>>,
    hold: H,
    flow: Registered,
) {
    let active = Active::new(&d.stats);
    let stats = &d.stats;
    let record = &flow.record;
    let meter = Meter::tcp(stats, Some(&*d.relay_pool)).with_flow(&record.up, &record.down);
    let meter = match A::FALLBACK_PAID {
        true => meter,
        false => meter.unshared(&d.admission),
    };
    let r = tokio::select! {
        // The host closed it (`Engine::close_connection`, counted there).
        () = record.closed() => Err(io::Error::new(io::ErrorKind::ConnectionAborted, "closed by the host")),
        r = relay::run(&app, &out, framing.as_deref_mut(), &d.relay, &meter) => r,
        () = d.life.reached(Phase::Draining) => Err(io::Error::other("engine stopping")),
        () = hold.idle() => Err(io::Error::new(io::ErrorKind::TimedOut, "idle timeout")),
        // The host moved to a network without this outbound's address: the
        // peer will never answer, so the app hears a reset now and
        // reconnects on the new network (`network.rs`).
        () = d.life.network().stranded(&out) => {
            stats.sessions_reset_on_network_change.fetch_add(1, Relaxed);
            Err(io::Error::new(io::ErrorKind::NetworkDown, "the network changed"))
        }
    };
    match &r {
        Ok(done) => {
            let fell_back = [done.up, done.down]
                .iter()
                .filter(|l| {
                    !matches!(l.fallback, None | Some(relay::Fallback::Disabled)) && l.bytes() > 0
                })
                .count();
            if fell_back > 0 {
                stats.splice_fallbacks.fetch_add(fell_back as u64, Relaxed);
            }
        }
        Err(e) => {
            if e.kind() == io::ErrorKind::InvalidData
                && let Some(c) = &counters
            {
                c.protocol_errors.fetch_add(1, Relaxed);
            }
            // A cut frame the relay pool had no room for within its wait
            // (`relay/copy.rs`, `FRAME_WAIT`).
            if e.kind() == io::ErrorKind::OutOfMemory {
                Stats::drop(stats, EngineDrop::RelayFrameRefused);
            }
            // A failure reaches both sides as a reset, not a clean FIN.
            let via = counters.as_ref().map_or("direct", |c| c.name.as_str());
            tracing::debug!("relay via {via} ended with {e}");
            app.reset();
            reset_on_close(&out);
        }
    }
    drop(active);
    drop(app);
    drop(hold);
    drop(flow);
}

/// DNS over TCP to a hijacked address: answered here, never relayed.
pub(crate) async fn dns<A: App, H>(d: &Dispatcher, app: A, hold: H) {
    if let Some(dns) = &d.routing().dns {
        let r = tokio::select! {
            r = dns.serve_tcp(&app, &d.stats) => r,
            () = d.life.reached(Phase::Draining) => Err(io::Error::other("engine stopping")),
        };
        if let Err(e) = r {
            tracing::debug!("dns over tcp ended with {e}");
            app.reset();
        }
    }
    drop(app);
    drop(hold);
}

/// A connection accepted before routing: read its domain from the first
/// bytes (`read`) and/or ask for the app that owns it (`ask`; both at
/// once), route, connect, send what sniffing consumed, relay. A refusal, a
/// failed connect or the host closing it (`flow`) resets the app.
pub(crate) async fn sniff<A: App, H: Hold>(
    d: &Dispatcher,
    app: A,
    (client, server): (SocketAddr, SocketAddr),
    (read, ask): (bool, bool),
    hold: H,
    flow: Registered,
) {
    let timeout = Duration::from_millis(d.routing().sniff.timeout_ms);
    let connected = async {
        let pool = SniffBytes {
            pool: &d.relay_pool,
            stats: &d.stats,
        };
        let first_bytes = async {
            if !read {
                return Sniff {
                    domain: None,
                    charge: None,
                };
            }
            let s = app.sniff(timeout, &pool).await;
            count_sniff(&d.stats, s.domain.is_some());
            s
        };
        let (owner, Sniff { domain, charge }) = tokio::join!(
            async {
                match ask {
                    true => d.owner(Network::Tcp, client, server).await,
                    false => None,
                }
            },
            first_bytes
        );
        if let Some(domain) = &domain {
            flow.record.set_domain(domain, DomainSource::Sniffed);
        }
        if let Some(o) = &owner {
            flow.record.set_owner(o.clone());
        }
        // Routed by the configuration of now (a reload while it sniffed
        // counts), and connected in the same generation.
        let on = d.routing();
        let routed = Dispatcher::route_later(
            &on,
            server,
            domain.as_deref(),
            owner.as_deref(),
            Network::Tcp,
        );
        let Some((route, why, dst)) = routed else {
            // A fake address whose domain went while it waited.
            Stats::drop(&d.stats, EngineDrop::FakeIpUnknown);
            return None;
        };
        if let Address::Domain(name, _) = &dst {
            flow.record.set_domain(name, DomainSource::FakeIp);
        }
        if route == Route::Reject {
            d.stats.tcp_rejected_by_rule.fetch_add(1, Relaxed);
            return None;
        }
        let mut out = d.connect(&on, route, &dst, server.is_ipv6()).await.ok()?;
        out.why = on.outbounds.explain(&why);
        drop(charge);
        Some(out)
    };
    let out = tokio::select! {
        out = connected => out,
        () = d.life.reached(Phase::Draining) => None,
        () = flow.record.closed() => None,
    };
    match out {
        Some(out) => Box::pin(relay(d, app, out, hold, flow)).await,
        None => {
            app.reset();
            drop(app);
            drop(hold);
            drop(flow);
        }
    }
}

fn count_sniff(stats: &Stats, found: bool) {
    if found {
        stats.dns.sniffed.fetch_add(1, Relaxed);
    } else {
        stats.dns.sniff_misses.fetch_add(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;
    use crate::budget::SESSION_STATE;
    use crate::stack::smoltcp::SmolStream;
    use crate::stack::system::FlowHold;

    /// A first request longer than a session's own sniffing bytes is read
    /// whole only with room in the relay pool for the larger buffer, held
    /// while sniffing and given back after; without room sniffing ends,
    /// counted. A short one takes nothing from the pool.
    #[tokio::test]
    async fn a_long_first_request_is_sniffed_only_with_room_in_the_pool() {
        use crate::budget::Pressure;

        let pad = "a".repeat(SNIFF_OWN + 1024);
        let long = format!("GET / HTTP/1.1\r\nX-Pad: {pad}\r\nHost: long.example\r\n\r\n");
        let short = "GET / HTTP/1.1\r\nHost: short.example\r\n\r\n".to_owned();
        for (request, room, want) in [
            (&long, true, Some("long.example")),
            (&long, false, None),
            (&short, false, Some("short.example")),
        ] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let client = TcpStream::connect(listener.local_addr().expect("addr"))
                .await
                .expect("connect");
            let (app, _) = listener.accept().await.expect("accept");
            client.write_all(request.as_bytes()).await.expect("request");
            let limit = if room {
                2 * sniff::MAX_SNIFF
            } else {
                sniff::MAX_SNIFF - 1
            };
            let pool = Arc::new(ByteBudget::new(limit, Arc::new(Pressure::default())));
            let stats = Stats::default();
            let bytes = SniffBytes {
                pool: &pool,
                stats: &stats,
            };
            let got = app.sniff(Duration::from_secs(2), &bytes).await;
            assert_eq!(got.domain.as_deref(), want, "{} bytes", request.len());
            let long = request.len() > SNIFF_OWN;
            let held = if long && room { sniff::MAX_SNIFF } else { 0 };
            assert_eq!(pool.used(), held, "{} bytes", request.len());
            let refused = u64::from(long && !room);
            assert_eq!(stats.dns.sniff_unbudgeted.load(Relaxed), refused);
            drop(got);
            assert_eq!(pool.used(), 0, "given back");
        }
    }

    /// The size of the future `f` returns (an async fn item's state machine).
    fn future_size<A, B, C, D, E, G, F: Future>(_: impl Fn(A, B, C, D, E, G) -> F) -> usize {
        size_of::<F>()
    }

    /// Every idle connection holds one session future, so its size is
    /// memory per connection, part of `budget::SESSION_STATE` (which
    /// `core/tests/memory.rs` checks end to end). Measured on x86_64 with
    /// the waits for a network change and for the host's close, the
    /// connection list's record and the outbound's counters (which name it
    /// across a reload), in the relay (which holds only the parts of the
    /// outbound stream it uses), the relay's moves between smoltcp's rings
    /// and the kernel, and what a session admitted without the fallback
    /// share charges as it goes (`relay::Scratch`): 3168 bytes (system
    /// stack) and 3080 (smoltcp), 136 more than before those two (rustc
    /// 1.95); 3.25 KiB leaves the rest of the 5 KiB for the sockets'
    /// registrations, the NAT entry and the task.
    #[test]
    fn session_futures_fit_their_share_of_the_session_budget() {
        let system = future_size(run::<TcpStream, FlowHold>);
        let smoltcp = future_size(run::<SmolStream, ()>);
        println!("[size] session future: system stack {system} B, smoltcp {smoltcp} B");
        for size in [system, smoltcp] {
            assert!(size <= 3328, "{size} B of {SESSION_STATE} per session");
        }
    }
}
