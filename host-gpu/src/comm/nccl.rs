//! NCCL communicator: the unique id goes through the same rendezvous as the
//! TCP ring's addresses. Each collective is enqueued on the stream and then
//! watched: if it has not finished within the timeout, or NCCL reports an
//! asynchronous error (a peer died), the communicator is aborted so that no
//! rank waits forever; it is then unusable and a new generation is needed.

use super::{CommError, Communicator, ReduceOp, Rendezvous};
use crate::device::{CudaUnavailable, check_cuda, nccl_present};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut};
use cudarc::nccl::{result, sys};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

/// A communicator over NCCL for one CUDA device per rank.
pub struct NcclCommunicator {
    rank: usize,
    world: usize,
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    timeout: Duration,
    broken: Option<String>,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time
// (all methods take &mut self).
unsafe impl Send for NcclCommunicator {}

fn nccl_err(e: impl std::fmt::Debug) -> CommError {
    CommError::Nccl(format!("{e:?}"))
}

impl NcclCommunicator {
    /// Joins the generation as `rank` of `world` on CUDA device `ordinal`.
    pub fn connect(
        ordinal: usize,
        rank: usize,
        world: usize,
        rendezvous: &dyn Rendezvous,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        check_cuda(ordinal)?;
        if !nccl_present() {
            return Err(CudaUnavailable::NoNccl.into());
        }
        let mine = if rank == 0 {
            let id = result::get_uniqueid().map_err(nccl_err)?;
            id.internal.iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        let all = rendezvous.exchange(rank, world, mine, timeout)?;
        let bytes = &all[0];
        if bytes.len() != 128 {
            return Err(CommError::Rendezvous(format!("rank 0 published a {}-byte NCCL id", bytes.len())));
        }
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        for (d, &b) in id.internal.iter_mut().zip(bytes) {
            *d = b as _;
        }
        let ctx = CudaContext::new(ordinal).map_err(nccl_err)?;
        let stream = ctx.default_stream();
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL before use; world and rank were checked.
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), world as i32, id, rank as i32).map_err(nccl_err)?;
            comm.assume_init()
        };
        Ok(NcclCommunicator { rank, world, comm, stream, timeout, broken: None })
    }

    fn check(&self) -> Result<(), CommError> {
        match &self.broken {
            Some(why) => Err(CommError::Broken { rank: self.rank, why: why.clone() }),
            None => Ok(()),
        }
    }

    /// Waits for the enqueued work, aborting the communicator on a timeout or
    /// an asynchronous NCCL error.
    fn watch(&mut self, op: &'static str) -> Result<(), CommError> {
        let event = self.stream.record_event(None).map_err(nccl_err)?;
        let start = Instant::now();
        loop {
            if event.is_complete() {
                return Ok(());
            }
            let mut async_err = sys::ncclResult_t::ncclSuccess;
            // SAFETY: `comm` is a live communicator.
            unsafe { sys::ncclCommGetAsyncError(self.comm, &mut async_err) };
            let failure = if async_err != sys::ncclResult_t::ncclSuccess {
                Some(CommError::Nccl(format!("rank {}: {op}: {async_err:?}", self.rank)))
            } else if start.elapsed() > self.timeout {
                Some(CommError::Timeout { rank: self.rank, op, peer: self.rank, after: self.timeout })
            } else {
                None
            };
            if let Some(err) = failure {
                // SAFETY: abort is the documented way out of a stuck collective.
                unsafe {
                    let _ = result::comm_abort(self.comm);
                }
                self.broken = Some(err.to_string());
                return Err(err);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// All-reduce of a device buffer, in place.
    pub fn all_reduce_device(&mut self, buf: &mut CudaSlice<f32>, op: ReduceOp) -> Result<(), CommError> {
        self.check()?;
        let count = buf.len();
        let nccl_op = match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Average => sys::ncclRedOp_t::ncclAvg,
        };
        {
            let stream = self.stream.clone();
            let (ptr, _sync) = buf.device_ptr_mut(&stream);
            // SAFETY: ptr is a device buffer of `count` f32 on this stream's context.
            unsafe {
                result::all_reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    count,
                    sys::ncclDataType_t::ncclFloat32,
                    nccl_op,
                    self.comm,
                    stream.cu_stream() as _,
                )
                .map_err(nccl_err)?;
            }
        }
        self.watch("all-reduce")
    }

    /// Broadcast of a device buffer from `root`, in place.
    pub fn broadcast_device(&mut self, buf: &mut CudaSlice<f32>, root: usize) -> Result<(), CommError> {
        self.check()?;
        let count = buf.len();
        {
            let stream = self.stream.clone();
            let (ptr, _sync) = buf.device_ptr_mut(&stream);
            // SAFETY: as in all_reduce_device.
            unsafe {
                result::broadcast(
                    ptr as *const _,
                    ptr as *mut _,
                    count,
                    sys::ncclDataType_t::ncclFloat32,
                    root as i32,
                    self.comm,
                    stream.cu_stream() as _,
                )
                .map_err(nccl_err)?;
            }
        }
        self.watch("broadcast")
    }

    fn staged(
        &mut self,
        buf: &mut [f32],
        f: impl FnOnce(&mut Self, &mut CudaSlice<f32>) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self.stream.clone_htod(buf).map_err(nccl_err)?;
        f(self, &mut dev)?;
        self.stream.memcpy_dtoh(&dev, buf).map_err(nccl_err)
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    /// Host buffers are staged through the device; keep gradients on the
    /// device and use [`NcclCommunicator::all_reduce_device`] in training.
    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.staged(buf, |me, dev| me.all_reduce_device(dev, op))
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.staged(buf, |me, dev| me.broadcast_device(dev, root))
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        // SAFETY: the communicator is not used after this; an aborted one is
        // already released by NCCL.
        unsafe {
            if self.broken.is_none() {
                let _ = result::comm_destroy(self.comm);
            }
        }
    }
}
