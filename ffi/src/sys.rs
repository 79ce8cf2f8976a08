//! The only place in this crate where `unsafe` is allowed: the unified log
//! on Apple platforms (the descriptor the app lends to `Engine.start` is
//! borrowed by the core, `kerntun::tun::with_lent_fd`). Every block carries
//! a `// SAFETY:` comment.
//!
//! `os_log` is a C macro; this calls the function it expands to,
//! `_os_log_impl`, with one public string argument. (The `oslog` crate does
//! the same through a C shim, which cannot be compiled for Apple targets
//! without an Apple SDK: it would break the Linux cross checks.)

use std::ffi::{CString, c_char, c_void};
use std::sync::OnceLock;

use crate::config::LogLevel;

unsafe extern "C" {
    fn os_log_create(subsystem: *const c_char, category: *const c_char) -> *mut c_void;
    fn _os_log_impl(
        dso: *const c_void,
        log: *mut c_void,
        log_type: u8,
        format: *const c_char,
        buf: *const u8,
        size: u32,
    );
    /// The Mach-O header of the image this code is linked into; `os_log`
    /// resolves the format string relative to it.
    static __dso_handle: c_void;
}

/// `<os/log.h>` log types.
const OS_LOG_TYPE_DEFAULT: u8 = 0x00;
const OS_LOG_TYPE_INFO: u8 = 0x01;
const OS_LOG_TYPE_DEBUG: u8 = 0x02;
const OS_LOG_TYPE_ERROR: u8 = 0x10;

/// The format, in the section the `os_log` macro puts its formats in, so
/// `log show` can read it from the binary.
#[unsafe(link_section = "__TEXT,__oslogstring,cstring_literals")]
static FORMAT: [u8; 11] = *b"%{public}s\0";

/// The `os_log_t` for subsystem `kerntun`, category `engine`; it lives for
/// the process (stored as an address so the cell is Sync).
fn handle() -> usize {
    static LOG: OnceLock<usize> = OnceLock::new();
    *LOG.get_or_init(|| {
        // SAFETY: both arguments are valid NUL-terminated strings;
        // os_log_create never fails (it returns the disabled log at worst)
        // and the object is never released.
        unsafe { os_log_create(c"kerntun".as_ptr(), c"engine".as_ptr()) as usize }
    })
}

/// Write `message` to the unified log, readable without private-data mode.
pub fn os_log(level: LogLevel, message: &str) {
    let log_type = match level {
        LogLevel::Error => OS_LOG_TYPE_ERROR,
        LogLevel::Warn => OS_LOG_TYPE_DEFAULT,
        LogLevel::Info => OS_LOG_TYPE_INFO,
        LogLevel::Debug | LogLevel::Trace => OS_LOG_TYPE_DEBUG,
    };
    let Ok(text) = CString::new(message.replace('\0', "\u{FFFD}")) else {
        return;
    };
    // The argument buffer the macro builds for one `%{public}s`: summary
    // flags 0x02 (has a non-scalar argument), 1 argument, then the argument:
    // descriptor 0x22 (public 0x02 | string 0x20), size 8, the pointer.
    let mut buf = [0u8; 12];
    buf[0] = 0x02;
    buf[1] = 0x01;
    buf[2] = 0x22;
    buf[3] = 0x08;
    buf[4..].copy_from_slice(&(text.as_ptr() as u64).to_le_bytes());
    // SAFETY: `handle()` is a live os_log_t; `__dso_handle` is provided by
    // the linker for this image; FORMAT is NUL-terminated and static; `buf`
    // matches the single-argument layout above and `text`, whose address it
    // carries, outlives the call (os_log copies the string synchronously).
    unsafe {
        _os_log_impl(
            &raw const __dso_handle,
            handle() as *mut c_void,
            log_type,
            FORMAT.as_ptr().cast(),
            buf.as_ptr(),
            buf.len() as u32,
        );
    }
    drop(text);
}
