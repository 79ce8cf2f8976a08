//! kerntun's DNS service: queries to port 53 of the hijacked addresses are
//! answered here (from the cache, the fake-ip pool, or an upstream reached
//! through the outbound the rules choose) instead of being relayed as
//! ordinary flows.

mod config;

pub use config::{DnsConfig, Upstream, UpstreamProto};

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::config::{Config, ConfigError};
use crate::outbound::Outbounds;
use crate::stats::Stats;

/// The DNS service of one engine (the contract the stacks call; the service
/// itself is filled in by the DNS work).
#[derive(Debug)]
pub struct Dns {
    _outbounds: Arc<Outbounds>,
}

/// Why a domain could not be resolved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DnsError {
    #[error("no upstream answered")]
    Upstream,
}

impl Dns {
    /// The service, or `None` when `[dns]` is off.
    pub fn new(
        config: &Config,
        outbounds: Arc<Outbounds>,
    ) -> Result<Option<Arc<Self>>, ConfigError> {
        if !config.dns.enabled {
            return Ok(None);
        }
        let _ = outbounds;
        Err(ConfigError::Dns {
            field: "enabled",
            reason: "the DNS service is not built yet".into(),
        })
    }

    /// Whether port-53 traffic to `dst` is answered here.
    pub fn hijacks(&self, _dst: SocketAddr) -> bool {
        false
    }

    /// The answer to one hijacked query; `None` for a packet that is not a
    /// DNS query (counted as malformed).
    pub async fn answer(&self, _query: &[u8], _stats: &Stats) -> Option<Vec<u8>> {
        None
    }

    /// The domain a fake address stands for.
    pub fn fake_domain(&self, _ip: IpAddr) -> Option<Arc<str>> {
        None
    }

    /// Resolve a domain through the upstreams (never the fake pool).
    pub async fn resolve(
        &self,
        _domain: &str,
        _v6: bool,
        _stats: &Stats,
    ) -> Result<IpAddr, DnsError> {
        Err(DnsError::Upstream)
    }
}
