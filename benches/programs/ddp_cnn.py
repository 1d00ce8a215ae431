"""A CNN trained with DDP over gloo, either as an edl job's worker or as a
torchrun rank: the same model, data, optimiser, schedule, global batch and
steps, so that `benches/torch_ddp.py` can set the two side by side.

    edl-runtime launch --samples 1397 --epochs 40 --batch 64 ... \
        -- python ddp_cnn.py --data digits --epochs 40 --batch 64
    torchrun --nproc-per-node 2 ddp_cnn.py --data digits --epochs 40 --batch 64

Under edl (`EDL_COORDINATOR` set: `edl.Job.from_env()`) the program is
the package's PyTorch path: `edl.torch.ElasticState` (model, AdamW, cosine
schedule), `edl.torch.ElasticDDP`, `scaled` losses, `step.commit`. Under torchrun
(RANK, WORLD_SIZE from the launcher) it is plain DDP on
`dist.init_process_group("gloo")`, each epoch a seeded permutation cut into
global batches shared out over the ranks, and the usual torchrun snapshot:
rank 0 saves model, optimiser, schedule and epochs done at each epoch's end
(`--snapshot`), every rank loads it when it starts.

`--data digits`: the 8x8 digits and the CNN of the runtime's PyTorch test
program (conv 8, BatchNorm, linear: ~1 ms of compute a step). `--data mnist`: MNIST 5k
at 28x28 and a LeNet-sized CNN (two conv + BatchNorm + pool blocks).

What it prints, one JSON object a line after `ddp_cnn `:
- at the end, rank 0: `{"samples_per_sec", "step_ms_median", "steps",
  "world", ...}`, the steady state (committed samples over the time after
  the first fifth of the steps; the median time between two steps there);
- `--log-steps`: `{"step_done": unix time, "world", "resumed"}` after each
  step (the resize benchmark reads the gap a restart leaves);
- `--steps-after-resume N`: a torchrun run that resumed from a snapshot
  ends after N steps (the restart is what is measured, not the rest);
- `--step-cost` (edl): the steps without the training, each step's CPU on
  the main thread in edl's parts: `{"step_cost": true, "next step us",
  "indices us", "commit us", "all us", "steps"}`.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import edl


def dataset(name):
    data = edl.builtin_data("digits" if name == "digits" else "mnist5k")
    side = 8 if name == "digits" else 28
    x = torch.from_numpy(np.ascontiguousarray(data["train_x"])).reshape(-1, 1, side, side)
    y = torch.from_numpy(data["train_y"].astype(np.int64))
    return x, y


def build(name, total_steps):
    torch.manual_seed(0)
    if name == "digits":
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 64, 10),
        )
    else:
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 5),
            torch.nn.BatchNorm2d(16),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 5),
            torch.nn.BatchNorm2d(32),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 4 * 4, 10),
        )
    opt = torch.optim.AdamW(model.parameters(), lr=0.005, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)
    return model, opt, sched


class Timing:
    """Each finished step's time and global samples; the steady state is
    what follows the first fifth of the steps."""

    def __init__(self, log_steps, world, resumed):
        self.times, self.rows = [], []
        self.log_steps, self.world, self.resumed = log_steps, world, resumed

    def done(self, rows):
        self.times.append(time.perf_counter())
        self.rows.append(rows)
        if self.log_steps:
            say({"step_done": time.time(), "world": self.world, "resumed": self.resumed})

    def summary(self, **extra):
        k0 = len(self.times) // 5
        secs = self.times[-1] - self.times[k0] if len(self.times) > k0 + 1 else float("nan")
        samples = sum(self.rows[k0 + 1 :])
        gaps = sorted(b - a for a, b in zip(self.times[k0:], self.times[k0 + 1 :]))
        return {
            "samples_per_sec": samples / secs,
            "step_ms_median": gaps[len(gaps) // 2] * 1e3 if gaps else float("nan"),
            "steps": len(self.times),
            "steady_steps": len(self.times) - 1 - k0,
            **extra,
        }


def say(obj):
    # One write a line: ranks sharing an output do not split each other's.
    sys.stdout.write("ddp_cnn " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def run_edl(job, args):
    import edl.torch

    x, y = dataset(args.data)
    model, opt, sched = build(args.data, args.epochs * math.ceil(len(y) / args.batch))
    state = edl.torch.ElasticState(job, model, opt, sched)
    # EDL_BENCH_NOISE_SCALE=0: DDP's own reduction, without the hook that
    # measures the gradient noise scale (what it costs, side by side).
    noise = os.environ.get("EDL_BENCH_NOISE_SCALE", "1") != "0"
    # EDL_BENCH_EXAMPLE=0: no warm-up on an example batch (what it saves
    # a joining rank's first step, side by side).
    example = x[: args.batch // 2] if os.environ.get("EDL_BENCH_EXAMPLE", "1") != "0" else None
    ddp = edl.torch.ElasticDDP(model, backend="gloo", timeout=30.0, noise_scale=noise, example=example)
    if args.loader_workers:
        # A DataLoader's worker processes: forked from this one, they hold
        # its sockets as long as they live.
        data = torch.utils.data.TensorDataset(x, y)
        batches = edl.torch.ElasticLoader(data, state, num_workers=args.loader_workers)
    else:
        batches = ((s, (x[torch.from_numpy(s.indices)], y[torch.from_numpy(s.indices)])) for s in state.steps())
    timing, rank = None, 0
    for step, (xb, yb) in batches:
        if timing is None:
            timing = Timing(args.log_steps, step.world, False)
        idx = torch.from_numpy(step.indices)
        try:
            net = ddp.on(step)
            opt.zero_grad()
            if len(idx):
                mean = F.cross_entropy(net(xb), yb)
                loss = edl.torch.scaled(step, mean)
            else:
                mean = torch.zeros(())
                loss = edl.torch.zero_loss(net)
            loss.backward()
        except RuntimeError as e:
            step.abandon(f"a collective failed: {e}")
            continue
        opt.step()
        sched.step()
        step.commit(loss=mean.item())
        timing.world, rank = step.world, step.rank
        timing.done(step.global_rows)
    ddp.close()
    if timing is not None and rank == 0:
        say(timing.summary(world=timing.world, side="edl"))


def run_step_cost(job, args):
    """What edl itself costs a step on the rank's main thread, without the
    training: the same `ElasticState` (the model, AdamW, the cosine
    schedule), each step's indices read as `run_edl` reads them (three
    times) and its commit. CPU time of the thread (`time.thread_time`), so
    that waiting for the coordinator's windows does not count; the state's
    copies written at each window's start (its rollback point) fall in the
    step that opens it."""
    import edl.torch

    model, opt, sched = build(args.data, 1000)
    state = edl.torch.ElasticState(job, model, opt, sched)
    steps = state.steps()
    parts = {"next step": [], "indices": [], "commit": []}
    while True:
        t0 = time.thread_time()
        step = next(steps, None)
        if step is None:
            break
        t1 = time.thread_time()
        for _ in range(3):
            step.indices
        t2 = time.thread_time()
        step.commit(loss=0.0)
        t3 = time.thread_time()
        for part, took in zip(parts.values(), (t1 - t0, t2 - t1, t3 - t2)):
            part.append(took)
    k0 = len(parts["commit"]) // 5
    us = {f"{name} us": sum(v[k0:]) / max(len(v) - k0, 1) * 1e6 for name, v in parts.items()}
    say({"step_cost": True, **us, "all us": sum(us.values()), "steps": len(parts["commit"]) - k0})


def run_torchrun(args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = dataset(args.data)
    n = len(y)
    model, opt, sched = build(args.data, args.epochs * math.ceil(n / args.batch))
    first_epoch = 0
    if args.snapshot and os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot)
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        sched.load_state_dict(snap["scheduler"])
        first_epoch = snap["epochs_done"]
    resumed = first_epoch > 0
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    timing = Timing(args.log_steps, world, resumed)
    for epoch in range(first_epoch, args.epochs):
        order = torch.from_numpy(np.random.default_rng(epoch).permutation(n))
        for start in range(0, n, args.batch):
            batch = order[start : start + args.batch]
            idx = batch[rank::world]
            opt.zero_grad()
            if len(idx):
                mean = F.cross_entropy(ddp(x[idx]), y[idx])
                loss = mean * (len(idx) * world / len(batch))
            else:
                mean = torch.zeros(())
                loss = sum(p.sum() for p in ddp.parameters()) * 0.0
            loss.backward()
            opt.step()
            sched.step()
            mean.item()
            timing.done(len(batch))
            if resumed and args.steps_after_resume and len(timing.times) >= args.steps_after_resume:
                finish()
                return
        if rank == 0 and args.snapshot:
            tmp = args.snapshot + ".tmp"
            snap = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            snap.update(scheduler=sched.state_dict(), epochs_done=epoch + 1)
            torch.save(snap, tmp)
            os.replace(tmp, args.snapshot)
    if rank == 0:
        say(timing.summary(world=world, side="torchrun"))
    finish()


def finish():
    # Every rank leaves the group together: a rank tearing gloo down while
    # its peer still does can abort in torch's C++ teardown.
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", choices=["digits", "mnist"], default="digits")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--snapshot", default="", help="torchrun: the snapshot file (none: no snapshot)")
    p.add_argument("--log-steps", action="store_true")
    p.add_argument("--steps-after-resume", type=int, default=0)
    p.add_argument("--loader-workers", type=int, default=0, help="edl: read batches through a DataLoader with this many processes")
    p.add_argument("--step-cost", action="store_true", help="edl: the steps without the training, timed")
    args = p.parse_args()
    torch.set_num_threads(1)
    if "EDL_COORDINATOR" in os.environ and args.step_cost:
        run_step_cost(edl.Job.from_env(), args)
    elif "EDL_COORDINATOR" in os.environ:
        run_edl(edl.Job.from_env(), args)
    elif "RANK" in os.environ:
        run_torchrun(args)
    else:
        sys.exit("run under edl-runtime launch or torchrun")


if __name__ == "__main__":
    main()
