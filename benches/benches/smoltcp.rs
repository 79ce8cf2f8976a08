//! The smoltcp stack's per-packet cost: one inbound data segment (1460
//! bytes, MTU 1500) into an established connection and the session's read
//! of it, with 1, 100 and 1000 other connections open and idle. The
//! per-packet work should not grow with them.
//!
//! Run: `cargo bench -p kerntun-benches --bench smoltcp`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kerntun::bench::smol::{Flows, PAYLOAD};

fn segment(c: &mut Criterion) {
    let mut g = c.benchmark_group("smoltcp_segment");
    g.throughput(Throughput::Bytes(PAYLOAD as u64));
    for idle in [1usize, 100, 1000] {
        let mut f = Flows::new(idle);
        assert_eq!(f.sockets(), idle + 1);
        g.bench_with_input(BenchmarkId::new("idle", idle), &idle, |b, _| {
            b.iter(|| black_box(&mut f).segment());
        });
        assert!(f.all_received(), "every segment reached the session");
    }
    g.finish();
}

criterion_group!(benches, segment);
criterion_main!(benches);
