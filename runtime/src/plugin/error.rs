//! The typed error of the plugin host: every failure names the plugin file.

use super::World;
use edl_plugin_sdk::PluginError as GuestError;

/// Why a plugin could not be loaded or a call to it failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: cannot read plugin file: {source}")]
    Read { path: String, source: std::io::Error },

    #[error("{path}: not a plugin: {detail}")]
    NotAPlugin { path: String, detail: String },

    #[error(
        "{path}: is a core WebAssembly module, not a component; build plugins with `cargo build --target wasm32-wasip2`"
    )]
    CoreModule { path: String },

    #[error("{path}: invalid WebAssembly component: {detail}")]
    InvalidComponent { path: String, detail: String },

    #[error("{path}: is a {found} plugin, but a {expected} plugin is needed here")]
    WrongWorld { path: String, found: World, expected: World },

    #[error(
        "{path}: built against edl:plugins@{found}, which this runtime (edl:plugins@{expected}) cannot load; rebuild it with a matching edl-plugin-sdk"
    )]
    IncompatibleVersion { path: String, found: String, expected: String },

    #[error("{path}: cannot be instantiated: {detail}")]
    Instantiate { path: String, detail: String },

    #[error("{path}: init {}: {error}", init_verb(error))]
    Init { path: String, error: GuestError },

    #[error("{path}: {call} broke the plugin contract: {detail}")]
    Contract { path: String, call: &'static str, detail: String },

    #[error("{path}: is a native library; native plugins run unsandboxed and load only with --allow-native")]
    NativeNotAllowed { path: String },

    #[error("{path}: {call} returned an error: {error}")]
    Guest { path: String, call: &'static str, error: GuestError },

    #[error("{path}: {call} trapped: {message}{}", stderr_suffix(stderr))]
    Trap { path: String, call: &'static str, message: String, stderr: String },

    #[error("{path}: {call} ran past its deadline of {deadline_ms} ms (wall-clock) and was stopped{detail}")]
    Deadline { path: String, call: &'static str, deadline_ms: u64, detail: String },

    #[error("{path}: {call} went over the memory limit of {limit_mib} MiB and was stopped")]
    MemoryLimit { path: String, call: &'static str, limit_mib: u64 },

    #[error("{path}: {call} panicked: {message}")]
    NativePanic { path: String, call: &'static str, message: String },

    #[error("{path}: native plugin: {detail}")]
    Native { path: String, detail: String },

    #[error("{path}: engine: {detail}")]
    Engine { path: String, detail: String },
}

fn init_verb(error: &GuestError) -> &'static str {
    match error {
        GuestError::InvalidConfig(_) => "rejected the configuration",
        _ => "failed",
    }
}

fn stderr_suffix(stderr: &str) -> String {
    let s = stderr.trim();
    if s.is_empty() { String::new() } else { format!("\nplugin stderr:\n{s}") }
}

impl Error {
    /// True for errors that stop a call (trap, deadline, memory) after which
    /// the host rebuilt the instance.
    pub fn is_trap(&self) -> bool {
        matches!(
            self,
            Error::Trap { .. }
                | Error::Deadline { .. }
                | Error::MemoryLimit { .. }
                | Error::NativePanic { .. }
        )
    }
}
