//! TCP segments built for the smoltcp bench (`bench.rs`) and fuzz target
//! (`fuzzing.rs`), which are built without the test-only packet builders
//! of `packet::testutil`.

use std::net::IpAddr;

use crate::nat::FlowKey;
use crate::packet::{self, checksum, protocol};

/// A TCP segment with valid IP and TCP checksums (`options` padded to 4 B).
pub(super) fn segment(
    key: FlowKey,
    seq: u32,
    ack: u32,
    flags: u8,
    window: u16,
    options: &[u8],
    data: &[u8],
) -> Vec<u8> {
    let FlowKey {
        client: src,
        server: dst,
    } = key;
    let opt_len = options.len().min(40).div_ceil(4) * 4;
    let tcp_len = 20 + opt_len + data.len();
    let ip_len = if src.is_ipv4() { 20 } else { 40 };
    let mut p = vec![0u8; ip_len + tcp_len];
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            p[0] = 0x45;
            p[2..4].copy_from_slice(&((ip_len + tcp_len) as u16).to_be_bytes());
            p[8] = 64;
            p[9] = protocol::TCP;
            p[12..16].copy_from_slice(&s.octets());
            p[16..20].copy_from_slice(&d.octets());
            let c = checksum::finish(checksum::sum_bytes(&p[..20]));
            p[10..12].copy_from_slice(&c.to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            p[0] = 0x60;
            p[4..6].copy_from_slice(&(tcp_len as u16).to_be_bytes());
            p[6] = protocol::TCP;
            p[7] = 64;
            p[8..24].copy_from_slice(&s.octets());
            p[24..40].copy_from_slice(&d.octets());
        }
        _ => return Vec::new(),
    }
    let t = &mut p[ip_len..];
    t[0..2].copy_from_slice(&src.port().to_be_bytes());
    t[2..4].copy_from_slice(&dst.port().to_be_bytes());
    t[4..8].copy_from_slice(&seq.to_be_bytes());
    t[8..12].copy_from_slice(&ack.to_be_bytes());
    t[12] = (((20 + opt_len) / 4) as u8) << 4;
    t[13] = flags;
    t[14..16].copy_from_slice(&window.to_be_bytes());
    let opts = options.len().min(40);
    t[20..20 + opts].copy_from_slice(&options[..opts]);
    t[20 + opt_len..].copy_from_slice(data);
    if let Ok(ip) = packet::parse_ip(&p) {
        checksum::fill_transport_checksum(&mut p, &ip);
    }
    p
}
