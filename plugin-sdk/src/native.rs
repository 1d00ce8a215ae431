//! The C ABI of native (`.so`) plugins.
//!
//! The export macros generate these symbols from a plugin's trait impl; the
//! runtime loads them with `libloading`. Native plugins are trusted and run
//! unsandboxed in the runtime's process: they are the fast path and the
//! baseline the WebAssembly host is measured against.
//!
//! Every plugin exports `edl_plugin_abi_version`, `edl_plugin_world`,
//! `edl_plugin_info`, `edl_plugin_new`, `edl_plugin_free`, `edl_plugin_init`
//! and `edl_plugin_last_error`, plus its world's calls (`edl_policy_decide`,
//! `edl_adapter_on_resize` / `edl_adapter_on_step`, `edl_transform_apply`,
//! `edl_teacher_policy_decide`); a scaling policy also exports
//! `edl_policy_decide_servers` (sizing the parameter servers) and
//! `edl_policy_decide_spares` (sizing the warm spares; the view is
//! [`SpareView`] as it is); a library built before either is taken for a
//! policy that leaves them be. Policies
//! (of workers and of teachers) and
//! adapters also export `edl_plugin_save_state` and
//! `edl_plugin_load_state` (their memory between calls, as the WIT `state`
//! interface); a library without them is taken for a plugin without memory.
//! Calls return a [`status`] code; panics are caught and reported as
//! [`status::PANIC`] with the message in `edl_plugin_last_error`. Output
//! buffers belong to the plugin instance and stay valid until its next call.

use crate::{
    Action, Batch, BatchAdapter, ClusterView, Config, Dtype, Hyperparams, PluginError, ReaderTransform,
    ResizeEvent, ScalingPolicy, ServerStats, ServerView, SpareView, TeacherPlan, TeacherPolicy, TeacherStats,
    TeacherView, WorkerStats,
};
use std::{ffi::c_void, panic::AssertUnwindSafe};

/// Version of this C ABI; the runtime refuses a plugin with another.
pub const ABI_VERSION: u32 = 1;

/// Status codes returned by every call.
pub mod status {
    pub const OK: i32 = 0;
    pub const INVALID_CONFIG: i32 = 1;
    pub const INVALID_INPUT: i32 = 2;
    pub const FAILED: i32 = 3;
    pub const PANIC: i32 = 4;
    pub const NULL_HANDLE: i32 = 5;
}

/// A borrowed UTF-8 string.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawStr {
    pub ptr: *const u8,
    pub len: usize,
}

impl RawStr {
    /// Borrows a string with static lifetime.
    pub const fn from_static(s: &'static str) -> Self {
        RawStr { ptr: s.as_ptr(), len: s.len() }
    }

    /// Borrows any string; the caller keeps it alive while the RawStr is used.
    pub fn borrow(s: &str) -> Self {
        RawStr { ptr: s.as_ptr(), len: s.len() }
    }

    /// Copies the string out (invalid UTF-8 is replaced).
    ///
    /// # Safety
    /// `ptr` must point at `len` readable bytes (or `len` must be 0).
    pub unsafe fn to_string_lossy(&self) -> String {
        if self.len == 0 || self.ptr.is_null() {
            return String::new();
        }
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr, self.len) };
        String::from_utf8_lossy(bytes).into_owned()
    }
}

/// A borrowed slice.
#[repr(C)]
#[derive(Debug)]
pub struct RawSlice<T> {
    pub ptr: *const T,
    pub len: usize,
}

impl<T> Clone for RawSlice<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for RawSlice<T> {}

impl<T> RawSlice<T> {
    /// Borrows a slice; the caller keeps it alive while the RawSlice is used.
    pub fn borrow(s: &[T]) -> Self {
        RawSlice { ptr: s.as_ptr(), len: s.len() }
    }

    /// An empty slice.
    pub const fn empty() -> Self {
        RawSlice { ptr: std::ptr::null(), len: 0 }
    }

