//! The TUN device: opening or adopting it, and writing single packets to it
//! from any task.
//!
//! Every buffer the engine reads into or writes from keeps
//! [`HEADROOM`] bytes free in front of the IP header. With Linux offload on,
//! each packet crossing the device carries a 10-byte `virtio_net_hdr` there;
//! on Darwin, utun's 4-byte address-family header. [`Tun::send`] fills it in
//! place (or skips it), so no packet is copied to add a header.
//!
//! One file per OS, picked at compile time: `linux.rs` (device creation with
//! offload, the virtio header), `android.rs` (an adopted VpnService
//! descriptor only), `darwin.rs` (utun framing and naming).

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::BorrowedFd;
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use crate::budget::Platform;
pub use crate::packet::HEADROOM;

#[cfg_attr(target_os = "linux", path = "linux.rs")]
#[cfg_attr(target_os = "android", path = "android.rs")]
#[cfg_attr(apple, path = "darwin.rs")]
mod imp;

pub use crate::sys::with_lent_fd;
pub use imp::find_platform_tun_fd;

/// Where the device comes from.
#[derive(Debug, Clone, Copy)]
pub enum TunSource<'fd> {
    /// Create a device named `tun.name` with the configured addresses
    /// (Linux and macOS desktop; needs CAP_NET_ADMIN or root).
    Create,
    /// Use a descriptor the host opened (iOS utun, Android VpnService, the
    /// CLI's `--tun-fd`; a raw number is borrowed with [`with_lent_fd`]).
    /// The engine duplicates it during `start`: the caller keeps the one it
    /// lent and may close it afterwards (never on iOS, where the system owns
    /// the utun descriptor).
    Fd(BorrowedFd<'fd>),
}

/// The TUN device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TunConfig {
    /// Interface name when kerntun creates the device (Linux desktop).
    pub name: String,
    /// Device MTU. Default per platform: desktop Linux 65535, iOS 4064,
    /// Android 9000 (`budget::Platform::default_mtu` says why).
    pub mtu: u16,
    /// Gateway address and prefix, e.g. `198.18.0.1/16`. The NAT address is gateway + 1.
    pub ipv4: Option<Ipv4Net>,
    /// IPv6 gateway address and prefix, e.g. `fd00:18::1/64`.
    pub ipv6: Option<Ipv6Net>,
    /// Transmit queue length set on a device kerntun creates. The kernel default of
    /// 500 overflows under load (the device then drops segments); 10000 is
    /// what the benchmarks use.
    pub tx_queue_len: u32,
    /// iOS: the tunnel's `NETunnelProviderProtocol.includeAllNetworks` is on.
    /// The system then routes everything, loopback included, into the tunnel
    /// and the engine's kernel listener never sees the rewritten SYNs, so the
    /// system stack cannot work: `auto` picks smoltcp and an explicit
    /// `stack = "system"` is refused.
    pub include_all_networks: bool,
    /// Per-packet driver on Linux/Android: merge consecutive in-order
    /// segments of a flow, read in the same drain, into one larger segment
    /// before writing them back toward the kernel listener (a userspace GRO,
    /// `packet::coalesce`; docs/architecture.md "Drivers"), at most 64 KiB.
    /// A merged packet the device refuses is written as its segments;
    /// merging goes on after `ENOBUFS`/`ENOMEM` (transient) and is turned
    /// off for the engine's life, logged, after any other refusal.
    pub coalesce: bool,
    /// Per-packet driver: of the pure ACKs of one flow and direction that
    /// a drain (the packets read at one wake-up) writes back, write only the
    /// newest, at the end of the drain or before the flow's next other
    /// segment (`packet::ackthin`). Duplicate ACKs, SACKs and ECN signals
    /// are always written. On by default.
    pub ack_thinning: bool,
    /// System stack: lower the window each TCP segment advertises, in both
    /// directions, to its flow's share of the TUN's transmit queue, so the
    /// two TCPs keep no more in flight than the queue holds (the kernel
    /// drops what overflows it; docs/architecture.md "Window clamping").
    /// Unset: on where the per-packet driver reads a queue of at most
    /// [`AUTO_CLAMP_QUEUE`] packets (an Android VpnService TUN keeps the
    /// kernel's 500), off with the batch driver (its queue holds merged
    /// packets) and on a longer queue (a device kerntun creates on Linux
    /// has `tx_queue_len`, 10000). On the phone profile at MTU 9000 it took
    /// the queue's drops (1.4-9.6 % of its packets at 16 and 64 streams)
    /// to 0 for at most 16 % of the throughput; at MTU 1500 it costs 15-23 %
    /// at 16 streams and 60 % at 64 (docs/notes.md, "Window clamping on the
    /// phone's TUN", run 7).
    pub window_clamp: Option<bool>,
    /// Packets the TUN's transmit queue holds, which `window_clamp` shares
    /// out. Unset: the device's own `txqueuelen` where the engine can read
    /// it (Linux: `SIOCGIFTXQLEN`; a device kerntun creates has
    /// `tx_queue_len`), else [`DEFAULT_QUEUE_PACKETS`] (Android, Darwin).
    pub queue_packets: Option<u32>,
    /// Per-packet driver on Linux/Android: packets the TUN reader thread's
    /// ring holds (docs/architecture.md "Drivers"). A thread of its own
    /// reads the device into the ring while the driver task processes and
    /// writes back, so the kernel's queue (`txqueuelen`, 500 on Android)
    /// is emptied during writes too. 0: the driver task reads the device
    /// itself. Unset: the platform's [`Platform::read_ring`], 0 on every
    /// platform (it cut drops at MTU 1500 but cost throughput at 9000:
    /// docs/notes.md, "A reader thread for the per-packet TUN"). The ring's
    /// buffers (one MTU each) are allocated at start and counted in the
    /// memory budget's worst case (`Budget::worst_case`).
    pub read_ring: Option<usize>,
}

