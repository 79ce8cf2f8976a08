//! The only place in the crate where `unsafe` is allowed: adopting the
//! device's descriptor, splice(2), batched UDP I/O, Darwin's utun calls. Every block carries a `// SAFETY:` comment.

use std::io;
use std::os::fd::OwnedFd;

/// Darwin utun: `recvmsg_x`, `UTUN_OPT_IFNAME`, the utun descriptor search.
#[cfg(apple)]
pub mod darwin;
/// `recvmsg_x` emulated over `readv`, to test the batch bookkeeping on Linux.
#[cfg(all(test, target_os = "linux"))]
pub mod recvx_emul;
/// The utun wire format and `recvmsg_x` batches (platform-neutral, so the
/// Linux tests cover them).
#[cfg(any(apple, test))]
pub mod utun;

/// Wrap an owned TUN descriptor in a tun-rs async device.
pub fn async_device_from_owned(fd: OwnedFd) -> io::Result<tun_rs::AsyncDevice> {
    use std::os::fd::IntoRawFd;
    let raw = fd.into_raw_fd();
    // SAFETY: `raw` comes from an `OwnedFd` we just released, so it is open and
    // owned by nobody else; `from_fd` takes over that ownership (and closes it
    // on drop, also on its error path inside tun-rs).
    unsafe { tun_rs::AsyncDevice::from_fd(raw) }
}

#[cfg_attr(linux_like, allow(dead_code))]
/// One `recvmsg(2)` into `buf` on a datagram socket: the length received
/// and whether the datagram was longer than `buf` (`MSG_TRUNC` in the
/// message flags, POSIX), so a caller can drop it instead of passing on a
/// truncated one. Non-blocking sockets answer `WouldBlock` as usual.
pub fn recv_datagram(fd: std::os::fd::BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, bool)> {
    use std::os::fd::AsRawFd;
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is a plain C struct for which all-zero is a valid value
    // (no name, no control data); the fields recvmsg needs are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    // SAFETY: `fd` is borrowed for the call; `msg` points at one iovec
    // describing `buf`, which is valid and writable for `buf.len()` bytes
    // and outlives the call.
    let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((n as usize, msg.msg_flags & libc::MSG_TRUNC != 0))
}

/// splice(2), pipes and the urgent-mark probe for the splice relay.
#[cfg(linux_like)]
pub mod splice;
/// Batched UDP: GSO sends (`UDP_SEGMENT`) and `recvmmsg`.
#[cfg(linux_like)]
pub mod udp;
