//! [`PluginHost`]: the engine, the sandbox limits and the artifact cache, and
//! the one place that decides how a plugin file is loaded.

use super::{
    AdapterPlugin, ArtifactCache, CacheStatus, Error, Loaded, PolicyPlugin, SERVER_INTERFACE,
    SPARE_INTERFACE, STATE_INTERFACE, TRAINING_INTERFACE, TeacherPolicyPlugin, TransformPlugin, World,
    contract, limits::Limits, native, wasm,
};
use edl_plugin_sdk::{PluginInfo, WIT_VERSION};
use std::{path::Path, sync::Arc};
use wasmtime::{Engine, component::Component, component::Linker};

/// How to build a [`PluginHost`].
#[derive(Clone, Debug)]
pub struct HostOptions {
    pub limits: Limits,
    pub cache: ArtifactCache,
    /// Whether native libraries may be loaded (`--allow-native`): they run
    /// unsandboxed, with the runtime's rights. Off by default.
    pub allow_native: bool,
}

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            limits: Limits::default(),
            cache: ArtifactCache::default_location(),
            allow_native: false,
        }
    }
}

/// What `edl-runtime plugin inspect` reports.
#[derive(Clone, Debug)]
pub struct Inspection {
    pub world: World,
    /// `wasm` or `native`.
    pub kind: &'static str,
    /// WIT package version (wasm) or C ABI version (native).
    pub interface_version: String,
    pub info: PluginInfo,
    pub exports: Vec<String>,
    pub size: u64,
    /// Whether a compiled artifact was in the cache before this inspection.
    pub cached: Option<bool>,
    pub cache_entry: Option<std::path::PathBuf>,
}

/// Loads plugins. Cheap to share (`Arc`); one engine, one linker, one cache.
pub struct PluginHost {
    engine: Engine,
    /// Advances the engine's epoch while a guest call runs.
    ticker: super::ticker::Ticker,
    linker: Linker<wasm::HostState>,
    cache: ArtifactCache,
    limits: Limits,
    allow_native: bool,
}

enum FileKind {
    Component,
    Native,
}

impl PluginHost {
    /// A host with these options; starts the thread that drives deadlines.
    pub fn new(options: HostOptions) -> Result<Arc<Self>, Error> {
        let engine_err =
            |e: wasmtime::Error| Error::Engine { path: "<engine>".into(), detail: format!("{e:#}") };
        let mut config = wasmtime::Config::new();
        config.wasm_component_model(true);
        // No async component-model features: a plain call is ~4x cheaper.
        config.concurrency_support(false);
        config.epoch_interruption(true);
        let engine = Engine::new(&config).map_err(engine_err)?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(engine_err)?;
        wasm::add_bounded_clocks(&mut linker).map_err(engine_err)?;

        let ticker = super::ticker::Ticker::start(&engine)
            .map_err(|e| Error::Engine { path: "<engine>".into(), detail: e.to_string() })?;

        Ok(Arc::new(PluginHost {
            engine,
            ticker,
            linker,
            cache: options.cache,
            limits: options.limits,
            allow_native: options.allow_native,
        }))
    }

    /// The sandbox limits every instance gets.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Whether native libraries may be loaded.
    pub fn allows_native(&self) -> bool {
        self.allow_native
    }

    /// The artifact cache.
    pub fn cache(&self) -> &ArtifactCache {
        &self.cache
    }

    /// The cache file a component with these bytes is (or would be) kept in.
    pub fn cache_entry(&self, wasm: &[u8]) -> Option<std::path::PathBuf> {
        self.cache.entry(&self.engine, wasm)
    }

    /// The configuration keys the plugin at `path` takes, each with its
    /// default and type, as its `init` looks them up when asked to describe
    /// them (plugins built with this SDK); None for one that does not say.
    pub fn describe_config(&self, path: &Path) -> Result<Option<Vec<edl_plugin_sdk::ConfigKey>>, Error> {
        let ask = [(edl_plugin_sdk::DESCRIBE.to_string(), "1".to_string())];
        let said = match self.load(path, &ask, None) {
            Ok(_) => return Ok(None),
            Err(e) => e.to_string(),
        };
        let Some((_, json)) = said.split_once(edl_plugin_sdk::DESCRIBED) else { return Ok(None) };
        let mut de = serde_json::Deserializer::from_str(json);
        Ok(serde::Deserialize::deserialize(&mut de).ok())
    }

