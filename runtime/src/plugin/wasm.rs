//! Sandboxed components: one `InstancePre` per plugin, one store per live
//! instance with a memory cap, a per-call epoch deadline and captured stderr.
//! A call that traps drops the instance; the next call rebuilds it from the
//! `InstancePre` and runs `init` again with the same configuration.

use super::{
    AdapterPlugin, Backend, CacheStatus, Error, Loaded, Plugin, PolicyPlugin, TeacherPolicyPlugin,
    TransformPlugin, World,
    bindings::{
        self, adapter, policy, policy::edl::plugins::types as wit, state, teacher_policy,
        teacher_policy::exports::edl::plugins::teacher_policy as wit_teacher, transform,
    },
    limits::{EPOCH_TICK, Limits},
    stderr::CapturedStderr,
};
use edl_plugin_sdk::{
    Action, Batch, ClusterView, Hyperparams, PluginInfo, ResizeEvent, TeacherPlan, TeacherView,
};
use std::{
    future::Future,
    pin::Pin,
    time::{Duration, Instant},
};
use wasmtime::{
    Engine, ResourceLimiter, Store, StoreContextMut, Trap,
    component::{Component, Instance, InstancePre, Linker, Resource, ResourceTable},
};
use wasmtime_wasi::p2::{DynPollable, Pollable, subscribe as subscribe_pollable};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

/// Per-store state: WASI with nothing granted, the memory cap, and the
/// wall-clock deadline of the call under way.
pub struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    limiter: MemoryCap,
    /// The running call must end by then (see [`add_bounded_clocks`]).
    deadline: Instant,
    /// Zero of the guest's monotonic clock.
    origin: Instant,
}

/// A guest asked to sleep past its call's deadline: the call is stopped at
/// once, as it would be at the deadline.
#[derive(Debug)]
struct SleepPastDeadline {
    asked: Duration,
}

impl std::fmt::Display for SleepPastDeadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "asked to sleep {:?}", self.asked)
    }
}

impl std::error::Error for SleepPastDeadline {}

/// A sleep that ends before the call's deadline.
struct Sleep(tokio::time::Instant);

impl Pollable for Sleep {
    fn ready<'life0, 'async_trait>(
        &'life0 mut self,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(tokio::time::sleep_until(self.0))
    }
}

/// Epoch interruption stops a guest that computes past its deadline, but not
/// one blocked in the host: the only host call that blocks in this sandbox (no
/// files, sockets or stdin) is a sleep on the monotonic clock. These
/// definitions replace WASI's so that a sleep ending past the call's deadline
/// is a deadline trap at once, and every call ends within its deadline
/// whatever the guest does. `now` is replaced too, so that the instants a
/// guest computes and the ones it subscribes to share one origin.
pub fn add_bounded_clocks(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    fn subscribe(
        mut cx: StoreContextMut<'_, HostState>,
        asked: Duration,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        let state = cx.data_mut();
        let now = Instant::now();
        match now.checked_add(asked) {
            Some(end) if end <= state.deadline => {
                let sleep = state.table.push(Sleep(tokio::time::Instant::from_std(end)))?;
                subscribe_pollable(&mut state.table, sleep)
            }
            _ => Err(wasmtime::Error::new(SleepPastDeadline { asked })),
        }
    }
    linker.allow_shadowing(true);
    let mut clock = linker.instance(MONOTONIC_CLOCK)?;
    clock.func_wrap("now", |cx: StoreContextMut<'_, HostState>, (): ()| {
        Ok((cx.data().origin.elapsed().as_nanos() as u64,))
    })?;
    clock.func_wrap("subscribe-duration", |cx: StoreContextMut<'_, HostState>, (nanos,): (u64,)| {
        Ok((subscribe(cx, Duration::from_nanos(nanos))?,))
    })?;
    clock.func_wrap("subscribe-instant", |cx: StoreContextMut<'_, HostState>, (at,): (u64,)| {
        let now = cx.data().origin.elapsed().as_nanos() as u64;
        Ok((subscribe(cx, Duration::from_nanos(at.saturating_sub(now)))?,))
    })?;
    linker.allow_shadowing(false);
    Ok(())
}

