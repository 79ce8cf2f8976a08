//! Opening the TUN device and writing single packets to it from any task.
//!
//! With Linux offload enabled every packet crossing the device carries a
//! 10-byte `virtio_net_hdr` in front. Every buffer the engine writes from
//! therefore reserves [`HEADROOM`] bytes before the IP header; [`Tun::send`]
//! fills them with a "no offload" header or skips them. On Darwin the same
//! headroom holds utun's 4-byte address-family header ([`crate::utun`]).

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::RawFd;
use std::time::Duration;

use ipnet::IpNet;

use ipnet::{Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use crate::budget::Platform;

/// Bytes reserved in front of every packet buffer (`VIRTIO_NET_HDR_LEN`).
pub const HEADROOM: usize = 10;

/// Where the device comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TunSource {
    /// Create a device named `config.tun.name` with the configured addresses
    /// (Linux desktop; needs CAP_NET_ADMIN).
    Create,
    /// Use a descriptor the host opened (iOS utun, Android VpnService, the CLI's
    /// `--tun-fd`). The engine duplicates it: the caller keeps ownership of
    /// the one it passed and may close it after start.
    Fd(RawFd),
}

/// The TUN device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TunConfig {
    /// Interface name when kerntun creates the device (Linux desktop).
    pub name: String,
    /// Device MTU. Desktop Linux default 65535; iOS 4064 and Android 9000 are the
    /// values peers settled on (DESIGN.md "Field notes").
    pub mtu: u16,
    /// Gateway address and prefix, e.g. `198.18.0.1/16`. The NAT address is gateway + 1.
    pub ipv4: Option<Ipv4Net>,
    /// IPv6 gateway address and prefix, e.g. `fd00:18::1/64`.
    pub ipv6: Option<Ipv6Net>,
    /// Transmit queue length set on a device kerntun creates. The kernel default of
    /// 500 overflows under load (seed measurements); 10000 is what the benchmarks use.
    pub tx_queue_len: u32,
    /// iOS: the tunnel's `NETunnelProviderProtocol.includeAllNetworks` is on.
    /// The system then routes everything, loopback included, into the tunnel
    /// and the engine's kernel listener never sees the rewritten SYNs, so the
    /// system stack cannot work: `auto` picks smoltcp and an explicit
    /// `stack = "system"` is refused.
    pub include_all_networks: bool,
}

impl TunConfig {
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
    /// Open the device per `source`. `offload`: ask a device kerntun
    /// creates on Linux for `virtio_net_hdr` offload (the batch driver).
    pub fn open(cfg: &TunConfig, offload: bool, source: TunSource) -> io::Result<Tun> {
        let dev = match source {
            TunSource::Create => create(cfg, offload)?,
            TunSource::Fd(fd) => crate::sys::async_device_from_owned(crate::sys::dup_lent_fd(fd)?)?,
        };
        #[cfg(target_os = "linux")]
        let vnet_hdr = dev.tcp_gso();
        #[cfg(not(target_os = "linux"))]
        let vnet_hdr = false;
        #[cfg(target_os = "linux")]
        let name = dev.name().ok();
        // Darwin: the engine reads and writes utun's address-family header
        // itself (in the headroom, see crate::utun) instead of letting tun-rs
        // add a second iovec per packet; the name comes from UTUN_OPT_IFNAME,
        // which also works on a descriptor adopted in an iOS extension.
        #[cfg(any(target_os = "macos", target_os = "ios"))]
        let name = {
            use std::os::fd::AsRawFd;
            dev.set_ignore_packet_info(false);
            crate::sys::darwin::utun_name(dev.as_raw_fd()).ok()
        };
        // tun-rs cannot name an adopted descriptor on Android; the platform
        // glue passes what it knows through the address check instead.
        #[cfg(not(any(target_os = "linux", target_os = "macos", target_os = "ios")))]
        let name = None;
        Ok(Tun {
            dev,
            vnet_hdr,
            name,
        })
    }

