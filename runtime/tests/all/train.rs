//! Data-parallel correctness: two workers on B/2 each, their gradients
//! summed by the TCP ring, take the same steps as one worker on B; on the
//! CPU, and with the two workers on CUDA against one on the CPU.

use edl_host_gpu::comm::{Communicator, LocalRendezvous, ReduceOp, RingOptions, TcpRing};
use edl_host_gpu::loss::SoftLabelLoss;
use edl_host_gpu::{Device, testing::cuda_or_skip};
use edl_runtime::trainer::{
    data::{self, Dataset, Source},
    model::Mlp,
    train::Trainer,
};

#[test]
fn two_workers_on_half_batches_equal_one_worker_on_the_whole() {
    two_ranks_against_one(Device::Cpu, 1e-4);
}

#[test]
fn two_cuda_workers_on_half_batches_equal_one_cpu_worker_on_the_whole() {
    if !cuda_or_skip("two_cuda_workers_on_half_batches_equal_one_cpu_worker_on_the_whole") {
        return;
    }
    // cuBLAS sums in another order than the CPU GEMM: rounding differs.
    two_ranks_against_one(Device::Cuda(0), 5e-4);
}

#[test]
fn asking_for_cuda_without_a_driver_is_an_error_that_says_so() {
    if edl_host_gpu::device::driver_present() {
        eprintln!(
            "SKIPPED asking_for_cuda_without_a_driver_is_an_error_that_says_so: a CUDA driver is present"
        );
        return;
    }
    let err = Trainer::on(Device::Cuda(0), Mlp::random(&[4, 3], 1)).err().expect("no driver here");
    assert_eq!(err.to_string(), "cuda:0: no CUDA driver library (libcuda) found");
}

/// Two ranks on `device` against one CPU worker on the whole batch, with
/// distillation (teacher logits) in the loss.
fn two_ranks_against_one(device: Device, tolerance: f32) {
    let (train, _) = Dataset::load(Source::Digits).unwrap().split(400, 2);
    let loss = SoftLabelLoss { temperature: 2.0, alpha: 0.5 };
    let teacher = Mlp::random(&[64, 10], 4);
    let (batch, steps) = (64usize, 12usize);
    let order = data::permutation(train.len(), 5, 0);

    let mut single = Trainer::new(Mlp::random(&[64, 32, 10], 9));
    for s in 0..steps {
        let (x, y) = train.gather(&order[data::shard(s * batch, batch, 0, 1, order.len())]);
        single.compute_gradient(&x, &y, Some(&teacher.forward(&x, y.len())), &loss, batch).unwrap();
        single.apply(0.05, 0.9).unwrap();
    }

    let rdv = LocalRendezvous::new();
    let results: Vec<Vec<f32>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (rdv, train, order, teacher) = (rdv.clone(), &train, &order, &teacher);
                sc.spawn(move || {
                    let mut ring = TcpRing::connect(rank, 2, &rdv, RingOptions::default()).unwrap();
                    let mut t = Trainer::on(device, Mlp::random(&[64, 32, 10], 9)).unwrap();
                    for s in 0..steps {
                        let (x, y) =
                            train.gather(&order[data::shard(s * batch, batch, rank, 2, order.len())]);
                        let soft = teacher.forward(&x, y.len());
                        t.compute_gradient(&x, &y, Some(&soft), &loss, batch).unwrap();
                        ring.all_reduce(t.grad_mut(), ReduceOp::Sum).unwrap();
                        t.apply(0.05, 0.9).unwrap();
                    }
                    t.params_flat()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want = single.params_flat();
    for (rank, got) in results.iter().enumerate() {
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < tolerance, "{device} rank {rank}: parameters differ by up to {worst}");
    }
    assert_eq!(results[0], results[1], "the ranks hold identical parameters");
}
