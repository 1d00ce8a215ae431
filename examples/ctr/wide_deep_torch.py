"""The wide-and-deep click-through model of `wide_deep.py` in PyTorch: its
two embedding tables on the job's parameter servers
(`edl.torch.SparseEmbedding`, looked up together by an
`edl.torch.SparseEmbeddingCollection`), its dense network under DDP
(`edl.torch.ElasticDDP`, gloo) with AdamW, the whole dense state kept by the
job (`edl.torch.ElasticState`):

    edl-runtime launch --samples 20000 --ps-servers 2 --no-distill \\
        --policy plugins/autoscale.wasm -- python examples/ctr/wide_deep_torch.py

The same data as `wide_deep.py` (synthetic Criteo-shaped rows, or a real
Criteo TSV file with CTR_DATA=path). Every epoch's first step, and the job's
last, measures the test AUC (the step's `auc` metric).
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import criteo  # noqa: E402
from wide_deep import EMBED, HIDDEN, data  # noqa: E402

import edl  # noqa: E402
import edl.torch  # noqa: E402


class WideDeep(torch.nn.Module):
    """The dense part; the tables are looked up outside it."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(criteo.FIELDS * EMBED + criteo.DENSE, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, 1),
        )

    def forward(self, wide, deep, dense):
        x = torch.cat([deep.flatten(1), dense], dim=1)
        return wide.sum(dim=(1, 2)) + self.net(x)[:, 0]


def main():
    (dense, ids, labels), (t_dense, t_ids, t_labels) = data()
    dense, ids, labels = map(torch.from_numpy, (dense, ids, labels))
    t_dense, t_ids = torch.from_numpy(t_dense), torch.from_numpy(t_ids)
    job = edl.Job.from_env()
    if job is None:
        return 0
    torch.manual_seed(job.seed)
    torch.set_num_threads(1)
    # The tables' optimiser (CTR_SPARSE_OPT, CTR_SPARSE_LR): Adagrad by default.
    sparse = os.environ.get("CTR_SPARSE_OPT", "adagrad")
    lr = float(os.environ.get("CTR_SPARSE_LR", "0.05"))
    wide = edl.torch.SparseEmbedding(job, "wide", 1, optimizer=sparse, lr=lr, init="zeros")
    deep = edl.torch.SparseEmbedding(job, "deep", EMBED, optimizer=sparse, lr=lr, seed=job.seed)
    # Both looked up in one flight of requests to the servers.
    tables = edl.torch.SparseEmbeddingCollection(wide, deep)
    model = WideDeep()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = edl.torch.ElasticState(job, model, opt)
    # A world of one trains the model itself, without DDP's reducer.
    ddp = edl.torch.ElasticDDP(model, bare_at_one=True)
    epoch, auc = None, None
    # Extra time per step (to try the runtime at other step times), ms.
    delay = float(os.environ.get("STEP_DELAY_MS", "0")) / 1e3
    # The training steps' own time, each from its start to the next's (its
    # commit included), steps that also evaluated left out: what a
    # one-process loop's timer around its training steps measures.
    trained, train_secs, last = 0, 0.0, None

    for step in state.steps():
        now = time.perf_counter()
        if last is not None:
            trained, train_secs = trained + last[1], train_secs + now - last[0]
        last = (now, step.global_rows)
        metrics = {}
        idx = torch.from_numpy(step.indices)
        try:
            # At each epoch's start, and before the job's last step.
            if step.epoch != epoch or (step.ends_epoch and step.epoch + 1 == job.epochs):
                with torch.no_grad():
                    logit = model(*tables(t_ids, step), t_dense)
                epoch = step.epoch
                auc = criteo.auc(logit.numpy(), t_labels)
                metrics["auc"] = auc
                last = None
            net = ddp.on(step)
            opt.zero_grad()
            x, i, y = dense[idx], ids[idx], labels[idx]
            logit = net(*tables(i, step), x)
            mean = F.binary_cross_entropy_with_logits(logit, y) if len(idx) else logit.sum() * 0.0
            edl.torch.scaled(step, mean).backward()
            if delay:
                time.sleep(delay)
        except RuntimeError as e:  # a peer died mid-collective
            step.abandon(str(e))
            last = None
            continue
        opt.step()
        step.commit(loss=mean.item(), **metrics)

    if last is not None:
        trained, train_secs = trained + last[1], train_secs + time.perf_counter() - last[0]
    measured = "never trained" if auc is None else f"test AUC before the last step {auc:.4f}"
    print(f"worker {job.worker_id}: {job.stopped}; {measured}", flush=True)
    if train_secs > 0:
        print(f"worker {job.worker_id}: training steps {trained / train_secs:.0f} samples/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
