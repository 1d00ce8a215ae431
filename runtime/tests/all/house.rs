//! The shape of the workspace's source that the compiler does not check:
//! `tools/house-check` finds functions over 80 lines in `src/`, comments
//! that excuse a length, and import loops between files.

use std::{path::Path, process::Command};

#[test]
fn the_source_has_no_long_function_and_no_import_loop() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace");
    let out = Command::new("python3")
        .arg(root.join("tools/house-check"))
        .arg(root)
        .output()
        .expect("python3 runs tools/house-check");
    let found = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && found.trim().is_empty(), "tools/house-check found:\n{found}");
}

#[test]
fn the_checker_finds_a_long_function_and_a_loop_between_two_files() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("k/src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(dir.path().join("k/Cargo.toml"), "[package]\nname = \"k\"\n").unwrap();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\n").unwrap();
    std::fs::write(src.join("a.rs"), "use crate::b::B;\npub struct A;\npub fn f(_: B) {}\n").unwrap();
    let long: String = (0..90).map(|i| format!("    let _x{i} = {i};\n")).collect();
    std::fs::write(
        src.join("b.rs"),
        format!("use crate::a::A;\npub struct B;\npub fn g(_: A) {{\n{long}}}\n"),
    )
    .unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out = Command::new("python3").arg(root.join("tools/house-check")).arg(dir.path()).output().unwrap();
    let found = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{found}");
    assert!(found.contains("long function: k/src/b.rs:3 fn g (92 lines)"), "{found}");
    assert!(found.contains("import loop: k/src/a.rs -> k/src/b.rs; k/src/b.rs -> k/src/a.rs"), "{found}");
}
