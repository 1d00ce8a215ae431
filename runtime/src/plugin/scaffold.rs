//! `edl-runtime plugin new`: a ready plugin crate for one world, with a
//! working example body, a unit test on the SDK's harness, a criterion bench
//! and a README with the three commands (test, build, run).

use crate::plugin::World;
use std::path::{Path, PathBuf};

/// Why a crate could not be created.
#[derive(Debug, thiserror::Error)]
pub enum ScaffoldError {
    #[error(
        "{0:?} is not a usable crate name: use lowercase letters, digits, '-' and '_', starting with a letter"
    )]
    BadName(String),
    #[error("{0} already exists and is not empty")]
    Exists(PathBuf),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// How the generated crate depends on the SDK.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SdkSource {
    Path(PathBuf),
    Version(String),
}

/// The SDK of the checkout this binary was built from, if it is still there.
pub fn local_sdk() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugin-sdk");
    dir.join("Cargo.toml").exists().then(|| dir.canonicalize().ok()).flatten()
}

/// The SDK dependency for a crate created in `crate_dir`: by path when this
/// binary's checkout is there (relative when the crate is inside it), else
/// by version.
pub fn sdk_source_for(crate_dir: &Path) -> SdkSource {
    let Some(sdk) = local_sdk() else {
        return SdkSource::Version(env!("CARGO_PKG_VERSION").to_string());
    };
    let repo = sdk.parent().map(Path::to_path_buf).unwrap_or_default();
    let abs = std::path::absolute(crate_dir).unwrap_or_else(|_| crate_dir.to_path_buf());
    match abs.strip_prefix(&repo) {
        Ok(inside) => {
            let up: PathBuf = inside.components().map(|_| "..").collect();
            SdkSource::Path(up.join("plugin-sdk"))
        }
        Err(_) => SdkSource::Path(sdk),
    }
}

fn camel(name: &str) -> String {
    name.split(['-', '_'])
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut c = p.chars();
            c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
        })
        .collect()
}

/// The example body, the `edl_plugin_sdk::bench` function and the crate
/// description of a world's plugin crate.
fn template(world: World) -> (&'static str, &'static str, &'static str) {
    match world {
        World::ScalingPolicy => (
            include_str!("../../templates/scaling-policy.rs.tmpl"),
            "policy",
            "A scaling policy that grows the job while each worker still pays",
        ),
        World::BatchAdapter => (
            include_str!("../../templates/batch-adapter.rs.tmpl"),
            "adapter",
            "A batch adapter that applies the linear scaling rule",
        ),
        World::ReaderTransform => (
            include_str!("../../templates/reader-transform.rs.tmpl"),
            "transform",
            "A reader transform that turns pixels into floats in [0, 1]",
        ),
        World::TeacherPolicy => (
            include_str!("../../templates/teacher-policy.rs.tmpl"),
            "teacher_policy",
            "A teacher policy that adds teachers while the students wait for soft labels",
        ),
    }
}

/// Creates `<parent>/<name>`, a plugin crate of `world`; returns its directory.
pub fn new_plugin(
    world: World,
    name: &str,
    parent: &Path,
    sdk: Option<SdkSource>,
) -> Result<PathBuf, ScaffoldError> {
    let valid = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_');
    if !valid {
        return Err(ScaffoldError::BadName(name.to_string()));
    }
    let dir = parent.join(name);
    if dir.exists() && std::fs::read_dir(&dir).map(|mut d| d.next().is_some()).unwrap_or(true) {
        return Err(ScaffoldError::Exists(dir));
    }
    let sdk = sdk.unwrap_or_else(|| sdk_source_for(&dir));
    let (dep, dep_bench) = match &sdk {
        SdkSource::Path(p) => {
            let p = p.display().to_string().replace('\\', "/");
            (format!("{{ path = \"{p}\" }}"), format!("{{ path = \"{p}\", features = [\"bench\"] }}"))
        }
        SdkSource::Version(v) => {
            (format!("\"{v}\""), format!("{{ version = \"{v}\", features = [\"bench\"] }}"))
        }
    };
    let lib = name.replace('-', "_");
    let (body, bench_fn, description) = template(world);
    // A teacher pool needs its bounds and a shared store beside the policy.
    let pool =
        if world == World::TeacherPolicy { "--store redis://127.0.0.1:6379 --max-teachers 4 " } else { "" };
    let run = match world.run_flag() {
        Some(flag) => format!(
            "Run it with the runtime, without rebuilding the runtime:\n\n    edl-runtime {pool}{flag} \
             target/wasm32-wasip2/release/{lib}.wasm\n"
        ),
        None => "`plugin inspect` below loads it.\n".to_string(),
    };
    let fill = |t: &str| {
        t.replace("{{crate}}", name)
            .replace("{{lib}}", &lib)
            .replace("{{type}}", &camel(name))
            .replace("{{sdk_bench}}", &dep_bench)
            .replace("{{sdk}}", &dep)
            .replace("{{world}}", world.name())
            .replace("{{bench_fn}}", bench_fn)
            .replace("{{run}}", &run)
            .replace("{{description}}", description)
    };
    let toolchain =
        "[toolchain]\nchannel = \"1.95.0\"\ntargets = [\"wasm32-wasip2\"]\nprofile = \"minimal\"\n";
    let files = [
        ("Cargo.toml".to_string(), fill(include_str!("../../templates/Cargo.toml.tmpl"))),
        ("src/lib.rs".to_string(), fill(body)),
        (format!("benches/{lib}.rs"), fill(include_str!("../../templates/bench.rs.tmpl"))),
        ("README.md".to_string(), fill(include_str!("../../templates/README.md.tmpl"))),
        ("rust-toolchain.toml".to_string(), toolchain.to_string()),
        (".gitignore".to_string(), "/target\n".to_string()),
    ];
    for (rel, text) in files {
        let path = dir.join(rel);
        let io = |source| ScaffoldError::Io { path: path.clone(), source };
        std::fs::create_dir_all(path.parent().expect("files live in the crate")).map_err(io)?;
        std::fs::write(&path, text).map_err(io)?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_types_and_bad_ones_are_refused() {
        assert_eq!(camel("my-cool_policy"), "MyCoolPolicy");
        let dir = std::env::temp_dir();
        assert!(matches!(
            new_plugin(World::ScalingPolicy, "My Policy", &dir, None),
            Err(ScaffoldError::BadName(_))
        ));
        assert!(matches!(
            new_plugin(World::ScalingPolicy, "9lives", &dir, None),
            Err(ScaffoldError::BadName(_))
        ));
    }
}
