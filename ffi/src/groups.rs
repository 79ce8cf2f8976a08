//! Outbound groups for the app (`core/src/outbound/group.rs`): their
//! configuration (`EngineConfig.groups`), `Engine.select`,
//! `Engine.groups()` (what a server list is drawn from) and
//! `Engine.testLatency`.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use kerntun::config::{GroupConfig, GroupKind};
use kerntun::outbound::group::{GroupState as CoreGroupState, Health, SelectError};
use kerntun::{LatencyError, SelectionError};

use crate::engine::Engine;
use crate::error::{KerntunError, guard};

/// How a group picks its member.
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GroupType {
    /// The app's choice (`Engine.select`), `default` until then.
    Select,
    /// The fastest healthy member by probe, kept until another is faster
    /// by more than `toleranceMs`.
    #[serde(alias = "url_test")]
    UrlTest,
    /// The first healthy member, in order.
    Fallback,
}

/// One group: `[groups.NAME]` in the TOML (docs/configuration.md,
/// "Outbound groups"). Rules name it like an outbound.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupOptions {
    pub kind: GroupType,
    /// Names in `EngineConfig.outbounds`, `direct`, `reject`, or other
    /// groups (no cycles).
    pub members: Vec<String>,
    /// Select groups: the member until `select` (default: the first).
    #[serde(default)]
    #[uniffi(default = None)]
    pub default_member: Option<String>,
    /// url-test, fallback: the probe target, `http://host[:port]/path`.
    #[serde(default)]
    #[uniffi(default = None)]
    pub url: Option<String>,
    /// url-test, fallback: time between probe rounds (default 300000).
    #[serde(default)]
    #[uniffi(default = None)]
    pub interval_ms: Option<u64>,
    /// url-test: how much faster another member must be (default 50).
    #[serde(default)]
    #[uniffi(default = None)]
    pub tolerance_ms: Option<u64>,
    /// url-test, fallback: a probe without an answer by then failed
    /// (default 5000).
    #[serde(default)]
    #[uniffi(default = None)]
    pub timeout_ms: Option<u64>,
}

impl GroupOptions {
    fn to_core(&self) -> GroupConfig {
        GroupConfig {
            kind: self.kind.into(),
            members: self.members.clone(),
            default: self.default_member.clone(),
            url: self.url.clone(),
            interval_ms: self.interval_ms,
            tolerance_ms: self.tolerance_ms,
            timeout_ms: self.timeout_ms,
        }
    }
}

paired!(GroupType, GroupKind {
    Select => Select,
    UrlTest => UrlTest,
    Fallback => Fallback,
});

/// `EngineConfig.groups` in the core's form (checked with the rest of the
/// configuration at start).
pub(crate) fn to_core(groups: &HashMap<String, GroupOptions>) -> BTreeMap<String, GroupConfig> {
    groups
        .iter()
        .map(|(name, g)| (name.clone(), g.to_core()))
        .collect()
}

/// A member's health as its last probe found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberHealth {
    /// Not probed (yet, or never: select groups do not probe).
    Unknown,
    Up,
    Down,
}

/// One member of a group.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Serialize)]
pub struct GroupMember {
    pub name: String,
    pub health: MemberHealth,
    /// The last answered probe's time in ms; `null` before one.
    pub latency_ms: Option<u32>,
}

/// One group as it is now.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Serialize)]
pub struct GroupState {
    pub name: String,
    pub kind: GroupType,
    pub members: Vec<GroupMember>,
    /// The member new flows take.
    pub selected: String,
}

impl From<CoreGroupState> for GroupState {
    fn from(g: CoreGroupState) -> Self {
        GroupState {
            name: g.name,
            kind: g.kind.into(),
            members: g
                .members
                .into_iter()
                .map(|m| GroupMember {
                    name: m.name,
                    health: match m.health {
                        Health::Unknown => MemberHealth::Unknown,
                        Health::Up => MemberHealth::Up,
                        Health::Down => MemberHealth::Down,
                    },
                    latency_ms: m.latency_ms,
                })
                .collect(),
            selected: g.selected,
        }
    }
}

impl From<SelectionError> for KerntunError {
    fn from(e: SelectionError) -> Self {
        match e {
            SelectionError::Group(SelectError::UnknownGroup(group)) => {
                KerntunError::UnknownGroup { group }
            }
            SelectionError::Group(SelectError::NotSelect { group, kind }) => {
                KerntunError::NotSelectGroup {
                    group,
                    kind: kind.into(),
                }
            }
            SelectionError::Group(SelectError::UnknownMember { group, member }) => {
                KerntunError::UnknownMember { group, member }
            }
            SelectionError::NotRunning => KerntunError::NotRunning {
                reason: "select needs a running engine".into(),
            },
            // Both are non_exhaustive: a later variant still arrives
            // typed, with its message.
            other => KerntunError::Internal {
                reason: other.to_string(),
            },
        }
    }
}

impl From<LatencyError> for KerntunError {
    fn from(e: LatencyError) -> Self {
        match e {
            LatencyError::NotRunning => KerntunError::NotRunning {
                reason: "testLatency needs a running engine".into(),
            },
            LatencyError::UnknownOutbound(name) => KerntunError::UnknownOutbound { name },
            LatencyError::BadUrl(reason) => KerntunError::InvalidUrl { reason },
            LatencyError::Timeout(t) => KerntunError::LatencyTimeout {
                timeout_ms: u64::try_from(t.as_millis()).unwrap_or(u64::MAX),
            },
            other => KerntunError::Unreachable {
                reason: other.to_string(),
            },
        }
    }
}

#[uniffi::export]
impl Engine {
    /// Send the new flows of the select group `group` to its member
    /// `member` (running flows keep their outbound). Listeners hear
    /// `EngineEvent.GroupSelected` when that changed the selection.
    pub fn select(&self, group: String, member: String) -> Result<(), KerntunError> {
        guard(|| {
            let e = self
                .running()
                .ok_or_else(|| KerntunError::from(SelectionError::NotRunning))?;
            Ok(e.select(&group, &member)?)
        })
    }

    /// Every group: type, members with their last probe's health and
    /// latency, and the member new flows take. Empty once stopped.
    pub fn groups(&self) -> Vec<GroupState> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.running()
                .map(|e| e.groups().into_iter().map(GroupState::from).collect())
                .unwrap_or_default()
        }))
        .unwrap_or_default()
    }

    /// One probe through `outbound` (a name in `EngineConfig.outbounds`,
    /// `direct`, or a group, which probes its current member): a TCP
    /// connect, the proxy's handshake and an HTTP/1.1 GET of `url`
    /// (`http://host[:port]/path`), timed to the first bytes of the
    /// answer, any status. Milliseconds; blocks for at most `timeoutMs`,
    /// so call it off the main thread.
    pub fn test_latency(
        &self,
        outbound: String,
        url: String,
        timeout_ms: u32,
    ) -> Result<u32, KerntunError> {
        guard(|| {
            let e = self
                .running()
                .ok_or_else(|| KerntunError::from(LatencyError::NotRunning))?;
            let timeout = Duration::from_millis(u64::from(timeout_ms.max(1)));
            let d = e.test_latency(&outbound, &url, timeout)?;
            Ok(u32::try_from(d.as_millis()).unwrap_or(u32::MAX))
        })
    }
}