    /// Loads a scaling policy (`.wasm` component or native `.so`).
    pub fn load_policy(
        &self,
        path: &Path,
        config: &[(String, String)],
    ) -> Result<Box<dyn PolicyPlugin>, Error> {
        match self.load(path, config, Some(World::ScalingPolicy))? {
            Loaded::Policy(p) => Ok(p),
            _ => unreachable!("load checks the world"),
        }
    }

    /// Loads a batch adapter.
    pub fn load_adapter(
        &self,
        path: &Path,
        config: &[(String, String)],
    ) -> Result<Box<dyn AdapterPlugin>, Error> {
        match self.load(path, config, Some(World::BatchAdapter))? {
            Loaded::Adapter(p) => Ok(p),
            _ => unreachable!("load checks the world"),
        }
    }

    /// Loads a reader transform.
    pub fn load_transform(
        &self,
        path: &Path,
        config: &[(String, String)],
    ) -> Result<Box<dyn TransformPlugin>, Error> {
        match self.load(path, config, Some(World::ReaderTransform))? {
            Loaded::Transform(p) => Ok(p),
            _ => unreachable!("load checks the world"),
        }
    }

    /// Loads a teacher policy (`.wasm` component or native `.so`). Its
    /// plans come back clamped to the view's bounds (see `contract`).
    pub fn load_teacher_policy(
        &self,
        path: &Path,
        config: &[(String, String)],
    ) -> Result<Box<dyn TeacherPolicyPlugin>, Error> {
        match self.load(path, config, Some(World::TeacherPolicy))? {
            Loaded::TeacherPolicy(p) => Ok(p),
            _ => unreachable!("load checks the world"),
        }
    }

    /// Loads a reader transform from `path`, naming it `shown` in every
    /// message: the file a user passed, when its bytes were copied elsewhere
    /// (a worker's copy of a plugin its coordinator shipped).
    pub fn load_transform_as(
        &self,
        path: &Path,
        shown: &str,
        config: &[(String, String)],
    ) -> Result<Box<dyn TransformPlugin>, Error> {
        match self.load_shown(path, shown.to_string(), config, Some(World::ReaderTransform))? {
            Loaded::Transform(p) => Ok(p),
            _ => unreachable!("load checks the world"),
        }
    }

    /// Loads a plugin of any world, or of `expected` only.
    pub fn load(
        &self,
        path: &Path,
        config: &[(String, String)],
        expected: Option<World>,
    ) -> Result<Loaded, Error> {
        self.load_shown(path, path.display().to_string(), config, expected)
    }

    fn load_shown(
        &self,
        path: &Path,
        shown: String,
        config: &[(String, String)],
        expected: Option<World>,
    ) -> Result<Loaded, Error> {
        let bytes = std::fs::read(path).map_err(|source| Error::Read { path: shown.clone(), source })?;
        let loaded = match classify(&shown, &bytes)? {
            FileKind::Native => {
                native_asked_for(path, &shown)?;
                if !self.allow_native {
                    return Err(Error::NativeNotAllowed { path: shown });
                }
                native::load(path, config, expected)?
            }
            FileKind::Component => {
                let (component, cache) = self.compile(&shown, &bytes)?;
                let (world, _) = self.world_of(&shown, &component, expected)?;
                wasm::load(
                    wasm::Ctx {
                        path: shown.clone(),
                        engine: &self.engine,
                        ticker: &self.ticker,
                        linker: &self.linker,
                        limits: self.limits,
                    },
                    &component,
                    world,
                    config,
                    cache,
                )?
            }
        };
        Ok(contract::checked(loaded, &shown))
    }

