//! Native plugins: a `cdylib` built from the same SDK crate, loaded with
//! `libloading` and called through the C ABI of `edl_plugin_sdk::native`.
//! Trusted and unsandboxed (no deadline, no memory cap): the fast path, and
//! the baseline the sandbox is measured against. A caught panic recreates
//! the plugin instance, as a trap does for a component, with the memory it
//! last saved.

use super::{
    AdapterPlugin, Backend, Error, Loaded, Plugin, PolicyPlugin, TeacherPolicyPlugin, TransformPlugin, World,
};
use edl_plugin_sdk::native::{
    ABI_VERSION, RawAction, RawBatch, RawClusterView, RawInfo, RawPair, RawServerAnswer, RawServerView,
    RawSlice, RawStr, RawTeacherView, status,
};
use edl_plugin_sdk::{
    Action, Batch, ClusterView, Hyperparams, PluginError, PluginInfo, ResizeEvent, TeacherPlan, TeacherView,
};
use libloading::Library;
use std::{ffi::c_void, path::Path, sync::Arc};

type Handle = *mut c_void;

/// The symbols every native plugin exports.
struct Common {
    path: String,
    // Keeps the library mapped while any function pointer below is alive.
    _lib: Arc<Library>,
    new: unsafe extern "C" fn() -> Handle,
    free: unsafe extern "C" fn(Handle),
    init: unsafe extern "C" fn(Handle, *const RawPair, usize) -> i32,
    last_error: unsafe extern "C" fn(Handle) -> RawStr,
    /// `edl_plugin_save_state` and `edl_plugin_load_state`, where the
    /// plugin keeps a memory it hands over (both or neither).
    state: Option<StateFns>,
    handle: Handle,
    config: Vec<(String, String)>,
    info: PluginInfo,
    /// The memory last saved or given: what an instance recreated after a
    /// panic starts from; and whether the live instance was given it and
    /// has not answered a call since.
    kept: Option<Vec<u8>>,
    restored: bool,
}

#[derive(Clone, Copy)]
struct StateFns {
    save: unsafe extern "C" fn(Handle, *mut RawSlice<u8>) -> i32,
    load: unsafe extern "C" fn(Handle, *const u8, usize) -> i32,
}

// SAFETY: a handle is used by one thread at a time (`&mut self` calls); the
// SDK's instances are plain Rust values owned by the handle.
unsafe impl Send for Common {}

impl Drop for Common {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            unsafe { (self.free)(self.handle) };
        }
    }
}

fn native_err(path: &str, detail: impl Into<String>) -> Error {
    Error::Native { path: path.into(), detail: detail.into() }
}

unsafe fn symbol<T: Copy>(lib: &Library, path: &str, name: &str) -> Result<T, Error> {
    unsafe { lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|_| {
        native_err(
            path,
            format!("missing symbol `{name}`; was it built with an edl-plugin-sdk export macro?"),
        )
    })
}

impl Common {
    fn error_text(&self) -> String {
        unsafe { (self.last_error)(self.handle).to_string_lossy() }
    }

    /// A fresh instance, initialised with the configuration.
    fn create(&mut self) -> Result<(), Error> {
        if !self.handle.is_null() {
            unsafe { (self.free)(self.handle) };
        }
        self.handle = unsafe { (self.new)() };
        if self.handle.is_null() {
            return Err(native_err(&self.path, "creating the plugin instance panicked"));
        }
        let pairs: Vec<RawPair> = self
            .config
            .iter()
            .map(|(k, v)| RawPair { key: RawStr::borrow(k), value: RawStr::borrow(v) })
            .collect();
        let code = unsafe { (self.init)(self.handle, pairs.as_ptr(), pairs.len()) };
        match self.check("init", code) {
            Err(Error::Guest { error, .. }) => Err(Error::Init { path: self.path.clone(), error }),
            other => other,
        }
    }

    fn save_state(&mut self) -> Result<Option<Vec<u8>>, Error> {
        let Some(f) = self.state else { return Ok(None) };
        let mut out = RawSlice::empty();
        // SAFETY: the handle is this instance's own, `out` a live local.
        let code = unsafe { (f.save)(self.handle, &mut out) };
        self.check("save", code)?;
        // A length past the contract's cap is refused before a byte is read
        // (a bogus one would read far past the plugin's buffer).
        if out.len > super::contract::MAX_STATE_BYTES {
            let detail = format!(
                "save returned {} bytes, more than the {} allowed",
                out.len,
                super::contract::MAX_STATE_BYTES
            );
            return Err(native_err(&self.path, detail));
        }
        // SAFETY: the SDK's export hands out its own buffer of `len` bytes,
        // valid until the instance's next call (null or 0: none); `len` is
        // bounded above. The bytes are copied now.
        let bytes = unsafe { out.as_slice() }.to_vec();
        if !bytes.is_empty() {
            self.kept = Some(bytes.clone());
        }
        Ok(Some(bytes))
    }