    /// Views the slice. A null, misaligned or impossibly long one (more
    /// than `isize::MAX` bytes) is checked here and read as empty, whatever
    /// the other side of the ABI sent.
    ///
    /// # Safety
    /// A non-null, aligned `ptr` must point at `len` initialised elements
    /// that outlive `'a` (what cannot be checked from here).
    pub unsafe fn as_slice<'a>(&self) -> &'a [T] {
        let aligned = (self.ptr as usize).is_multiple_of(std::mem::align_of::<T>());
        let fits = self.len.checked_mul(std::mem::size_of::<T>()).is_some_and(|b| b <= isize::MAX as usize);
        if self.len == 0 || self.ptr.is_null() || !aligned || !fits {
            &[]
        } else {
            // SAFETY: non-null, aligned and of a size a slice may have (checked
            // above); the elements' validity and lifetime are the caller's.
            unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
        }
    }
}

/// One configuration pair.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawPair {
    pub key: RawStr,
    pub value: RawStr,
}

/// `edl_plugin_info`'s answer (static strings).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawInfo {
    pub name: RawStr,
    pub version: RawStr,
    pub description: RawStr,
}

/// [`ClusterView`] with its workers borrowed.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawClusterView {
    pub step: u64,
    pub epoch: u32,
    pub world_size: u32,
    pub min_workers: u32,
    pub max_workers: u32,
    pub free_slots: u32,
    pub global_batch: u32,
    pub throughput: f64,
    pub workers: RawSlice<WorkerStats>,
    pub secs_since_change: f64,
    pub price_per_worker_hour: f64,
    pub samples_remaining: u64,
}

impl RawClusterView {
    /// Borrows a view; `view` must outlive the result.
    pub fn borrow(view: &ClusterView) -> Self {
        RawClusterView {
            step: view.step,
            epoch: view.epoch,
            world_size: view.world_size,
            min_workers: view.min_workers,
            max_workers: view.max_workers,
            free_slots: view.free_slots,
            global_batch: view.global_batch,
            throughput: view.throughput,
            workers: RawSlice::borrow(&view.workers),
            secs_since_change: view.secs_since_change,
            price_per_worker_hour: view.price_per_worker_hour,
            samples_remaining: view.samples_remaining,
        }
    }
}

/// [`TeacherView`] with its teachers' statistics borrowed.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawTeacherView {
    pub step: u64,
    pub wait_share: f64,
    pub student_throughput: f64,
    pub student_world_size: u32,
    pub student_world_planned: u32,
    pub teacher_count: u32,
    pub min_teachers: u32,
    pub max_teachers: u32,
    pub in_flight_per_teacher: u32,
    pub teachers: RawSlice<TeacherStats>,
    pub secs_since_change: f64,
    pub price_per_teacher_hour: f64,
}

impl RawTeacherView {
    /// Borrows a view; `view` must outlive the result.
    pub fn borrow(view: &TeacherView) -> Self {
        RawTeacherView {
            step: view.step,
            wait_share: view.wait_share,
            student_throughput: view.student_throughput,
            student_world_size: view.student_world_size,
            student_world_planned: view.student_world_planned,
            teacher_count: view.teacher_count,
            min_teachers: view.min_teachers,
            max_teachers: view.max_teachers,
            in_flight_per_teacher: view.in_flight_per_teacher,
            teachers: RawSlice::borrow(&view.teachers),
            secs_since_change: view.secs_since_change,
            price_per_teacher_hour: view.price_per_teacher_hour,
        }
    }

    /// Overwrites `out` with this view, reusing `out`'s teacher list.
    ///
    /// # Safety
    /// `teachers` must point at that many initialised statistics (its
    /// null, alignment and size are checked by [`RawSlice::as_slice`]).
    pub unsafe fn fill(&self, out: &mut TeacherView) {
        out.step = self.step;
        out.wait_share = self.wait_share;
        out.student_throughput = self.student_throughput;
        out.student_world_size = self.student_world_size;
        out.student_world_planned = self.student_world_planned;
        out.teacher_count = self.teacher_count;
        out.min_teachers = self.min_teachers;
        out.max_teachers = self.max_teachers;
        out.in_flight_per_teacher = self.in_flight_per_teacher;
        out.teachers.clear();
        out.teachers.extend_from_slice(unsafe { self.teachers.as_slice() });
        out.secs_since_change = self.secs_since_change;
        out.price_per_teacher_hour = self.price_per_teacher_hour;
    }
}

