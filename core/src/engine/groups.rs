//! The engine's side of outbound groups (`core/src/outbound/group.rs`):
//! the probe tasks, `select`, `groups` and `test_latency`.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::AbortHandle;

use super::{Engine, Parts};
use crate::EngineEvent;
use crate::lifecycle::Phase;
use crate::outbound::group::{GroupEvent, GroupState, ProbeError, ProbeUrl, SelectError};
use crate::outbound::{Outbounds, Route};

/// Why [`Engine::test_latency`] has no number.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LatencyError {
    /// The engine is stopped.
    #[error("the engine is not running")]
    NotRunning,
    /// No outbound or group has this name.
    #[error("no outbound or group named {0:?}")]
    UnknownOutbound(String),
    /// The outbound is `reject` (or a group whose member is).
    #[error("{0:?} rejects every connection")]
    Rejected(String),
    /// The URL is not `http://host[:port]/path`.
    #[error("url: {0}")]
    BadUrl(String),
    /// No answer within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The outbound or the target failed (connect, handshake, not HTTP).
    #[error("{0}")]
    Failed(String),
}

/// Why [`Engine::select`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SelectionError {
    /// The engine is stopped.
    #[error("the engine is not running")]
    NotRunning,
    #[error(transparent)]
    Group(#[from] SelectError),
}

/// Start one probe task per `url-test` / `fallback` group of `outbounds`
/// (none when there is no such group). They end when the runtime shuts
/// down at stop, or when a reload aborts them (the handles returned).
pub(super) fn spawn_probes(
    rt: &tokio::runtime::Handle,
    parts: &Parts,
    outbounds: &Arc<Outbounds>,
) -> Vec<AbortHandle> {
    let mut handles = Vec::new();
    for g in outbounds.groups().probed() {
        let life = parts.life.clone();
        let notify: Arc<dyn Fn(GroupEvent) + Send + Sync> = Arc::new(move |e| {
            if life.phase() == Phase::Running {
                life.emit(event(e));
            }
        });
        let task = rt.spawn(crate::outbound::group::probe_loop(
            outbounds.clone(),
            g,
            notify,
        ));
        handles.push(task.abort_handle());
    }
    handles
}

fn event(e: GroupEvent) -> EngineEvent {
    match e {
        GroupEvent::Selected { group, member } => EngineEvent::GroupSelected { group, member },
        GroupEvent::Health {
            group,
            member,
            healthy,
            latency_ms,
        } => EngineEvent::OutboundHealth {
            group,
            member,
            healthy,
            latency_ms,
        },
    }
}

impl Engine {
    fn running_parts(&self) -> Option<&Parts> {
        self.inner
            .as_ref()
            .filter(|i| i.parts.life.phase() == Phase::Running)
            .map(|i| &i.parts)
    }

    /// Send new flows of the `select` group `group` to its member `member`
    /// (flows already running keep their outbound). The event sink hears
    /// [`EngineEvent::GroupSelected`] when the selection changed.
    pub fn select(&self, group: &str, member: &str) -> Result<(), SelectionError> {
        let parts = self.running_parts().ok_or(SelectionError::NotRunning)?;
        if parts
            .routing
            .load()
            .outbounds
            .groups()
            .select(group, member)?
        {
            tracing::info!("group {group}: new flows go to {member}");
            parts.life.emit(EngineEvent::GroupSelected {
                group: group.to_owned(),
                member: member.to_owned(),
            });
        }
        Ok(())
    }

    /// Every group: its type, members with their last probe's health and
    /// latency, and the member new flows take. Empty once stopped.
    pub fn groups(&self) -> Vec<GroupState> {
        self.inner
            .as_ref()
            .map(|i| i.parts.routing.load().outbounds.groups().states())
            .unwrap_or_default()
    }

    /// One probe through `outbound` (a proxy, `direct`, or a group's
    /// current member): a TCP connect to `url`'s host, the outbound's
    /// handshake and an HTTP/1.1 GET, timed to the first bytes of the
    /// answer's status line, within `timeout`. Blocks the calling thread
    /// up to `timeout` (the probe runs on the engine's runtime).
    pub fn test_latency(
        &self,
        outbound: &str,
        url: &str,
        timeout: Duration,
    ) -> Result<Duration, LatencyError> {
        let inner = self
            .inner
            .as_ref()
            .filter(|i| i.parts.life.phase() == Phase::Running)
            .ok_or(LatencyError::NotRunning)?;
        let url: ProbeUrl = url.parse().map_err(LatencyError::BadUrl)?;
        let ob = inner.parts.routing.load_full().outbounds.clone();
        let route = ob
            .route_of(outbound)
            .ok_or_else(|| LatencyError::UnknownOutbound(outbound.to_owned()))?;
        if route == Route::Reject {
            return Err(LatencyError::Rejected(outbound.to_owned()));
        }
        let ob = ob.clone();
        // On the engine's runtime (its sockets belong to its reactor); this
        // thread only waits, on a plain channel, so a caller that is itself
        // on some runtime is not refused with a panic.
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        inner.rt.spawn(async move {
            let _ = tx.send(ob.probe(route, &url, timeout).await);
        });
        // The probe ends by `timeout`; the margin covers scheduling. A
        // runtime stopped meanwhile drops the sender: an error, not a wait.
        match rx.recv_timeout(timeout + Duration::from_secs(1)) {
            Ok(Ok(d)) => Ok(d),
            Ok(Err(ProbeError::Timeout(t))) => Err(LatencyError::Timeout(t)),
            Ok(Err(e)) => Err(LatencyError::Failed(e.to_string())),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(LatencyError::Timeout(timeout)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(LatencyError::NotRunning),
        }
    }
}