/// The WASI monotonic clock interface as wasmtime-wasi 48 defines it
/// (guests built against any 0.2.x version are matched to it).
const MONOTONIC_CLOCK: &str = "wasi:clocks/monotonic-clock@0.2.12";

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// Refuses memory growth past the limit and remembers that it did, so the
/// trap that follows (a guest's allocation failure) is reported as such.
struct MemoryCap {
    limit: usize,
    hit: bool,
}

impl ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _max: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.limit {
            self.hit = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _max: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 20)
    }
}

/// What loading needs from the host.
pub struct Ctx<'a> {
    pub path: String,
    pub engine: &'a Engine,
    pub ticker: &'a super::ticker::Ticker,
    pub linker: &'a Linker<HostState>,
    pub limits: Limits,
}

/// The generated bindings of one world.
pub trait WorldBindings: Sized + Send + 'static {
    /// Where the world's exports are in a component, found once at load.
    type Indices: Send + Sync + 'static;
    fn indices(pre: &InstancePre<HostState>) -> wasmtime::Result<Self::Indices>;
    fn load(ix: &Self::Indices, store: &mut Store<HostState>, instance: &Instance) -> wasmtime::Result<Self>;
    fn info(&self, store: &mut Store<HostState>) -> wasmtime::Result<wit::PluginInfo>;
    fn init(
        &self,
        store: &mut Store<HostState>,
        config: &[(String, String)],
    ) -> wasmtime::Result<Result<(), wit::PluginError>>;
}

macro_rules! world_bindings {
    ($ty:ty, $ix:ty, $iface:ident) => {
        impl WorldBindings for $ty {
            type Indices = $ix;
            fn indices(pre: &InstancePre<HostState>) -> wasmtime::Result<Self::Indices> {
                <$ix>::new(pre)
            }
            fn load(
                ix: &Self::Indices,
                store: &mut Store<HostState>,
                instance: &Instance,
            ) -> wasmtime::Result<Self> {
                ix.load(store, instance)
            }
            fn info(&self, store: &mut Store<HostState>) -> wasmtime::Result<wit::PluginInfo> {
                self.$iface().call_info(store)
            }
            fn init(
                &self,
                store: &mut Store<HostState>,
                config: &[(String, String)],
            ) -> wasmtime::Result<Result<(), wit::PluginError>> {
                self.$iface().call_init(store, config)
            }
        }
    };
}

world_bindings!(policy::ScalingPolicy, policy::ScalingPolicyIndices, edl_plugins_policy);
world_bindings!(adapter::BatchAdapter, adapter::BatchAdapterIndices, edl_plugins_adapter);
world_bindings!(transform::ReaderTransform, transform::ReaderTransformIndices, edl_plugins_transform);
world_bindings!(
    teacher_policy::TeacherPoolPolicy,
    teacher_policy::TeacherPoolPolicyIndices,
    edl_plugins_teacher_policy
);

struct Live<B> {
    store: Store<HostState>,
    bindings: B,
    /// The `state` export, where the component has one.
    state: Option<state::PluginState>,
    /// The `training-observer` export, where the component has one.
    training: Option<bindings::training::PluginTrainingObserver>,
    /// The `server-policy` export, where the component has one.
    servers: Option<bindings::servers::PluginServerPolicy>,
    /// The `spare-policy` export, where the component has one.
    spares: Option<bindings::spares::PluginSparePolicy>,
    stderr: CapturedStderr,
}

/// A component instance behind a sandbox, rebuilt after a trap.
pub struct Sandboxed<B: WorldBindings> {
    path: String,
    engine: Engine,
    ticker: super::ticker::Ticker,
    pre: InstancePre<HostState>,
    indices: B::Indices,
    /// Where the component's `state` export is, if it has one.
    state_indices: Option<state::PluginStateIndices>,
    /// Where its `training-observer` export is, if it has one.
    training_indices: Option<bindings::training::PluginTrainingObserverIndices>,
    /// Where its `server-policy` export is, if it has one.
    server_indices: Option<bindings::servers::PluginServerPolicyIndices>,
    /// Where its `spare-policy` export is, if it has one.
    spare_indices: Option<bindings::spares::PluginSparePolicyIndices>,
    limits: Limits,
    deadline_ticks: u64,
    config: Vec<(String, String)>,
    info: PluginInfo,
    cache: CacheStatus,
    live: Option<Live<B>>,
    /// The memory the plugin last saved or was given, whether the next
    /// instance (one rebuilt after a trap) is to be given it, and whether
    /// the live one was and has not yet answered a call since.
    kept: Option<Vec<u8>>,
    restore: bool,
    restored: bool,
    scratch_view: Option<wit::ClusterView>,
    scratch_batch: Option<wit::Batch>,
    scratch_teacher_view: Option<wit_teacher::TeacherView>,
}

