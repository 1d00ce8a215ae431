"""A stand-in for a torchrun training script, for the launcher's tests.

Each rank records the environment it was started with in
DIR/start-<group's MASTER_PORT>-<RANK>.json, then waits until DIR/done exists
and exits 0. A file DIR/fail-<RANK>-<TORCHELASTIC_RESTART_COUNT> makes that
rank fail with exit code 3 instead, writing a torchelastic error file.
"""

import json
import os
import pathlib
import sys
import time

KEYS = [
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS",
]

d = pathlib.Path(sys.argv[1])
env = {k: os.environ.get(k) for k in KEYS}
env["pid"] = os.getpid()
rank, restart = env["RANK"], env["TORCHELASTIC_RESTART_COUNT"]
tmp = d / f".start-{env['MASTER_PORT']}-{rank}.tmp"
tmp.write_text(json.dumps(env))
tmp.rename(d / f"start-{env['MASTER_PORT']}-{rank}.json")
print(f"rank {rank} of {env['WORLD_SIZE']} started (restart {restart})", flush=True)

if (d / f"fail-{rank}-{restart}").exists():
    message = f"rank {rank} cannot go on: injected failure at restart {restart}"
    print(message, file=sys.stderr, flush=True)
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({"message": {"message": f"RuntimeError: {message}", "extraInfo": {}}}, f)
    sys.exit(3)

while not (d / "done").exists():
    time.sleep(0.02)
print(f"rank {rank} done", flush=True)
