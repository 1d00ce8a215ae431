//! Finding a plugin file given on the command line: where it says, or
//! beside the installed executable.
//!
//! `--policy plugins/autoscale.wasm` names a file relative to the current
//! directory, which is the repository root in a checkout. An installed
//! `edl-runtime` keeps the shipped plugins beside it instead (`bin/` with
//! `plugins/` next to it, or `share/edl/plugins/`), so a relative path
//! missing here is also looked for there.

use anyhow::{Result, bail};
use std::path::{Path, PathBuf};

/// The file `given` names for `flag`: itself when it exists, else the first
/// of [`candidates`] that does; an error naming every place tried.
pub fn resolve(flag: &str, given: &Path) -> Result<PathBuf> {
    if given.exists() {
        return Ok(given.to_path_buf());
    }
    let exe_dir = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf));
    let tried = candidates(given, exe_dir.as_deref());
    if let Some(found) = tried.iter().skip(1).find(|p| p.exists()) {
        return Ok(found.clone());
    }
    let places: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
    bail!("{flag} {}: no such plugin; looked in {}.{}", given.display(), places.join(", "), hint(given))
}

/// The plugins the project ships (`plugins/<name>.wasm`).
const SHIPPED: [&str; 5] = ["autoscale", "dynamic-batch", "schedule", "augment", "teacher-autoscale"];

/// What to do about a plugin not found: build the shipped ones, where it
/// names one; else the plugins beside where it was looked for (a typo).
fn hint(given: &Path) -> String {
    let stem = given.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    if SHIPPED.contains(&stem) {
        return " `cargo build --release` builds the shipped plugins into plugins/".into();
    }
    let dir = match given.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else { return String::new() };
    let mut near: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".wasm") || n.ends_with(".so"))
        .collect();
    near.sort();
    match near.is_empty() {
        true => String::new(),
        false => format!(" Plugins in {}: {}", dir.display(), near.join(", ")),
    }
}

/// Where a plugin named `given` may be, in order: as given (from the
/// current directory), then, for a relative path, beside the executable,
/// in the executable's parent directory, in `<exe dir>/../share/edl/`,
/// and, for an executable cargo built (`<checkout>/target/<profile>/`), in
/// the checkout it was built from.
pub fn candidates(given: &Path, exe_dir: Option<&Path>) -> Vec<PathBuf> {
    let here = std::path::absolute(given).unwrap_or_else(|_| given.to_path_buf());
    let mut out = vec![here];
    if let (true, Some(dir)) = (given.is_relative(), exe_dir) {
        out.push(dir.join(given));
        if let Some(parent) = dir.parent() {
            out.push(parent.join(given));
            out.push(parent.join("share/edl").join(given));
            if parent.file_name().is_some_and(|n| n == "target")
                && let Some(checkout) = parent.parent()
            {
                out.push(checkout.join(given));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relative_plugin_is_looked_for_beside_the_executable() {
        let got = candidates(Path::new("plugins/a.wasm"), Some(Path::new("/opt/edl/bin")));
        assert!(got[0].is_absolute() && got[0].ends_with("plugins/a.wasm"));
        assert_eq!(
            got[1..],
            [
                PathBuf::from("/opt/edl/bin/plugins/a.wasm"),
                PathBuf::from("/opt/edl/plugins/a.wasm"),
                PathBuf::from("/opt/edl/share/edl/plugins/a.wasm"),
            ]
        );
        assert_eq!(
            candidates(Path::new("/x/a.wasm"), Some(Path::new("/opt/edl/bin"))),
            [PathBuf::from("/x/a.wasm")]
        );
        // A cargo build: the checkout's plugins/ last.
        let built = candidates(Path::new("plugins/a.wasm"), Some(Path::new("/src/edl/target/release")));
        assert_eq!(built.last(), Some(&PathBuf::from("/src/edl/plugins/a.wasm")));
    }

    #[test]
    fn a_missing_plugin_names_every_place_tried() {
        let e = resolve("--policy", Path::new("no/such/plugin.wasm")).unwrap_err().to_string();
        assert!(e.starts_with("--policy no/such/plugin.wasm: no such plugin; looked in "), "{e}");
        assert!(e.contains("share/edl/no/such/plugin.wasm"), "{e}");
        assert!(!e.contains("cargo build"), "not a shipped plugin: {e}");
        // A shipped plugin's name: how to build them.
        let e = resolve("--policy", Path::new("nowhere/autoscale.wasm")).unwrap_err().to_string();
        assert!(e.contains("`cargo build --release` builds the shipped plugins"), "{e}");
        // A typo beside plugins that are there: they are named.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("my_policy.wasm"), b"").unwrap();
        let e = resolve("--policy", &dir.path().join("my_polcy.wasm")).unwrap_err().to_string();
        assert!(e.ends_with(&format!("Plugins in {}: my_policy.wasm", dir.path().display())), "{e}");
    }
}
