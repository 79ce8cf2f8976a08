//! The utun wire format and `recvmsg_x` batch bookkeeping (Darwin), kept
//! platform-neutral so Linux tests cover it.
//!
//! Every packet on a utun descriptor carries a 4-byte header in front of the
//! IP header: the address family in network byte order
//! (`htonl(AF_INET)` = `00 00 00 02`, `htonl(AF_INET6)` = `00 00 00 1e`).
//! The engine keeps [`HEADROOM`] bytes free in front of every packet, so the
//! header is written in place at `HEADROOM - 4` and reads land there too:
//! no copy, no second buffer.
//!
//! The batch read receives up to [`MAX_BATCH`] packets per `recvmsg_x` call,
//! each message with two iovecs (the header, then the packet), so each
//! packet lands behind its headroom as a single read's does, with no copy.
//! The layout work (slots, iovecs,
//! headers re-zeroed before every call, reading back `msg_datalen` and
//! `msg_flags`) is platform-neutral and tested on Linux; only the system
//! call itself is Darwin's ([`super::darwin::recvmsg_x`], which takes a
//! [`RecvBatch`] and prepares it itself, so no caller handles a raw header).

use std::ffi::{c_int, c_void};
use std::io;

use crate::packet::HEADROOM;

/// Length of the utun address-family header.
pub const AF_HEADER_LEN: usize = 4;
/// Darwin's `AF_INET` (`sys/socket.h`).
pub const DARWIN_AF_INET: u32 = 2;
/// Darwin's `AF_INET6` (`sys/socket.h`; Linux's is 10, so these are spelled
/// out rather than taken from the host's libc).
pub const DARWIN_AF_INET6: u32 = 30;
/// `MSG_TRUNC` on Darwin: the packet did not fit its buffer.
pub const DARWIN_MSG_TRUNC: c_int = 0x10;

/// Packets per `recvmsg_x` call: half the per-packet driver's drain bound
/// (64 packets per wake-up), so a batch never holds a worker longer than a
/// per-packet drain would.
pub const MAX_BATCH: usize = 32;

/// Bytes the kernel may hold for the engine to read: with
/// `UTUN_OPT_MAX_PENDING_PACKETS` at its default of 1, utun queues a single
/// packet on the control socket (XNU `bsd/net/if_utun.c`), so a
/// `recvmsg_x` batch finds one packet and a burst is dropped behind it.
pub const PENDING_BYTES: usize = 512 * 1024;

/// `UTUN_OPT_MAX_PENDING_PACKETS` for a device of `mtu`: [`PENDING_BYTES`]
/// in packets of that size, at least two batches ([`MAX_BATCH`]).
pub fn max_pending_packets(mtu: usize) -> u32 {
    let packets = (PENDING_BYTES / mtu.max(1)).max(2 * MAX_BATCH);
    u32::try_from(packets).unwrap_or(u32::MAX)
}

// The header must fit in the headroom every buffer reserves.
const _: () = assert!(AF_HEADER_LEN <= HEADROOM);

/// Where the header starts in a buffer whose packet starts at [`HEADROOM`].
pub const HEADER_AT: usize = HEADROOM - AF_HEADER_LEN;

/// The utun header for a packet, from its IP version nibble.
pub fn af_header(packet: &[u8]) -> Option<[u8; AF_HEADER_LEN]> {
    match packet.first()? >> 4 {
        4 => Some(DARWIN_AF_INET.to_be_bytes()),
        6 => Some(DARWIN_AF_INET6.to_be_bytes()),
        _ => None,
    }
}

/// Write the utun header in front of the packet at `buf[HEADROOM..HEADROOM +
/// len]` and return the frame to hand to the device, header included.
pub fn frame(buf: &mut [u8], len: usize) -> io::Result<&[u8]> {
    let end = HEADROOM
        .checked_add(len)
        .filter(|&e| e <= buf.len())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "packet exceeds buffer"))?;
    let hdr = af_header(&buf[HEADROOM..end])
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not an IPv4/IPv6 packet"))?;
    buf[HEADER_AT..HEADROOM].copy_from_slice(&hdr);
    Ok(&buf[HEADER_AT..end])
}

/// The packet length of a frame of `frame_len` bytes read at [`HEADER_AT`].
/// A frame shorter than the header yields 0: an empty packet, which the
/// parser rejects and counts.
pub fn packet_len(frame_len: usize) -> usize {
    frame_len.saturating_sub(AF_HEADER_LEN)
}

