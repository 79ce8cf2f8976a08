//! The namespace demo lives in `examples/demo.rs`, outside the `kerntun`
//! binary (which does not link the test kit): `kerntun demo` says where it
//! went instead of running anything. No root needed.

use std::process::Command;

#[test]
fn kerntun_demo_points_at_the_example() {
    let out = Command::new(env!("CARGO_BIN_EXE_kerntun"))
        .arg("demo")
        .output()
        .expect("run kerntun");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cargo run --release -p kerntun-cli --example demo"),
        "{err}"
    );
    // Hidden: the help lists only what the binary does.
    let help = Command::new(env!("CARGO_BIN_EXE_kerntun"))
        .arg("--help")
        .output()
        .expect("run kerntun --help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("run"), "{help}");
    assert!(!help.contains("demo"), "{help}");
}