impl<B: WorldBindings> Sandboxed<B> {
    fn new(
        ctx: Ctx<'_>,
        component: &Component,
        config: &[(String, String)],
        cache: CacheStatus,
    ) -> Result<Self, Error> {
        let instance_pre = ctx
            .linker
            .instantiate_pre(component)
            .map_err(|e| Error::Instantiate { path: ctx.path.clone(), detail: format!("{e:#}") })?;
        let indices = B::indices(&instance_pre)
            .map_err(|e| Error::Instantiate { path: ctx.path.clone(), detail: format!("{e:#}") })?;
        let state_indices = state::PluginStateIndices::new(&instance_pre).ok();
        let training_indices = bindings::training::PluginTrainingObserverIndices::new(&instance_pre).ok();
        let server_indices = bindings::servers::PluginServerPolicyIndices::new(&instance_pre).ok();
        let spare_indices = bindings::spares::PluginSparePolicyIndices::new(&instance_pre).ok();
        let tick = EPOCH_TICK.as_nanos().max(1);
        let deadline_ticks = (ctx.limits.deadline.as_nanos().div_ceil(tick) as u64).max(1) + 1;
        let mut me = Sandboxed {
            path: ctx.path,
            engine: ctx.engine.clone(),
            ticker: ctx.ticker.clone(),
            pre: instance_pre,
            indices,
            state_indices,
            training_indices,
            server_indices,
            spare_indices,
            limits: ctx.limits,
            deadline_ticks,
            config: config.to_vec(),
            info: PluginInfo { name: String::new(), version: String::new(), description: String::new() },
            cache,
            live: None,
            kept: None,
            restore: false,
            restored: false,
            scratch_view: None,
            scratch_batch: None,
            scratch_teacher_view: None,
        };
        me.info = me.call("info", |b: &B, s| b.info(s))?.into();
        Ok(me)
    }

    fn instantiate(&self) -> Result<Live<B>, Error> {
        let stderr = CapturedStderr::new(self.limits.stderr_bytes);
        // Nothing is granted: no preopened directories, no environment, no
        // arguments, no sockets. Clocks and randomness stay (std needs them).
        let wasi = WasiCtxBuilder::new()
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        let now = Instant::now();
        let state = HostState {
            wasi,
            table: ResourceTable::new(),
            limiter: MemoryCap { limit: self.limits.memory_bytes, hit: false },
            deadline: now + self.limits.deadline,
            origin: now,
        };
        let _ticking = self.ticker.enter();
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.set_epoch_deadline(self.deadline_ticks);
        let loaded = self.pre.instantiate(&mut store).and_then(|instance| {
            let bindings = B::load(&self.indices, &mut store, &instance)?;
            let state = self.state_indices.as_ref().map(|ix| ix.load(&mut store, &instance)).transpose()?;
            let training =
                self.training_indices.as_ref().map(|ix| ix.load(&mut store, &instance)).transpose()?;
            let servers =
                self.server_indices.as_ref().map(|ix| ix.load(&mut store, &instance)).transpose()?;
            let spares = self.spare_indices.as_ref().map(|ix| ix.load(&mut store, &instance)).transpose()?;
            Ok((bindings, state, training, servers, spares))
        });
        let (bindings, state, training, servers, spares) = match loaded {
            Ok(b) => b,
            Err(e) => return Err(self.classify("instantiate", e, &store, &stderr)),
        };
        store.set_epoch_deadline(self.deadline_ticks);
        store.data_mut().deadline = Instant::now() + self.limits.deadline;
        match bindings.init(&mut store, &self.config) {
            Ok(Ok(())) => Ok(Live { store, bindings, state, training, servers, spares, stderr }),
            Ok(Err(e)) => Err(Error::Init { path: self.path.clone(), error: e.into() }),
            Err(e) => Err(self.classify("init", e, &store, &stderr)),
        }
    }