    fn load_state(&mut self, bytes: &[u8]) -> Result<bool, Error> {
        let Some(f) = self.state else { return Ok(false) };
        // SAFETY: `bytes` is a live slice; the plugin reads `len` bytes of it
        // during the call only.
        let code = unsafe { (f.load)(self.handle, bytes.as_ptr(), bytes.len()) };
        self.check("load", code)?;
        if !bytes.is_empty() && bytes.len() <= super::contract::MAX_STATE_BYTES {
            self.kept = Some(bytes.to_vec());
        }
        Ok(true)
    }

    /// A fresh instance after a panic, given the memory last saved (what it
    /// learned since is lost); one that cannot take it starts from `init`.
    fn recreate(&mut self) -> Result<(), Error> {
        self.create()?;
        let (Some(f), Some(bytes)) = (self.state, self.kept.as_ref()) else { return Ok(()) };
        // SAFETY: as in `load_state`.
        let code = unsafe { (f.load)(self.handle, bytes.as_ptr(), bytes.len()) };
        if code == status::OK {
            self.restored = true;
            return Ok(());
        }
        let why = self.error_text();
        // Not offered again: this memory will not go back in.
        self.kept = None;
        self.create()?;
        tracing::warn!(
            "{}: the recreated instance could not take its memory back ({why}); it starts afresh",
            self.path
        );
        Ok(())
    }

    /// Turns a status code into a result; a panic recreates the instance.
    fn check(&mut self, call: &'static str, code: i32) -> Result<(), Error> {
        let guest = |e: fn(String) -> PluginError, me: &Self| Error::Guest {
            path: me.path.clone(),
            call,
            error: e(me.error_text()),
        };
        if code != status::PANIC {
            // It answered (or chose its error) with the memory it holds.
            self.restored = false;
        }
        match code {
            status::OK => Ok(()),
            status::INVALID_CONFIG => Err(guest(PluginError::InvalidConfig, self)),
            status::INVALID_INPUT => Err(guest(PluginError::InvalidInput, self)),
            status::FAILED => Err(guest(PluginError::Failed, self)),
            status::PANIC => {
                let err = Error::NativePanic { path: self.path.clone(), call, message: self.error_text() };
                if std::mem::take(&mut self.restored) {
                    // The memory it was given back may be what panics:
                    // the next instance starts from `init`.
                    self.kept = None;
                    tracing::warn!(
                        "{}: it panicked on the memory it was given back; the next instance starts afresh",
                        self.path
                    );
                }
                if call != "init"
                    && let Err(e) = self.recreate()
                {
                    tracing::warn!("{e}");
                }
                Err(err)
            }
            other => Err(native_err(&self.path, format!("{call} returned unknown status {other}"))),
        }
    }
}

fn world_symbols(world: World) -> &'static [&'static str] {
    match world {
        World::ScalingPolicy => &["edl_policy_decide"],
        World::BatchAdapter => &["edl_adapter_on_resize", "edl_adapter_on_step"],
        World::ReaderTransform => &["edl_transform_apply"],
        World::TeacherPolicy => &["edl_teacher_policy_decide"],
    }
}

