//! `uniffi-bindgen` for this workspace: generates the Kotlin and Swift
//! bindings from the built `kerntun-ffi` library (see `scripts/bindings.sh`).
//! Must run inside the workspace: it reads `cargo metadata`.

fn main() {
    uniffi::uniffi_bindgen_main()
}
