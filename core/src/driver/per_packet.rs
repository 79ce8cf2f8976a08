//! The per-packet reader: one packet per read system call, as Android's
//! VpnService descriptor and a Linux TUN without offload deliver them.

use std::io;

use super::{DRAIN_PER_EDGE, Head, Processor, is_fatal};
use crate::lifecycle::Lifecycle;
use crate::packet::HEADROOM;

pub(super) async fn run(proc: &mut Processor, life: &Lifecycle, mtu: usize) -> io::Result<()> {
    let tun = proc.tun.clone();
    // One buffer for the device's largest packet plus the headroom.
    let mut buf = vec![0u8; HEADROOM + mtu.max(1500) + 64].into_boxed_slice();
    let mut head = Head::new(proc, life);
    while head.readable(proc).await? {
        let mut n_read = 0u64;
        for _ in 0..DRAIN_PER_EDGE {
            let len = match tun.try_recv(&mut buf) {
                Ok(len) => len,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if is_fatal(&e) => return Err(e),
                Err(_) => break,
            };
            n_read += 1;
            proc.handle(&mut buf, len).await;
        }
        if n_read > 0 {
            proc.read_done(n_read);
        }
        head.drained(proc, (n_read as usize) < DRAIN_PER_EDGE);
    }
    Ok(())
}