/// `struct msghdr_x` (`bsd/sys/socket_private.h`): `struct msghdr` plus
/// `msg_datalen`, the byte count of the message (56 bytes on LP64).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MsghdrX {
    pub msg_name: *mut c_void,
    pub msg_namelen: u32,
    pub msg_iov: *mut libc::iovec,
    pub msg_iovlen: c_int,
    pub msg_control: *mut c_void,
    pub msg_controllen: u32,
    pub msg_flags: c_int,
    pub msg_datalen: usize,
}

impl MsghdrX {
    /// An all-zero header: what every header must be before each call (the
    /// kernel reads `msg_flags`/`msg_controllen` as inputs).
    pub const ZERO: MsghdrX = MsghdrX {
        msg_name: std::ptr::null_mut(),
        msg_namelen: 0,
        msg_iov: std::ptr::null_mut(),
        msg_iovlen: 0,
        msg_control: std::ptr::null_mut(),
        msg_controllen: 0,
        msg_flags: 0,
        msg_datalen: 0,
    };
}

/// A zeroed iovec pair for [`RecvBatch::prepare`]'s scratch arrays.
pub const IOV_ZERO: [libc::iovec; 2] = [libc::iovec {
    iov_base: std::ptr::null_mut(),
    iov_len: 0,
}; 2];

/// Why a batch slot holds no packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotError {
    /// The kernel truncated the packet (larger than the slot).
    Truncated,
    /// Shorter than the utun header.
    Short,
}

/// Receive buffers for one `recvmsg_x` call: [`MAX_BATCH`] slots in one
/// lazily-touched arena, each `HEADROOM + capacity` bytes, laid out like
/// every other packet buffer of the engine (packet at [`HEADROOM`], utun
/// header just before it), so processing and write-back work in place.
///
/// The message headers and iovecs hold raw pointers into the arena; they are
/// built fresh by [`RecvBatch::prepare`] in the caller's scratch arrays right
/// before each call and never stored, so this type stays `Send` and no
/// pointer outlives the borrow it came from.
#[derive(Debug)]
pub struct RecvBatch {
    arena: Box<[u8]>,
    slot_len: usize,
    slots: usize,
    /// `msg_datalen` and `msg_flags` of the last call, per slot.
    datalen: [usize; MAX_BATCH],
    flags: [c_int; MAX_BATCH],
    received: usize,
}

impl RecvBatch {
    /// `slots` buffers (at most [`MAX_BATCH`]) for packets up to `capacity`
    /// bytes.
    pub fn new(slots: usize, capacity: usize) -> Self {
        let slots = slots.clamp(1, MAX_BATCH);
        let slot_len = HEADROOM + capacity;
        Self {
            arena: vec![0u8; slots * slot_len].into_boxed_slice(),
            slot_len,
            slots,
            datalen: [0; MAX_BATCH],
            flags: [0; MAX_BATCH],
            received: 0,
        }
    }

