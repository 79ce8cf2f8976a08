//! `[sniff]`: which connections wait for their first bytes so domain rules
//! can apply to them. The reading itself (TLS ClientHello SNI, HTTP Host) is
//! sans-I/O and lives in `kerntun_proto::sniff`, re-exported here.

use serde::{Deserialize, Serialize};

use crate::rules::PortRange;

pub use kerntun_proto::sniff::*;

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

/// A `[sniff]` field the engine cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sniff.{field}: {reason}")]
pub struct SniffConfigError {
    pub field: &'static str,
    pub reason: String,
}

impl SniffConfig {
    pub fn validate(&self) -> Result<(), SniffConfigError> {
        if self.enabled && self.timeout_ms == 0 {
            return Err(SniffConfigError {
                field: "timeout_ms",
                reason: "must be greater than zero".into(),
            });
        }
        Ok(())
    }
}

impl SniffConfig {
    /// Whether connections to `port` are sniffed.
    pub fn covers(&self, port: u16) -> bool {
        self.enabled && self.ports.iter().any(|p| (p.start..=p.end).contains(&port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_covers_ports() {
        let mut c = SniffConfig::default();
        assert!(c.covers(443) && c.covers(80) && !c.covers(8443));
        c.ports = vec!["8000-8999".parse().expect("range")];
        assert!(c.covers(8443) && !c.covers(443));
        c.enabled = false;
        assert!(!c.covers(8443));
    }
}
