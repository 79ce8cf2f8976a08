//! cfg aliases for the per-platform code (`#[cfg(apple)]` instead of a
//! repeated `any(target_os = "macos", target_os = "ios")`).

fn main() {
    // `cargo fuzz` builds with `--cfg fuzzing`: fuzz-only entry points.
    println!("cargo::rustc-check-cfg=cfg(fuzzing)");
    cfg_aliases::cfg_aliases! {
        // Darwin: utun devices, recvmsg_x, IP_BOUND_IF.
        apple: { any(target_os = "macos", target_os = "ios") },
        // Linux kernels: splice(2), IPV6_FREEBIND, SO_BINDTODEVICE.
        linux_like: { any(target_os = "linux", target_os = "android") },
        // Phones: the engine adopts the platform's descriptor, never creates one.
        mobile: { any(target_os = "ios", target_os = "android") },
        // Architectures whose `SIOCATMARK` is asm-generic/sockios.h's
        // (sys/splice.rs): the ones Android and desktop Linux run on.
        generic_sockios: { any(
            target_arch = "x86",
            target_arch = "x86_64",
            target_arch = "arm",
            target_arch = "aarch64",
            target_arch = "riscv64",
            target_arch = "loongarch64",
            target_arch = "powerpc64"
        ) },
    }
}
