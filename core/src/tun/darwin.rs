//! Darwin (macOS, iOS): utun devices. Every packet carries utun's 4-byte
//! address-family header, which the engine reads and writes itself in the
//! headroom (`crate::sys::utun`) instead of letting tun-rs add a second
//! iovec per packet.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use super::TunConfig;
use crate::sys::utun::{HEADER_AT, frame as utun_frame, max_pending_packets, packet_len};

#[cfg(target_os = "ios")]
pub(super) fn create(_: &TunConfig, _: bool) -> io::Result<tun_rs::AsyncDevice> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "creating a TUN device is not possible on iOS; pass the Packet Tunnel's utun descriptor (TunSource::Fd)",
    ))
}

#[cfg(target_os = "macos")]
pub(super) fn create(cfg: &TunConfig, _offload: bool) -> io::Result<tun_rs::AsyncDevice> {
    super::builder(cfg).build_async()
}

/// No virtio header. The name comes from `UTUN_OPT_IFNAME`, which also
/// works on a descriptor adopted in an iOS extension.
pub(super) fn describe(dev: &tun_rs::AsyncDevice) -> (bool, Option<String>) {
    dev.set_ignore_packet_info(false);
    (false, crate::sys::darwin::utun_name(dev.as_raw_fd()).ok())
}

/// Let utun queue [`max_pending_packets`] packets for the engine instead
/// of its default one, so a `recvmsg_x` batch finds a burst waiting. A
/// refusal leaves the default, logged.
pub(super) fn tune(dev: &tun_rs::AsyncDevice, mtu: u16) {
    let packets = max_pending_packets(usize::from(mtu));
    if let Err(e) = crate::sys::darwin::set_max_pending_packets(dev.as_raw_fd(), packets) {
        tracing::warn!("utun kept its default pending-packet limit ({packets} asked): {e}");
    }
}

/// utun has no `txqueuelen` to read.
pub(super) fn tx_queue_len(_: &tun_rs::AsyncDevice) -> Option<u32> {
    None
}

pub(super) fn frame(buf: &mut [u8], len: usize, _vnet_hdr: bool) -> io::Result<&[u8]> {
    utun_frame(buf, len)
}

/// The utun header lands just before the packet and is not counted.
pub(super) fn try_recv(dev: &tun_rs::AsyncDevice, buf: &mut [u8]) -> io::Result<usize> {
    let n = dev.try_recv(&mut buf[HEADER_AT..])?;
    Ok(packet_len(n))
}

/// The utun socket of an iOS/macOS Packet Tunnel extension, found by
/// scanning this process's descriptors.
pub fn find_platform_tun_fd() -> Option<RawFd> {
    crate::sys::darwin::find_utun_fd()
}