/// The longest transmit queue, in packets, on which the per-packet driver
/// clamps windows unless `tun.window_clamp` says otherwise: twice an
/// Android TUN's 500. A judgement, not a measurement: the phone profiles
/// run at 500 (the queue overflows there without the clamp) and the other
/// profiles at 10000, the queue of a device kerntun creates; no length
/// between was measured.
pub const AUTO_CLAMP_QUEUE: u32 = 1000;

/// A TUN's transmit queue in packets when neither the configuration nor
/// the device says: the kernel's default `txqueuelen` for a TUN, which an
/// Android VpnService TUN keeps (no app may change it).
pub const DEFAULT_QUEUE_PACKETS: u32 = 500;

impl TunConfig {
    /// Packets the reader thread's ring holds (0: no reader thread).
    pub fn read_ring(&self, platform: Platform) -> usize {
        self.read_ring.unwrap_or(platform.read_ring())
    }

    /// Whether windows are clamped (`window_clamp`, else on for the
    /// per-packet driver on a queue of at most [`AUTO_CLAMP_QUEUE`]
    /// packets).
    pub fn clamps_windows(&self, per_packet: bool, queue_packets: u32) -> bool {
        self.window_clamp
            .unwrap_or(per_packet && queue_packets <= AUTO_CLAMP_QUEUE)
    }

    /// The configured gateway prefixes, IPv4 first.
    pub fn nets(&self) -> Vec<IpNet> {
        self.ipv4
            .map(IpNet::V4)
            .into_iter()
            .chain(self.ipv6.map(IpNet::V6))
            .collect()
    }
}

impl Default for TunConfig {
    fn default() -> Self {
        Self {
            name: "kerntun0".into(),
            mtu: Platform::current().default_mtu(),
            ipv4: Some(Ipv4Net::new(Ipv4Addr::new(198, 18, 0, 1), 16).expect("static prefix")),
            ipv6: None,
            tx_queue_len: 10_000,
            include_all_networks: false,
            coalesce: true,
            ack_thinning: true,
            window_clamp: None,
            queue_packets: None,
            read_ring: None,
        }
    }
}

/// The device plus what the drivers need to know about it.
pub struct Tun {
    pub dev: tun_rs::AsyncDevice,
    /// Packets carry a `virtio_net_hdr` (Linux offload on).
    pub vnet_hdr: bool,
    pub name: Option<String>,
}

impl std::fmt::Debug for Tun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tun")
            .field("name", &self.name)
            .field("vnet_hdr", &self.vnet_hdr)
            .finish_non_exhaustive()
    }
}

impl Tun {
    /// Open the device per `source`. `offload`: ask a device kerntun creates
    /// on Linux for `virtio_net_hdr` offload (the batch driver).
    pub fn open(cfg: &TunConfig, offload: bool, source: TunSource<'_>) -> io::Result<Tun> {
        let dev = match source {
            TunSource::Create => imp::create(cfg, offload)?,
            TunSource::Fd(fd) => crate::sys::async_device_from_owned(fd.try_clone_to_owned()?)?,
        };
        let (vnet_hdr, name) = imp::describe(&dev);
        imp::tune(&dev, cfg.mtu);
        Ok(Tun {
            dev,
            vnet_hdr,
            name,
        })
    }

    /// Write one packet found at `buf[HEADROOM..HEADROOM + len]`.
    pub async fn send(&self, buf: &mut [u8], len: usize) -> io::Result<()> {
        let frame = imp::frame(buf, len, self.vnet_hdr)?;
        self.dev.send(frame).await.map(|_| ())
    }

    /// Non-blocking [`Tun::send`]; `WouldBlock` when the device queue is full.
    pub fn try_send(&self, buf: &mut [u8], len: usize) -> io::Result<()> {
        let frame = imp::frame(buf, len, self.vnet_hdr)?;
        self.dev.try_send(frame).map(|_| ())
    }