/// The world and the edl symbols of a native library, read from its symbol
/// table without loading it (so none of its code runs).
pub fn read_symbols(path: &str, bytes: &[u8]) -> Result<(World, Vec<String>), Error> {
    use object::{Object, ObjectSymbol};
    let file = object::File::parse(bytes).map_err(|e| Error::NotAPlugin {
        path: path.into(),
        detail: format!("cannot read native library: {e}"),
    })?;
    let names: std::collections::BTreeSet<String> = file
        .exports()
        .map(|list| list.iter().map(|e| String::from_utf8_lossy(e.name()).into_owned()).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(
            file.dynamic_symbols()
                .filter(|s| s.is_definition())
                .filter_map(|s| s.name().ok().map(String::from)),
        )
        .map(|n| n.trim_start_matches('_').to_string())
        .filter(|n| n.starts_with("edl_"))
        .collect();
    if !names.contains("edl_plugin_abi_version") {
        return Err(Error::NotAPlugin {
            path: path.into(),
            detail: "a native library without `edl_plugin_abi_version`, so not an edl plugin".into(),
        });
    }
    let world = World::ALL
        .into_iter()
        .find(|w| world_symbols(*w).iter().all(|s| names.contains(*s)))
        .ok_or_else(|| native_err(path, "exports the edl ABI but no world's functions"))?;
    Ok((world, names.into_iter().collect()))
}

/// Loads a native plugin library.
pub fn load(path: &Path, config: &[(String, String)], expected: Option<World>) -> Result<Loaded, Error> {
    let shown = path.display().to_string();
    // SAFETY: loading a native plugin runs its initialisers; native plugins
    // are trusted by definition (the sandboxed form is the `.wasm`).
    let lib = unsafe { Library::new(path) }.map_err(|e| Error::NotAPlugin {
        path: shown.clone(),
        detail: format!("cannot load native library: {e}"),
    })?;
    let lib = Arc::new(lib);
    unsafe {
        let abi: unsafe extern "C" fn() -> u32 = lib
            .get::<unsafe extern "C" fn() -> u32>(b"edl_plugin_abi_version")
            .map(|s| *s)
            .map_err(|_| Error::NotAPlugin {
                path: shown.clone(),
                detail: "a native library without `edl_plugin_abi_version`, so not an edl plugin".into(),
            })?;
        let version = abi();
        if version != ABI_VERSION {
            return Err(Error::IncompatibleVersion {
                path: shown,
                found: format!("C ABI {version}"),
                expected: format!("C ABI {ABI_VERSION}"),
            });
        }
        let world_fn: unsafe extern "C" fn() -> RawStr = symbol(&lib, &shown, "edl_plugin_world")?;
        let world_name = world_fn().to_string_lossy();
        let world = World::from_name(&world_name)
            .ok_or_else(|| native_err(&shown, format!("unknown world {world_name:?}")))?;
        if let Some(expected) = expected
            && expected != world
        {
            return Err(Error::WrongWorld { path: shown, found: world, expected });
        }
        let info_fn: unsafe extern "C" fn() -> RawInfo = symbol(&lib, &shown, "edl_plugin_info")?;
        let raw = info_fn();
        let info = PluginInfo {
            name: raw.name.to_string_lossy(),
            version: raw.version.to_string_lossy(),
            description: raw.description.to_string_lossy(),
        };
        let mut common = Common {
            new: symbol(&lib, &shown, "edl_plugin_new")?,
            free: symbol(&lib, &shown, "edl_plugin_free")?,
            init: symbol(&lib, &shown, "edl_plugin_init")?,
            last_error: symbol(&lib, &shown, "edl_plugin_last_error")?,
            state: match (
                symbol(&lib, &shown, "edl_plugin_save_state"),
                symbol(&lib, &shown, "edl_plugin_load_state"),
            ) {
                (Ok(save), Ok(load)) => Some(StateFns { save, load }),
                _ => None,
            },
            _lib: lib.clone(),
            path: shown.clone(),
            handle: std::ptr::null_mut(),
            config: config.to_vec(),
            info,
            kept: None,
            restored: false,
        };
        common.create()?;
        world_plugin(world, &lib, common)
    }
}

/// The world's own calls, looked up beside the common ones.
///
/// # Safety
/// As for [`load`]: `lib` is a trusted edl plugin of `world`.
unsafe fn world_plugin(world: World, lib: &Library, common: Common) -> Result<Loaded, Error> {
    let shown = common.path.clone();
    unsafe {
        Ok(match world {
            World::ScalingPolicy => Loaded::Policy(Box::new(NativePolicy {
                decide: symbol(lib, &shown, "edl_policy_decide")?,
                // A library built before servers were asked about has none.
                decide_servers: symbol(lib, &shown, "edl_policy_decide_servers").ok(),
                decide_spares: symbol(lib, &shown, "edl_policy_decide_spares").ok(),
                common,
            })),
            World::BatchAdapter => Loaded::Adapter(Box::new(NativeAdapter {
                on_resize: symbol(lib, &shown, "edl_adapter_on_resize")?,
                on_step: symbol(lib, &shown, "edl_adapter_on_step")?,
                common,
            })),
            World::ReaderTransform => Loaded::Transform(Box::new(NativeTransform {
                apply: symbol(lib, &shown, "edl_transform_apply")?,
                common,
            })),
            World::TeacherPolicy => Loaded::TeacherPolicy(Box::new(NativeTeacherPolicy {
                decide: symbol(lib, &shown, "edl_teacher_policy_decide")?,
                common,
            })),
        })
    }
}

macro_rules! native_plugin {
    ($ty:ident) => {
        impl Plugin for $ty {
            fn info(&self) -> &PluginInfo {
                &self.common.info
            }
            fn backend(&self) -> Backend {
                Backend::Native
            }
            fn save_state(&mut self) -> Result<Option<Vec<u8>>, Error> {
                self.common.save_state()
            }
            fn load_state(&mut self, bytes: &[u8]) -> Result<bool, Error> {
                self.common.load_state(bytes)
            }
        }
    };
}

struct NativePolicy {
    common: Common,
    decide: unsafe extern "C" fn(Handle, *const RawClusterView, *mut RawSlice<RawAction>) -> i32,
    decide_servers: Option<unsafe extern "C" fn(Handle, *const RawServerView, *mut RawServerAnswer) -> i32>,
    /// The view crosses as it is; the answer is the servers' kind.
    decide_spares:
        Option<unsafe extern "C" fn(Handle, *const edl_plugin_sdk::SpareView, *mut RawServerAnswer) -> i32>,
}
native_plugin!(NativePolicy);

impl NativePolicy {
    /// A count the policy answered (`asked` 0 or 1), or an error naming the call.
    fn count_answer(&self, call: &str, out: RawServerAnswer) -> Result<Option<u32>, Error> {
        out.get().ok_or_else(|| {
            native_err(&self.common.path, format!("{call} answered {out:?}: `asked` is neither 0 nor 1"))
        })
    }
}

impl PolicyPlugin for NativePolicy {
    fn decide(&mut self, view: &ClusterView) -> Result<Vec<Action>, Error> {
        let raw = RawClusterView::borrow(view);
        let mut out = RawSlice::empty();
        let code = unsafe { (self.decide)(self.common.handle, &raw, &mut out) };
        self.common.check("decide", code)?;
        unsafe { out.as_slice() }
            .iter()
            .map(|a| {
                Action::try_from(*a).map_err(|tag| {
                    native_err(&self.common.path, format!("decide returned unknown action tag {tag}"))
                })
            })
            .collect()
    }

    fn decide_servers(&mut self, view: &edl_plugin_sdk::ServerView) -> Result<Option<u32>, Error> {
        let Some(decide) = self.decide_servers else { return Ok(None) };
        let raw = RawServerView::borrow(view);
        let mut out = RawServerAnswer::default();
        // SAFETY: the handle is this instance's own; `raw` borrows `view`,
        // which outlives the call; `out` is a live local.
        let code = unsafe { decide(self.common.handle, &raw, &mut out) };
        self.common.check("decide-servers", code)?;
        self.count_answer("decide-servers", out)
    }

    fn decide_spares(&mut self, view: &edl_plugin_sdk::SpareView) -> Result<Option<u32>, Error> {
        let Some(decide) = self.decide_spares else { return Ok(None) };
        let mut out = RawServerAnswer::default();
        // SAFETY: the handle is this instance's own; `view` outlives the
        // call; `out` is a live local.
        let code = unsafe { decide(self.common.handle, view, &mut out) };
        self.common.check("decide-spares", code)?;
        self.count_answer("decide-spares", out)
    }
}

struct NativeAdapter {
    common: Common,
    on_resize: unsafe extern "C" fn(Handle, *const ResizeEvent, *const Hyperparams, *mut Hyperparams) -> i32,
    on_step: unsafe extern "C" fn(Handle, u64, *const Hyperparams, *mut Hyperparams) -> i32,
}
native_plugin!(NativeAdapter);

impl AdapterPlugin for NativeAdapter {
    fn on_resize(&mut self, event: &ResizeEvent, current: &Hyperparams) -> Result<Hyperparams, Error> {
        let mut out = *current;
        let code = unsafe { (self.on_resize)(self.common.handle, event, current, &mut out) };
        self.common.check("on-resize", code).map(|()| out)
    }

    fn on_step(&mut self, step: u64, current: &Hyperparams) -> Result<Hyperparams, Error> {
        let mut out = *current;
        let code = unsafe { (self.on_step)(self.common.handle, step, current, &mut out) };
        self.common.check("on-step", code).map(|()| out)
    }
}

struct NativeTransform {
    common: Common,
    apply: unsafe extern "C" fn(Handle, *const RawBatch, *mut RawBatch) -> i32,
}
native_plugin!(NativeTransform);

impl TransformPlugin for NativeTransform {
    fn apply(&mut self, batch: &Batch) -> Result<Batch, Error> {
        let raw = RawBatch::borrow(batch);
        let mut out = raw;
        let code = unsafe { (self.apply)(self.common.handle, &raw, &mut out) };
        self.common.check("apply", code)?;
        unsafe { out.to_batch() }
            .map_err(|e| native_err(&self.common.path, format!("apply returned a bad batch: {e}")))
    }
}

struct NativeTeacherPolicy {
    common: Common,
    decide: unsafe extern "C" fn(Handle, *const RawTeacherView, *mut TeacherPlan) -> i32,
}
native_plugin!(NativeTeacherPolicy);

impl TeacherPolicyPlugin for NativeTeacherPolicy {
    fn decide(&mut self, view: &TeacherView) -> Result<TeacherPlan, Error> {
        let raw = RawTeacherView::borrow(view);
        let mut out = TeacherPlan::keep(view);
        // SAFETY: the handle is this instance's own; `raw` borrows `view`,
        // which outlives the call; `out` is a live local.
        let code = unsafe { (self.decide)(self.common.handle, &raw, &mut out) };
        self.common.check("decide", code).map(|()| out)
    }
}
