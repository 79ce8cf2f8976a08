//! Batched UDP socket I/O (Linux, Android): one `sendmsg` carrying many
//! datagrams of one flow (UDP GSO, `UDP_SEGMENT`, Linux 4.18), and one
//! `recvmmsg` taking many. `udp.rs` decides what to batch; this file only
//! makes the calls.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

/// The most segments one GSO send may carry (the kernel's `UDP_MAX_SEGMENTS`).
pub const GSO_MAX_SEGMENTS: usize = 64;

/// The most payload one GSO send may carry: one IPv4 datagram's worth
/// (65535 - 20 - 8); IPv6 allows slightly more.
pub const GSO_MAX_BYTES: usize = 65_507;

/// Whether this kernel segments UDP sends (`UDP_SEGMENT`, Linux 4.18 and
/// later), probed once per process by setting the option on a fresh socket.
/// It must be known before the first send: an older kernel ignores the
/// control message and would send a whole batch as one datagram.
pub fn gso_supported() -> bool {
    static PROBE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PROBE.get_or_init(|| {
        let Ok(s) = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None) else {
            return false;
        };
        super::set_int_option(s.as_fd(), libc::SOL_UDP, libc::UDP_SEGMENT, 1200).is_ok()
    })
}

/// Send `buf` on a UDP socket, connected or to `to`, as datagrams of `seg` bytes each,
/// the last one possibly shorter, in one `sendmsg(2)` with a `UDP_SEGMENT`
/// control message: the kernel builds one large packet and splits it at the
/// device or in software (GSO). The whole buffer is sent or nothing is: the
/// error is the call's (`EIO`/`EINVAL` where the path or device cannot take
/// it, `WouldBlock` when the send buffer is full).
pub fn send_gso(
    fd: BorrowedFd<'_>,
    to: Option<&socket2::SockAddr>,
    buf: &[u8],
    seg: u16,
) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_ptr().cast_mut().cast(),
        iov_len: buf.len(),
    };
    // Room for one control message carrying a u16, aligned for cmsghdr
    // (CMSG_SPACE(2) is 24 bytes on 64-bit targets, 16 on 32-bit).
    #[repr(C, align(8))]
    struct Control([u8; 32]);
    let mut control = Control([0; 32]);
    // SAFETY: CMSG_SPACE only computes a size from its argument.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) } as usize;
    debug_assert!(space <= control.0.len());
    // SAFETY: msghdr is a plain C struct for which all-zero is a valid value
    // (no name, no control data); the fields sendmsg needs are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    if let Some(to) = to {
        // Read only by sendmsg, though the field is not const.
        msg.msg_name = to.as_ptr().cast_mut().cast();
        msg.msg_namelen = to.len();
    }
    // SAFETY: `msg` describes `control`, which is aligned for cmsghdr and at
    // least CMSG_SPACE(2) bytes long, so CMSG_FIRSTHDR returns a pointer to
    // its start (never null with msg_controllen >= sizeof(cmsghdr)), and the
    // header and its 2 data bytes lie inside `control`. CMSG_DATA may be
    // unaligned for u16, hence write_unaligned.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_UDP;
        (*c).cmsg_type = libc::UDP_SEGMENT;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), seg);
    }
    // SAFETY: `fd` is borrowed for the call; `msg` points at one iovec over
    // `buf` (read-only for sendmsg, valid for `buf.len()` bytes), at the
    // control message above and at `to`'s address (valid for its length),
    // all alive for the call.
    let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Datagrams one [`recv_batch`] call takes at most.
pub const RECV_BATCH: usize = 16;

/// Where [`recv_batch`] puts datagram `i`: its first `room` bytes at
/// `dense[i * stride + start..]`, the rest (a datagram longer than `room`)
/// at `spill[i * spill_stride..][..spill_stride]`. Both areas are the
/// caller's, so nothing is allocated per call.
#[derive(Debug)]
pub struct Slots<'a> {
    pub dense: &'a mut [u8],
    pub stride: usize,
    pub start: usize,
    pub room: usize,
    pub spill: &'a mut [u8],
    pub spill_stride: usize,
}