// `SpareView` crosses this ABI as it is: a field added, moved or retyped
// changes its layout, which needs a new `ABI_VERSION`. Its size and every
// field's offset are pinned here.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<SpareView>() == 96);
    let offsets = [
        offset_of!(SpareView, step),
        offset_of!(SpareView, world_size),
        offset_of!(SpareView, min_workers),
        offset_of!(SpareView, max_workers),
        offset_of!(SpareView, spares_wanted),
        offset_of!(SpareView, spares_ready),
        offset_of!(SpareView, spares_starting),
        offset_of!(SpareView, price_per_spare_hour),
        offset_of!(SpareView, spare_hours),
        offset_of!(SpareView, from_spares),
        offset_of!(SpareView, started_cold),
        offset_of!(SpareView, members_lost),
        offset_of!(SpareView, ready_secs),
        offset_of!(SpareView, hours),
        offset_of!(SpareView, secs_since_change),
    ];
    let expected = [0, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 72, 80, 88];
    let mut i = 0;
    while i < offsets.len() {
        assert!(offsets[i] == expected[i]);
        i += 1;
    }
};

// `ServerStats` is an element of this ABI's slices: a field added to it
// changes its stride, which needs a new `ABI_VERSION`.
const _: () = assert!(std::mem::size_of::<ServerStats>() == 56);

/// [`ServerView`] with its servers' statistics borrowed.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawServerView {
    pub step: u64,
    pub servers: RawSlice<ServerStats>,
    pub min_servers: u32,
    pub max_servers: u32,
    pub replicas: u32,
    pub secs_since_change: f64,
}

impl RawServerView {
    /// Borrows a view; `view` must outlive the result.
    pub fn borrow(view: &ServerView) -> Self {
        RawServerView {
            step: view.step,
            servers: RawSlice::borrow(&view.servers),
            min_servers: view.min_servers,
            max_servers: view.max_servers,
            replicas: view.replicas,
            secs_since_change: view.secs_since_change,
        }
    }

    /// Overwrites `out` with this view, reusing `out`'s server list.
    ///
    /// # Safety
    /// `servers` must point at that many initialised statistics (its null,
    /// alignment and size are checked by [`RawSlice::as_slice`]).
    pub unsafe fn fill(&self, out: &mut ServerView) {
        out.step = self.step;
        out.servers.clear();
        out.servers.extend_from_slice(unsafe { self.servers.as_slice() });
        out.min_servers = self.min_servers;
        out.max_servers = self.max_servers;
        out.replicas = self.replicas;
        out.secs_since_change = self.secs_since_change;
    }
}

/// `edl_policy_decide_servers`'s and `edl_policy_decide_spares`'s answer:
/// `asked` 1 with the number (`servers`) of servers or spares the job
/// should have, 0 to leave them as they are.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawServerAnswer {
    pub asked: u32,
    pub servers: u32,
}

impl From<Option<u32>> for RawServerAnswer {
    fn from(a: Option<u32>) -> Self {
        RawServerAnswer { asked: u32::from(a.is_some()), servers: a.unwrap_or(0) }
    }
}

impl RawServerAnswer {
    /// The answer; `None` for one that is not `asked` 0 or 1.
    pub fn get(self) -> Option<Option<u32>> {
        match self.asked {
            0 => Some(None),
            1 => Some(Some(self.servers)),
            _ => None,
        }
    }
}

/// An [`Action`] as a tagged struct: tag 0 hold, 1 scale-out(count),
/// 2 scale-in(count), 3 replace(worker).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawAction {
    pub tag: u32,
    pub count: u32,
    pub worker: u64,
}

impl From<Action> for RawAction {
    fn from(a: Action) -> Self {
        match a {
            Action::Hold => RawAction { tag: 0, count: 0, worker: 0 },
            Action::ScaleOut(n) => RawAction { tag: 1, count: n, worker: 0 },
            Action::ScaleIn(n) => RawAction { tag: 2, count: n, worker: 0 },
            Action::Replace(id) => RawAction { tag: 3, count: 0, worker: id },
        }
    }
}

