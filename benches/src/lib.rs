//! Shared pieces of the kerntun benchmarks: the netns harness
//! (`kerntun-netbench`, run through `scripts/bench.sh`) and its helper
//! processes (`kerntun-bench-helper`), plus the criterion benches in
//! `benches/`.
//!
//! Everything here that does not need root is plain parsing and rendering
//! (`/proc` files, iperf3 JSON, criterion estimates, the Markdown page), so
//! it is unit-tested without namespaces.

pub mod crit;
pub mod iperf;
pub mod phone;
pub mod phone_udp;
pub mod procfs;
pub mod profile;
pub mod record;
pub mod report;
pub mod scenario;