    fn classify(
        &self,
        call: &'static str,
        e: wasmtime::Error,
        store: &Store<HostState>,
        stderr: &CapturedStderr,
    ) -> Error {
        let path = self.path.clone();
        let deadline_ms = self.limits.deadline.as_millis() as u64;
        if e.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
            return Error::Deadline { path, call, deadline_ms, detail: String::new() };
        }
        if let Some(sleep) = e.downcast_ref::<SleepPastDeadline>() {
            return Error::Deadline { path, call, deadline_ms, detail: format!(" ({sleep})") };
        }
        if store.data().limiter.hit {
            return Error::MemoryLimit { path, call, limit_mib: (self.limits.memory_bytes >> 20) as u64 };
        }
        let message = match e.downcast_ref::<Trap>() {
            Some(Trap::StackOverflow) => "stack overflow (the guest's call stack ran out)".to_string(),
            Some(Trap::MemoryOutOfBounds) => {
                match e.downcast_ref::<wasmtime::WasmBacktrace>().and_then(recursion) {
                    Some((depth, func)) => format!(
                        "stack overflow: {depth} calls deep in `{func}`, the guest's stack ran past the start of its memory \
                     (seen by wasm as an out-of-bounds access)"
                    ),
                    None => Trap::MemoryOutOfBounds.to_string(),
                }
            }
            Some(trap) => trap.to_string(),
            None => format!("{e:#}"),
        };
        Error::Trap { path, call, message, stderr: stderr.take().unwrap_or_default() }
    }

    /// Runs one call under the deadline; a trap drops the instance.
    fn call<R>(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&B, &mut Store<HostState>) -> wasmtime::Result<R>,
    ) -> Result<R, Error> {
        self.call_live(call, |live| f(&live.bindings, &mut live.store))
    }

    /// Calls the `training-observer` export; false when there is none.
    fn tell_training(&mut self, stats: &edl_plugin_sdk::TrainingStats) -> Result<bool, Error> {
        if self.training_indices.is_none() {
            return Ok(false);
        }
        let stats = bindings::training_stats(stats);
        self.call_live("on-training", |live| match &live.training {
            Some(t) => {
                t.edl_plugins_training_observer().call_on_training(&mut live.store, &stats).map(|()| true)
            }
            None => Ok(false),
        })
    }

    /// Calls the `server-policy` export; None when there is none.
    fn ask_servers(&mut self, view: &edl_plugin_sdk::ServerView) -> Result<Option<u32>, Error> {
        if self.server_indices.is_none() {
            return Ok(None);
        }
        let view = bindings::server_view(view);
        self.call_live("decide-servers", |live| match &live.servers {
            Some(p) => p.edl_plugins_server_policy().call_decide_servers(&mut live.store, &view),
            None => Ok(None),
        })
    }

    /// Calls the `spare-policy` export; None when there is none.
    fn ask_spares(&mut self, view: &edl_plugin_sdk::SpareView) -> Result<Option<u32>, Error> {
        if self.spare_indices.is_none() {
            return Ok(None);
        }
        let view = bindings::spare_view(view);
        self.call_live("decide-spares", |live| match &live.spares {
            Some(p) => p.edl_plugins_spare_policy().call_decide_spares(&mut live.store, view),
            None => Ok(None),
        })
    }

    /// Runs one call of the `state` export; `None` when there is none.
    fn call_state<R>(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&state::PluginState, &mut Store<HostState>) -> wasmtime::Result<R>,
    ) -> Result<Option<R>, Error> {
        if self.state_indices.is_none() {
            return Ok(None);
        }
        self.call_live(call, |live| match &live.state {
            Some(st) => f(st, &mut live.store).map(Some),
            None => Ok(None),
        })
    }

    /// An instance; after a trap, given the memory last saved (what the
    /// plugin learned since is lost); one that cannot take it back (a trap,
    /// an error) is made again from `init`.
    fn rebuild(&mut self) -> Result<Live<B>, Error> {
        let mut live = self.instantiate()?;
        if !std::mem::take(&mut self.restore) {
            return Ok(live);
        }
        let (Some(bytes), Some(st)) = (self.kept.as_ref(), live.state.as_ref()) else { return Ok(live) };
        live.store.set_epoch_deadline(self.deadline_ticks);
        live.store.data_mut().deadline = Instant::now() + self.limits.deadline;
        let ticking = self.ticker.enter();
        let loaded = st.edl_plugins_state().call_load(&mut live.store, bytes);
        drop(ticking);
        let why = match loaded {
            Ok(Ok(())) => {
                self.restored = true;
                return Ok(live);
            }
            Ok(Err(e)) => edl_plugin_sdk::PluginError::from(e).to_string(),
            Err(e) => self.classify("load", e, &live.store, &live.stderr).to_string(),
        };
        // Not offered again: this memory will not go back in.
        self.kept = None;
        tracing::warn!(
            "{}: the rebuilt instance could not take its memory back ({why}); it starts afresh",
            self.path
        );
        self.instantiate()
    }

    fn call_live<R>(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&mut Live<B>) -> wasmtime::Result<R>,
    ) -> Result<R, Error> {
        if self.live.is_none() {
            self.live = Some(self.rebuild()?);
        }
        let live = self.live.as_mut().expect("instantiated above");
        live.store.set_epoch_deadline(self.deadline_ticks);
        live.store.data_mut().deadline = Instant::now() + self.limits.deadline;
        let ticking = self.ticker.enter();
        let done = f(live);
        drop(ticking);
        match done {
            Ok(r) => {
                self.restored = false;
                if let Some(text) = live.stderr.take() {
                    for line in text.lines() {
                        tracing::info!(target: "edl::plugin", plugin = %self.info.name, "{line}");
                    }
                }
                Ok(r)
            }
            Err(e) => {
                let live = self.live.take().expect("instantiated above");
                let err = self.classify(call, e, &live.store, &live.stderr);
                tracing::warn!("{err}; the instance will be rebuilt");
                if std::mem::take(&mut self.restored) {
                    // The memory it was given back may be what traps: the
                    // next instance starts from `init`.
                    self.kept = None;
                    tracing::warn!(
                        "{}: it trapped on the memory it was given back; the next instance starts afresh",
                        self.path
                    );
                }
                self.restore = true;
                Err(err)
            }
        }
    }
}

