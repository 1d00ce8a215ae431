"""A plain torchrun DDP script (CPU, gloo): the built-in student's model
(784-128-10 MLP) on MNIST 5k. Nothing in it knows edl; it runs the same
under torchrun and under edl's launcher:

    torchrun --nproc-per-node 2 examples/pytorch/train_ddp.py
    edl-runtime launch --torchrun --min-workers 1 --max-workers 3 \
        --policy plugins/schedule.wasm --decide-secs 20 \
        -- python examples/pytorch/train_ddp.py

Like every script written for torchrun's elastic restarts, it keeps a
snapshot (the model, the optimiser and the epochs done) that rank 0 writes
after each epoch and that every rank loads when it starts, so a group
restarted at another size (a resize, or a restart after a failure) goes on
from the last epoch done.
"""

import argparse
import gzip
import os
import pathlib
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DATA = pathlib.Path(__file__).resolve().parents[2] / "runtime" / "data" / "mnist_5k.csv.gz"


def load(path):
    """MNIST 5k (784 pixel columns and the label, sorted by label), shuffled
    with a fixed seed: 4000 training rows, 1000 test rows."""
    with gzip.open(path, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.float32)
    rows = rows[np.random.default_rng(1).permutation(len(rows))]
    x, y = rows[:, :-1] / 255.0, rows[:, -1].astype(np.int64)
    return (torch.from_numpy(x[:4000]), torch.from_numpy(y[:4000])), (torch.from_numpy(x[4000:]), torch.from_numpy(y[4000:]))


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--snapshot", default="ddp_snapshot.pt")
    args = p.parse_args()

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch.manual_seed(1)
    torch.set_num_threads(1)
    (train_x, train_y), (test_x, test_y) = load(DATA)

    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    epochs_done = 0
    if os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot)
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        epochs_done = snap["epochs_done"]
    ddp = DDP(model)
    print(f"rank {rank}/{world} (restart {restart}): starting at epoch {epochs_done}", flush=True)

    sampler = DistributedSampler(TensorDataset(train_x, train_y), num_replicas=world, rank=rank, seed=1)
    loader = DataLoader(TensorDataset(train_x, train_y), batch_size=max(1, args.batch // world), sampler=sampler)
    for epoch in range(epochs_done, args.epochs):
        sampler.set_epoch(epoch)
        total, n = 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            total, n = total + loss.item() * len(y), n + len(y)
        if rank == 0:
            tmp = args.snapshot + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epochs_done": epoch + 1}, tmp)
            os.replace(tmp, args.snapshot)  # a restart never reads half a snapshot
            print(f"epoch {epoch + 1}/{args.epochs}: loss {total / max(n, 1):.4f} on rank 0, snapshot saved", flush=True)

    if rank == 0:
        with torch.no_grad():
            acc = (model(test_x).argmax(dim=1) == test_y).float().mean().item()
        print(f"test accuracy {acc * 100:.2f}%", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
