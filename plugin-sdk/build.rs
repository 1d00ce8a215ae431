//! Embeds the WIT contract into a `macro_rules!` so that each plugin crate
//! generates the bindings of its own world only (a component must carry the
//! type information of exactly one world), from the single file in `wit/`.

use std::{env, fs, path::PathBuf};

fn main() {
    let wit_path = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("wit/edl.wit");
    println!("cargo:rerun-if-changed={}", wit_path.display());
    let wit = fs::read_to_string(&wit_path).expect("plugin-sdk/wit/edl.wit is readable");
    assert!(!wit.contains("\"###"), "edl.wit must not contain the raw-string terminator");
    let version = wit
        .lines()
        .find_map(|l| l.trim().strip_prefix("package edl:plugins@"))
        .and_then(|v| v.strip_suffix(';'))
        .expect("edl.wit declares `package edl:plugins@<version>;`");
    let out = format!(
        r####"
/// Version of the WIT package `edl:plugins` this SDK implements.
pub const WIT_VERSION: &str = "{version}";

/// The WIT contract, as text.
pub const WIT: &str = r###"{wit}"###;

#[doc(hidden)]
#[macro_export]
macro_rules! __edl_generate_world {{
    ($world:literal) => {{
        $crate::__private::wit_bindgen::generate!({{
            inline: r###"{wit}"###,
            world: $world,
            runtime_path: "::edl_plugin_sdk::__private::wit_bindgen::rt",
            with: {{ "edl:plugins/types@{version}": ::edl_plugin_sdk::types }},
        }});
    }};
}}
"####
    );
    let dest = PathBuf::from(env::var("OUT_DIR").unwrap()).join("wit.rs");
    fs::write(dest, out).unwrap();
}
