//! Android: the engine only adopts the VpnService descriptor (created by the
//! system without `IFF_VNET_HDR`: one bare IP packet per read and write).

use std::io;
use std::os::fd::RawFd;

use super::{HEADROOM, TunConfig, packet_end};

pub(super) fn create(_: &TunConfig, _: bool) -> io::Result<tun_rs::AsyncDevice> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "creating a TUN device is not possible on Android; pass the VpnService descriptor (TunSource::Fd)",
    ))
}

/// No virtio header; tun-rs cannot name an adopted descriptor here (the
/// platform glue passes what it knows through the address check instead).
pub(super) fn describe(_: &tun_rs::AsyncDevice) -> (bool, Option<String>) {
    (false, None)
}

/// Not asked: an adopted VpnService descriptor keeps the kernel's default
/// (no app may change it), and tun-rs does not name it here.
/// Nothing to tune: the kernel queues `txqueuelen` packets for the reader.
pub(super) fn tune(_: &tun_rs::AsyncDevice, _: u16) {}

pub(super) fn tx_queue_len(_: &tun_rs::AsyncDevice) -> Option<u32> {
    None
}

pub(super) fn frame(buf: &mut [u8], len: usize, _vnet_hdr: bool) -> io::Result<&[u8]> {
    let end = packet_end(buf, len)?;
    Ok(&buf[HEADROOM..end])
}

pub(super) fn try_recv(dev: &tun_rs::AsyncDevice, buf: &mut [u8]) -> io::Result<usize> {
    dev.try_recv(&mut buf[HEADROOM..])
}

/// The descriptor comes from `VpnService.Builder.establish()`, handed over
/// by the app; nothing to search for.
pub fn find_platform_tun_fd() -> Option<RawFd> {
    None
}