    /// Describes a plugin file without keeping it loaded. A component is
    /// instantiated in the sandbox and its `init` runs with an empty
    /// configuration; a native library is only read (its symbol table), never
    /// loaded, so inspecting one runs none of its code.
    pub fn inspect(&self, path: &Path) -> Result<Inspection, Error> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| Error::Read { path: shown.clone(), source })?;
        let size = bytes.len() as u64;
        match classify(&shown, &bytes)? {
            FileKind::Native => {
                native_asked_for(path, &shown)?;
                let (world, exports) = native::read_symbols(&shown, &bytes)?;
                Ok(Inspection {
                    world,
                    kind: "native",
                    interface_version: "C ABI (not read: inspect runs no native code)".into(),
                    info: PluginInfo {
                        name: path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
                        version: "?".into(),
                        description: "native library; name and version are read only when it is loaded \
                                      (--allow-native)"
                            .into(),
                    },
                    exports,
                    size,
                    cached: None,
                    cache_entry: None,
                })
            }
            FileKind::Component => {
                let entry = self.cache.entry(&self.engine, &bytes);
                let was_cached = entry.as_ref().map(|e| e.exists());
                let (component, cache) = self.compile(&shown, &bytes)?;
                let (world, exports) = self.world_of(&shown, &component, None)?;
                let ctx = wasm::Ctx {
                    path: shown,
                    engine: &self.engine,
                    ticker: &self.ticker,
                    linker: &self.linker,
                    limits: self.limits,
                };
                let loaded = wasm::load(ctx, &component, world, &[], cache)?;
                Ok(Inspection {
                    world,
                    kind: "wasm",
                    interface_version: format!("edl:plugins@{WIT_VERSION}"),
                    info: loaded.info().clone(),
                    exports,
                    size,
                    cached: was_cached,
                    cache_entry: entry,
                })
            }
        }
    }

    fn compile(&self, path: &str, bytes: &[u8]) -> Result<(Component, CacheStatus), Error> {
        self.cache
            .load(&self.engine, bytes)
            .map_err(|e| Error::InvalidComponent { path: path.into(), detail: format!("{e:#}") })
    }

    /// The world a component implements, from its export names
    /// (`edl:plugins/<interface>@<version>`), and every export name.
    fn world_of(
        &self,
        path: &str,
        component: &Component,
        expected: Option<World>,
    ) -> Result<(World, Vec<String>), Error> {
        let ty = component.component_type();
        let exports: Vec<String> = ty.exports(&self.engine).map(|(name, _)| name.to_string()).collect();
        // The world's own interface; `state` rides beside it in any world,
        // `training-observer` beside an adapter's or a policy's,
        // `server-policy` and `spare-policy` beside a policy's.
        let ours = exports.iter().find_map(|name| {
            let rest = name.strip_prefix("edl:plugins/")?;
            let (iface, version) = rest.split_once('@').unwrap_or((rest, ""));
            (![STATE_INTERFACE, TRAINING_INTERFACE, SERVER_INTERFACE, SPARE_INTERFACE].contains(&iface))
                .then(|| (iface.to_string(), version.to_string()))
        });
        let Some((iface, version)) = ours else {
            return Err(Error::InvalidComponent {
                path: path.into(),
                detail: format!(
                    "exports no edl:plugins interface, so it is not an edl plugin (exports: {})",
                    if exports.is_empty() { "nothing".to_string() } else { exports.join(", ") }
                ),
            });
        };
        if version != WIT_VERSION {
            return Err(Error::IncompatibleVersion {
                path: path.into(),
                found: version,
                expected: WIT_VERSION.into(),
            });
        }
        let world = World::from_interface(&iface).ok_or_else(|| Error::InvalidComponent {
            path: path.into(),
            detail: format!("exports unknown interface edl:plugins/{iface}"),
        })?;
        if let Some(expected) = expected
            && expected != world
        {
            return Err(Error::WrongWorld { path: path.into(), found: world, expected });
        }
        Ok((world, exports))
    }
}

/// A native library is loaded only under a native library's name: a file
/// named `.wasm` is promised to be sandboxed, whatever its bytes are.
fn native_asked_for(path: &Path, shown: &str) -> Result<(), Error> {
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("wasm")) {
        return Err(Error::NotAPlugin {
            path: shown.into(),
            detail: "named .wasm but holds a native library; a .wasm plugin must be a WebAssembly component \
                     (native plugins are .so/.dylib/.dll files loaded with --allow-native)"
                .into(),
        });
    }
    Ok(())
}

fn classify(path: &str, bytes: &[u8]) -> Result<FileKind, Error> {
    const WASM: &[u8] = b"\0asm";
    const ELF: &[u8] = b"\x7fELF";
    const MACHO: [&[u8]; 2] = [b"\xcf\xfa\xed\xfe", b"\xca\xfe\xba\xbe"];
    if bytes.starts_with(WASM) {
        return match bytes.get(4..8) {
            Some([1, 0, 0, 0]) => Err(Error::CoreModule { path: path.into() }),
            Some([_, _, 1, 0]) => Ok(FileKind::Component),
            _ => Err(Error::InvalidComponent {
                path: path.into(),
                detail: "unknown WebAssembly binary version (truncated header?)".into(),
            }),
        };
    }
    if bytes.starts_with(ELF) || MACHO.iter().any(|m| bytes.starts_with(m)) || bytes.starts_with(b"MZ") {
        return Ok(FileKind::Native);
    }
    let head: Vec<String> = bytes.iter().take(4).map(|b| format!("{b:02x}")).collect();
    Err(Error::NotAPlugin {
        path: path.into(),
        detail: if bytes.is_empty() {
            "the file is empty".into()
        } else {
            format!("neither a WebAssembly component nor a native library (starts with {})", head.join(" "))
        },
    })
}
