//! The only place in the crate where `unsafe` is allowed: adopting the
//! device's descriptor, splice(2), Darwin's utun calls. Every block carries a `// SAFETY:` comment.

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

/// splice(2), pipes and the urgent-mark probe for the splice relay.
#[cfg(linux_like)]
pub mod splice;
