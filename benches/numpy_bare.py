"""The NumPy example's training loop run bare, without the runtime: the same
data, initial weights, gradient and update (imported from
examples/numpy-mlp/train.py), the same global batch, one process. Prints the
steady-state seconds per step (after the first fifth of the steps), the
figure `benches/launch.rs` compares the launched example with.

    python benches/numpy_bare.py EPOCHS BATCH   (STEP_DELAY_MS as for the example)
"""

import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "numpy-mlp"))
import edl  # noqa: E402  (data and initial weights only: no job)
from train import SIZES, gradient, sgd  # noqa: E402


def main():
    epochs, batch = int(sys.argv[1]), int(sys.argv[2])
    delay = float(os.environ.get("STEP_DELAY_MS", "0")) / 1e3
    data = edl.builtin_data("mnist5k")
    X, Y = data["train_x"], data["train_y"]
    params = [a for wb in edl.mlp_init(SIZES, 1) for a in wb]
    velocity = [np.zeros_like(p) for p in params]
    grads = [np.zeros_like(p) for p in params]
    done = []
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(X))
        for start in range(0, len(X), batch):
            idx = order[start:start + batch]
            gradient(params, grads, X[idx], Y[idx], len(idx))
            if delay:
                time.sleep(delay)
            sgd(params, velocity, grads, 0.05, 0.9)
            done.append(time.perf_counter())
    k0 = len(done) // 5
    print((done[-1] - done[k0]) / (len(done) - 1 - k0))


if __name__ == "__main__":
    main()
