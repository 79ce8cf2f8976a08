//! Darwin (macOS, iOS) system calls for the utun driver: `recvmsg_x`, the
//! utun interface name (`UTUN_OPT_IFNAME`) and the utun descriptor search of
//! a Packet Tunnel extension. Every `unsafe` block carries a `// SAFETY:`.
//!
//! `recvmsg_x` is exported by libsystem_kernel but declared in no public
//! header, so it is looked up with `dlsym` at run time instead of linked:
//! an SDK that stops listing it cannot break the app's link, and its absence
//! is just a failed probe (the driver falls back to per-packet reads).

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::OnceLock;

use super::utun::{IOV_ZERO, MAX_BATCH, MsghdrX, RecvBatch};

/// `sys/sys_domain.h`: the system protocol of kernel-control sockets.
const SYSPROTO_CONTROL: c_int = 2;
/// `sys/sys_domain.h`: kernel control sub-address.
const AF_SYS_CONTROL: u16 = 2;
/// `net/if_utun.h`: get the interface name of a utun control socket.
const UTUN_OPT_IFNAME: c_int = 2;
/// `net/if_utun.h`: how many packets utun queues on the control socket
/// for the reader (a `u32`, at least 1; XNU's default is 1).
const UTUN_OPT_MAX_PENDING_PACKETS: c_int = 16;
/// `sys/kern_control.h`: `_IOWR('N', 3, struct ctl_info)`.
const CTLIOCGINFO: libc::c_ulong = 0xc064_4e03;
/// `sys/kern_control.h`.
const MAX_KCTL_NAME: usize = 96;
/// The kernel control behind every utun device.
const UTUN_CONTROL_NAME: &[u8] = b"com.apple.net.utun_control";
/// Descriptors scanned for the utun socket. A Packet Tunnel extension opens
/// few descriptors; the utun one is among the first dozens.
const FD_SCAN_LIMIT: RawFd = 1024;

/// `struct ctl_info` (`sys/kern_control.h`).
#[repr(C)]
struct CtlInfo {
    ctl_id: u32,
    ctl_name: [c_char; MAX_KCTL_NAME],
}

/// `struct sockaddr_ctl` (`sys/kern_control.h`).
#[repr(C)]
#[derive(Default)]
struct SockaddrCtl {
    sc_len: u8,
    sc_family: u8,
    ss_sysaddr: u16,
    sc_id: u32,
    sc_unit: u32,
    sc_reserved: [u32; 5],
}

type RecvmsgX = unsafe extern "C" fn(c_int, *mut MsghdrX, c_uint, c_int) -> isize;

fn recvmsg_x_fn() -> Option<RecvmsgX> {
    static FN: OnceLock<Option<usize>> = OnceLock::new();
    let addr = *FN.get_or_init(|| {
        // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only
        // looks the symbol up; a null result means "absent".
        let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"recvmsg_x".as_ptr()) };
        (!p.is_null()).then_some(p as usize)
    });
    // SAFETY: the address is libsystem_kernel's `recvmsg_x`, whose C
    // signature (`bsd/sys/socket_private.h`) is
    // `ssize_t recvmsg_x(int, const struct msghdr_x *, u_int, int)`, which
    // `RecvmsgX` matches (the kernel writes through the pointer, hence mut).
    addr.map(|a| unsafe { std::mem::transmute::<usize, RecvmsgX>(a) })
}

/// Whether `recvmsg_x` exists in this process (the first half of the probe;
/// the second is the first call's result).
pub fn recvmsg_x_available() -> bool {
    recvmsg_x_fn().is_some()
}