impl TryFrom<RawAction> for Action {
    type Error = u32;
    fn try_from(a: RawAction) -> Result<Self, u32> {
        Ok(match a.tag {
            0 => Action::Hold,
            1 => Action::ScaleOut(a.count),
            2 => Action::ScaleIn(a.count),
            3 => Action::Replace(a.worker),
            t => return Err(t),
        })
    }
}

/// [`Batch`] with its buffers borrowed.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawBatch {
    pub data: RawSlice<u8>,
    pub shape: RawSlice<u32>,
    pub dtype: u8,
    pub labels: RawSlice<u32>,
    pub ids: RawSlice<u64>,
    pub seed: u64,
}

impl RawBatch {
    /// Borrows a batch; `batch` must outlive the result.
    pub fn borrow(batch: &Batch) -> Self {
        RawBatch {
            data: RawSlice::borrow(&batch.data),
            shape: RawSlice::borrow(&batch.shape),
            dtype: batch.dtype as u8,
            labels: RawSlice::borrow(&batch.labels),
            ids: RawSlice::borrow(&batch.ids),
            seed: batch.seed,
        }
    }

    /// Copies the batch out.
    ///
    /// # Safety
    /// Every slice must be valid for its length.
    pub unsafe fn to_batch(&self) -> Result<Batch, PluginError> {
        let dtype = Dtype::from_u8(self.dtype)
            .ok_or_else(|| PluginError::InvalidInput(format!("unknown dtype {}", self.dtype)))?;
        unsafe {
            Ok(Batch {
                data: self.data.as_slice().to_vec(),
                shape: self.shape.as_slice().to_vec(),
                dtype,
                labels: self.labels.as_slice().to_vec(),
                ids: self.ids.as_slice().to_vec(),
                seed: self.seed,
            })
        }
    }
}

/// The state behind a native plugin handle.
pub struct Instance<T> {
    plugin: T,
    last_error: String,
    view: ClusterView,
    teacher_view: TeacherView,
    server_view: ServerView,
    actions: Vec<RawAction>,
    batch_out: Batch,
    state_out: Vec<u8>,
}

