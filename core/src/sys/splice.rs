//! The raw system calls of the splice relay (Linux/Android): pipes sized with
//! `F_SETPIPE_SZ`, `splice(2)`, the urgent-mark probe and the SIGPIPE check.
//! Safe wrappers only; the relay logic lives in `crate::splice`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `pipe2(O_NONBLOCK | O_CLOEXEC)`, then ask for `size` bytes of capacity.
/// Returns (read end, write end, the capacity the kernel granted). Resizing is
/// best effort: an unprivileged process past `fs.pipe-user-pages-soft` gets
/// a smaller pipe (the caller decides whether that is enough).
pub fn pipe(size: usize) -> io::Result<(OwnedFd, OwnedFd, usize)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid, writable array of two ints, as pipe2(2) requires.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let want = libc::c_int::try_from(size).unwrap_or(libc::c_int::MAX);
    // SAFETY: fcntl on a descriptor we own; F_SETPIPE_SZ takes an int argument.
    // A failure (EPERM over the per-user budget, EBUSY) leaves the default size.
    let _ = unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, want) };
    // SAFETY: fcntl on a descriptor we own; F_GETPIPE_SZ takes no argument.
    let got = unsafe { libc::fcntl(write.as_raw_fd(), libc::F_GETPIPE_SZ) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((read, write, got as usize))
}

/// One non-blocking `splice(2)` of at most `len` bytes, without
/// `SPLICE_F_MORE` (it would cork the last segment of a transfer).
pub fn splice(from: BorrowedFd<'_>, to: BorrowedFd<'_>, len: usize) -> io::Result<usize> {
    // SAFETY: both descriptors are borrowed for the duration of the call; null
    // offsets are what splice(2) requires for sockets and pipes.
    let n = unsafe {
        libc::splice(
            from.as_raw_fd(),
            std::ptr::null_mut(),
            to.as_raw_fd(),
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_NONBLOCK,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// `SIOCATMARK` from `asm-generic/sockios.h`; the architectures Android and
/// desktop Linux run on (x86, Arm, RISC-V, LoongArch, PowerPC) all use the
/// generic value. Others (Alpha, MIPS, SPARC...) define their own and get
/// no splicing (see [`at_urgent_mark`]).
#[cfg(generic_sockios)]
const SIOCATMARK: u32 = 0x8905;

/// Whether the socket's read position is at the urgent mark, i.e. the next
/// byte is the out-of-band one. `splice` from TCP stops in front of it and
/// returns EAGAIN (or 0 with the FIN in) until something reads past it.
#[cfg(generic_sockios)]
pub fn at_urgent_mark(sock: BorrowedFd<'_>) -> io::Result<bool> {
    let mut at: libc::c_int = 0;
    // SAFETY: SIOCATMARK writes one int through the pointer, which is valid
    // and writable for the duration of the call; the descriptor is borrowed.
    // The request parameter is c_ulong in glibc and c_int in Bionic/musl.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), SIOCATMARK as _, &mut at) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(at != 0)
    }
}

/// Architectures with their own `SIOCATMARK` number: report "unsupported",
/// which makes the relay copy instead of splicing.
#[cfg(not(generic_sockios))]
pub fn at_urgent_mark(_sock: BorrowedFd<'_>) -> io::Result<bool> {
    Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
}

/// Whether SIGPIPE has its default action (terminate) in this process.
/// `splice` cannot take `MSG_NOSIGNAL`, so splicing into a socket whose peer
/// is gone raises SIGPIPE; Rust executables ignore it at startup, but a host
/// app embedding the library may not. Unknown counts as default (copy).
pub fn sigpipe_is_default() -> bool {
    // SAFETY: an all-zero sigaction is a valid out-parameter; a null new action
    // only queries the current disposition.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGPIPE, std::ptr::null(), &mut old) != 0 {
            return true;
        }
        old.sa_sigaction == libc::SIG_DFL
    }
}