    /// Read one packet into `buf[HEADROOM..]`, non-blocking; returns its
    /// length (a device header in front of it is not counted).
    ///
    /// On Linux/Android the descriptor is read directly, and only a read
    /// that finds it empty is made again through tun-rs, whose `try_recv`
    /// clears the runtime's readiness on `WouldBlock`, so that the driver's
    /// next wait sleeps until the device has a packet (one that came in
    /// between is returned). tun-rs's `try_recv` builds, polls and drops a
    /// readiness future around every read, and the drop locks the
    /// descriptor's waiter list: 2.1-2.2 % of the per-packet engine's
    /// samples in one-stream runs at MTU 1500 (docs/notes.md, "A TUN read
    /// without the runtime's readiness check"), once per packet.
    pub fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        #[cfg(linux_like)]
        {
            use std::os::fd::AsFd;
            match crate::sys::read_fd(self.dev.as_fd(), &mut buf[HEADROOM..]) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                done => return done,
            }
        }
        imp::try_recv(&self.dev, buf)
    }

    /// Packets the device's transmit queue holds: `cfg.queue_packets`, else
    /// the device's `txqueuelen` where it can be read, else
    /// [`DEFAULT_QUEUE_PACKETS`].
    pub fn queue_packets(&self, cfg: &TunConfig) -> u32 {
        cfg.queue_packets
            .or_else(|| imp::tx_queue_len(&self.dev))
            .unwrap_or(DEFAULT_QUEUE_PACKETS)
    }

    /// Whether the batch driver can run on this device: Linux with the
    /// virtio header (GRO/GSO), Darwin always (recvmsg_x is probed at run
    /// time, with a per-packet fallback).
    pub fn supports_batch(&self) -> bool {
        cfg!(apple) || self.vnet_hdr
    }

    /// Check that an interface (this device's, when its name is known) really
    /// carries the configured gateway addresses, retrying while the host
    /// finishes configuring it (10 x 50 ms).
    pub async fn verify_addresses(&self, want: &[IpNet]) -> io::Result<()> {
        let mut last = Vec::new();
        for attempt in 0..10 {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            last = interface_addresses(self.name.as_deref())?;
            if want.iter().all(|n| {
                last.iter()
                    .any(|(a, p)| *a == n.addr() && *p == n.prefix_len())
            }) {
                return Ok(());
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AddrNotAvailable,
            format!(
                "the TUN device must carry {want:?}; {} has {last:?}",
                self.name.as_deref().unwrap_or("no interface")
            ),
        ))
    }

    /// The interface index, for binding the listener to it (Darwin: the
    /// name comes from `UTUN_OPT_IFNAME`, see [`Tun::open`]).
    pub fn if_index(&self) -> Option<u32> {
        let name = self.name.as_deref()?;
        getifaddrs::InterfaceFilter::new()
            .name(name)
            .get()
            .ok()?
            .find_map(|i| i.index)
    }
}

/// (address, prefix length) pairs of `name`, or of every interface when the
/// name is unknown.
fn interface_addresses(name: Option<&str>) -> io::Result<Vec<(IpAddr, u8)>> {
    let mut filter = getifaddrs::InterfaceFilter::new();
    if let Some(n) = name {
        filter = filter.name(n);
    }
    Ok(filter
        .get()?
        .filter_map(|i| {
            let ip = i.address.ip_addr()?;
            let prefix = match i.address.netmask()? {
                IpAddr::V4(m) => u32::from(m).count_ones(),
                IpAddr::V6(m) => u128::from(m).count_ones(),
            };
            Some((ip, prefix as u8))
        })
        .collect())
}

/// A builder for a device kerntun creates: name, MTU and the configured
/// addresses (each OS file adds its own options).
#[cfg(not(mobile))]
fn builder(cfg: &TunConfig) -> tun_rs::DeviceBuilder {
    let mut b = tun_rs::DeviceBuilder::new()
        .name(cfg.name.clone())
        .mtu(cfg.mtu);
    if let Some(v4) = cfg.ipv4 {
        b = b.ipv4(v4.addr(), v4.prefix_len(), None);
    }
    if let Some(v6) = cfg.ipv6 {
        b = b.ipv6(v6.addr(), v6.prefix_len());
    }
    b
}

#[cfg(not(apple))]
/// The bounds check every framing does: the end of a packet of `len` bytes
/// at [`HEADROOM`], if `buf` holds it.
fn packet_end(buf: &[u8], len: usize) -> io::Result<usize> {
    HEADROOM
        .checked_add(len)
        .filter(|&e| e <= buf.len())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "packet exceeds buffer"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_clamped_by_default_on_a_short_per_packet_queue_only() {
        let auto = TunConfig::default();
        assert!(auto.clamps_windows(true, DEFAULT_QUEUE_PACKETS));
        assert!(auto.clamps_windows(true, AUTO_CLAMP_QUEUE));
        assert!(!auto.clamps_windows(true, AUTO_CLAMP_QUEUE + 1));
        assert!(!auto.clamps_windows(true, auto.tx_queue_len));
        assert!(!auto.clamps_windows(false, DEFAULT_QUEUE_PACKETS));
        for set in [true, false] {
            let cfg = TunConfig {
                window_clamp: Some(set),
                ..TunConfig::default()
            };
            assert_eq!(cfg.clamps_windows(true, 500), set);
            assert_eq!(cfg.clamps_windows(false, 10_000), set);
        }
    }
}
