//! The NCCL communicator on the GPUs this machine has: sums, averages and
//! broadcasts equal the sequential ones; a rank whose peer stops coming is
//! aborted within the timeout instead of waiting forever. Skipped, saying
//! why, where CUDA or NCCL is missing; with `EDL_REQUIRE_CUDA=1` a missing
//! GPU or NCCL fails instead.

use edl_host_gpu::comm::{CommError, Communicator, LocalRendezvous, NcclCommunicator, ReduceOp};
use edl_host_gpu::device::{CudaUnavailable, cuda_device_count, nccl_present};
use std::time::{Duration, Instant};

/// The GPUs NCCL can use here (NCCL wants one per rank), or `None` with a
/// `SKIPPED` line.
fn gpus_or_skip(test: &str) -> Option<usize> {
    if !crate::cuda_or_skip(test) {
        return None;
    }
    if nccl_present() {
        return Some(cuda_device_count().expect("cuda_or_skip saw a device"));
    }
    if std::env::var_os("EDL_REQUIRE_CUDA").is_some_and(|v| v == "1") {
        panic!("{test}: EDL_REQUIRE_CUDA=1 but {}", CudaUnavailable::NoNccl);
    }
    eprintln!("SKIPPED {test}: {}", CudaUnavailable::NoNccl);
    None
}

fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 7 + rank * 13) % 101) as f32 * 0.25 - 12.0).collect()
}

/// Runs `f` on each of `world` ranks, rank r on GPU r, as threads.
fn on_ranks<T: Send>(world: usize, f: impl Fn(&mut NcclCommunicator) -> T + Sync) -> Vec<T> {
    let rdv = LocalRendezvous::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (rdv, f) = (rdv.clone(), &f);
                s.spawn(move || {
                    let mut comm =
                        NcclCommunicator::connect(rank, rank, world, &rdv, Duration::from_secs(20)).unwrap();
                    f(&mut comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn nccl_sums_averages_and_broadcasts_on_every_gpu_here() {
    let Some(world) = gpus_or_skip("nccl_sums_averages_and_broadcasts_on_every_gpu_here") else {
        return;
    };
    // A size that is not a multiple of anything NCCL splits by.
    let len = 1_000_003;
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, len)).collect();
    let sum: Vec<f32> = (0..len).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
    let results = on_ranks(world, |comm| {
        assert_eq!(comm.world_size(), world);
        let mut summed = input(comm.rank(), len);
        comm.all_reduce(&mut summed, ReduceOp::Sum).unwrap();
        let mut averaged = input(comm.rank(), len);
        comm.all_reduce(&mut averaged, ReduceOp::Average).unwrap();
        let mut sent = if comm.rank() == world - 1 { input(99, len) } else { vec![0.0; len] };
        comm.broadcast(&mut sent, world - 1).unwrap();
        let mut empty: Vec<f32> = Vec::new();
        comm.all_reduce(&mut empty, ReduceOp::Sum).unwrap();
        (summed, averaged, sent)
    });
    let wanted_broadcast = input(99, len);
    for (rank, (summed, averaged, sent)) in results.into_iter().enumerate() {
        for i in 0..len {
            assert!((summed[i] - sum[i]).abs() <= 1e-4 * sum[i].abs().max(1.0), "rank {rank} sum at {i}");
            let mean = sum[i] / world as f32;
            assert!((averaged[i] - mean).abs() <= 1e-4 * mean.abs().max(1.0), "rank {rank} mean at {i}");
        }
        assert_eq!(sent, wanted_broadcast, "rank {rank}: the broadcast");
    }
}

#[test]
fn an_nccl_rank_whose_peer_stops_coming_is_aborted_within_the_timeout() {
    let Some(gpus) = gpus_or_skip("an_nccl_rank_whose_peer_stops_coming_is_aborted_within_the_timeout")
    else {
        return;
    };
    if gpus < 2 {
        // NCCL refuses two ranks of one communicator on one GPU.
        eprintln!(
            "SKIPPED an_nccl_rank_whose_peer_stops_coming_is_aborted_within_the_timeout: {gpus} GPU here, 2 needed"
        );
        return;
    }
    let rdv = LocalRendezvous::new();
    let timeout = Duration::from_secs(2);
    let (first, second, after) = std::thread::scope(|s| {
        let peer = {
            let rdv = rdv.clone();
            s.spawn(move || {
                let mut comm = NcclCommunicator::connect(1, 1, 2, &rdv, timeout).unwrap();
                let mut v = input(1, 4096);
                comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                // Then never comes to the second collective, and stays
                // alive (and in the communicator) past rank 0's timeout.
                std::thread::sleep(timeout * 3);
                comm
            })
        };
        let mut comm = NcclCommunicator::connect(0, 0, 2, &rdv, timeout).unwrap();
        let mut v = input(0, 4096);
        let first = comm.all_reduce(&mut v, ReduceOp::Sum);
        let started = Instant::now();
        let second = comm.all_reduce(&mut v, ReduceOp::Sum);
        let waited = started.elapsed();
        let after = comm.all_reduce(&mut v, ReduceOp::Sum);
        // The peer's half of an aborted communicator is left, not destroyed
        // (a destroy may wait for rank 0, which is gone).
        std::mem::forget(peer.join().unwrap());
        (first, (second, waited), after)
    });
    first.unwrap();
    let (second, waited) = second;
    assert!(matches!(second, Err(CommError::Timeout { rank: 0, .. })), "{second:?}");
    assert!(waited < timeout * 10, "aborted after {waited:?}, not near the {timeout:?} timeout");
    assert!(
        matches!(after, Err(CommError::Broken { rank: 0, .. })),
        "an aborted communicator says so: {after:?}"
    );
}
