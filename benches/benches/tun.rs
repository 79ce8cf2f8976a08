//! What one `read(2)` of a TUN without offload costs, by packet size: the
//! call every packet of the per-packet driver pays (Android's TUN, or any
//! device opened without `IFF_VNET_HDR`), against which the batch driver
//! pays one call per coalesced run of up to 64 KiB.
//!
//! - `tun_read/<bytes>`: 256 packets of `<bytes>` (IPv4, UDP) read back
//!   one `read` each from a TUN's transmit queue that already holds them;
//!   the queue is filled outside the timed part (a UDP socket sending to
//!   an address routed into the device). Time per packet is the call's
//!   cost with the queue never empty: no wake-up, no poll, no
//!   processing, so a floor under what the driver spends per packet.
//!
//! Sizes 1500, 4064 and 9000 are the TUN MTUs the phone profiles run; the
//! slope between them is the per-byte copy, the rest the per-call cost.
//!
//! Needs root (a TUN in a network namespace of its own, made with
//! `unshare(CLONE_NEWNET)` at start, so nothing outside it changes); prints
//! why and measures nothing otherwise. Run:
//! `cargo bench -p kerntun-benches --bench tun`.

use std::hint::black_box;
use std::net::UdpSocket;
use std::process::Command;

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};

/// Packets one timed batch reads; below the queue length set on the device.
const BATCH: usize = 256;
/// The device's MTU: the largest size measured.
const MTU: u16 = 9000;
const SIZES: [usize; 3] = [1500, 4064, 9000];
const DEVICE: &str = "ktbench0";
/// IPv4 (20) and UDP (8) headers in front of each datagram's payload.
const HEADERS: usize = 28;

fn main() {
    if !nix::unistd::Uid::effective().is_root() {
        println!("tun bench: skipped, needs root (a TUN in a namespace of its own)");
        return;
    }
    if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
        println!("tun bench: skipped, unshare(CLONE_NEWNET) failed: {e}");
        return;
    }
    // No IPv6 on devices made from here on: its router solicitations
    // would sit in the queue between the datagrams.
    std::fs::write("/proc/sys/net/ipv6/conf/default/disable_ipv6", "1")
        .expect("IPv6 off in the bench's namespace");
    let dev = tun_rs::DeviceBuilder::new()
        .name(DEVICE)
        .mtu(MTU)
        .tx_queue_len(4 * BATCH as u32)
        .ipv4("198.18.99.1", 30, None)
        .build_sync()
        .expect("a TUN in the bench's namespace");
    // The device answers nothing, so a datagram to its peer address stays
    // in its transmit queue until read.
    let up = Command::new("ip")
        .args(["link", "set", DEVICE, "up"])
        .status();
    assert!(
        matches!(up, Ok(s) if s.success()),
        "ip link set {DEVICE} up: {up:?}"
    );
    let sender = UdpSocket::bind("198.18.99.1:0").expect("a UDP socket on the device's address");
    sender
        .connect("198.18.99.2:9")
        .expect("a route into the device");

    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("tun_read");
    g.throughput(Throughput::Elements(BATCH as u64));
    let payload = vec![0xa5u8; usize::from(MTU)];
    let mut buf = vec![0u8; usize::from(MTU) + 64];
    for size in SIZES {
        let datagram = &payload[..size - HEADERS];
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            b.iter_batched_ref(
                || {
                    for _ in 0..BATCH {
                        sender
                            .send(datagram)
                            .expect("a datagram into the TUN's queue");
                    }
                },
                |()| {
                    for _ in 0..BATCH {
                        let n = dev.recv(&mut buf).expect("a queued packet");
                        assert_eq!(n, size, "one whole packet per read");
                        black_box(&buf[..n]);
                    }
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
    c.final_summary();
}
