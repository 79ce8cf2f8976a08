//! The enums whose every variant is a counter with a stable name.

/// Declares a fieldless `#[repr(u8)]` enum whose every variant has a stable
/// snake_case name (`Variant => "name"`), with `COUNT`, `ALL` (declaration
/// order, which is also the `as usize` order) and `as_str`.
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $(
                $(#[$vmeta:meta])*
                $variant:ident => $str:literal,
            )*
        }
    ) => {
        $(#[$meta])*
        #[repr(u8)]
        pub enum $name {
            $(
                $(#[$vmeta])*
                $variant,
            )*
        }

        impl $name {
            /// Number of variants (size of a counter array indexed by them).
            pub const COUNT: usize = [$(stringify!($variant)),*].len();
            /// Every variant, in declaration order.
            pub const ALL: [$name; Self::COUNT] = [$($name::$variant),*];

            /// Stable snake_case name used in stats and logs.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $str,)*
                }
            }
        }
    };
}
