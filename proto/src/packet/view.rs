//! What every header view shares: the struct over a caller-owned buffer,
//! `new_unchecked` / `into_inner`, and one getter (and setter) per field at
//! a fixed offset, read and written in network byte order.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::ops::Range;

/// A header field's value type: how it is read from and written to the
/// place `At` in the buffer (an octet's offset, or a byte range read
/// big-endian). Every method is a plain index or slice copy, inlined into
/// the view's accessor.
pub(crate) trait Field: Sized {
    type At;
    fn get(buf: &[u8], at: Self::At) -> Self;
    fn put(buf: &mut [u8], at: Self::At, v: Self);
}

impl Field for u8 {
    type At = usize;

    #[inline]
    fn get(buf: &[u8], at: usize) -> u8 {
        buf[at]
    }

    #[inline]
    fn put(buf: &mut [u8], at: usize, v: u8) {
        buf[at] = v;
    }
}

/// Integers and addresses stored in network byte order over a byte range
/// of their size `$n`: read through `$t::$from([u8; $n])`, written from
/// `v.$to()`.
macro_rules! be_field {
    ($($t:ty: $n:literal = $from:ident / $to:ident;)*) => {$(
        impl Field for $t {
            type At = Range<usize>;

            #[inline]
            fn get(buf: &[u8], at: Range<usize>) -> $t {
                let mut b = [0u8; $n];
                b.copy_from_slice(&buf[at]);
                <$t>::$from(b)
            }

            #[inline]
            fn put(buf: &mut [u8], at: Range<usize>, v: $t) {
                buf[at].copy_from_slice(&v.$to());
            }
        }
    )*};
}

be_field! {
    u16: 2 = from_be_bytes / to_be_bytes;
    u32: 4 = from_be_bytes / to_be_bytes;
    Ipv4Addr: 4 = from / octets;
    Ipv6Addr: 16 = from / octets;
}

/// Declares a header view `$name<T>` over a buffer `T` with
/// `new_unchecked`, `into_inner`, and for each field line
/// `vis getter[, setter]: Type = place;` a getter and, where named, a setter
/// (same visibility) through [`Field`]. Checked constructors and derived
/// accessors stay in a separate `impl` next to the view.
macro_rules! header_view {
    (
        $(#[$meta:meta])*
        pub struct $name:ident, at least $min:ident bytes;
        $(
            $(#[$fmeta:meta])*
            $vis:vis $get:ident $(, $set:ident)?: $ty:ty = $at:expr;
        )*
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name<T> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            #[doc = concat!(
                "Wraps a buffer without checks. Only for buffers this crate sized\n",
                "itself (at least [`", stringify!($min), "`] bytes); accessors panic otherwise."
            )]
            pub const fn new_unchecked(buffer: T) -> Self {
                $name { buffer }
            }

            pub fn into_inner(self) -> T {
                self.buffer
            }

            $(
                $(#[$fmeta])*
                #[inline]
                $vis fn $get(&self) -> $ty {
                    <$ty as $crate::packet::view::Field>::get(self.buffer.as_ref(), $at)
                }
            )*
        }

        impl<T: AsRef<[u8]> + AsMut<[u8]>> $name<T> {
            $($(
                #[inline]
                $vis fn $set(&mut self, v: $ty) {
                    <$ty as $crate::packet::view::Field>::put(self.buffer.as_mut(), $at, v)
                }
            )?)*
        }
    };
}
