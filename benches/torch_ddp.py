#!/usr/bin/env python3
"""PyTorch DDP under edl against plain torchrun, side by side in one run.

    cargo build --release -p edl-runtime -p edl-python
    ~/.cache/edl/venv-torch/bin/python benches/torch_ddp.py

Both sides run `benches/programs/ddp_cnn.py`: the same CNN (BatchNorm),
AdamW, cosine schedule, data, global batch and steps, on 2 workers, DDP over
gloo, one compute thread each.

Throughput: `edl-runtime launch` (fixed world of 2: `--min-workers 2
--max-workers 2`, the schedule policy, checkpoints at each epoch's end, the
report) against `torchrun --nproc-per-node 2` (rank 0 saving the usual
snapshot at each epoch's end). Steady-state samples/s as rank 0 measures it
(after the first fifth of the steps) and the median time between two steps
there; the two sides alternate, `--runs` times each; medians, edl /
torchrun and each pair's ratio. A run during which other work kept
`QUIET` cores or more of the machine busy is measured again (up to 4 times).

Resize cost, on the digits CNN: edl's scale events (2 -> 3 -> 2 workers,
the schedule policy) from the job's report: `join_ms`, from the decision to
the new worker being ready, while the others train, and `pause_ms`, from the
step boundary to the first committed step of the new generation, during
which nobody trains. Against torchrun's restart of the group at the new
size, as `edl-runtime launch --torchrun` does it: the time between the last
step the old group of 2 finished and the first step the new group of 3
finished (stop, start of 3 processes, torch import, rendezvous, snapshot
load, DDP set-up, one step); and a cold `torchrun --nproc-per-node 3` from
the snapshot: from the command's start to its first finished step.

A lost rank (`--lost-rank`): three workers of the digits CNN, each reading
through a DataLoader of two processes (which hold the rank's sockets), and
one rank's main process killed with SIGKILL (as the OOM killer does); the
time from the kill to the new generation's first commit, on the job's
output, and the report's pause in its phases; side by side with the
built-in trainer's worker killed the same way.

The `edl` package is put together here from the release build
(target/release/lib_edl.so and runtime/python/python/edl/*.py, into
target/edl-python/torch-site). Needs torch (CPU wheels are enough).
"""

import argparse
import json
import os
import pathlib
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "benches" / "programs" / "ddp_cnn.py"
RELEASE = ROOT / "target" / "release"
SCHEDULE = ROOT / "plugins" / "schedule.wasm"
# (training rows, epochs) per data set: 5 to 10 s of training on 2 cores.
DATA = {"digits": (1397, 60), "mnist": (4000, 6)}
LINE = re.compile(r"ddp_cnn (\{[^{}]*\})")
# A throughput run counts when other work kept fewer cores busy than this.
QUIET = 0.15


def site():
    """The `edl` package from the release build, on a directory of its own."""
    for built in (RELEASE / "edl-runtime", RELEASE / "lib_edl.so", SCHEDULE):
        if not built.exists():
            sys.exit(f"{built} missing: cargo build --release -p edl-runtime -p edl-python (and the plugins)")
    pkg = ROOT / "target" / "edl-python" / "torch-site" / "edl"
    pkg.mkdir(parents=True, exist_ok=True)
    for py in (ROOT / "runtime" / "python" / "python" / "edl").glob("*.py"):
        shutil.copy(py, pkg / py.name)
    shutil.copy(RELEASE / "lib_edl.so", pkg / "_edl.abi3.so")
    return pkg.parent


def environment(site_dir):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(site_dir)
    env["OMP_NUM_THREADS"] = "1"
    return env


def records(text):
    return [json.loads(m.group(1)) for m in LINE.finditer(text)]