/// Memory a rebuilt instance is given back: none from a plugin that keeps
/// none (the SDK saves nothing then), and none the contract refuses to
/// store (past its cap).
fn worth_keeping(bytes: &[u8]) -> bool {
    !bytes.is_empty() && bytes.len() <= super::contract::MAX_STATE_BYTES
}

impl<B: WorldBindings> Plugin for Sandboxed<B> {
    fn info(&self) -> &PluginInfo {
        &self.info
    }

    fn backend(&self) -> Backend {
        Backend::Wasm { cache: self.cache }
    }

    fn save_state(&mut self) -> Result<Option<Vec<u8>>, Error> {
        let saved = self.call_state("save", |st, s| st.edl_plugins_state().call_save(s))?;
        if let Some(bytes) = saved.as_ref().filter(|b| worth_keeping(b)) {
            self.kept = Some(bytes.clone());
        }
        Ok(saved)
    }

    fn load_state(&mut self, bytes: &[u8]) -> Result<bool, Error> {
        match self.call_state("load", |st, s| st.edl_plugins_state().call_load(s, bytes))? {
            None => Ok(false),
            Some(Ok(())) => {
                if worth_keeping(bytes) {
                    self.kept = Some(bytes.to_vec());
                }
                Ok(true)
            }
            Some(Err(e)) => Err(Error::Guest { path: self.path.clone(), call: "load", error: e.into() }),
        }
    }
}

impl PolicyPlugin for Sandboxed<policy::ScalingPolicy> {
    fn decide(&mut self, view: &ClusterView) -> Result<Vec<Action>, Error> {
        // The converted view is kept between calls so its worker list's
        // allocation is reused.
        let mut wit_view = std::mem::take(&mut self.scratch_view).unwrap_or_default();
        bindings::fill_cluster_view(&mut wit_view, view);
        let result = self.call("decide", |b, s| b.edl_plugins_policy().call_decide(s, &wit_view));
        self.scratch_view = Some(wit_view);
        Ok(result?.into_iter().map(Action::from).collect())
    }

    fn on_training(&mut self, stats: &edl_plugin_sdk::TrainingStats) -> Result<bool, Error> {
        self.tell_training(stats)
    }

    fn decide_servers(&mut self, view: &edl_plugin_sdk::ServerView) -> Result<Option<u32>, Error> {
        self.ask_servers(view)
    }

