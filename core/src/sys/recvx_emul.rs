//! Test support (Linux): `recvmsg_x` semantics emulated with one `readv`
//! per message, so the Darwin batch bookkeeping is checked against real
//! kernel writes through the iovecs it prepares.

use std::io;
use std::os::fd::RawFd;

use crate::utun::MsghdrX;

/// Read datagrams from a non-blocking `fd` into the prepared headers until
/// they are all used or the socket is empty; fill `msg_datalen` and set
/// `MSG_TRUNC` (Darwin's value) when a datagram did not fit.
pub fn recv_batch(fd: RawFd, hdrs: &mut [MsghdrX]) -> io::Result<usize> {
    let mut n = 0;
    for h in hdrs.iter_mut() {
        let capacity: usize = {
            // SAFETY: `msg_iov` points at `msg_iovlen` iovecs prepared by
            // RecvBatch::prepare, alive for this call (the caller's scratch).
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
        // SAFETY: the iovecs point into the RecvBatch arena, borrowed by the
        // caller for this call; readv writes at most `iov_len` per iovec.
        let got = unsafe { libc::readv(fd, h.msg_iov, h.msg_iovlen) };
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        h.msg_datalen = got as usize;
        if real as usize > capacity {
            h.msg_flags |= crate::utun::DARWIN_MSG_TRUNC;
        }
        n += 1;
    }
    Ok(n)
}
