//! `kerntun` command-line interface (Linux desktop). Filled in by the system-netstack work.
fn main() {
    println!("kerntun {}", env!("CARGO_PKG_VERSION"));
}