def busy_secs():
    """CPU seconds the machine has spent on anything but idling."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_secs():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd, env, cwd, what):
    """The command's output, and the cores other work on the machine kept
    busy meanwhile (its CPU time less the command's, over its wall time)."""
    busy, ours, start = busy_secs(), children_secs(), time.perf_counter()
    # A run that never ends (a resize that does not go as planned) is ended
    # with its launcher; the launcher's ranks die with it.
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"{what} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    others = (busy_secs() - busy) - (children_secs() - ours)
    return p.stdout + p.stderr, max(others, 0.0) / (time.perf_counter() - start)


def torchrun(nproc, program_args):
    # `python -m torch.distributed.run` is torchrun.
    run_module = [sys.executable, "-m", "torch.distributed.run"]
    return [*run_module, "--nproc-per-node", str(nproc), str(PROGRAM), *program_args]


def launch(flags, program_args):
    return [str(RELEASE / "edl-runtime"), "launch", *flags, "--", sys.executable, str(PROGRAM), *program_args]


def throughput_torchrun(data, env, scratch):
    _, epochs = DATA[data]
    with tempfile.TemporaryDirectory(dir=scratch) as d:
        args = ["--data", data, "--epochs", str(epochs), "--snapshot", str(pathlib.Path(d) / "snapshot.pt")]
        out, others = run(torchrun(2, args), env, d, "torchrun")
    (r,) = [r for r in records(out) if "samples_per_sec" in r]
    return r, others


def throughput_edl(data, env, scratch):
    rows, epochs = DATA[data]
    with tempfile.TemporaryDirectory(dir=scratch) as d:
        flags = ["--samples", str(rows), "--epochs", str(epochs), "--batch", "64", "--no-distill"]
        flags += ["--min-workers", "2", "--max-workers", "2", "--workers", "2", "--policy", str(SCHEDULE)]
        flags += ["--job", f"torch-ddp-{data}", "--report", str(pathlib.Path(d) / "report.json")]
        program = ["--data", data, "--epochs", str(epochs)]
        out, others = run(launch(flags, program), env, d, "edl-runtime launch")
    (r,) = [r for r in records(out) if "samples_per_sec" in r]
    return r, others


def process_tree(root):
    """`root` and every process below it."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree = [root]
    for pid in tree:
        tree += children.get(pid, [])
    return tree


def thread_times(root):
    """{(pid, process name, thread id, thread name): (ns on a CPU, times run)} under `root`."""
    out = {}
    for pid in process_tree(root):
        try:
            name = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            # A thread that ended meanwhile is left out; its process's others are not.
            try:
                task = pathlib.Path(f"/proc/{pid}/task/{tid}")
                ns, _, runs = (task / "schedstat").read_text().split()
                out[(pid, name, int(tid), (task / "comm").read_text().strip())] = (int(ns), int(runs))
            except OSError:
                continue
    return out


def thread_costs(env, scratch, warm_up_steps=2000, seconds=5.0):
    """A fixed world of 2 on digits, long enough to be steady: after
    `warm_up_steps` committed steps, each thread's CPU (ms a second) and how
    often it was put on a CPU (its wake-ups), over `seconds`, grouped by
    process and thread name; edl's own threads are what elasticity costs
    the ranks' cores."""
    with tempfile.TemporaryDirectory(dir=scratch) as d:
        flags = ["--samples", "1397", "--epochs", "1000", "--batch", "64", "--no-distill"]
        flags += ["--min-workers", "2", "--max-workers", "2", "--workers", "2", "--policy", str(SCHEDULE)]
        flags += ["--job", "torch-ddp-threads"]
        cmd = launch(flags, ["--data", "digits", "--epochs", "1000"])
        p = subprocess.Popen(cmd, env=env, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # A job that never gets there is ended (its output then ends too).
        deadline = threading.Timer(600, p.kill)
        deadline.start()
        try:
            for line in p.stdout:
                m = re.search(r"step (\d+) \|", line)
                if m and int(m.group(1)) >= warm_up_steps:
                    break
            else:
                sys.exit(f"the job ended (or was stopped after 600 s) before step {warm_up_steps}")
            # The output is read on, so that the job never waits on a full pipe.
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            before, start = thread_times(p.pid), time.perf_counter()
            time.sleep(seconds)
            after, took = thread_times(p.pid), time.perf_counter() - start
        finally:
            deadline.cancel()
            p.kill()
            p.wait()
    rows = {}
    for key, (ns, runs) in after.items():
        if key in before:
            pid, name, _, thread = key
            row = rows.setdefault((pid, name, thread), [0, 0])
            row[0] += ns - before[key][0]
            row[1] += runs - before[key][1]
    print(f"Each thread of a steady edl + DDP job (digits, 2 ranks), over {seconds:.0f} s:")
    print("| process | thread | CPU, ms a second | put on a CPU, times a second |")
    print("|---|---|---|---|")
    for (pid, name, thread), (ns, runs) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        if ns > 0:
            print(f"| {name} ({pid}) | {thread} | {ns / took / 1e6:.1f} | {runs / took:.0f} |")


def resize_edl(env, scratch, spares=0, every=250, epochs=60):
    """The report's scale events of a 2 -> 3 -> 2 job: [(from, to, join_ms, pause_ms)]."""
    with tempfile.TemporaryDirectory(dir=scratch) as d:
        report = pathlib.Path(d) / "report.json"
        flags = ["--samples", "1397", "--epochs", str(epochs), "--batch", "64", "--no-distill"]
        flags += ["--min-workers", "2", "--max-workers", "3", "--workers", "2"]
        flags += ["--warm-spares", str(spares)]
        flags += ["--policy", str(SCHEDULE), "--policy-config", f"every={every}", "--decide-every-steps", "10"]
        flags += ["--job", "torch-ddp-resize", "--report", str(report)]
        program = ["--data", "digits", "--epochs", str(epochs)]
        run(launch(flags, program), env, d, "edl-runtime launch (resizes)")
        events = json.loads(report.read_text())["scale_events"]
    return [(e["from"], e["to"], e["join_ms"], e["pause_ms"]) for e in events if e["from"] > 0]


def resize_torchrun(env, scratch):
    """`launch --torchrun` resizing a group of 2 to 3: seconds from the old
    group's last finished step to the new group's first; and a cold
    `torchrun --nproc-per-node 3` from the snapshot left: seconds from its
    start to its first finished step."""
    with tempfile.TemporaryDirectory(dir=scratch) as d:
        snapshot = str(pathlib.Path(d) / "snapshot.pt")
        args = ["--data", "digits", "--epochs", "100000", "--snapshot", snapshot, "--log-steps"]
        args += ["--steps-after-resume", "20"]
        # The schedule policy holds at its first decision and scales out at
        # its second: the group of 2 trains for 2 x --decide-secs; the group
        # of 3 ends after its 20 steps, well before its first decision.
        flags = ["--torchrun", "--min-workers", "2", "--max-workers", "3", "--workers", "2"]
        flags += ["--policy", str(SCHEDULE), "--policy-config", "every=1", "--decide-secs", "20"]
        flags += ["--job", "torch-ddp-restart", "--report", str(pathlib.Path(d) / "report.json")]
        out = records(run(launch(flags, args), env, d, "edl-runtime launch --torchrun")[0])
        old = max(r["step_done"] for r in out if r.get("world") == 2)
        new = min(r["step_done"] for r in out if r.get("world") == 3)
        start = time.time()
        cold = records(run(torchrun(3, args), env, d, "torchrun --nproc-per-node 3")[0])
        first = min(r["step_done"] for r in cold if r.get("resumed"))
    return new - old, first - start


def quiet(measure):
    """`measure()`'s result, measured again (up to 4 times in all) while
    other work on the machine kept more than QUIET cores busy."""
    for _ in range(4):
        result, others = measure()
        if others < QUIET:
            break
        print(f"  (other work kept {others:.2f} cores busy: measured again)", file=sys.stderr, flush=True)
    return result, others


def median_ms(values):
    return f"{statistics.median(values):.0f} ms" if values else "-"


def side_by_side(header, datas, runs, first, second):
    """`first(data)` and `second(data)` alternating, `runs` times each, per
    data set: a table under `header` (its columns' names), a row each
    (medians, their ratio, each pair's ratio, the median steps), then the
    cores other work kept busy meanwhile."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    others = []
    for data in datas:
        a, b = [], []
        for _ in range(runs):
            for side, out in ((first, a), (second, b)):
                r, busy = quiet(lambda: side(data))
                out.append(r)
                others.append(busy)
        am = statistics.median(r["samples_per_sec"] for r in a)
        bm = statistics.median(r["samples_per_sec"] for r in b)
        each = ", ".join(f"{y['samples_per_sec'] / x['samples_per_sec']:.3f}" for x, y in zip(a, b))
        steps = [statistics.median(r["step_ms_median"] for r in side) for side in (a, b)]
        print(
            f"| {data} | {am:.0f} samples/s | {bm:.0f} samples/s | {bm / am:.3f} | {each} "
            f"| {steps[0]:.2f} ms / {steps[1]:.2f} ms |",
            flush=True,
        )
    print(f"other work on the machine during these runs: at most {max(others):.2f} cores")


def noise_hook_cost(args, env, scratch):
    """edl + DDP with ElasticDDP's communication hook (the gradient noise
    scale measured) against DDP's own reduction, alternating, `--runs` each."""
    off = dict(env, EDL_BENCH_NOISE_SCALE="0")
    side_by_side(
        ["data", "without the hook", "with it", "with / without", "each pair", "median step, without / with"],
        args.data.split(","),
        args.runs,
        lambda data: throughput_edl(data, off, scratch),
        lambda data: throughput_edl(data, env, scratch),
    )


def step_cost(args, env, scratch):
    """edl's own CPU a step on a rank's main thread (`ddp_cnn.py
    --step-cost`: the steps of a one-worker digits job without the
    training), `--runs` jobs; medians of each part."""
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(dir=scratch) as d:
            # Batches of 8: 175 steps an epoch, so that an epoch's end (its
            # checkpoint, a window cut there) weighs as little as it does in a
            # longer data set; windows are cut every 8 steps by the decisions.
            flags = ["--samples", "1397", "--epochs", "40", "--batch", "8", "--no-distill"]
            flags += ["--workers", "1", "--min-workers", "1", "--max-workers", "1", "--policy", str(SCHEDULE)]
            flags += ["--decide-every-steps", "8", "--job", "torch-step-cost"]
            flags += ["--report", str(pathlib.Path(d) / "report.json")]
            out, _ = run(launch(flags, ["--data", "digits", "--step-cost"]), env, d, "edl-runtime launch")
        (r,) = [r for r in records(out) if r.get("step_cost")]
        runs.append(r)
    parts = [k for k in runs[0] if k.endswith(" us")]
    print(f"| edl's CPU a step, main thread (medians of {len(runs)} jobs) | " + " | ".join(parts) + " |")
    print("|---|" + "---|" * len(parts))
    cells = [f"{statistics.median(r[p] for r in runs):.1f}" for p in parts]
    print(f"| {runs[0]['steps']} steps a job | " + " | ".join(cells) + " |")
    print("each job, all: " + ", ".join(f"{r['all us']:.1f}" for r in runs) + " us")


def worker_pid(launcher, worker):
    """The pid of `worker`'s main process, a child of `launcher`, or None."""
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            env = (p / "environ").read_bytes().split(b"\0")
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        ours = f"EDL_WORKER_ID={worker}".encode() in env
        builtin = b"worker" in argv and argv[argv.index(b"--id") + 1 :][:1] == [str(worker).encode()]
        if ours or builtin:
            return int(p.name)
    return None


def warm_spares_cost(args, env, scratch):
    """Growing 2 -> 3 (the schedule's 2 -> 3 -> 2 job) with one warm spare
    against without, and with one warm spare whose program gives
    `ElasticDDP` no example to warm up on; and a lost rank's place taken
    by a spare."""
    settings = {
        "no spare": (0, "1"),
        "one warm spare": (1, "1"),
        "one warm spare, no example": (1, "0"),
    }
    rows = {label: ([], []) for label in settings}
    shrinks = []
    for _ in range(args.runs):
        for label, (spares, example) in settings.items():
            # Changes 1000 steps apart (a few seconds): time for a spare
            # started behind a taken one to be ready for the next growth.
            run_env = dict(env, EDL_BENCH_EXAMPLE=example)
            for src, dst, join, pause in resize_edl(run_env, scratch, spares, every=1000, epochs=120):
                if dst > src:
                    rows[label][0].append(join)
                    rows[label][1].append(pause)
                elif example == "1":
                    shrinks.append(pause)
    print("| growing 2 -> 3 (medians) | decision to the new worker ready | pause | decision to first commit |")
    print("|---|---|---|---|")
    for label, (joins, pauses) in rows.items():
        total = [j + p for j, p in zip(joins, pauses) if j is not None]
        print(f"| {label} ({len(pauses)} resizes) | {median_ms([j for j in joins if j is not None])} "
              f"| {median_ms(pauses)} | {median_ms(total)} |")
    for label, (joins, pauses) in rows.items():
        each = ", ".join(f"({j or 0:.0f}, {p:.0f})" for j, p in zip(joins, pauses))
        print(f"each, {label}: (join, pause) {each}")
    print(f"shrinking 3 -> 2 ({len(shrinks)} resizes): pause {median_ms(shrinks)}, each {[round(p) for p in shrinks]}")
    flags = ["--workers", "3", "--min-workers", "2", "--max-workers", "4", "--warm-spares", "1", "--no-distill"]
    flags += ["--policy", str(SCHEDULE), "--policy-config", "every=1000000", "--report", "report.json"]
    flags += ["--samples", "1397", "--epochs", "30", "--batch", "64"]
    kills = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(dir=scratch) as d:
            cmd = launch(flags, ["--data", "digits", "--epochs", "30", "--loader-workers", "2"])
            kills.append(lost_rank(cmd, env, d, wait_for="warm spare 4 ready"))
    assert all(e["to"] == 3 for _, e in kills), [e for _, e in kills]
    print()
    print(f"a rank killed, its place taken by the spare (3 -> 3 workers, {len(kills)} kills): "
          f"kill to next commit {median_ms([s * 1e3 for s, _ in kills])}, "
          f"pause {median_ms([e['pause_ms'] for _, e in kills])}")


def lost_rank(cmd, env, cwd, victim=2, wait_for="-> 3 workers"):
    """Runs a job of 3 workers, SIGKILLs worker `victim`'s main process
    once the job has trained 2 s at 3, and returns (seconds from the kill
    to the new generation's first commit as the job's output says it, the
    report's event for the loss)."""
    import queue
    import threading

    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = queue.Queue()

    def read():
        for line in p.stdout:
            lines.put((time.monotonic(), line.rstrip("\n")))
        lines.put((time.monotonic(), None))

    threading.Thread(target=read, daemon=True).start()
    grown_at = killed_at = seen_at = None
    out = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                at, line = lines.get(timeout=0.005)
            except queue.Empty:
                at, line = None, ""
            if line is None:
                break
            if at is not None:
                out.append(line)
                if grown_at is None and wait_for in line:
                    grown_at = at
                if killed_at and seen_at is None and line.startswith("scale") and f"worker {victim} lost" in line:
                    seen_at = at
            if grown_at and killed_at is None and time.monotonic() - grown_at > 2.0:
                pid = worker_pid(p.pid, victim)
                if pid is None:
                    sys.exit(f"worker {victim} not found under {p.pid}")
                killed_at = time.monotonic()
                os.kill(pid, 9)
    finally:
        if p.poll() is None and seen_at is None:
            p.kill()
        p.wait(timeout=600)
    if p.returncode != 0 or seen_at is None:
        sys.exit(f"{cmd[:3]} ended {p.returncode}, loss seen: {seen_at is not None}:\n" + "\n".join(out[-40:]))
    report = json.loads((pathlib.Path(cwd) / "report.json").read_text())
    (event,) = [e for e in report["scale_events"] if f"worker {victim} lost" in e["reason"]]
    return seen_at - killed_at, event


def lost_rank_cost(args, env, scratch):
    """A DDP rank's main process killed (its two loader processes alive)
    against the built-in trainer's worker killed, alternating, `--runs` each."""
    flags = ["--workers", "3", "--min-workers", "2", "--max-workers", "3", "--no-distill"]
    flags += ["--policy", str(SCHEDULE), "--policy-config", "every=1000000", "--report", "report.json"]
    sides = {
        "PyTorch DDP (gloo), 2 loader processes a rank": lambda: launch(
            [*flags, "--samples", "1397", "--epochs", "30", "--batch", "64"],
            ["--data", "digits", "--epochs", "30", "--loader-workers", "2"],
        ),
        "built-in trainer": lambda: [
            str(RELEASE / "edl-runtime"), *flags, "--epochs", "40", "--step-delay-ms", "2",
        ],
    }
    results = {name: [] for name in sides}
    for _ in range(args.runs):
        for name, cmd in sides.items():
            with tempfile.TemporaryDirectory(dir=scratch) as d:
                results[name].append(lost_rank(cmd(), env, d))
    print("| a worker killed (SIGKILL), medians | kill to next commit | pause (report) | seen after | survivors out | formed | first step |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        rec = lambda k: median_ms([e["recovery"][k] for _, e in runs])
        print(
            f"| {name} ({len(runs)} runs) | {median_ms([s * 1e3 for s, _ in runs])} | "
            f"{median_ms([e['pause_ms'] for _, e in runs])} | {rec('detect_ms')} | {rec('abort_ms')} | "
            f"{rec('form_ms')} | {rec('first_step_ms')} |"
        )
    for name, runs in results.items():
        print(f"each, {name}: kill to commit " + ", ".join(f"{s * 1e3:.0f}" for s, _ in runs) + " ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="digits,mnist", help="digits, mnist or both (comma separated)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-resize", action="store_true", help="throughput only")
    ap.add_argument(
        "--noise-hook",
        action="store_true",
        help="instead: edl + DDP with ElasticDDP's noise-scale hook against without it, side by side",
    )
    ap.add_argument(
        "--lost-rank",
        action="store_true",
        help="instead: a DDP rank's main process killed, its loader processes alive, to the next commit; "
        "and the built-in trainer's worker killed",
    )
    ap.add_argument(
        "--warm-spares",
        action="store_true",
        help="instead: growing 2 -> 3 with a warm spare against without, and a lost rank's place taken by one",
    )
    ap.add_argument(
        "--threads",
        action="store_true",
        help="instead: each thread's CPU and wake-ups a second in a steady edl + DDP job (digits)",
    )
    ap.add_argument(
        "--step-cost",
        action="store_true",
        help="instead: edl's own CPU a step on a rank's main thread, the steps run without the training",
    )
    args = ap.parse_args()
    env = environment(site())
    scratch = ROOT / "target" / "edl-python"
    if args.noise_hook:
        return noise_hook_cost(args, env, scratch)
    if args.lost_rank:
        return lost_rank_cost(args, env, scratch)
    if args.warm_spares:
        return warm_spares_cost(args, env, scratch)
    if args.threads:
        return thread_costs(env, scratch)
    if args.step_cost:
        return step_cost(args, env, scratch)

    side_by_side(
        ["data", "torchrun + DDP", "edl + DDP", "edl / torchrun", "each run's edl / torchrun",
         "median step, torchrun / edl"],
        args.data.split(","),
        args.runs,
        lambda data: throughput_torchrun(data, env, scratch),
        lambda data: throughput_edl(data, env, scratch),
    )

    if args.no_resize:
        return
    outs, ins, gaps, colds = [], [], [], []
    for _ in range(args.runs):
        for src, dst, join, pause in resize_edl(env, scratch):
            (outs if dst > src else ins).append((join, pause))
        gap, cold = resize_torchrun(env, scratch)
        gaps.append(gap * 1e3)
        colds.append(cold * 1e3)
    joins = [j for j, _ in outs if j is not None]
    print()
    print("| resize (medians) | decision to new worker ready, others training | training stopped |")
    print("|---|---|---|")
    print(f"| edl 2 -> 3 ({len(outs)} resizes) | {median_ms(joins)} | {median_ms([p for _, p in outs])} |")
    print(f"| edl 3 -> 2 ({len(ins)} resizes) | - | {median_ms([p for _, p in ins])} |")
    print(f"| `launch --torchrun` 2 -> 3 ({len(gaps)} restarts) | - | {median_ms(gaps)} |")
    label = "`torchrun --nproc-per-node 3` from the snapshot"
    print(f"| {label} ({len(colds)} starts) | - | {median_ms(colds)} |")
    print()
    each = ", ".join(f"({j:.0f}, {p:.0f})" for j, p in outs if j is not None)
    print("each: edl 2 -> 3 (join, pause) " + each)
    print("      edl 3 -> 2 pause " + ", ".join(f"{p:.0f}" for _, p in ins))
    print(
        "      torchrun restart " + ", ".join(f"{g:.0f}" for g in gaps)
        + "; cold start " + ", ".join(f"{c:.0f}" for c in colds),
        flush=True,
    )


if __name__ == "__main__":
    main()
