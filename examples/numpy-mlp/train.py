"""The built-in student (784-128-10 MLP, MNIST 5k, same seed and schedule),
written in NumPy against the `edl` package. Run it as the job's workers:

    edl-runtime launch --samples 4000 --no-distill --policy plugins/autoscale.wasm \
        -- python examples/numpy-mlp/train.py

Every worker gets its own samples of each step (`step.indices`), sums its
gradient over the generation's ring and applies the same update; the runtime
keeps the registered arrays consistent across resizes, failures and restarts.
"""

import os
import sys
import time

import numpy as np

import edl

SIZES = [784, 128, 10]


def gradient(params, grads, x, y, global_rows):
    """Writes the gradient of the step's mean cross-entropy over these rows
    into `grads` (this rank's rows over the step's global rows, so the
    ring's sum is the global mean); returns these rows' mean loss."""
    w1, b1, w2, b2 = params
    for g in grads:
        g.fill(0.0)
    if not len(y):
        return 0.0
    h = np.maximum(x @ w1 + b1, 0.0)
    logits = h @ w2 + b2
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    d = p
    d[np.arange(len(y)), y] -= 1.0
    d /= global_rows
    grads[2][...] = h.T @ d
    grads[3][...] = d.sum(axis=0)
    dh = (d @ w2.T) * (h > 0)
    grads[0][...] = x.T @ dh
    grads[1][...] = dh.sum(axis=0)
    return loss


def sgd(params, velocity, grads, lr, momentum):
    """SGD with momentum, in place."""
    for p, v, g in zip(params, velocity, grads):
        v *= momentum
        v += g
        p -= lr * v


def main():
    data = edl.builtin_data("mnist5k")
    X, Y = data["train_x"], data["train_y"]
    job = edl.Job.from_env()
    if job is None:  # the job had no place for this worker
        return 0
    if job.samples != len(X):
        raise SystemExit(f"the job has {job.samples} samples, this data {len(X)}: launch with --samples {len(X)}")
    names, params = [], []
    for i, (w, b) in enumerate(edl.mlp_init(SIZES, job.seed)):
        names += [f"layers.{i}.weight", f"layers.{i}.bias"]
        params += [w, b]
    velocity = [np.zeros_like(p) for p in params]
    for name, p in zip(names, params):
        job.register(name, p)
    for name, v in zip(names, velocity):
        job.register(f"momentum.{name}", v)
    grads = [np.zeros_like(p) for p in params]
    # Extra time per step (to try the runtime at other step times), ms.
    delay = float(os.environ.get("STEP_DELAY_MS", "0")) / 1e3

    for step in job.steps():
        idx = step.indices
        loss = gradient(params, grads, X[idx], Y[idx], step.global_rows)
        if delay:
            time.sleep(delay)
        if not step.all_reduce(grads):
            continue  # a peer is gone: the runtime redoes the step
        sgd(params, velocity, grads, step.lr, step.momentum)
        step.commit(loss=loss)

    w1, b1, w2, b2 = params
    h = np.maximum(data["test_x"] @ w1 + b1, 0.0)
    acc = float(((h @ w2 + b2).argmax(axis=1) == data["test_y"]).mean())
    print(f"worker {job.worker_id}: {job.stopped}; test accuracy {acc * 100:.2f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
