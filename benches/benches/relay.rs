//! What the live connection list costs the relay, and what a listing
//! costs the host:
//!
//! - `relay_counters`: the counters of one relayed chunk as the copy relay
//!   updates them, with and without the connection's own pair of counters
//!   (`conns.rs`), 1,000 chunks a run;
//! - `relay_copy`: 4 MiB relayed between two loopback TCP connections
//!   through the engine's userspace copy, with and without them;
//! - `connections_list`: one listing of 1,000, 10,000 and 20,000 live
//!   connections (each with a 253-byte domain), which copies at most
//!   `LIST_CAP` (10,000) of them; it prints the heap a listing holds.
//!
//! Run: `cargo bench -p kerntun-benches --bench relay`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kerntun::bench::{conns, relay};

fn counters(c: &mut Criterion) {
    let mut g = c.benchmark_group("relay_counters");
    const CHUNKS: u64 = 1_000;
    g.throughput(Throughput::Elements(CHUNKS));
    for flow in [false, true] {
        let id = if flow { "with_flow" } else { "engine_only" };
        g.bench_function(id, |b| {
            b.iter(|| black_box(relay::count_chunks(CHUNKS, 64 * 1024, flow)))
        });
    }
    g.finish();
}

fn copy(c: &mut Criterion) {
    let rig = relay::CopyRelay::new().expect("a runtime");
    const TOTAL: usize = 4 << 20;
    let mut g = c.benchmark_group("relay_copy");
    g.throughput(Throughput::Bytes(TOTAL as u64));
    g.sample_size(30);
    for flow in [false, true] {
        let id = if flow { "with_flow" } else { "engine_only" };
        g.bench_function(id, |b| {
            b.iter(|| {
                let got = rig.relay(TOTAL, flow).expect("relay");
                assert_eq!(got, TOTAL as u64);
            })
        });
    }
    g.finish();
}

fn listing(c: &mut Criterion) {
    let mut g = c.benchmark_group("connections_list");
    g.sample_size(20);
    for n in [1_000usize, 10_000, 20_000] {
        let registry = conns::Registry::new(n);
        let l = registry.list();
        println!(
            "connections_list/{n}: {} listed (truncated: {}), {} KiB of heap",
            l.connections.len(),
            l.truncated,
            conns::listing_bytes(&l) / 1024
        );
        g.bench_with_input(BenchmarkId::from_parameter(n), &registry, |b, r| {
            b.iter(|| black_box(r.list().connections.len()))
        });
    }
    g.finish();
}

criterion_group!(benches, counters, copy, listing);
criterion_main!(benches);
