//! The only place in the crate where `unsafe` is allowed: adopting descriptors
//! handed over by the host app. Every block carries a `// SAFETY:` comment.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};

/// Darwin utun: `recvmsg_x`, `UTUN_OPT_IFNAME`, the utun descriptor search.
#[cfg(any(target_os = "macos", target_os = "ios"))]
pub mod darwin;
/// `recvmsg_x` emulated over `readv`, to test the batch bookkeeping on Linux.
#[cfg(all(test, target_os = "linux"))]
pub mod recvx_emul;

/// Duplicate a descriptor the host app lent us, so the engine owns (and later
/// closes) its own copy while the app keeps the original. On iOS the utun fd
/// must never be closed by the engine; on Android the app can close its copy
/// after start.
pub fn dup_lent_fd(fd: RawFd) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    // SAFETY: the caller promises `fd` is open for the duration of this call;
    // the borrow does not outlive it and is only used to duplicate.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    borrowed.try_clone_to_owned()
}

/// Wrap an owned TUN descriptor in a tun-rs async device.
pub fn async_device_from_owned(fd: OwnedFd) -> io::Result<tun_rs::AsyncDevice> {
    use std::os::fd::IntoRawFd;
    let raw = fd.into_raw_fd();
    // SAFETY: `raw` comes from an `OwnedFd` we just released, so it is open and
    // owned by nobody else; `from_fd` takes over that ownership (and closes it
    // on drop, also on its error path inside tun-rs).
    unsafe { tun_rs::AsyncDevice::from_fd(raw) }
}

/// splice(2), pipes and the urgent-mark probe for the splice relay.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub mod splice;