/// One `recvmmsg(2)` on a non-blocking datagram socket: up to `got.len()`
/// (at most [`RECV_BATCH`]) datagrams into `slots`. Returns how many came;
/// `got[i]` is datagram `i`'s length and whether it was longer than its
/// room and spill together (`MSG_TRUNC`: the caller drops it, never passes
/// it on cut short). With `from`, `from[i]` is datagram `i`'s source (an
/// unconnected socket's replies come from any peer). `WouldBlock` when
/// none was waiting.
pub fn recv_batch(
    fd: BorrowedFd<'_>,
    slots: &mut Slots<'_>,
    got: &mut [(usize, bool)],
    from: Option<&mut [Option<std::net::SocketAddr>]>,
) -> io::Result<usize> {
    let n = got.len().min(RECV_BATCH);
    assert!(
        n * slots.stride <= slots.dense.len()
            && slots.start + slots.room <= slots.stride
            && n * slots.spill_stride <= slots.spill.len(),
        "recv_batch: slots out of their buffers"
    );
    let mut iov = [[libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; 2]; RECV_BATCH];
    // SAFETY: mmsghdr is a plain C struct for which all-zero is a valid
    // value (no name, no iovecs, no control data).
    let mut hdrs: [libc::mmsghdr; RECV_BATCH] = unsafe { std::mem::zeroed() };
    // A source is an IPv4 or IPv6 address, so a sockaddr_in6 holds it:
    // 16 of them instead of 16 sockaddr_storage (128 bytes each) to zero
    // saved about 90 of a call's 680-990 instructions (docs/notes.md, "UDP
    // download: instructions per datagram").
    // SAFETY: sockaddr_in6 is a plain C struct; all-zero is valid.
    let mut names: [libc::sockaddr_in6; RECV_BATCH] = unsafe { std::mem::zeroed() };
    let named = from.as_ref().is_some_and(|f| f.len() >= n);
    let dense = slots.dense.as_mut_ptr();
    let spill = slots.spill.as_mut_ptr();
    for i in 0..n {
        // SAFETY: the assert above keeps both offsets and their lengths
        // inside `slots.dense` and `slots.spill`, and the areas of two
        // slots do not overlap (stride >= start + room).
        iov[i] = unsafe {
            [
                libc::iovec {
                    iov_base: dense.add(i * slots.stride + slots.start).cast(),
                    iov_len: slots.room,
                },
                libc::iovec {
                    iov_base: spill.add(i * slots.spill_stride).cast(),
                    iov_len: slots.spill_stride,
                },
            ]
        };
        hdrs[i].msg_hdr.msg_iov = iov[i].as_mut_ptr();
        hdrs[i].msg_hdr.msg_iovlen = 2;
        if named {
            hdrs[i].msg_hdr.msg_name = (&mut names[i] as *mut libc::sockaddr_in6).cast();
            hdrs[i].msg_hdr.msg_namelen =
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
        }
    }
    // SAFETY: `fd` is borrowed for the call; each of the first `n` headers
    // points at two iovecs over disjoint, writable parts of the caller's
    // buffers (borrowed mutably for the call) and, with `from`, at its own
    // entry of `names`; `iov`, `names` and `hdrs` outlive it. No timeout: the socket is non-blocking, the call returns what is
    // queued.
    let r = unsafe {
        libc::recvmmsg(
            fd.as_raw_fd(),
            hdrs.as_mut_ptr(),
            n as _,
            0,
            std::ptr::null_mut(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let r = r as usize;
    for (g, h) in got.iter_mut().zip(&hdrs).take(r) {
        *g = (
            h.msg_len as usize,
            h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0,
        );
    }
    if named && let Some(from) = from {
        for i in 0..r {
            from[i] = source(&names[i], hdrs[i].msg_hdr.msg_namelen);
        }
    }
    Ok(r)
}

/// The IPv4 or IPv6 source `recv_batch` got in `name` (`len` bytes of
/// it, as the kernel reports): `super::socket_addr` for a name buffer the
/// size of a `sockaddr_in6`.
fn source(name: &libc::sockaddr_in6, len: libc::socklen_t) -> Option<std::net::SocketAddr> {
    use super::{from_sockaddr_in, from_sockaddr_in6};
    let len = len as usize;
    match i32::from(name.sin6_family) {
        libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: a sockaddr_in is smaller than a sockaddr_in6 and
            // needs no stricter alignment, and the kernel wrote one here
            // (its family says so, and it wrote at least its size).
            let a = unsafe { &*(name as *const libc::sockaddr_in6).cast::<libc::sockaddr_in>() };
            Some(from_sockaddr_in(a))
        }
        libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
            Some(from_sockaddr_in6(name))
        }
        _ => None,
    }
}

/// Socket options and a GRO receive the tests of the batched paths need.
#[cfg(test)]
pub(crate) mod testing {
    use crate::sys::set_int_option;
    use std::io;
    use std::os::fd::{AsRawFd, BorrowedFd};

    /// `SO_NO_CHECK`: the kernel refuses GSO sends on such a socket (`EINVAL`).
    pub fn set_no_check(fd: BorrowedFd<'_>) -> io::Result<()> {
        set_int_option(fd, libc::SOL_SOCKET, libc::SO_NO_CHECK, 1)
    }

    /// `UDP_GRO`: a GSO packet reaches this socket whole.
    pub fn set_gro(fd: BorrowedFd<'_>) -> io::Result<()> {
        set_int_option(fd, libc::SOL_UDP, libc::UDP_GRO, 1)
    }

    /// One `recvmsg` on a `UDP_GRO` socket: the bytes and the segment size
    /// the kernel reports (`None`: one plain datagram).
    pub fn recv_gro(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Option<u16>)> {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        #[repr(C, align(8))]
        struct Control([u8; 64]);
        let mut control = Control([0; 64]);
        // SAFETY: all-zero is a valid msghdr; the fields used are set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.0.as_mut_ptr().cast();
        msg.msg_controllen = control.0.len() as _;
        // SAFETY: `msg` points at one iovec over `buf` and at `control`,
        // both writable and alive for the call.
        let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut seg = None;
        // SAFETY: the kernel filled `msg_controllen` bytes of `control` with
        // well-formed control messages; CMSG_FIRSTHDR/NXTHDR stay inside it
        // and return null at its end; a UDP_GRO message carries an int.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == libc::UDP_GRO {
                    let v = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<i32>());
                    seg = Some(v as u16);
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        Ok((n as usize, seg))
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{recv_gro, set_gro};
    use super::*;
    use std::net::UdpSocket;
    use std::os::fd::AsFd;
    use std::time::Duration;

    fn pair(v6: bool) -> (UdpSocket, UdpSocket) {
        let any = if v6 { "[::1]:0" } else { "127.0.0.1:0" };
        let rx = UdpSocket::bind(any).expect("bind");
        let tx = UdpSocket::bind(any).expect("bind");
        tx.connect(rx.local_addr().expect("addr")).expect("connect");
        rx.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        (tx, rx)
    }

    /// Datagram `i` of a test: `len` bytes that name `i` and their offset.
    fn datagram(i: usize, len: usize) -> Vec<u8> {
        (0..len).map(|k| (i * 31 + k * 7 + k / 251) as u8).collect()
    }

    /// One GSO send of 10 x 1200 bytes and a 700-byte tail arrives as 11
    /// datagrams, byte for byte, v4 and v6; a receiver with UDP_GRO gets the
    /// batch whole in one read with segment size 1200 (so it was one packet
    /// through the stack, not 11).
    #[test]
    fn gso_send_arrives_as_its_datagrams_and_as_one_packet() {
        assert!(gso_supported(), "this kernel has UDP_SEGMENT (4.18+)");
        for v6 in [false, true] {
            let sizes: Vec<usize> = std::iter::repeat_n(1200, 10).chain([700]).collect();
            let want: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &l)| datagram(i, l))
                .collect();
            let batch = want.concat();
            let (tx, rx) = pair(v6);
            let n = send_gso(tx.as_fd(), None, &batch, 1200).expect("gso send");
            assert_eq!(n, batch.len());
            let mut buf = vec![0u8; 65536];
            for (i, w) in want.iter().enumerate() {
                let got = rx.recv(&mut buf).expect("datagram");
                assert_eq!(&buf[..got], &w[..], "v6 {v6}: datagram {i}");
            }
            let (tx, rx) = pair(v6);
            set_gro(rx.as_fd()).expect("UDP_GRO");
            send_gso(tx.as_fd(), None, &batch, 1200).expect("gso send");
            let (got, seg) = recv_gro(rx.as_fd(), &mut buf).expect("whole batch");
            assert_eq!((got, seg), (batch.len(), Some(1200)), "v6 {v6}");
            assert_eq!(&buf[..got], &batch[..]);
        }
    }

    /// The buffers behind [`Slots`] for [`RECV_BATCH`] datagrams: `room`
    /// bytes from `start` in each dense slot, `spill_stride` bytes of spill
    /// each.
    struct Buffers {
        dense: Vec<u8>,
        spill: Vec<u8>,
        start: usize,
        room: usize,
        spill_stride: usize,
    }

    impl Buffers {
        fn new(start: usize, room: usize, spill_stride: usize) -> Self {
            Buffers {
                dense: vec![0u8; RECV_BATCH * (start + room)],
                spill: vec![0u8; RECV_BATCH * spill_stride],
                start,
                room,
                spill_stride,
            }
        }

        fn slots(&mut self) -> Slots<'_> {
            Slots {
                dense: &mut self.dense,
                stride: self.start + self.room,
                start: self.start,
                room: self.room,
                spill: &mut self.spill,
                spill_stride: self.spill_stride,
            }
        }
    }

    /// recvmmsg takes up to 16 datagrams a call, each whole: small ones in
    /// their slot, longer ones continued in their spill area, a zero-length
    /// one as such, and one longer than slot + spill flagged (MSG_TRUNC),
    /// never handed over as if whole. v4 and v6.
    #[test]
    fn recv_batch_takes_mixed_sizes_whole() {
        for v6 in [false, true] {
            let (tx, rx) = pair(v6);
            let mut sizes: Vec<usize> = std::iter::repeat_n(1200, 20).collect();
            sizes.extend([1, 0, 1472, 1473, 3000, 20_000, 16_384, 1200]);
            for (i, &l) in sizes.iter().enumerate() {
                tx.send(&datagram(i, l)).expect("send");
            }
            rx.set_nonblocking(true).expect("nonblocking");
            let (start, room, spill_stride) = (38, 1472, 16_384 - 1472);
            let stride = start + room;
            let mut bufs = Buffers::new(start, room, spill_stride);
            let mut slots = bufs.slots();
            let mut got = [(0usize, false); RECV_BATCH];
            let mut seen = 0;
            while seen < sizes.len() {
                let n = recv_batch(rx.as_fd(), &mut slots, &mut got, None).expect("batch");
                assert!(n > 0 && n <= RECV_BATCH);
                for (k, &(len, trunc)) in got.iter().enumerate().take(n) {
                    let i = seen + k;
                    let want = datagram(i, sizes[i]);
                    if sizes[i] > room + spill_stride {
                        assert!(trunc, "v6 {v6}: datagram {i} of {} bytes", sizes[i]);
                        continue;
                    }
                    assert!(!trunc, "v6 {v6}: datagram {i}");
                    assert_eq!(len, sizes[i], "v6 {v6}: datagram {i}");
                    let head = len.min(room);
                    assert_eq!(&slots.dense[k * stride + start..][..head], &want[..head]);
                    assert_eq!(
                        &slots.spill[k * spill_stride..][..len - head],
                        &want[head..]
                    );
                }
                seen += n;
            }
            assert_eq!(seen, sizes.len());
            let e = recv_batch(rx.as_fd(), &mut slots, &mut got, None).expect_err("empty");
            assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        }
    }

    /// With `from`, each datagram of a batch is named by its own source,
    /// v4 and v6: two senders interleaved, and what a short batch leaves
    /// in `from` past its end is untouched.
    #[test]
    fn recv_batch_names_each_source() {
        for v6 in [false, true] {
            let any = if v6 { "[::1]:0" } else { "127.0.0.1:0" };
            let rx = UdpSocket::bind(any).expect("bind");
            let to = rx.local_addr().expect("addr");
            let a = UdpSocket::bind(any).expect("bind");
            let b = UdpSocket::bind(any).expect("bind");
            let senders = [&a, &b, &a, &b, &b];
            for (i, s) in senders.iter().enumerate() {
                s.send_to(&datagram(i, 100 + i), to).expect("send");
            }
            rx.set_nonblocking(true).expect("nonblocking");
            let mut bufs = Buffers::new(38, 1472, 64);
            let mut got = [(0usize, false); RECV_BATCH];
            let mut from = [None; RECV_BATCH];
            let n = recv_batch(rx.as_fd(), &mut bufs.slots(), &mut got, Some(&mut from[..]))
                .expect("batch");
            assert_eq!(n, senders.len(), "v6 {v6}: one batch");
            for (i, s) in senders.iter().enumerate() {
                assert_eq!(got[i], (100 + i, false), "v6 {v6}: datagram {i}");
                let want = s.local_addr().expect("addr");
                assert_eq!(from[i], Some(want), "v6 {v6}: datagram {i}'s source");
            }
            assert!(from[n..].iter().all(Option::is_none), "v6 {v6}");
        }
    }
}
