//! NAT table benches: the per-packet lookups (alone and with parse +
//! rewrite of a 1500-byte packet), a batch of new flows through their whole
//! life, and two threads doing steady lookups at once.
//!
//! Run: `cargo bench -p kerntun-benches --bench nat`.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kerntun::nat::{FlowKey, NatConfig, NatTable};
use kerntun::packet::{parse_ip, parse_tcp, rewrite_tcp};

const GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const NAT_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const LISTEN_PORT: u16 = 40000;

fn table() -> Arc<NatTable> {
    Arc::new(NatTable::new(NatConfig::default(), Instant::now()))
}

fn flow(i: u16) -> FlowKey {
    FlowKey::new(
        SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 9)), 20000 + i),
        SocketAddr::new(IpAddr::V4(Ipv4Addr::new(1, 1, 1, 1)), 443),
    )
}

/// An established flow: SYN, accept (Active until something marks it
/// Closing: nothing does here).
fn established(t: &Arc<NatTable>, key: &FlowKey) -> u16 {
    let now = Instant::now();
    let Ok(up) = t.uplink(key, Some(0), now) else {
        panic!("bench setup: uplink")
    };
    if t.accept(up.port, now).is_err() {
        panic!("bench setup: accept")
    }
    up.port
}

/// A 1500-byte IPv4 TCP ACK segment `src -> dst` with 1460 bytes of payload.
/// Checksums are left zero: the rewrite is incremental, so its cost does not
/// depend on them being right.
fn tcp_packet(src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let (IpAddr::V4(s), IpAddr::V4(d)) = (src.ip(), dst.ip()) else {
        panic!("bench fixture is IPv4")
    };
    let mut p = vec![0u8; 1500];
    p[0] = 0x45; // version 4, IHL 5
    p[2..4].copy_from_slice(&1500u16.to_be_bytes());
    p[6] = 0x40; // DF
    p[8] = 64; // TTL
    p[9] = 6; // TCP
    p[12..16].copy_from_slice(&s.octets());
    p[16..20].copy_from_slice(&d.octets());
    p[20..22].copy_from_slice(&src.port().to_be_bytes());
    p[22..24].copy_from_slice(&dst.port().to_be_bytes());
    p[32] = 5 << 4; // data offset 5
    p[33] = 0x10; // ACK
    p[34..36].copy_from_slice(&65535u16.to_be_bytes());
    for (i, b) in p[40..].iter_mut().enumerate() {
        *b = i as u8;
    }
    p
}

fn steady(c: &mut Criterion) {
    let mut g = c.benchmark_group("steady");
    // Two packets per iteration: one uplink, one downlink.
    g.throughput(Throughput::Elements(2));

    let t = table();
    let key = flow(1);
    let port = established(&t, &key);
    let now = Instant::now();
    g.bench_function("nat_uplink_downlink", |b| {
        b.iter(|| {
            let up = t.uplink(black_box(&key), None, now);
            let down = t.downlink(black_box(port), now);
            black_box((up, down))
        })
    });

    // The driver's work for one packet each way: parse, NAT, rewrite. The
    // 40 header bytes are restored from a template before each packet (a
    // 40-byte copy, included in the figure); the payload is never touched.
    let nat_src = SocketAddr::new(IpAddr::V4(NAT_ADDR), port);
    let listener = SocketAddr::new(IpAddr::V4(GATEWAY), LISTEN_PORT);
    let up_tpl = tcp_packet(key.client, key.server);
    let down_tpl = tcp_packet(listener, nat_src);
    let (mut up_buf, mut down_buf) = (up_tpl.clone(), down_tpl.clone());
    g.bench_function("parse_nat_rewrite_1500B", |b| {
        b.iter(|| {
            up_buf[..40].copy_from_slice(&up_tpl[..40]);
            let ip = parse_ip(black_box(&up_buf)).ok()?;
            let tcp = parse_tcp(&up_buf, &ip).ok()?;
            let k = FlowKey::new(
                SocketAddr::new(ip.src, tcp.src_port),
                SocketAddr::new(ip.dst, tcp.dst_port),
            );
            let up = t
                .uplink(&k, tcp.is_syn_only().then_some(tcp.seq), now)
                .ok()?;
            rewrite_tcp(
                &mut up_buf,
                &ip,
                SocketAddr::new(IpAddr::V4(NAT_ADDR), up.port),
                listener,
            )
            .ok()?;

            down_buf[..40].copy_from_slice(&down_tpl[..40]);
            let ip = parse_ip(black_box(&down_buf)).ok()?;
            let tcp = parse_tcp(&down_buf, &ip).ok()?;
            let orig = t.downlink(tcp.dst_port, now)?;
            rewrite_tcp(&mut down_buf, &ip, orig.server, orig.client).ok()?;
            Some(black_box(ip.len))
        })
    });
    g.finish();
}

fn batch(c: &mut Criterion) {
    const FLOWS: u16 = 1024;
    let mut g = c.benchmark_group("batch");
    g.throughput(Throughput::Elements(u64::from(FLOWS)));
    let keys: Vec<FlowKey> = (0..FLOWS).map(flow).collect();
    let linger = NatConfig::default().linger;
    // Per flow: SYN (allocate), accept, the session's end (mark Closing at
    // the real time, as the engine's hold does when it drops), then one
    // cleanup past the linger removes all of them. Table creation is in the
    // setup, its drop outside the timing.
    g.bench_function("1024_flows_lifecycle", |b| {
        b.iter_batched(
            table,
            |t| {
                let now = Instant::now();
                let accepted: Vec<_> = keys
                    .iter()
                    .filter_map(|k| {
                        let up = t.uplink(k, Some(0), now).ok()?;
                        t.accept(up.port, now).ok()
                    })
                    .collect();
                assert_eq!(accepted.len(), usize::from(FLOWS));
                for a in &accepted {
                    t.mark_closing(a.port, a.generation, Instant::now());
                }
                // Past the linger of the last session's end, timed from after
                // the marks: a stalled (loaded, virtualised) machine must not
                // turn a timing gap into a failed assertion.
                let done = t.cleanup(Instant::now() + linger + Duration::from_secs(1));
                assert_eq!(done.removed.closing, usize::from(FLOWS));
                t
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn contended(c: &mut Criterion) {
    let mut g = c.benchmark_group("threads_steady");
    g.throughput(Throughput::Elements(2));
    for threads in [1u16, 2] {
        let t = table();
        let flows: Vec<(FlowKey, u16)> = (0..threads)
            .map(|i| {
                let key = flow(100 + i);
                (key, established(&t, &key))
            })
            .collect();
        // Per thread and iteration: one uplink + one downlink on the
        // thread's own flow; the time is the slowest thread's wall clock, so
        // with no contention 2 threads report the same time as 1.
        g.bench_with_input(BenchmarkId::from_parameter(threads), &flows, |b, flows| {
            b.iter_custom(|iters| {
                let barrier = Barrier::new(flows.len());
                thread::scope(|s| {
                    let handles: Vec<_> = flows
                        .iter()
                        .map(|(key, port)| {
                            let (t, barrier) = (&t, &barrier);
                            s.spawn(move || {
                                barrier.wait();
                                let start = Instant::now();
                                let now = start;
                                for _ in 0..iters {
                                    black_box(t.uplink(black_box(key), None, now).ok());
                                    black_box(t.downlink(black_box(*port), now));
                                }
                                start.elapsed()
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().unwrap_or_default())
                        .max()
                        .unwrap_or_default()
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, steady, batch, contended);
criterion_main!(benches);
