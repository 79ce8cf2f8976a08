//! The per-packet reader: one packet per read system call, as Android's
//! VpnService descriptor and a Linux TUN without offload deliver them.
//!
//! What it writes back goes through [`WriteBack`]
//! (`core/src/driver/writeback.rs`): with `coalesce`, a flow's data
//! segments toward the kernel listener read in one drain are merged; with
//! `thin_acks`, of a flow's pure ACKs in one drain only the newest is
//! written. Both wait at most until the drain ends.

use std::io;

use super::writeback::WriteBack;
use super::{DRAIN_PER_EDGE, Head, is_fatal};
use crate::demux::Demux;
use crate::packet::{Disposition, HEADROOM};
use crate::tun::Tun;

pub(super) async fn run(
    demux: &mut Demux,
    head: &mut Head,
    tun: &Tun,
    mtu: usize,
    coalesce: bool,
    thin_acks: bool,
) -> io::Result<()> {
    // One buffer for the device's largest packet plus the headroom.
    let mut buf = vec![0u8; HEADROOM + mtu.max(1500) + 64].into_boxed_slice();
    let mut out = WriteBack::new(coalesce, thin_acks);
    while head.readable(demux).await? {
        let mut n_read = 0u64;
        for _ in 0..DRAIN_PER_EDGE {
            let len = match tun.try_recv(&mut buf) {
                Ok(len) => len,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if is_fatal(&e) => return Err(e),
                Err(_) => break,
            };
            n_read += 1;
            let Disposition::WriteBack(n) = demux.process(&mut buf[HEADROOM..HEADROOM + len])
            else {
                continue;
            };
            let mergeable = out.merging() && demux.coalescible(&buf[HEADROOM..HEADROOM + n]);
            out.put(tun, &mut demux.local, &mut buf, n, mergeable).await;
        }
        out.flush(tun, &mut demux.local).await;
        if n_read > 0 {
            demux.read_done(n_read);
        }
        demux.drained((n_read as usize) < DRAIN_PER_EDGE);
    }
    Ok(())
}