fn status_of(e: &PluginError) -> i32 {
    match e {
        PluginError::InvalidConfig(_) => status::INVALID_CONFIG,
        PluginError::InvalidInput(_) => status::INVALID_INPUT,
        PluginError::Failed(_) => status::FAILED,
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("plugin panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("plugin panicked: {s}")
    } else {
        "plugin panicked".to_string()
    }
}

/// Runs `f` on the instance behind `handle`, turning errors and panics into a status.
unsafe fn with_instance<T>(
    handle: *mut c_void,
    f: impl FnOnce(&mut Instance<T>) -> Result<(), PluginError>,
) -> i32 {
    let Some(inst) = (unsafe { (handle as *mut Instance<T>).as_mut() }) else {
        return status::NULL_HANDLE;
    };
    match std::panic::catch_unwind(AssertUnwindSafe(|| f(&mut *inst))) {
        Ok(Ok(())) => status::OK,
        Ok(Err(e)) => {
            let code = status_of(&e);
            inst.last_error = e.to_string();
            code
        }
        Err(payload) => {
            inst.last_error = panic_message(payload);
            status::PANIC
        }
    }
}

#[doc(hidden)]
pub fn plugin_new<T: Default>() -> *mut c_void {
    match std::panic::catch_unwind(T::default) {
        Ok(plugin) => Box::into_raw(Box::new(Instance {
            plugin,
            last_error: String::new(),
            view: ClusterView::default(),
            teacher_view: TeacherView::default(),
            server_view: ServerView::default(),
            actions: Vec::new(),
            batch_out: Batch::default(),
            state_out: Vec::new(),
        })) as *mut c_void,
        Err(_) => std::ptr::null_mut(),
    }
}

#[doc(hidden)]
pub unsafe fn plugin_free<T>(handle: *mut c_void) {
    if !handle.is_null() {
        drop(unsafe { Box::from_raw(handle as *mut Instance<T>) });
    }
}

#[doc(hidden)]
pub unsafe fn plugin_init<T: Default>(
    handle: *mut c_void,
    pairs: *const RawPair,
    len: usize,
    init: fn(&mut T, &Config) -> Result<(), PluginError>,
) -> i32 {
    let pairs = unsafe { RawSlice { ptr: pairs, len }.as_slice() };
    let config = Config::new(
        pairs.iter().map(|p| unsafe { (p.key.to_string_lossy(), p.value.to_string_lossy()) }).collect(),
    );
    unsafe {
        with_instance::<T>(handle, |inst| {
            let mut fresh = T::default();
            init(&mut fresh, &config)?;
            config.described()?;
            inst.plugin = fresh;
            Ok(())
        })
    }
}

#[doc(hidden)]
pub unsafe fn plugin_last_error<T>(handle: *mut c_void) -> RawStr {
    match unsafe { (handle as *const Instance<T>).as_ref() } {
        Some(inst) => RawStr::borrow(&inst.last_error),
        None => RawStr::from_static("null plugin handle"),
    }
}

#[doc(hidden)]
pub unsafe fn policy_decide<T: ScalingPolicy>(
    handle: *mut c_void,
    view: *const RawClusterView,
    out: *mut RawSlice<RawAction>,
) -> i32 {
    unsafe {
        with_instance::<T>(handle, |inst| {
            let raw = view.as_ref().ok_or_else(|| PluginError::InvalidInput("null view".into()))?;
            // The view is rebuilt in place so that a decision allocates nothing in steady state.
            let v = &mut inst.view;
            v.step = raw.step;
            v.epoch = raw.epoch;
            v.world_size = raw.world_size;
            v.min_workers = raw.min_workers;
            v.max_workers = raw.max_workers;
            v.free_slots = raw.free_slots;
            v.global_batch = raw.global_batch;
            v.throughput = raw.throughput;
            v.workers.clear();
            v.workers.extend_from_slice(raw.workers.as_slice());
            v.secs_since_change = raw.secs_since_change;
            v.price_per_worker_hour = raw.price_per_worker_hour;
            v.samples_remaining = raw.samples_remaining;
            let actions = inst.plugin.decide(&inst.view);
            inst.actions.clear();
            inst.actions.extend(actions.into_iter().map(RawAction::from));
            *out = RawSlice::borrow(&inst.actions);
            Ok(())
        })
    }
}

#[doc(hidden)]
pub unsafe fn policy_decide_servers<T: ScalingPolicy>(
    handle: *mut c_void,
    view: *const RawServerView,
    out: *mut RawServerAnswer,
) -> i32 {
    unsafe {
        with_instance::<T>(handle, |inst| {
            let raw = view.as_ref().ok_or_else(|| PluginError::InvalidInput("null view".into()))?;
            let out = out.as_mut().ok_or_else(|| PluginError::InvalidInput("null output".into()))?;
            raw.fill(&mut inst.server_view);
            *out = inst.plugin.decide_servers(&inst.server_view).into();
            Ok(())
        })
    }
}

#[doc(hidden)]
pub unsafe fn policy_decide_spares<T: ScalingPolicy>(
    handle: *mut c_void,
    view: *const SpareView,
    out: *mut RawServerAnswer,
) -> i32 {
    // Null and misaligned pointers are refused here, not trusted: a
    // reference is made only from one that is neither.
    let aligned = |p: usize, align: usize| p.is_multiple_of(align);
    unsafe {
        with_instance::<T>(handle, |inst| {
            if !aligned(view as usize, std::mem::align_of::<SpareView>())
                || !aligned(out as usize, std::mem::align_of::<RawServerAnswer>())
            {
                return Err(PluginError::InvalidInput("misaligned view or output".into()));
            }
            // SAFETY: non-null (checked by `as_ref`/`as_mut`) and aligned
            // (above); the host's view and answer live through the call.
            let view = view.as_ref().ok_or_else(|| PluginError::InvalidInput("null view".into()))?;
            let out = out.as_mut().ok_or_else(|| PluginError::InvalidInput("null output".into()))?;
            *out = inst.plugin.decide_spares(view).into();
            Ok(())
        })
    }
}

#[doc(hidden)]
pub unsafe fn teacher_policy_decide<T: TeacherPolicy>(
    handle: *mut c_void,
    view: *const RawTeacherView,
    out: *mut TeacherPlan,
) -> i32 {
    unsafe {
        with_instance::<T>(handle, |inst| {
            let raw = view.as_ref().ok_or_else(|| PluginError::InvalidInput("null view".into()))?;
            let out = out.as_mut().ok_or_else(|| PluginError::InvalidInput("null output".into()))?;
            // As for worker policies, the view is rebuilt in place.
            raw.fill(&mut inst.teacher_view);
            *out = inst.plugin.decide(&inst.teacher_view);
            Ok(())
        })
    }
}

#[doc(hidden)]
pub unsafe fn adapter_on_resize<T: BatchAdapter>(
    handle: *mut c_void,
    event: *const ResizeEvent,
    current: *const Hyperparams,
    out: *mut Hyperparams,
) -> i32 {
    unsafe {
        with_instance::<T>(handle, |inst| {
            *out = inst.plugin.on_resize(&*event, &*current);
            Ok(())
        })
    }
}

#[doc(hidden)]
pub unsafe fn adapter_on_step<T: BatchAdapter>(
    handle: *mut c_void,
    step: u64,
    current: *const Hyperparams,
    out: *mut Hyperparams,
) -> i32 {
    unsafe {
        with_instance::<T>(handle, |inst| {
            *out = inst.plugin.on_step(step, &*current);
            Ok(())
        })
    }
}

#[doc(hidden)]
pub unsafe fn transform_apply<T: ReaderTransform>(
    handle: *mut c_void,
    input: *const RawBatch,
    out: *mut RawBatch,
) -> i32 {
    unsafe {
        with_instance::<T>(handle, |inst| {
            let raw = input.as_ref().ok_or_else(|| PluginError::InvalidInput("null batch".into()))?;
            let batch = raw.to_batch()?;
            inst.batch_out = inst.plugin.apply(batch)?;
            *out = RawBatch::borrow(&inst.batch_out);
            Ok(())
        })
    }
}

#[doc(hidden)]
pub unsafe fn plugin_save_state<T>(
    handle: *mut c_void,
    out: *mut RawSlice<u8>,
    save: fn(&T) -> Vec<u8>,
) -> i32 {
    // SAFETY: a null handle or output is refused; the slice handed out is
    // the instance's own buffer, valid until its next call.
    unsafe {
        with_instance::<T>(handle, |inst| {
            let out = out.as_mut().ok_or_else(|| PluginError::InvalidInput("null output".into()))?;
            inst.state_out = save(&inst.plugin);
            *out = RawSlice::borrow(&inst.state_out);
            Ok(())
        })
    }
}

#[doc(hidden)]
pub unsafe fn plugin_load_state<T>(
    handle: *mut c_void,
    ptr: *const u8,
    len: usize,
    load: fn(&mut T, &[u8]) -> Result<(), PluginError>,
) -> i32 {
    // SAFETY: the caller (the runtime) passes a slice of `len` live bytes
    // for the call's duration, as for every other input of this ABI; a
    // null pointer or 0 reads as empty, and a null handle is refused.
    let bytes = unsafe { RawSlice { ptr, len }.as_slice() };
    unsafe { with_instance::<T>(handle, |inst| load(&mut inst.plugin, bytes)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raw_slice_that_cannot_be_one_reads_as_empty() {
        let v: Vec<u64> = vec![1, 2, 3];
        // SAFETY: borrowed from a live Vec.
        assert_eq!(unsafe { RawSlice::borrow(&v).as_slice() }, &[1, 2, 3]);
        let misaligned = RawSlice::<u64> { ptr: (v.as_ptr() as usize + 1) as *const u64, len: 2 };
        let huge = RawSlice::<u64> { ptr: v.as_ptr(), len: usize::MAX / 4 };
        let null = RawSlice::<u64> { ptr: std::ptr::null(), len: 3 };
        for s in [misaligned, huge, null] {
            // SAFETY: each is refused by the checks before anything is read.
            assert!(unsafe { s.as_slice() }.is_empty());
        }
    }
}
