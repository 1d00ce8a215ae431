#!/usr/bin/env python3
"""Parameter servers under load: the wide-and-deep CTR example
(examples/ctr/wide_deep_torch.py) on edl's servers against the same model in
one process with `nn.EmbeddingBag(sparse=True)` and `SparseAdam` (the peer,
benches/programs/ctr_peer.py), side by side in one run.

    cargo build --release -p edl-runtime -p edl-python
    ~/.cache/edl/venv-torch/bin/python benches/ps_ctr.py

Throughput: samples/s of the job's training (the report's
`samples_per_sec`) with 1, 2 and 4 servers and 1 and 2 workers, against the
peer's (its training steps alone); both tables on Adam (the servers' per-row
Adam against SparseAdam), the dense network on AdamW, batch 128, the same
synthetic Criteo-shaped rows. Quality: the test AUC before the job's last
step against the peer's after its last (one step of the epoch apart).
Recovery: three servers with two replicas and two workers, one server
killed with SIGKILL mid-job: the job's pause for it (the report's scale
event, from the last commit before the failure to the first after) and the
rows moved to new replicas.

All on this machine's cores: servers, workers and the coordinator share
them, so more servers or workers than cores measure the machine, not the
design.
"""

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from torch_ddp import RELEASE, ROOT, environment, run, site  # noqa: E402

PROGRAM = ROOT / "examples" / "ctr" / "wide_deep_torch.py"
PEER = ROOT / "benches" / "programs" / "ctr_peer.py"
AUC = re.compile(r"test AUC before the last step ([0-9.]+)")


def data_env(env, args):
    env = dict(env)
    env.update(
        CTR_ROWS=str(args.rows),
        CTR_VOCAB=str(args.vocab),
        CTR_SPARSE_OPT="adam",
        CTR_SPARSE_LR=str(args.lr),
    )
    return env


def launch(servers, workers, epochs, extra=()):
    return [
        str(RELEASE / "edl-runtime"), "launch", "--samples", None, "--ps-servers", str(servers),
        "--workers", str(workers), "--min-workers", str(workers), "--max-workers", str(workers),
        "--epochs", str(epochs), "--batch", "128", "--no-distill", "--report", "report.json", *extra,
        "--", sys.executable, str(PROGRAM),
    ]


def edl_run(servers, workers, args, env):
    with tempfile.TemporaryDirectory() as d:
        cmd = launch(servers, workers, args.epochs)
        cmd[cmd.index(None)] = str(args.rows)
        text, _ = run(cmd, env, d, f"edl with {servers} servers, {workers} workers")
        report = json.loads(pathlib.Path(d, "report.json").read_text())
        aucs = [float(a) for a in AUC.findall(text)]
        return report["samples_per_sec"], (aucs[-1] if aucs else float("nan"))


def peer_run(args, env):
    text, _ = run([sys.executable, str(PEER), str(args.epochs), "128"], env, ROOT, "the peer")
    line = next(l for l in text.splitlines() if l.startswith("ctr_peer "))
    r = json.loads(line[len("ctr_peer ") :])
    return r["samples_per_sec"], r["auc"]


def recovery(args, env):
    """Three servers, two replicas, two workers; server 2 killed mid-job."""
    with tempfile.TemporaryDirectory() as d:
        cmd = launch(3, 2, args.epochs, ("--ps-replicas", "2"))
        cmd[cmd.index(None)] = str(args.rows)
        p = subprocess.Popen(cmd, env=env, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, killed = [], False
        for line in p.stdout:
            out.append(line)
            if not killed and line.startswith("epoch     0 done"):
                server = next(
                    pid
                    for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                    if " ps --id 2 " in " " + pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
                os.kill(server, signal.SIGKILL)
                killed = True
        if p.wait() != 0:
            sys.exit("the recovery run failed:\n" + "".join(out[-40:]))
        report = json.loads(pathlib.Path(d, "report.json").read_text())
        text = "".join(out)
        moved = re.search(r"parameter servers 3 -> 2: (\d+) rows moved", text)
        events = [e for e in report["scale_events"] if e["step"] > 0]
        return (events[0]["pause_ms"] if events else float("nan")), int(moved.group(1)) if moved else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20000, help="training rows (a fifth more for the test)")
    ap.add_argument("--vocab", type=int, default=20000, help="values per categorical field")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.01, help="the tables' Adam learning rate")
    ap.add_argument("--servers", default="1,2,4")
    ap.add_argument("--workers", default="1,2")
    args = ap.parse_args()
    env = data_env(environment(site()), args)
    started = time.time()
    peer_rate, peer_auc = peer_run(args, env)
    print(f"{'setting':<26} {'samples/s':>10} {'x peer':>7} {'test AUC':>9} {'AUC - peer':>11}")
    print(f"{'one process (peer)':<26} {peer_rate:>10.0f} {1.0:>7.2f} {peer_auc:>9.4f} {0.0:>+11.4f}")
    for w in map(int, args.workers.split(",")):
        for s in map(int, args.servers.split(",")):
            rate, auc = edl_run(s, w, args, env)
            name = f"edl {s} server(s), {w} worker(s)"
            print(f"{name:<26} {rate:>10.0f} {rate / peer_rate:>7.2f} {auc:>9.4f} {auc - peer_auc:>+11.4f}", flush=True)
    pause, moved = recovery(args, env)
    print(f"server killed (3 servers, 2 replicas, 2 workers): pause {pause:.0f} ms, {moved} rows moved to new replicas")
    print(f"({time.time() - started:.0f} s; {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
