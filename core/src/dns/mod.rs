//! kerntun's DNS service: queries to port 53 of the hijacked addresses are
//! answered here (from the cache, the fake-ip pool, or an upstream reached
//! through the outbound the rules choose) instead of being relayed as
//! ordinary flows.

mod config;

pub use config::{DnsConfig, Upstream, UpstreamProto};
