//! Probing a group's members: one probe through an outbound
//! ([`Outbounds::probe`]), and the loop that probes every member of a
//! `url-test` or `fallback` group each interval and moves its selection
//! ([`probe_loop`]). Apart from `group.rs`, which defines the groups and
//! resolves flows through them without any I/O.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{DOWN, GroupEvent, Pick, ProbeUrl, UP, choose};
use crate::outbound::addr::Address;
use crate::outbound::{OutboundError, OutboundStream, Outbounds, Route, resolve};

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// The outbound could not be opened (connect, handshake, resolution).
    #[error("{0}")]
    Outbound(#[from] OutboundError),
    /// No status line arrived in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The target closed the connection (or the proxy did) before it answered.
    #[error("the connection closed before an answer")]
    Closed,
    /// The target answered something other than HTTP.
    #[error("the answer is not HTTP")]
    NotHttp,
}

impl Outbounds {
    /// One probe along `route`: a TCP connect to `url`'s host, the
    /// outbound's handshake, an HTTP/1.1 GET, and the time until the first
    /// five bytes of the answer (`HTTP/`), all within `timeout`. Not
    /// counted in the outbound's statistics: no app made it.
    pub async fn probe(
        &self,
        route: Route,
        url: &ProbeUrl,
        timeout: Duration,
    ) -> Result<Duration, ProbeError> {
        let start = Instant::now();
        match tokio::time::timeout(timeout, self.probe_inner(route, url)).await {
            Ok(r) => r.map(|()| start.elapsed()),
            Err(_) => Err(ProbeError::Timeout(timeout)),
        }
    }

    async fn probe_inner(&self, route: Route, url: &ProbeUrl) -> Result<(), ProbeError> {
        let mut out = match (route, &url.target) {
            // A direct probe to a host name resolves it as proxy names are
            // (kerntun's resolvers, on direct sockets).
            (Route::Direct, Address::Domain(name, port)) => {
                let named = resolve::Named::new(name, *port);
                let addrs = named
                    .addresses(&self.factory, &self.resolvers)
                    .await
                    .map_err(|reason| OutboundError::Resolve {
                        outbound: "direct".into(),
                        name: name.clone(),
                        reason,
                    })?;
                let (stream, _) = resolve::connect_happy(&self.factory, &addrs)
                    .await
                    .map_err(OutboundError::from)?;
                OutboundStream {
                    stream,
                    framing: None,
                    route,
                    why: None,
                    counters: None,
                }
            }
            (route, target) => self.connect_inner(route, target).await?,
        };
        let request = url.request();
        let mut plain = Vec::with_capacity(64);
        match &mut out.framing {
            Some(f) => {
                let mut wire = Vec::with_capacity(request.len() + 64);
                f.split().0.seal(&request, &mut wire);
                out.stream
                    .write_all(&wire)
                    .await
                    .map_err(OutboundError::from)?;
            }
            None => out
                .stream
                .write_all(&request)
                .await
                .map_err(OutboundError::from)?,
        }
        let mut buf = [0u8; 512];
        while plain.len() < 5 {
            let n = out
                .stream
                .read(&mut buf)
                .await
                .map_err(OutboundError::from)?;
            if n == 0 {
                return Err(ProbeError::Closed);
            }
            match &mut out.framing {
                Some(f) => {
                    f.split()
                        .1
                        .open(&buf[..n], &mut plain, usize::MAX)
                        .map_err(OutboundError::from)?;
                }
                None => plain.extend_from_slice(&buf[..n]),
            }
        }
        if plain.starts_with(b"HTTP/") {
            Ok(())
        } else {
            Err(ProbeError::NotHttp)
        }
    }
}

/// Probe the members of group `g` every interval and move its selection
/// (`url-test`: the fastest healthy member, past the tolerance;
/// `fallback`: the first healthy one), telling `notify` of each change of
/// selection and of health. Runs until the engine's runtime shuts down.
/// Returns at once for a group that does not probe.
pub async fn probe_loop(
    outbounds: Arc<Outbounds>,
    g: usize,
    notify: Arc<dyn Fn(GroupEvent) + Send + Sync>,
) {
    let Some(spec) = outbounds.groups.list.get(g).and_then(|x| x.probe.as_ref()) else {
        return;
    };
    let (interval, timeout) = (spec.interval, spec.timeout);
    loop {
        let group = &outbounds.groups.list[g];
        // Every member at once; the round ends when the last probe does
        // (each within `timeout`), so no member has two probes in flight.
        let mut set = tokio::task::JoinSet::new();
        for (i, m) in group.members.iter().enumerate() {
            let route = match *m {
                Pick::Route(r) => r,
                Pick::Group(h) => outbounds.groups.resolve(h),
            };
            let ob = outbounds.clone();
            set.spawn(async move {
                let r = match route {
                    Route::Reject => Err(ProbeError::Outbound(OutboundError::Rejected)),
                    route => {
                        let Some(spec) = ob.groups.list[g].probe.as_ref() else {
                            return (i, Err(ProbeError::Timeout(timeout)));
                        };
                        ob.probe(route, &spec.url, timeout).await
                    }
                };
                (i, r)
            });
        }
        while let Some(done) = set.join_next().await {
            let Ok((i, r)) = done else { continue };
            let h = &group.health[i];
            let (state, ms) = match &r {
                Ok(d) => (UP, u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)),
                Err(e) => {
                    tracing::debug!(
                        "group {}: probe of {} failed: {e}",
                        group.name,
                        group.member_names[i]
                    );
                    (DOWN, h.latency_ms.load(Relaxed))
                }
            };
            h.latency_ms.store(ms, Relaxed);
            if h.state.swap(state, Relaxed) != state {
                tracing::info!(
                    "group {}: {} is {}",
                    group.name,
                    group.member_names[i],
                    if state == UP { "up" } else { "down" }
                );
                notify(GroupEvent::Health {
                    group: group.name.clone(),
                    member: group.member_names[i].clone(),
                    healthy: state == UP,
                    latency_ms: (state == UP).then_some(ms),
                });
            }
        }
        if let Some(next) = choose(group)
            && group.current.swap(next, Relaxed) != next
        {
            tracing::info!(
                "group {}: new flows go to {}",
                group.name,
                group.member_names[next]
            );
            notify(GroupEvent::Selected {
                group: group.name.clone(),
                member: group.member_names[next].clone(),
            });
        }
        tokio::time::sleep(interval).await;
    }
}
