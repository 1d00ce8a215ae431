"""A CNN on MNIST 5k (two conv + BatchNorm + pool blocks, SGD with momentum)
trained with DDP under edl, its global batch and learning rate chosen as it
runs by the job's batch adapter:

    edl-runtime launch --samples 4000 --no-distill --batch 64 --lr 0.05 \
        --adapter plugins/goodput.wasm --batch-max 1024 \
        --policy plugins/schedule.wasm -- python examples/pytorch/train_cnn.py

The model, its BatchNorm statistics and the optimiser's momentum are the
job's state (`edl.torch.ElasticState`); `edl.torch.ElasticDDP` reduces the
gradients and, on every fourth step, tells the runtime each rank's gradient
norm and the reduced one, from which it measures the gradient noise scale
that `goodput` decides by. Each step takes the rate and momentum the
adapter gave it (`step.lr`, `step.momentum`); its batch is the step's
samples (`step.indices`), however many the adapter made them.

`benches/goodput_torch.py` runs it under several batch settings and reads
its checkpoints back (`build` and `data` below) to time each to a target
test accuracy; `STEP_DELAY_MS` adds a fixed time to every step, whatever
its batch (steps bound by communication or fixed costs, as on accelerators).
"""

import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import edl


def data():
    """MNIST 5k as images: (train x, train y), (test x, test y)."""
    d = edl.builtin_data("mnist5k")

    def images(x):
        return torch.from_numpy(np.ascontiguousarray(x)).reshape(-1, 1, 28, 28)

    ys = [torch.from_numpy(d[k].astype(np.int64)) for k in ("train_y", "test_y")]
    return (images(d["train_x"]), ys[0]), (images(d["test_x"]), ys[1])


def build(seed=0):
    """The CNN, the same on every rank (the seed's initial weights)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 5),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 5),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 4 * 4, 10),
    )


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train()
    return acc


def main():
    import edl.torch

    job = edl.Job.from_env()
    if job is None:
        return 0  # the job had no place for this worker
    torch.set_num_threads(1)
    (x, y), (test_x, test_y) = data()
    model = build(job.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = edl.torch.ElasticState(job, model, opt)
    # A batch to warm up on: a worker that joins later is as quick as the others at its first step.
    ddp = edl.torch.ElasticDDP(model, backend="gloo", example=x[:32])
    delay = float(os.environ.get("STEP_DELAY_MS", "0")) / 1e3
    trained = False
    for step in state.steps():
        for g in opt.param_groups:  # the batch adapter may change them at any resize
            g["lr"], g["momentum"] = step.lr, step.momentum
        idx = torch.from_numpy(step.indices)
        try:
            net = ddp.on(step)
            opt.zero_grad()
            if len(idx):
                mean = F.cross_entropy(net(x[idx]), y[idx])
                loss = edl.torch.scaled(step, mean)  # this rank's share of the global mean
            else:
                mean = torch.zeros(())
                loss = edl.torch.zero_loss(net)
            loss.backward()
        except RuntimeError as e:
            step.abandon(f"a collective failed: {e}")  # a peer is gone: the step is redone
            continue
        opt.step()
        if delay:
            time.sleep(delay)
        step.commit(loss=mean.item())
        trained = True
    ddp.close()
    said = f"test accuracy {accuracy(model, test_x, test_y) * 100:.2f}%" if trained else "no step taken part in"
    print(f"worker {job.worker_id}: {job.stopped}; {said}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