/// Receive up to `batch.slots()` packets in one non-blocking call. The
/// message headers and iovecs (raw pointers into `batch`) are built here,
/// re-zeroed, right before the call and never outlive it, so the safe
/// signature cannot be misused.
pub fn recvmsg_x(fd: BorrowedFd<'_>, batch: &mut RecvBatch) -> io::Result<usize> {
    let Some(f) = recvmsg_x_fn() else {
        return Err(io::Error::from_raw_os_error(libc::ENOSYS));
    };
    let mut hdrs = [MsghdrX::ZERO; MAX_BATCH];
    let mut iovs = [IOV_ZERO; MAX_BATCH];
    let prepared = batch.prepare(&mut hdrs, &mut iovs);
    let cnt = c_uint::try_from(prepared.len()).unwrap_or(c_uint::MAX);
    // SAFETY: `prepared` is a live, exclusively borrowed array of `cnt`
    // headers just built by `RecvBatch::prepare`; their iovecs live in `iovs`
    // and point into `batch`'s arena, both borrowed for the whole call. The
    // kernel writes at most `iov_len` bytes per iovec and fills
    // `msg_datalen`/`msg_flags`.
    let n = unsafe {
        f(
            fd.as_raw_fd(),
            prepared.as_mut_ptr(),
            cnt,
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = n as usize;
    batch.complete(&hdrs, n);
    Ok(n)
}

/// The interface name of a utun control socket (`utun4`).
pub fn utun_name(fd: RawFd) -> io::Result<String> {
    let mut name = [0u8; libc::IFNAMSIZ];
    let mut len = name.len() as libc::socklen_t;
    // SAFETY: `name` is a writable buffer of `len` bytes and `len` a valid
    // in/out length; getsockopt writes at most `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            fd,
            SYSPROTO_CONTROL,
            UTUN_OPT_IFNAME,
            name.as_mut_ptr().cast::<c_void>(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let len = (len as usize).min(name.len());
    let end = name[..len].iter().position(|&b| b == 0).unwrap_or(len);
    String::from_utf8(name[..end].to_vec())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "utun name is not UTF-8"))
}

/// Let utun queue up to `packets` packets for the reader
/// (`UTUN_OPT_MAX_PENDING_PACKETS`).
pub fn set_max_pending_packets(fd: RawFd, packets: u32) -> io::Result<()> {
    // SAFETY: `packets` is a live u32 and its exact size is passed;
    // setsockopt only reads it.
    let r = unsafe {
        libc::setsockopt(
            fd,
            SYSPROTO_CONTROL,
            UTUN_OPT_MAX_PENDING_PACKETS,
            (&raw const packets).cast::<c_void>(),
            std::mem::size_of::<u32>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The control id of `com.apple.net.utun_control`, asked through `fd`
/// (any kernel-control socket answers).
fn utun_ctl_id(fd: RawFd) -> Option<u32> {
    let mut info = CtlInfo {
        ctl_id: 0,
        ctl_name: [0; MAX_KCTL_NAME],
    };
    for (d, s) in info.ctl_name.iter_mut().zip(UTUN_CONTROL_NAME) {
        *d = *s as c_char;
    }
    // SAFETY: CTLIOCGINFO reads `ctl_name` and writes `ctl_id` of the
    // `struct ctl_info` we pass, which is live and correctly laid out.
    let r = unsafe { libc::ioctl(fd, CTLIOCGINFO, &mut info as *mut CtlInfo) };
    (r == 0).then_some(info.ctl_id)
}

/// The descriptor of this process's utun device: a socket whose peer is
/// the utun kernel control. Used by Packet Tunnel extensions, where
/// `packetFlow` no longer exposes the descriptor (iOS 15+).
pub fn find_utun_fd() -> Option<RawFd> {
    let mut ctl_id = None;
    for fd in 0..FD_SCAN_LIMIT {
        let mut addr = SockaddrCtl::default();
        let mut len = std::mem::size_of::<SockaddrCtl>() as libc::socklen_t;
        // SAFETY: getpeername writes at most `len` bytes into `addr`, a
        // live buffer of that size; an unused or non-socket fd just fails.
        let r = unsafe {
            libc::getpeername(
                fd,
                (&mut addr as *mut SockaddrCtl).cast::<libc::sockaddr>(),
                &mut len,
            )
        };
        if r != 0
            || c_int::from(addr.sc_family) != libc::AF_SYSTEM
            || addr.ss_sysaddr != AF_SYS_CONTROL
        {
            continue;
        }
        if ctl_id.is_none() {
            ctl_id = utun_ctl_id(fd);
        }
        if ctl_id == Some(addr.sc_id) {
            return Some(fd);
        }
    }
    None
}
