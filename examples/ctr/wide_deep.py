"""A wide-and-deep click-through model on Criteo-shaped data, its
embedding tables on the job's parameter servers and its dense layers
all-reduced across the workers (Fleet's hybrid of PS and collective),
in NumPy against the `edl` package:

    edl-runtime launch --samples 20000 --ps-servers 2 --no-distill \\
        --policy plugins/autoscale.wasm -- python examples/ctr/wide_deep.py

- wide: a table of one weight per id (`wide`), summed over the 26 fields;
- deep: a table of 8-float embeddings per id (`deep`), the 26 embeddings and
  the 13 dense features through a 221-32-1 ReLU network.

Each step pulls the rows of its ids (made on first touch on the server),
computes the loss and its gradients, pushes the rows' gradients (summed
over the ranks and applied on the servers by Adagrad) and all-reduces the
dense ones. Every epoch's first step, and the job's last, measures the test
AUC, reported as the step's `auc` metric.

Data: synthetic (`criteo.synthetic`, CTR_ROWS rows + a fifth for the test,
CTR_VOCAB values per field), or a real Criteo TSV file with CTR_DATA=path
(its first CTR_ROWS rows; the last fifth of them for the test).
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import criteo  # noqa: E402

import edl  # noqa: E402

EMBED = 8
HIDDEN = 32


def data():
    rows = int(os.environ.get("CTR_ROWS", "20000"))
    test = rows // 5
    if "CTR_DATA" in os.environ:
        dense, ids, labels = criteo.read_tsv(os.environ["CTR_DATA"], rows + test)
    else:
        vocab = int(os.environ.get("CTR_VOCAB", "100000"))
        dense, ids, labels = criteo.synthetic(rows + test, seed=0, vocab=vocab)
    split = len(labels) - test
    return (dense[:split], ids[:split], labels[:split]), (dense[split:], ids[split:], labels[split:])


def forward(step, params, dense, ids):
    """The logits of rows `dense`, `ids`, and what backward needs; None when
    the step was abandoned (a parameter server gone: it is redone)."""
    w1, b1, w2, b2 = params
    n = len(ids)
    flat = ids.reshape(-1)
    wide, emb = step.pull("wide", flat), step.pull("deep", flat)
    if wide is None or emb is None:
        return None
    wide = wide.reshape(n, criteo.FIELDS)
    emb = emb.reshape(n, criteo.FIELDS * EMBED)
    x = np.concatenate([emb, dense], axis=1)
    h = np.maximum(x @ w1 + b1, 0.0)
    logit = wide.sum(axis=1) + (h @ w2)[:, 0] + b2[0]
    return logit, (x, h)


def train_step(step, params, grads, dense, ids, labels):
    """Pushes the sparse gradients, fills `grads`; returns the rows' mean
    loss, or None when the step was abandoned."""
    w1, b1, w2, b2 = params
    for g in grads:
        g.fill(0.0)
    n = len(labels)
    if n == 0:
        return 0.0
    out = forward(step, params, dense, ids)
    if out is None:
        return None
    logit, (x, h) = out
    p = 1.0 / (1.0 + np.exp(-logit))
    loss = float(np.mean(np.logaddexp(0.0, logit) - labels * logit))
    # This rank's rows over the step's global rows: the ranks' sum is the mean.
    d = ((p - labels) / step.global_rows).astype(np.float32)
    grads[3][0] = d.sum()
    grads[2][...] = h.T @ d[:, None]
    dh = (d[:, None] @ w2.T) * (h > 0)
    grads[0][...] = x.T @ dh
    grads[1][...] = dh.sum(axis=0)
    dx = dh @ w1.T
    flat = ids.reshape(-1)
    if not step.push("wide", flat, np.repeat(d, criteo.FIELDS)[:, None]):
        return None
    if not step.push("deep", flat, dx[:, : criteo.FIELDS * EMBED].reshape(-1, EMBED)):
        return None
    return loss


def main():
    (dense, ids, labels), (t_dense, t_ids, t_labels) = data()
    job = edl.Job.from_env()
    if job is None:
        return 0
    if job.samples != len(labels):
        raise SystemExit(f"the job has {job.samples} samples, this data {len(labels)}: launch with --samples {len(labels)}")
    job.table("wide", 1, optimizer="adagrad", lr=0.05, init="zeros")
    job.table("deep", EMBED, optimizer="adagrad", lr=0.05, init="uniform", scale=0.05, seed=job.seed)
    rng = np.random.default_rng(job.seed)
    inputs = criteo.FIELDS * EMBED + criteo.DENSE
    params = [
        (rng.standard_normal((inputs, HIDDEN)) * np.sqrt(2.0 / inputs)).astype(np.float32),
        np.zeros(HIDDEN, np.float32),
        (rng.standard_normal((HIDDEN, 1)) * np.sqrt(1.0 / HIDDEN)).astype(np.float32),
        np.zeros(1, np.float32),
    ]
    velocity = [np.zeros_like(p) for p in params]
    for name, p, v in zip(["w1", "b1", "w2", "b2"], params, velocity):
        job.register(name, p)
        job.register(f"momentum.{name}", v)
    grads = [np.zeros_like(p) for p in params]
    epoch, auc = None, None
    # Extra time per step (to try the runtime at other step times), ms.
    delay = float(os.environ.get("STEP_DELAY_MS", "0")) / 1e3

    for step in job.steps():
        metrics = {}
        # At each epoch's start, and before the job's last step.
        if step.epoch != epoch or (step.ends_epoch and step.epoch + 1 == job.epochs):
            out = forward(step, params, t_dense, t_ids)
            if out is None:
                continue  # abandoned: redone by the next generation
            epoch = step.epoch
            auc = criteo.auc(out[0], t_labels)
            metrics["auc"] = auc
        idx = step.indices
        loss = train_step(step, params, grads, dense[idx], ids[idx], labels[idx])
        if loss is None:
            continue
        if delay:
            time.sleep(delay)
        if not step.all_reduce(grads):
            continue
        for p, v, g in zip(params, velocity, grads):
            v *= step.momentum
            v += g
            p -= step.lr * v
        step.commit(loss=loss, **metrics)

    measured = "never trained" if auc is None else f"test AUC before the last step {auc:.4f}"
    print(f"worker {job.worker_id}: {job.stopped}; {measured}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