    /// Fill `hdrs[..slots]` and `iovs[..slots]` for one call: every header
    /// re-zeroed, then pointed at its two iovecs: `[HEADER_AT, HEADROOM)`
    /// for the utun header and `[HEADROOM, slot end)` for the packet.
    /// Returns the headers to pass to `recvmsg_x`.
    pub(in crate::sys) fn prepare<'a>(
        &mut self,
        hdrs: &'a mut [MsghdrX; MAX_BATCH],
        iovs: &mut [[libc::iovec; 2]; MAX_BATCH],
    ) -> &'a mut [MsghdrX] {
        self.received = 0;
        let base = self.arena.as_mut_ptr();
        for i in 0..self.slots {
            let slot = base.wrapping_add(i * self.slot_len);
            iovs[i] = [
                libc::iovec {
                    iov_base: slot.wrapping_add(HEADER_AT).cast(),
                    iov_len: AF_HEADER_LEN,
                },
                libc::iovec {
                    iov_base: slot.wrapping_add(HEADROOM).cast(),
                    iov_len: self.slot_len - HEADROOM,
                },
            ];
            hdrs[i] = MsghdrX {
                msg_iov: iovs[i].as_mut_ptr(),
                msg_iovlen: 2,
                ..MsghdrX::ZERO
            };
        }
        &mut hdrs[..self.slots]
    }

    /// Record what the kernel reported for the first `n` messages.
    pub(in crate::sys) fn complete(&mut self, hdrs: &[MsghdrX], n: usize) {
        let n = n.min(self.slots).min(hdrs.len());
        for (i, h) in hdrs[..n].iter().enumerate() {
            self.datalen[i] = h.msg_datalen;
            self.flags[i] = h.msg_flags;
        }
        self.received = n;
    }

    /// Messages received by the last call.
    #[cfg(test)]
    pub fn received(&self) -> usize {
        self.received
    }

    /// Packet `i` of the last call: its slot (packet at [`HEADROOM`]) and
    /// length, or why it must be dropped.
    pub fn packet(&mut self, i: usize) -> Result<(&mut [u8], usize), SlotError> {
        if i >= self.received {
            return Err(SlotError::Short);
        }
        if self.flags[i] & DARWIN_MSG_TRUNC != 0 {
            return Err(SlotError::Truncated);
        }
        let frame = self.datalen[i];
        if frame <= AF_HEADER_LEN {
            return Err(SlotError::Short);
        }
        let len = packet_len(frame).min(self.slot_len - HEADROOM);
        let start = i * self.slot_len;
        Ok((&mut self.arena[start..start + self.slot_len], len))
    }

    /// Slot `i` for a single (fallback) read.
    #[cfg_attr(not(apple), allow(dead_code))]
    pub fn slot_mut(&mut self, i: usize) -> &mut [u8] {
        let start = i.min(self.slots - 1) * self.slot_len;
        &mut self.arena[start..start + self.slot_len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_packets_hold_half_a_mebibyte_and_two_batches() {
        assert_eq!(max_pending_packets(1500), 349);
        assert_eq!(max_pending_packets(4064), 129);
        assert_eq!(max_pending_packets(9000), 64, "two batches at least");
        assert_eq!(max_pending_packets(65535), 64);
        assert_eq!(max_pending_packets(0), 524_288, "never a division by zero");
    }

    #[test]
    fn af_header_follows_the_ip_version() {
        assert_eq!(af_header(&[0x45, 0]), Some([0, 0, 0, 2]));
        assert_eq!(af_header(&[0x60, 0]), Some([0, 0, 0, 30]));
        assert_eq!(af_header(&[0x10]), None);
        assert_eq!(af_header(&[]), None);
    }

    #[test]
    fn frame_puts_the_header_in_the_headroom() {
        let mut buf = [0xAAu8; HEADROOM + 24];
        buf[HEADROOM] = 0x60;
        let f = frame(&mut buf, 20).expect("frame").to_vec();
        assert_eq!(f.len(), AF_HEADER_LEN + 20);
        assert_eq!(&f[..4], &[0, 0, 0, 30]);
        assert_eq!(f[4], 0x60);
        // Bytes before the header are untouched (a virtio header never
        // coexists with it, but nothing else may be clobbered either).
        assert!(buf[..HEADER_AT].iter().all(|&b| b == 0xAA));
        assert!(frame(&mut buf, 25).is_err(), "longer than the buffer");
        buf[HEADROOM] = 0x00;
        assert!(frame(&mut buf, 20).is_err(), "not IP");
    }

    #[test]
    fn packet_len_strips_the_header_and_never_underflows() {
        assert_eq!(packet_len(24), 20);
        assert_eq!(packet_len(4), 0);
        assert_eq!(packet_len(1), 0);
    }

    #[test]
    fn msghdr_x_has_the_darwin_lp64_layout() {
        // 56 bytes on LP64 (`struct msghdr` plus a size_t); msg_datalen last.
        #[cfg(target_pointer_width = "64")]
        {
            assert_eq!(std::mem::size_of::<MsghdrX>(), 56);
            assert_eq!(std::mem::offset_of!(MsghdrX, msg_iov), 16);
            assert_eq!(std::mem::offset_of!(MsghdrX, msg_flags), 44);
            assert_eq!(std::mem::offset_of!(MsghdrX, msg_datalen), 48);
        }
    }

    #[test]
    fn prepare_points_two_iovecs_per_slot_and_rezeroes() {
        let mut b = RecvBatch::new(3, 100);
        let mut hdrs = [MsghdrX::ZERO; MAX_BATCH];
        let mut iovs = [IOV_ZERO; MAX_BATCH];
        // Leftovers of a previous call must not survive.
        hdrs[1].msg_flags = DARWIN_MSG_TRUNC;
        hdrs[1].msg_datalen = 77;
        hdrs[1].msg_controllen = 9;
        let base = b.arena.as_ptr() as usize;
        let n = b.prepare(&mut hdrs, &mut iovs).len();
        assert_eq!(n, 3);
        for i in 0..3 {
            let h = &hdrs[i];
            assert_eq!((h.msg_flags, h.msg_datalen, h.msg_controllen), (0, 0, 0));
            assert!(h.msg_name.is_null() && h.msg_control.is_null());
            assert_eq!(h.msg_iovlen, 2);
            assert_eq!(h.msg_iov as usize, iovs[i].as_ptr() as usize);
            let slot = base + i * (HEADROOM + 100);
            assert_eq!(iovs[i][0].iov_base as usize, slot + HEADER_AT);
            assert_eq!(iovs[i][0].iov_len, 4);
            assert_eq!(iovs[i][1].iov_base as usize, slot + HEADROOM);
            assert_eq!(iovs[i][1].iov_len, 100);
        }
        assert!(hdrs[3].msg_iov.is_null(), "unused headers stay zero");
    }

    #[test]
    fn complete_reports_packets_truncation_and_short_frames() {
        let mut b = RecvBatch::new(4, 64);
        let mut hdrs = [MsghdrX::ZERO; MAX_BATCH];
        let mut iovs = [IOV_ZERO; MAX_BATCH];
        b.prepare(&mut hdrs, &mut iovs);
        hdrs[0].msg_datalen = 4 + 20;
        hdrs[1].msg_datalen = 4 + 64;
        hdrs[1].msg_flags = DARWIN_MSG_TRUNC;
        hdrs[2].msg_datalen = 3;
        hdrs[3].msg_datalen = 4 + 40;
        b.complete(&hdrs, 3);
        assert_eq!(b.received(), 3);
        let (slot, len) = b.packet(0).expect("packet 0");
        assert_eq!((slot.len(), len), (HEADROOM + 64, 20));
        assert_eq!(b.packet(1).err(), Some(SlotError::Truncated));
        assert_eq!(b.packet(2).err(), Some(SlotError::Short));
        assert_eq!(b.packet(3).err(), Some(SlotError::Short), "not received");
        // A new call forgets the previous results.
        b.prepare(&mut hdrs, &mut iovs);
        assert_eq!(b.received(), 0);
    }

    /// Real kernel writes through the prepared iovecs: a datagram socket pair
    /// stands in for the utun, `readv` per message for `recvmsg_x`.
    #[cfg(target_os = "linux")]
    #[test]
    fn kernel_scatter_reads_land_header_and_packet_in_place() {
        use std::os::fd::AsFd;
        use std::os::unix::net::UnixDatagram;
        let (tx, rx) = UnixDatagram::pair().expect("socketpair");
        rx.set_nonblocking(true).expect("nonblocking");
        let mut frames = Vec::new();
        for (i, len) in [(0u8, 20usize), (1, 60), (2, 1)].into_iter() {
            let mut f = DARWIN_AF_INET.to_be_bytes().to_vec();
            f.extend((0..len).map(|j| if j == 0 { 0x45 } else { i ^ j as u8 }));
            tx.send(&f).expect("send");
            frames.push(f);
        }
        let mut b = RecvBatch::new(8, 64);
        let n = crate::sys::recvx_emul::recv_batch(rx.as_fd(), &mut b).expect("read");
        assert_eq!(n, 3);
        for (i, f) in frames.iter().enumerate() {
            let (slot, len) = b.packet(i).expect("packet");
            assert_eq!(len, f.len() - 4);
            assert_eq!(&slot[HEADER_AT..HEADROOM], &f[..4], "header {i}");
            assert_eq!(&slot[HEADROOM..HEADROOM + len], &f[4..], "packet {i}");
        }
        // The third datagram held 1 byte of IP data; a 60-byte packet into
        // a 64-byte slot fits, so nothing was truncated.
        assert_eq!(b.packet(1).map(|(_, l)| l), Ok(60));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn oversized_packets_are_flagged_truncated() {
        use std::os::fd::AsFd;
        use std::os::unix::net::UnixDatagram;
        let (tx, rx) = UnixDatagram::pair().expect("socketpair");
        rx.set_nonblocking(true).expect("nonblocking");
        let mut f = DARWIN_AF_INET6.to_be_bytes().to_vec();
        f.extend(std::iter::repeat_n(0x60, 100));
        tx.send(&f).expect("send");
        let mut b = RecvBatch::new(2, 64);
        let n = crate::sys::recvx_emul::recv_batch(rx.as_fd(), &mut b).expect("read");
        assert_eq!(n, 1);
        assert_eq!(b.packet(0).err(), Some(SlotError::Truncated));
    }
}
