//! Shared pieces of the kerntun benchmarks: the netns harness
//! (`kerntun-netbench`, run through `scripts/bench.sh`) and its helper
//! processes (`kerntun-bench-helper`), plus the criterion benches in
//! `benches/`.
//!
//! Everything here that does not need root is plain parsing and rendering
//! (`/proc` files, iperf3 JSON, perf output, criterion estimates, the
//! Markdown page), so it is unit-tested without namespaces. Modules import
//! one way: the parsers (`procfs`, `iperf`, `syscalls`, `cpu_profile`,
//! `crit`) and `scenario` know nothing of the others; `record` holds what
//! they produce; `phone` says what the phone profiles are; `report`
//! renders all of it.

pub mod cpu_profile;
pub mod crit;
pub mod iperf;
pub mod phone;
pub mod procfs;
pub mod record;
pub mod report;
pub mod scenario;
pub mod syscalls;
