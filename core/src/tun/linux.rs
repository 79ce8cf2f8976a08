//! Linux: devices kerntun creates itself (with `virtio_net_hdr` offload for
//! the batch driver) or adopts from a descriptor.

use std::io;
use std::os::fd::RawFd;

use super::{HEADROOM, TunConfig, packet_end};

pub(super) fn create(cfg: &TunConfig, offload: bool) -> io::Result<tun_rs::AsyncDevice> {
    super::builder(cfg)
        .tx_queue_len(cfg.tx_queue_len)
        .offload(offload)
        .build_async()
}

/// Whether packets carry a virtio header, and the interface name.
pub(super) fn describe(dev: &tun_rs::AsyncDevice) -> (bool, Option<String>) {
    (dev.tcp_gso(), dev.name().ok())
}

/// The device's `txqueuelen` (`SIOCGIFTXQLEN`), if the kernel says.
/// Nothing to tune: the kernel queues `txqueuelen` packets for the reader.
pub(super) fn tune(_: &tun_rs::AsyncDevice, _: u16) {}

pub(super) fn tx_queue_len(dev: &tun_rs::AsyncDevice) -> Option<u32> {
    dev.tx_queue_len().ok()
}

/// The bytes to hand the device for the packet at `buf[HEADROOM..][..len]`.
pub(super) fn frame(buf: &mut [u8], len: usize, vnet_hdr: bool) -> io::Result<&[u8]> {
    let end = packet_end(buf, len)?;
    if vnet_hdr {
        // A zeroed virtio_net_hdr: gso_type NONE, no checksum offload. The
        // packet's checksums are complete.
        buf[..HEADROOM].fill(0);
        Ok(&buf[..end])
    } else {
        Ok(&buf[HEADROOM..end])
    }
}

pub(super) fn try_recv(dev: &tun_rs::AsyncDevice, buf: &mut [u8]) -> io::Result<usize> {
    dev.try_recv(&mut buf[HEADROOM..])
}

/// No platform-opened descriptor to look for on Linux.
pub fn find_platform_tun_fd() -> Option<RawFd> {
    None
}
