#!/usr/bin/env python3
"""The default elastic job against a plain PyTorch CPU loop, in one go.

Both train the same 784-128-10 MLP (ReLU, cross-entropy on hard labels, SGD
with momentum 0.9, lr 0.05) on the same 4000 MNIST training samples with the
same global batch and one compute thread; the edl job is
`edl-runtime --no-distill --max-workers 1` with its shipped policy,
checkpoints and store. Throughput is steady-state samples per second: the
first epoch (PyTorch) or the first fifth of the committed steps (edl) is left
out as warm-up.

    cargo build --release -p edl-runtime
    python3 benches/torch_compare.py --batch 64 --epochs 30

Needs `torch` (CPU wheels are enough); nothing else outside the standard
library. Prints both figures and edl / PyTorch.
"""

import argparse
import csv
import gzip
import json
import pathlib
import subprocess
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def mnist_train():
    """The job's training rows: mnist5k less the 1000 test rows of its split."""
    rows = []
    with gzip.open(ROOT / "runtime" / "data" / "mnist_5k.csv.gz", "rt") as f:
        for r in csv.reader(f):
            if r:
                rows.append(([float(v) / 255.0 for v in r[:784]], int(r[784])))
    order = permutation(len(rows), 1, 2**64 - 1)
    return [rows[i] for i in order[1000:]]


MASK = 2**64 - 1


def splitmix(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def permutation(n, seed, epoch):
    """The runtime's seeded Fisher-Yates order (runtime/src/data.rs)."""
    p = list(range(n))
    state = splitmix(seed ^ splitmix(epoch))
    for i in range(n - 1, 0, -1):
        state = splitmix(state)
        j = state % (i + 1)
        p[i], p[j] = p[j], p[i]
    return p


def torch_samples_per_sec(train, batch, epochs):
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(1)
    x = torch.tensor([r[0] for r in train], dtype=torch.float32)
    y = torch.tensor([r[1] for r in train], dtype=torch.int64)
    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    samples, start = 0, None
    for epoch in range(epochs):
        if epoch == 1:
            samples, start = 0, time.perf_counter()
        order = torch.randperm(len(train))
        for i in range(0, len(train), batch):
            idx = order[i : i + batch]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            samples += len(idx)
    return samples / (time.perf_counter() - start)


def edl_samples_per_sec(batch, epochs):
    binary = ROOT / "target" / "release" / "edl-runtime"
    if not binary.exists():
        raise SystemExit("build the runtime first: cargo build --release -p edl-runtime")
    with tempfile.TemporaryDirectory() as d:
        report = pathlib.Path(d) / "report.json"
        subprocess.run(
            [str(binary), "--no-distill", "--max-workers", "1", "--batch", str(batch),
             "--epochs", str(epochs), "--job", f"torch-compare-b{batch}",
             "--checkpoint-dir", str(pathlib.Path(d) / "ckpt"), "--report", str(report)],
            cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
        )
        timeline = json.loads(report.read_text())["timeline"]
    # A record's cursor is the samples of its epoch consumed after the step.
    k0 = len(timeline) // 5
    samples = sum(
        s["cursor"] - p["cursor"] if s["cursor"] > p["cursor"] else s["cursor"]
        for p, s in zip(timeline[k0:], timeline[k0 + 1 :])
    )
    return samples / (timeline[-1]["secs"] - timeline[k0]["secs"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=30)
    args = ap.parse_args()
    train = mnist_train()
    t = torch_samples_per_sec(train, args.batch, args.epochs)
    e = edl_samples_per_sec(args.batch, args.epochs)
    print(f"batch {args.batch}: PyTorch {t:.0f} samples/s, edl {e:.0f} samples/s, edl / PyTorch {e / t:.2f}")


if __name__ == "__main__":
    main()
