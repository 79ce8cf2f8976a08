//! Test support (Linux): `recvmsg_x` semantics emulated with one `readv`
//! per message, so the Darwin batch bookkeeping is checked against real
//! kernel writes through the iovecs it prepares.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::utun::{DARWIN_MSG_TRUNC, IOV_ZERO, MAX_BATCH, MsghdrX, RecvBatch};

/// Read datagrams from a non-blocking `fd` into `batch` until its slots are
/// used or the socket is empty, the way `recvmsg_x` fills them: each slot's
/// length, and Darwin's `MSG_TRUNC` when a datagram did not fit.
pub fn recv_batch(fd: BorrowedFd<'_>, batch: &mut RecvBatch) -> io::Result<usize> {
    let mut hdrs = [MsghdrX::ZERO; MAX_BATCH];
    let mut iovs = [IOV_ZERO; MAX_BATCH];
    let prepared = batch.prepare(&mut hdrs, &mut iovs);
    let fd = fd.as_raw_fd();
    let mut n = 0;
    for h in prepared.iter_mut() {
        let capacity: usize = {
            // SAFETY: `msg_iov` points at `msg_iovlen` iovecs prepared by
            // RecvBatch::prepare in `iovs`, alive for this call.
            let iovs = unsafe { std::slice::from_raw_parts(h.msg_iov, h.msg_iovlen as usize) };
            iovs.iter().map(|v| v.iov_len).sum()
        };
        // MSG_TRUNC|MSG_PEEK tells the real datagram length without consuming it.
        // SAFETY: a zero-length peek writes nothing.
        let real = unsafe {
            libc::recv(
                fd,
                std::ptr::null_mut(),
                0,
                libc::MSG_PEEK | libc::MSG_TRUNC | libc::MSG_DONTWAIT,
            )
        };
        if real < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock && n > 0 {
                break;
            }
            return Err(e);
        }
        // SAFETY: the iovecs point into `batch`'s arena, exclusively borrowed
        // for this call; readv writes at most `iov_len` per iovec.
        let got = unsafe { libc::readv(fd, h.msg_iov, h.msg_iovlen) };
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        h.msg_datalen = got as usize;
        if real as usize > capacity {
            h.msg_flags |= DARWIN_MSG_TRUNC;
        }
        n += 1;
    }
    batch.complete(&hdrs, n);
    Ok(n)
}
