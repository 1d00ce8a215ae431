//! Data-parallel correctness: two workers on B/2 each, their gradients
//! summed by the TCP ring, take the same steps as one worker on B.

use edl_host_gpu::comm::{Communicator, LocalRendezvous, ReduceOp, RingOptions, TcpRing};
use edl_host_gpu::loss::SoftLabelLoss;
use edl_runtime::{
    data::{self, Dataset, Source},
    model::Mlp,
    train::Trainer,
};

#[test]
fn two_workers_on_half_batches_equal_one_worker_on_the_whole() {
    let (train, _) = Dataset::load(Source::Digits).unwrap().split(400, 2);
    let loss = SoftLabelLoss { temperature: 1.0, alpha: 0.0 };
    let (batch, steps) = (64usize, 12usize);
    let order = data::permutation(train.len(), 5, 0);

    let mut single = Trainer::new(Mlp::random(&[64, 32, 10], 9));
    for s in 0..steps {
        let (x, y) = train.gather(&order[data::shard(s * batch, batch, 0, 1, order.len())]);
        single.compute_gradient(&x, &y, None, &loss, batch).unwrap();
        single.apply(0.05, 0.9);
    }

    let rdv = LocalRendezvous::new();
    let results: Vec<Vec<f32>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (rdv, train, order) = (rdv.clone(), &train, &order);
                sc.spawn(move || {
                    let mut ring = TcpRing::connect(rank, 2, &rdv, RingOptions::default()).unwrap();
                    let mut t = Trainer::new(Mlp::random(&[64, 32, 10], 9));
                    for s in 0..steps {
                        let (x, y) =
                            train.gather(&order[data::shard(s * batch, batch, rank, 2, order.len())]);
                        t.compute_gradient(&x, &y, None, &loss, batch).unwrap();
                        ring.all_reduce(t.grad_mut(), ReduceOp::Sum).unwrap();
                        t.apply(0.05, 0.9);
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
        assert!(worst < 1e-4, "rank {rank}: parameters differ by up to {worst}");
    }
    assert_eq!(results[0], results[1], "the ranks hold identical parameters");
}