    fn decide_spares(&mut self, view: &edl_plugin_sdk::SpareView) -> Result<Option<u32>, Error> {
        self.ask_spares(view)
    }
}

impl AdapterPlugin for Sandboxed<adapter::BatchAdapter> {
    fn on_resize(&mut self, event: &ResizeEvent, current: &Hyperparams) -> Result<Hyperparams, Error> {
        let (e, h) = (bindings::resize_event(event), bindings::hyperparams(current));
        Ok(self.call("on-resize", |b, s| b.edl_plugins_adapter().call_on_resize(s, e, h))?.into())
    }

    fn on_step(&mut self, step: u64, current: &Hyperparams) -> Result<Hyperparams, Error> {
        let h = bindings::hyperparams(current);
        Ok(self.call("on-step", |b, s| b.edl_plugins_adapter().call_on_step(s, step, h))?.into())
    }

    fn on_training(&mut self, stats: &edl_plugin_sdk::TrainingStats) -> Result<bool, Error> {
        self.tell_training(stats)
    }
}

impl TransformPlugin for Sandboxed<transform::ReaderTransform> {
    fn apply(&mut self, batch: &Batch) -> Result<Batch, Error> {
        // As for policies, the converted input keeps its buffers between calls.
        let mut input = std::mem::take(&mut self.scratch_batch).unwrap_or_default();
        bindings::fill_batch(&mut input, batch);
        let result = self.call("apply", |b, s| b.edl_plugins_transform().call_apply(s, &input));
        self.scratch_batch = Some(input);
        match result? {
            Ok(out) => Ok(out.into()),
            Err(e) => Err(Error::Guest { path: self.path.clone(), call: "apply", error: e.into() }),
        }
    }
}

impl TeacherPolicyPlugin for Sandboxed<teacher_policy::TeacherPoolPolicy> {
    fn decide(&mut self, view: &TeacherView) -> Result<TeacherPlan, Error> {
        // As for scaling policies, the converted view keeps its teacher list.
        let mut wit_view = std::mem::take(&mut self.scratch_teacher_view).unwrap_or_default();
        bindings::fill_teacher_view(&mut wit_view, view);
        let result = self.call("decide", |b, s| b.edl_plugins_teacher_policy().call_decide(s, &wit_view));
        self.scratch_teacher_view = Some(wit_view);
        Ok(result?.into())
    }
}

/// Instantiates `component` as a plugin of `world`.
pub fn load(
    ctx: Ctx<'_>,
    component: &Component,
    world: World,
    config: &[(String, String)],
    cache: CacheStatus,
) -> Result<Loaded, Error> {
    Ok(match world {
        World::ScalingPolicy => {
            Loaded::Policy(Box::new(Sandboxed::<policy::ScalingPolicy>::new(ctx, component, config, cache)?))
        }
        World::BatchAdapter => {
            Loaded::Adapter(Box::new(Sandboxed::<adapter::BatchAdapter>::new(ctx, component, config, cache)?))
        }
        World::ReaderTransform => Loaded::Transform(Box::new(Sandboxed::<transform::ReaderTransform>::new(
            ctx, component, config, cache,
        )?)),
        World::TeacherPolicy => {
            Loaded::TeacherPolicy(Box::new(Sandboxed::<teacher_policy::TeacherPoolPolicy>::new(
                ctx, component, config, cache,
            )?))
        }
    })
}

/// An out-of-bounds access inside a recursion at least this deep is taken
/// for the guest's own stack running out: Rust and C toolchains keep it at
/// the start of linear memory (64 KiB by default for wasm32-wasip2), so an
/// overflow wraps below address 0 and wasm reports an out-of-bounds access.
/// Returns the depth and the recursing function.
fn recursion(bt: &wasmtime::WasmBacktrace) -> Option<(usize, String)> {
    const DEEP: usize = 12;
    let frames = bt.frames();
    let mut counts: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
    for f in frames {
        *counts.entry(f.func_index()).or_default() += 1;
    }
    let (&index, &n) = counts.iter().max_by_key(|(_, n)| **n)?;
    if n < DEEP || n * 2 < frames.len() {
        return None;
    }
    let name = frames
        .iter()
        .find(|f| f.func_index() == index)
        .and_then(|f| f.func_name().map(str::to_string))
        .unwrap_or_else(|| format!("function {index}"));
    Some((frames.len(), name))
}
