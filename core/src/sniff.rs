//! Reading the domain a connection is for from its first bytes (TLS
//! ClientHello SNI, HTTP/1 Host) so domain rules apply to connections made to
//! real addresses.

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;
use crate::rules::PortRange;

/// `[sniff]` in the engine's TOML.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SniffConfig {
    /// Read SNI / Host before routing. Only connections whose route could
    /// depend on a domain (some rule names one) wait for it.
    pub enabled: bool,
    /// Destination ports sniffed.
    pub ports: Vec<PortRange>,
    /// Longest wait for the first bytes before routing by address.
    pub timeout_ms: u64,
}

impl Default for SniffConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            ports: vec![
                PortRange { start: 80, end: 80 },
                PortRange {
                    start: 443,
                    end: 443,
                },
            ],
            timeout_ms: 300,
        }
    }
}

impl SniffConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.enabled && self.timeout_ms == 0 {
            return Err(ConfigError::Sniff {
                field: "timeout_ms",
                reason: "must be greater than zero".into(),
            });
        }
        Ok(())
    }
}
