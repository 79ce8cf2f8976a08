//! Handing pages of memory back to the system while keeping their
//! address: the smoltcp stack's rings (`stack::smoltcp`) drop the pages no
//! data sits in. Safe to call: it only ever zero-fills memory the caller
//! holds a unique borrow of.

use std::sync::OnceLock;

/// The size of a memory page (4 KiB on Linux x86-64, 16 KiB on iOS arm64).
pub fn page() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf reads a constant of the system; no memory is passed.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(p)
            .ok()
            .filter(|p| p.is_power_of_two())
            .unwrap_or(4096)
    })
}

/// Hand the whole pages inside `buf` back to the system: they cost nothing
/// until written again, and read as zeros meanwhile (Linux; unspecified
/// bytes on Darwin). Returns the bytes handed back (0 where the system has
/// no such advice). One system call when `buf` spans a whole page.
pub fn discard(buf: &mut [u8]) -> usize {
    let page = page();
    let start = buf.as_mut_ptr() as usize;
    let first = start.next_multiple_of(page);
    let end = (start + buf.len()) & !(page - 1);
    if end <= first {
        return 0;
    }
    let len = end - first;
    let at = buf[first - start..].as_mut_ptr();
    // SAFETY: [at, at + len) lies inside `buf`, a unique borrow, on whole
    // pages of private anonymous memory (the heap is): zero-filling them is
    // a write of zeros through that borrow, and nothing else refers to
    // those bytes while it is held.
    let ok = unsafe { release(at, len) };
    if ok { len } else { 0 }
}

/// Drop the pages at `at` (page-aligned, `len` a multiple of the page).
///
/// # Safety
/// The range is whole pages of private anonymous memory the caller may
/// write to.
#[cfg(linux_like)]
unsafe fn release(at: *mut u8, len: usize) -> bool {
    // SAFETY: as the caller promises; MADV_DONTNEED on private anonymous
    // memory frees the pages at once, later reads see zeros.
    unsafe { libc::madvise(at.cast(), len, libc::MADV_DONTNEED) == 0 }
}

/// Drop the pages at `at` (page-aligned, `len` a multiple of the page).
/// Darwin's MADV_DONTNEED leaves them counted against the process until
/// the system reclaims them; MADV_FREE_REUSABLE takes them off its
/// footprint at once (their contents are then unspecified: zeros or what
/// was there). Not measured here (no Apple device in this lab).
///
/// # Safety
/// The range is whole pages of private anonymous memory the caller may
/// write to.
#[cfg(apple)]
unsafe fn release(at: *mut u8, len: usize) -> bool {
    // SAFETY: as the caller promises; the advice changes no mapping.
    unsafe { libc::madvise(at.cast(), len, libc::MADV_FREE_REUSABLE) == 0 }
}

/// Elsewhere the pages stay where they are.
#[cfg(not(any(linux_like, apple)))]
unsafe fn release(_: *mut u8, _: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discard_zeroes_whole_pages_only() {
        let page = page();
        let mut v = vec![7u8; 5 * page];
        let base = v.as_ptr() as usize;
        let skip = base.next_multiple_of(page) - base;
        let buf = &mut v[skip..skip + 3 * page + 10];
        // From byte 1: pages 1 and 2 of `buf` are whole, 0 and 3 are not.
        assert_eq!(discard(&mut buf[1..]), 2 * page);
        assert!(buf[..page].iter().all(|&b| b == 7));
        assert!(buf[page..3 * page].iter().all(|&b| b == 0));
        assert!(buf[3 * page..].iter().all(|&b| b == 7));
        assert_eq!(discard(&mut buf[5..page]), 0);
        buf[page] = 1;
        assert_eq!(buf[page], 1, "a discarded page is writable again");
        assert!(
            v[..skip].iter().all(|&b| b == 7),
            "nothing outside the borrow"
        );
    }
}
