#!/usr/bin/env python3
"""Time to a target test accuracy of a PyTorch CNN under edl for several
batch settings, side by side in one run: the PyTorch half of the goodput
benchmark (`cargo bench -p edl-benches --bench goodput` is the built-in
job's).

    cargo build --release -p edl-runtime -p edl-python
    ~/.cache/edl/venv-torch/bin/python benches/goodput_torch.py [--step-delay-ms MS] [--runs N]

The program is `examples/pytorch/train_cnn.py` (MNIST 5k, two conv +
BatchNorm blocks, SGD with momentum 0.9, DDP over gloo, the gradient noise
scale measured by `ElasticDDP`'s hook) under `edl-runtime launch`, the
schedule policy growing it 1 -> 2 -> 3 -> 4 workers and back (a decision
every 4 steps), a checkpoint every few steps. Settings: a fixed global
batch of 64 at rate 0.05 (and again on one worker throughout, no
resizes: the goodput policy may keep the job that small); a fixed 512 at
0.4 (the linear rule);
`dynamic-batch`; `goodput` (AdaScale's rate, then the linear rule, then
with the goodput policy choosing the workers instead of the schedule), up
to `--batch-max 1024`. Afterwards every checkpoint is put back into the
model (`edl.torch.load_checkpoint`) and measured on the 1000 held-out
images; a setting's time is the job's own clock (its report's timeline),
from its first committed step to its first checkpoint at the target or
above (every setting waits the same for its first worker's Python and
torch to start before that).

`--step-delay-ms` adds a fixed time to every step whatever its batch (the
program's `STEP_DELAY_MS`: it sleeps that long before committing): steps bound by communication or
fixed costs, as on accelerators; 0 is this CPU as it is.
"""

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import torch_ddp  # noqa: E402  (the site of the `edl` package, the environment, run())

ROOT = torch_ddp.ROOT
PROGRAM = ROOT / "examples" / "pytorch" / "train_cnn.py"
PLUGINS = ROOT / "plugins"


def settings():
    """(name, flags, steps between checkpoints, most workers)."""
    goodput = ["--batch", "64", "--lr", "0.05", "--batch-max", "1024", "--adapter", str(PLUGINS / "goodput.wasm")]
    return [
        ("fixed 64, lr 0.05", ["--batch", "64", "--lr", "0.05"], 8, 4),
        ("fixed 64, lr 0.05, one worker throughout", ["--batch", "64", "--lr", "0.05"], 8, 1),
        ("fixed 512, lr 0.4 (linear)", ["--batch", "512", "--lr", "0.4"], 1, 4),
        ("`dynamic-batch`", ["--batch", "64", "--lr", "0.05", "--adapter", str(PLUGINS / "dynamic-batch.wasm")], 4, 4),
        ("`goodput` (AdaScale's rate)", goodput, 2, 4),
        ("`goodput`, `lr-rule=linear`", [*goodput, "--adapter-config", "lr-rule=linear"], 2, 4),
        ("`goodput` with `goodput-policy`", [*goodput, "--policy", str(PLUGINS / "goodput-policy.wasm")], 2, 4),
    ]


def run(name, flags, every, most, args, env, scratch):
    """One job: (seconds to the target or None, best accuracy, its seconds,
    steps, last batch)."""
    import edl.torch
    import train_cnn

    with tempfile.TemporaryDirectory(dir=scratch) as d:
        d = pathlib.Path(d)
        policy = [] if "--policy" in flags else ["--policy", str(torch_ddp.SCHEDULE), "--policy-config", "every=8"]
        cmd = [
            str(torch_ddp.RELEASE / "edl-runtime"),
            "launch",
            "--samples",
            "4000",
            "--no-distill",
            "--epochs",
            str(args.epochs),
            "--max-workers",
            str(most),
            "--decide-every-steps",
            "4",
            *policy,
            "--keep-checkpoints",
            "100000",
            "--checkpoint-every-steps",
            str(every),
            "--report",
            "r.json",
            *flags,
            "--",
            sys.executable,
            str(PROGRAM),
        ]
        torch_ddp.run(cmd, {**env, "STEP_DELAY_MS": str(args.step_delay_ms)}, d, name)
        report = json.loads((d / "r.json").read_text())
        # Seconds of training: from the first step's commit (every setting
        # waits the same for its first worker's Python and torch to start).
        start = report["timeline"][0]["secs"]
        secs = {t["step"]: t["secs"] - start for t in report["timeline"]}
        (_, _), (test_x, test_y) = train_cnn.data()
        model = train_cnn.build()
        points = []
        for ckpt in sorted(d.glob("**/checkpoints/step-*")):
            if not ckpt.is_dir():
                continue
            info = edl.torch.load_checkpoint(ckpt, model)
            step = info["step"]
            if step in secs:
                points.append((secs[step], train_cnn.accuracy(model, test_x, test_y)))
        points.sort()
        reached = next((t for t, acc in points if acc >= args.target), None)
        best = max(points, key=lambda p: p[1], default=(0.0, 0.0))
        last = report["timeline"][-1]
        return reached, best[1], best[0], last["step"], last["batch"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-delay-ms", type=int, default=0)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--target", type=float, default=0.98)
    args = p.parse_args()
    site = torch_ddp.site()
    sys.path.insert(0, str(site))
    sys.path.insert(0, str(PROGRAM.parent))
    env = torch_ddp.environment(site)
    scratch = tempfile.mkdtemp(prefix="edl-goodput-")
    print(f"time to {args.target * 100:.0f}% test accuracy, {args.runs} runs each, --step-delay-ms {args.step_delay_ms}")
    print("| setting | seconds to the target (each run) | best accuracy (at s) | steps | last batch |")
    print("|---|---|---|---|---|")
    means = {}
    for name, flags, every, most in settings():
        runs = [run(name, flags, every, most, args, env, scratch) for _ in range(args.runs)]
        each = ", ".join("not reached" if r[0] is None else f"{r[0]:.2f}" for r in runs)
        best = max(runs, key=lambda r: r[1])
        print(f"| {name} | {each} | {best[1] * 100:.2f}% ({best[2]:.1f} s) | {runs[0][3]} | {runs[0][4]} |", flush=True)
        if all(r[0] is not None for r in runs):
            means[name] = statistics.mean(r[0] for r in runs)
    fixed = min((t for n, t in means.items() if n.startswith("fixed")), default=None)
    for name, t in means.items():
        if "goodput" in name and fixed is not None:
            print(f"{name} against the best fixed setting: {fixed / t:.2f}x sooner")


if __name__ == "__main__":
    main()
