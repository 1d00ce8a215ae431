#!/usr/bin/env python3
"""Parameter servers under load: the wide-and-deep CTR example
(examples/ctr/wide_deep_torch.py) on edl's servers against the same model in
one process with `nn.EmbeddingBag(sparse=True)` and `SparseAdam` (the peer,
benches/programs/ctr_peer.py), side by side in one run.

    cargo build --release -p edl-runtime -p edl-python
    ~/.cache/edl/venv-torch/bin/python benches/ps_ctr.py

Throughput: samples/s of the job's training steps with 1, 2 and 4 servers
and 1 and 2 workers (what each worker's program measures of its own
training steps, each from its start to the next one's, its commit included,
the steps that also evaluate left out; the slowest worker's), against the
peer's (its training steps alone, timed the same way); beside it the job's
end to end (the report's `samples_per_sec`: from the job's start, its
evaluations, first steps and final checkpoint included); each setting run
`--repeats` times (3), round after round, the medians shown; both tables on Adam (the servers' per-row
Adam against SparseAdam), the dense network on AdamW, batch 128, the same
synthetic Criteo-shaped rows. Quality: the test AUC before the job's last
step against the peer's after its last (one step of the epoch apart).
Memory: the most table memory one process holds, the peer's tables with
SparseAdam's two moments (its whole table, every id of the data numbered
ahead) against the largest server's rows with their Adam state (the
report's `parameter_servers`, at the job's end): what one host must have
for the tables, and what more servers divide.
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
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from torch_ddp import RELEASE, ROOT, environment, run, site  # noqa: E402

PROGRAM = ROOT / "examples" / "ctr" / "wide_deep_torch.py"
PEER = ROOT / "benches" / "programs" / "ctr_peer.py"
AUC = re.compile(r"test AUC before the last step ([0-9.]+)")
TRAINING = re.compile(r"training steps ([0-9.]+) samples/s")


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
        rates = [float(r) for r in TRAINING.findall(text)]
        if len(rates) < workers:
            sys.exit(f"{workers} worker(s), {len(rates)} measured their training steps:\n{text[-3000:]}")
        # The most any one server held: what a server's host must have.
        largest = max((s["bytes"] for s in report.get("parameter_servers", [])), default=0)
        return min(rates), report["samples_per_sec"], (aucs[-1] if aucs else float("nan")), largest


def peer_run(args, env):
    text, _ = run([sys.executable, str(PEER), str(args.epochs), "128"], env, ROOT, "the peer")
    line = next(l for l in text.splitlines() if l.startswith("ctr_peer "))
    r = json.loads(line[len("ctr_peer ") :])
    return r["samples_per_sec"], r["auc"], r["table_bytes"]


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
    ap.add_argument("--repeats", type=int, default=3, help="runs of each setting, the peer's among them; medians shown")
    args = ap.parse_args()
    env = data_env(environment(site()), args)
    started = time.time()
    settings = [(s, w) for w in map(int, args.workers.split(",")) for s in map(int, args.servers.split(","))]
    peer, runs = [], {k: [] for k in settings}
    # Round after round, each setting once, so that the machine's drift
    # falls on all of them alike.
    for _ in range(max(1, args.repeats)):
        peer.append(peer_run(args, env))
        for s, w in settings:
            runs[(s, w)].append(edl_run(s, w, args, env))
    median = statistics.median
    peer_rate, peer_auc, peer_table = median(r[0] for r in peer), peer[0][1], peer[0][2]
    spread = f"{min(r[0] for r in peer):.0f}-{max(r[0] for r in peer):.0f}"
    mib = 1 << 20
    print(
        f"{'setting':<28} {'samples/s':>10} {'x peer':>7} {'end to end':>11} {'test AUC':>9} {'AUC - peer':>11} "
        f"{'table MiB a process':>20}  runs"
    )
    print(
        f"{'one process (peer)':<28} {peer_rate:>10.0f} {1.0:>7.2f} {'':>11} {peer_auc:>9.4f} {0.0:>+11.4f} "
        f"{peer_table / mib:>20.1f}  {spread}"
    )
    for (s, w), rs in runs.items():
        rate, whole, auc, largest = median(r[0] for r in rs), median(r[1] for r in rs), rs[0][2], rs[0][3]
        name = f"edl {s} server(s), {w} worker(s)"
        spread = f"{min(r[0] for r in rs):.0f}-{max(r[0] for r in rs):.0f}"
        print(
            f"{name:<28} {rate:>10.0f} {rate / peer_rate:>7.2f} {whole:>11.0f} {auc:>9.4f} {auc - peer_auc:>+11.4f} "
            f"{largest / mib:>20.1f}  {spread}",
            flush=True,
        )
    pause, moved = recovery(args, env)
    print(f"server killed (3 servers, 2 replicas, 2 workers): pause {pause:.0f} ms, {moved} rows moved to new replicas")
    print(f"({time.time() - started:.0f} s; {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
