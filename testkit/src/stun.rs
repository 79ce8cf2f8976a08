//! A tiny STUN binding responder (RFC 5389): it answers each Binding
//! Request with a Binding Success Response carrying the request's source
//! as XOR-MAPPED-ADDRESS, the address a NAT between the client and it
//! mapped the client to. And the client's side: the request, and the
//! mapped address read from the response.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::Netns;
use crate::servers::Server;

/// The fixed magic cookie of every STUN message (RFC 5389 6).
const MAGIC: u32 = 0x2112_A442;
const BINDING_REQUEST: u16 = 0x0001;
const BINDING_SUCCESS: u16 = 0x0101;
const XOR_MAPPED_ADDRESS: u16 = 0x0020;
const HEADER_LEN: usize = 20;

/// A Binding Request with transaction id `id`.
pub fn binding_request(id: [u8; 12]) -> Vec<u8> {
    let mut m = Vec::with_capacity(HEADER_LEN);
    m.extend_from_slice(&BINDING_REQUEST.to_be_bytes());
    m.extend_from_slice(&0u16.to_be_bytes());
    m.extend_from_slice(&MAGIC.to_be_bytes());
    m.extend_from_slice(&id);
    m
}

/// The Binding Success Response to a request with `id` seen from `from`.
fn binding_success(id: &[u8], from: SocketAddr) -> Vec<u8> {
    let port = from.port() ^ (MAGIC >> 16) as u16;
    let (family, addr): (u8, Vec<u8>) = match from.ip() {
        IpAddr::V4(a) => (1, (u32::from(a) ^ MAGIC).to_be_bytes().to_vec()),
        IpAddr::V6(a) => {
            let mut key = MAGIC.to_be_bytes().to_vec();
            key.extend_from_slice(id);
            (2, a.octets().iter().zip(&key).map(|(b, k)| b ^ k).collect())
        }
    };
    let mut attr = vec![0, family];
    attr.extend_from_slice(&port.to_be_bytes());
    attr.extend_from_slice(&addr);
    let mut m = Vec::with_capacity(HEADER_LEN + 4 + attr.len());
    m.extend_from_slice(&BINDING_SUCCESS.to_be_bytes());
    m.extend_from_slice(&((4 + attr.len()) as u16).to_be_bytes());
    m.extend_from_slice(&MAGIC.to_be_bytes());
    m.extend_from_slice(id);
    m.extend_from_slice(&XOR_MAPPED_ADDRESS.to_be_bytes());
    m.extend_from_slice(&(attr.len() as u16).to_be_bytes());
    m.extend_from_slice(&attr);
    m
}

/// The XOR-MAPPED-ADDRESS of a Binding Success Response to the request
/// with `id`; `None` for anything else.
pub fn mapped_address(msg: &[u8], id: [u8; 12]) -> Option<SocketAddr> {
    let h = msg.get(..HEADER_LEN)?;
    if u16::from_be_bytes([h[0], h[1]]) != BINDING_SUCCESS
        || u32::from_be_bytes([h[4], h[5], h[6], h[7]]) != MAGIC
        || h[8..20] != id
    {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([h[2], h[3]]));
    let mut attrs = msg.get(HEADER_LEN..HEADER_LEN + len)?;
    while attrs.len() >= 4 {
        let kind = u16::from_be_bytes([attrs[0], attrs[1]]);
        let n = usize::from(u16::from_be_bytes([attrs[2], attrs[3]]));
        let v = attrs.get(4..4 + n)?;
        if kind == XOR_MAPPED_ADDRESS && n >= 8 {
            let port = u16::from_be_bytes([v[2], v[3]]) ^ (MAGIC >> 16) as u16;
            let ip: IpAddr = match (v[1], n) {
                (1, 8) => {
                    let x = u32::from_be_bytes([v[4], v[5], v[6], v[7]]) ^ MAGIC;
                    Ipv4Addr::from(x).into()
                }
                (2, 20) => {
                    let mut key = MAGIC.to_be_bytes().to_vec();
                    key.extend_from_slice(&id);
                    let mut o = [0u8; 16];
                    for (i, b) in o.iter_mut().enumerate() {
                        *b = v[4 + i] ^ key[i];
                    }
                    Ipv6Addr::from(o).into()
                }
                _ => return None,
            };
            return Some(SocketAddr::new(ip, port));
        }
        // Attributes are padded to 4 bytes.
        attrs = attrs.get(4 + n.div_ceil(4) * 4..).unwrap_or(&[]);
    }
    None
}

/// Start a binding responder on `addr` in `ns`; `accepted` counts the
/// requests it answered.
pub fn server(ns: &Netns, addr: SocketAddr) -> io::Result<Server> {
    Server::start(
        ns,
        move || {
            let s = UdpSocket::bind(addr)?;
            s.set_read_timeout(Some(Duration::from_millis(50)))?;
            let addr = s.local_addr()?;
            Ok((s, addr))
        },
        |s, stop, answered| {
            let mut buf = [0u8; 1500];
            while !stop.load(Ordering::Relaxed) {
                let Ok((n, from)) = s.recv_from(&mut buf) else {
                    continue;
                };
                let m = &buf[..n];
                if n >= HEADER_LEN
                    && u16::from_be_bytes([m[0], m[1]]) == BINDING_REQUEST
                    && u32::from_be_bytes([m[4], m[5], m[6], m[7]]) == MAGIC
                {
                    answered.fetch_add(1, Ordering::Relaxed);
                    let _ = s.send_to(&binding_success(&m[8..20], from), from);
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A response names the address it was built for, both families, and
    /// only for its own transaction.
    #[test]
    fn response_round_trips_the_mapped_address() {
        let id = *b"kerntun-test";
        for from in ["198.19.1.1:40000", "[fd00:19:1::1]:5"] {
            let from: SocketAddr = from.parse().expect("addr");
            let r = binding_success(&id, from);
            assert_eq!(mapped_address(&r, id), Some(from));
            assert_eq!(mapped_address(&r, *b"another-test"), None);
        }
        assert_eq!(mapped_address(&binding_request(id), id), None);
    }
}
