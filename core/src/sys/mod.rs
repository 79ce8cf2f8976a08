//! The only place in the crate where `unsafe` is allowed: borrowing a lent
//! descriptor and adopting the device's, splice(2), batched UDP I/O, Darwin's utun calls. Every block carries a `// SAFETY:` comment.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};

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

/// Run `f` with the descriptor `fd` borrowed, or with `None` when `fd` is not
/// an open descriptor of this process (the CLI's `--tun-fd`, the app's
/// `tun_fd` through the FFI: `kerntun::tun::with_lent_fd`).
///
/// The contract, stated once for every caller: `fd` is *lent*, i.e. whoever
/// owns it keeps it open at least until `f` returns. The CLI's inherited
/// descriptor is never closed by the process; the FFI's `Engine.start`
/// documents that the app keeps `tun_fd` open until it returns, and `f`
/// (the start) runs inside that call. The engine itself only duplicates
/// the borrowed descriptor (`Tun::open` with `TunSource::Fd`) before `f`
/// returns, so the borrow never outlives the lender's promise.
pub fn with_lent_fd<T>(fd: RawFd, f: impl FnOnce(Option<BorrowedFd<'_>>) -> T) -> T {
    // SAFETY: fcntl(F_GETFD) only reads the descriptor's flags; it fails
    // (EBADF) for a number that is not an open descriptor.
    if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return f(None);
    }
    // SAFETY: the descriptor is open (checked above) and lent for the
    // duration of `f` (the contract above); the borrow ends with `f`.
    f(Some(unsafe { BorrowedFd::borrow_raw(fd) }))
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

#[cfg_attr(linux_like, allow(dead_code))]
/// One `recvmsg(2)` into `buf` on a datagram socket: the length received,
/// whether the datagram was longer than `buf` (`MSG_TRUNC` in the message
/// flags, POSIX), so a caller can drop it instead of passing on a
/// truncated one, and its source (`None` from an address family other
/// than IPv4 and IPv6). Non-blocking sockets answer `WouldBlock` as usual.
pub fn recv_datagram(
    fd: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
) -> io::Result<(usize, bool, Option<std::net::SocketAddr>)> {
    use std::os::fd::AsRawFd;
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: sockaddr_storage is a plain C struct; all-zero is valid.
    let mut name: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    // SAFETY: msghdr is a plain C struct for which all-zero is a valid value
    // (no name, no control data); the fields recvmsg needs are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_name = (&mut name as *mut libc::sockaddr_storage).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `fd` is borrowed for the call; `msg` points at one iovec
    // describing `buf`, which is valid and writable for `buf.len()` bytes,
    // and at `name`, writable for the size given; both outlive the call.
    let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let from = socket_addr(&name, msg.msg_namelen);
    Ok((n as usize, msg.msg_flags & libc::MSG_TRUNC != 0, from))
}

/// The IPv4 or IPv6 address the kernel wrote into `name` (`len` bytes of
/// it), as `recvmsg(2)` and `recvmmsg(2)` report a datagram's source.
pub fn socket_addr(
    name: &libc::sockaddr_storage,
    len: libc::socklen_t,
) -> Option<std::net::SocketAddr> {
    let len = len as usize;
    match i32::from(name.ss_family) {
        libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: sockaddr_storage is large enough and aligned for every
            // socket address type, and the kernel wrote a sockaddr_in here
            // (its family says so, and it wrote at least its size).
            let a =
                unsafe { &*(name as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(from_sockaddr_in(a))
        }
        libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for a sockaddr_in6.
            let a =
                unsafe { &*(name as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Some(from_sockaddr_in6(a))
        }
        _ => None,
    }
}

/// The address and port of a `sockaddr_in` (network byte order).
#[inline]
pub(crate) fn from_sockaddr_in(a: &libc::sockaddr_in) -> std::net::SocketAddr {
    std::net::SocketAddrV4::new(
        std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
        u16::from_be(a.sin_port),
    )
    .into()
}

/// The address, port, flow label and scope of a `sockaddr_in6`.
#[inline]
pub(crate) fn from_sockaddr_in6(a: &libc::sockaddr_in6) -> std::net::SocketAddr {
    std::net::SocketAddrV6::new(
        std::net::Ipv6Addr::from(a.sin6_addr.s6_addr),
        u16::from_be(a.sin6_port),
        a.sin6_flowinfo,
        a.sin6_scope_id,
    )
    .into()
}

/// splice(2), pipes and the urgent-mark probe for the splice relay.
/// Pages handed back to the system (the smoltcp stack's rings).
pub mod pages;
#[cfg(linux_like)]
pub mod splice;

/// `TCP_SAVE_SYN` on a listener: the kernel keeps each connection's SYN
/// headers (IP and TCP, about 60-100 bytes) until [`saved_syn`] reads them
/// from the accepted socket (Linux 4.2+).
#[cfg(linux_like)]
pub fn set_save_syn(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    set_int_option(fd, libc::IPPROTO_TCP, libc::TCP_SAVE_SYN, 1)
}

/// `setsockopt(2)` of an int-valued option on `fd`.
#[cfg(linux_like)]
pub(crate) fn set_int_option(
    fd: std::os::fd::BorrowedFd<'_>,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: `fd` is borrowed for the call; the option value is a c_int
    // that lives on the stack for the call, and its size is passed with it.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `TCP_SAVED_SYN` of an accepted socket, into `buf`: the length of the
/// saved headers, 0 when the kernel saved none (a connection completed by
/// a SYN cookie, or a listener without `TCP_SAVE_SYN`). The kernel frees
/// them on this read, so a second call answers 0.
#[cfg(linux_like)]
pub fn saved_syn(fd: std::os::fd::BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut len = libc::socklen_t::try_from(buf.len()).unwrap_or(libc::socklen_t::MAX);
    // SAFETY: `fd` is borrowed for the call; `buf` is valid and writable for
    // `len` bytes (at most its length), and `len` is a live socklen_t the
    // kernel overwrites with the bytes it wrote.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_SAVED_SYN,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((len as usize).min(buf.len()))
}

/// Raise this process's descriptor limit (`RLIMIT_NOFILE`, soft) toward
/// `want`, as far as the hard limit allows (Darwin: also `OPEN_MAX`, the
/// most `setrlimit` takes there), never lowering it. Returns the soft limit
/// in force afterwards. Process-wide, like the Go runtime's own raise at
/// start: descriptors are what every engine session holds.
pub fn raise_nofile(want: u64) -> io::Result<u64> {
    // SAFETY: rlimit is a plain C struct of two integers; all-zero is valid
    // and getrlimit overwrites it.
    let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: `lim` is a live, writable rlimit for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let (soft, hard) = (lim.rlim_cur as u64, lim.rlim_max as u64);
    // <sys/syslimits.h> OPEN_MAX: Darwin's setrlimit refuses a soft
    // NOFILE above it, whatever the hard limit says.
    #[cfg(apple)]
    let hard = hard.min(10_240);
    let target = want.min(hard);
    if target <= soft {
        return Ok(soft);
    }
    lim.rlim_cur = target as libc::rlim_t;
    // SAFETY: `lim` is a valid rlimit read above, its soft value raised
    // within the hard one; setrlimit only reads it.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(target)
}

/// Hand the allocator's free memory back to the kernel: glibc keeps what
/// was freed in its arenas (one per thread that allocated), so after a
/// burst of connections the process's RSS stays at its peak until this
/// runs. `malloc_trim(0)` releases the free pages of every arena. Returns
/// whether any memory was released. glibc only: Android's bionic (scudo,
/// or jemalloc before Android 11) and Darwin's libmalloc release free pages
/// on their own and have no `malloc_trim`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn trim_heap() -> bool {
    // SAFETY: malloc_trim takes no pointer and only walks glibc's own arenas
    // under their locks; 0 asks it to keep no padding at the heap's top.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// Caps how many malloc arenas glibc keeps (`M_ARENA_MAX`), for the
/// process that runs the engine to call once at its start, before it
/// spawns threads; the library never calls it on its own, since the
/// setting is the whole process's (the CLI calls it with 1). glibc gives
/// a thread that meets contention an arena of its own, up to 8 per core,
/// and `malloc_trim` ([`trim_heap`]) does not give back the free top of
/// any arena but the main one. Measured in the stress suite's process
/// (`core/tests/stress.rs`, 4,000 spoofed SYNs, system stack), 15 s after
/// the flood and after the engine's trim: 5.2-6.9 MB above idle with the
/// default 16 arenas, 2.4 MB with 2, 2.2 MB with 1, most of it the
/// non-main arenas' tops. The engine's packet paths do not allocate, so
/// one arena serialises only what connections allocate as they open and
/// close.
///
/// Does nothing (returns `false`) when the environment already sets the
/// arena count (`MALLOC_ARENA_MAX`, or `arena_max` in `GLIBC_TUNABLES`):
/// the operator's choice stands. glibc only; elsewhere it returns `false`.
pub fn limit_malloc_arenas(max: u16) -> bool {
    let set_by_env = std::env::var_os("MALLOC_ARENA_MAX").is_some()
        || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("arena_max"));
    if set_by_env || max == 0 {
        return false;
    }
    set_arena_max(max)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_arena_max(max: u16) -> bool {
    // SAFETY: mallopt takes two integers and changes a glibc parameter
    // under its own lock; M_ARENA_MAX only bounds arenas created later.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, i32::from(max)) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_arena_max(_max: u16) -> bool {
    false
}

/// Batched UDP: GSO sends (`UDP_SEGMENT`) and `recvmmsg`.
#[cfg(linux_like)]
pub mod udp;

/// One `read(2)` from `fd` into `buf` (each packet of the per-packet
/// driver, `Tun::try_recv`, and of its reader thread, `driver::read_ring`):
/// a non-blocking descriptor answers `WouldBlock`.
///
/// Made with `syscall(2)`, not libc's `read`: glibc's and musl's `read`
/// is a thread cancellation point, wrapped in two calls that switch
/// asynchronous cancellation on and off, and the engine never cancels a
/// thread. Those two calls were 1.4 % of the per-packet engine's samples
/// in a one-stream upload at MTU 1500 and 1.6 % in a download
/// (docs/notes.md, "A TUN read without the runtime's readiness check").
/// Bionic's `read` has no such wrapper; the same call serves there.
#[cfg(linux_like)]
pub fn read_fd(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: `fd` is borrowed for the call; `buf` is valid and writable for
    // `buf.len()` bytes for the call's duration. `SYS_read` takes exactly
    // (int fd, void *buf, size_t count), passed here as such.
    let n = unsafe {
        libc::syscall(
            libc::SYS_read,
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast::<libc::c_void>(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Block in `poll(2)` until `wake` is readable, or `dev` is (when given);
/// an error or hang-up on a descriptor counts as readable, so the read that
/// follows reports it. Returns (`dev` ready, `wake` ready); `EINTR` returns
/// (false, false) and the caller polls again.
#[cfg(linux_like)]
pub fn poll_readable(
    dev: Option<BorrowedFd<'_>>,
    wake: BorrowedFd<'_>,
) -> io::Result<(bool, bool)> {
    use std::os::fd::AsRawFd;
    let ready = libc::POLLIN | libc::POLLERR | libc::POLLHUP | libc::POLLNVAL;
    let mut fds = [
        libc::pollfd {
            fd: wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            // A negative descriptor is ignored by poll(2).
            fd: dev.map_or(-1, |d| d.as_raw_fd()),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: `fds` is a valid array of two pollfd structs for the call's
    // duration; both descriptors are borrowed for it (or -1, ignored).
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok((false, false));
        }
        return Err(e);
    }
    Ok((fds[1].revents & ready != 0, fds[0].revents & ready != 0))
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    /// An open descriptor is borrowed as itself; a negative number, or one
    /// that names no open descriptor (past any descriptor limit), is `None`
    /// and never borrowed.
    #[test]
    fn only_open_descriptors_are_lent() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().expect("pair");
        let raw = a.as_raw_fd();
        assert_eq!(
            with_lent_fd(raw, |fd| fd.map(|fd| fd.as_raw_fd())),
            Some(raw)
        );
        assert!(with_lent_fd(-1, |fd| fd.is_none()));
        assert!(with_lent_fd(RawFd::MAX, |fd| fd.is_none()));
    }

    /// A listener with `TCP_SAVE_SYN` (set through [`set_int_option`])
    /// keeps each connection's SYN: its IPv4 header and TCP header read
    /// back once; without it there is nothing to read.
    #[cfg(linux_like)]
    #[test]
    fn a_listener_with_save_syn_keeps_the_syn() {
        use std::os::fd::AsFd;
        for save in [true, false] {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
            if save {
                set_save_syn(l.as_fd()).expect("TCP_SAVE_SYN");
            }
            let _c = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
            let (conn, _) = l.accept().expect("accept");
            let mut buf = [0u8; 512];
            let n = saved_syn(conn.as_fd(), &mut buf).expect("read");
            if save {
                assert!(n >= 40, "IPv4 and TCP headers: {n}");
                assert_eq!(buf[0] >> 4, 4, "an IPv4 header");
                assert_eq!(saved_syn(conn.as_fd(), &mut buf).expect("again"), 0);
            } else {
                assert_eq!(n, 0);
            }
        }
    }
}