    /// Write one packet found at `buf[HEADROOM..HEADROOM + len]`.
    pub async fn send(&self, buf: &mut [u8], len: usize) -> io::Result<()> {
        let frame = self.frame(buf, len)?;
        self.dev.send(frame).await.map(|_| ())
    }

    /// Non-blocking [`Tun::send`]; `WouldBlock` when the device queue is full.
    pub fn try_send(&self, buf: &mut [u8], len: usize) -> io::Result<()> {
        let frame = self.frame(buf, len)?;
        self.dev.try_send(frame).map(|_| ())
    }

    /// Read one packet into `buf[HEADROOM..]`, non-blocking; returns its
    /// length. On Darwin the utun header lands just before it and is not
    /// counted.
    pub fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        #[cfg(any(target_os = "macos", target_os = "ios"))]
        {
            let n = self.dev.try_recv(&mut buf[crate::utun::HEADER_AT..])?;
            Ok(crate::utun::packet_len(n))
        }
        #[cfg(not(any(target_os = "macos", target_os = "ios")))]
        self.dev.try_recv(&mut buf[HEADROOM..])
    }

    /// Whether the batch driver can run on this device: Linux with the
    /// virtio header (GRO/GSO), Darwin always (recvmsg_x is probed at run
    /// time, with a per-packet fallback).
    pub fn supports_batch(&self) -> bool {
        cfg!(any(target_os = "macos", target_os = "ios")) || self.vnet_hdr
    }

    fn frame<'a>(&self, buf: &'a mut [u8], len: usize) -> io::Result<&'a [u8]> {
        #[cfg(any(target_os = "macos", target_os = "ios"))]
        {
            crate::utun::frame(buf, len)
        }
        #[cfg(not(any(target_os = "macos", target_os = "ios")))]
        {
            let end = HEADROOM
                .checked_add(len)
                .filter(|&e| e <= buf.len())
                .ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidInput, "packet exceeds buffer")
                })?;
            if self.vnet_hdr {
                // A zeroed virtio_net_hdr: gso_type NONE, no checksum offload. The
                // packet's checksums are complete.
                buf[..HEADROOM].fill(0);
                Ok(&buf[..end])
            } else {
                Ok(&buf[HEADROOM..end])
            }
        }
    }

    /// Check that an interface (this device's, when its name is known) really
    /// carries the configured gateway addresses, retrying while the host
    /// finishes configuring it (10 x 50 ms, DESIGN.md part 5).
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

/// The TUN descriptor the platform opened for this process, when it can be
/// found: the utun socket of an iOS/macOS Packet Tunnel extension. `None`
/// elsewhere.
pub fn find_platform_tun_fd() -> Option<RawFd> {
    #[cfg(any(target_os = "macos", target_os = "ios"))]
    return crate::sys::darwin::find_utun_fd();
    #[cfg(not(any(target_os = "macos", target_os = "ios")))]
    None
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

#[cfg(any(target_os = "ios", target_os = "android"))]
fn create(_: &TunConfig, _: bool) -> io::Result<tun_rs::AsyncDevice> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "creating a TUN device is not possible here; pass the platform's descriptor (TunSource::Fd)",
    ))
}

#[cfg(not(any(target_os = "ios", target_os = "android")))]
fn create(
    cfg: &TunConfig,
    #[allow(unused_variables)] offload: bool,
) -> io::Result<tun_rs::AsyncDevice> {
    let mut b = tun_rs::DeviceBuilder::new()
        .name(cfg.name.clone())
        .mtu(cfg.mtu);
    if let Some(v4) = cfg.ipv4 {
        b = b.ipv4(v4.addr(), v4.prefix_len(), None);
    }
    if let Some(v6) = cfg.ipv6 {
        b = b.ipv6(v6.addr(), v6.prefix_len());
    }
    #[cfg(target_os = "linux")]
    {
        b = b.tx_queue_len(cfg.tx_queue_len).offload(offload);
    }
    b.build_async()
}
