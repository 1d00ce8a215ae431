"""The wide-and-deep model of examples/ctr/wide_deep_torch.py in one
process without edl: its tables as `nn.EmbeddingBag(sparse=True)` /
`nn.Embedding(sparse=True)` updated by `torch.optim.SparseAdam`, its dense
network by AdamW; the same data, batch and epochs. Prints one JSON line:
`ctr_peer {"samples_per_sec": ..., "auc": ..., "table_bytes": ...}`: as the job's program
measures, the test AUC at each epoch's first step and before the last one
(the last of them printed), and samples/s over the training steps that did
not evaluate, each timed from its start to its end."""

import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "ctr"))
import criteo  # noqa: E402
from wide_deep import EMBED, HIDDEN, data  # noqa: E402


def main():
    epochs, batch = int(sys.argv[1]), int(sys.argv[2])
    lr = float(os.environ.get("CTR_SPARSE_LR", "0.05"))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    (dense, ids, labels), (t_dense, t_ids, t_labels) = data()
    # A table that fits: every id of the data, numbered.
    known, index = np.unique(np.concatenate([ids.reshape(-1), t_ids.reshape(-1)]), return_inverse=True)
    index = torch.from_numpy(index.astype(np.int64))
    rows, fields = ids.shape
    train_ix, test_ix = index[: rows * fields].reshape(rows, fields), index[rows * fields :].reshape(-1, fields)
    wide = torch.nn.EmbeddingBag(len(known), 1, mode="sum", sparse=True)
    deep = torch.nn.Embedding(len(known), EMBED, sparse=True)
    with torch.no_grad():
        wide.weight.zero_()
        deep.weight.uniform_(-0.05, 0.05)
    net = torch.nn.Sequential(
        torch.nn.Linear(criteo.FIELDS * EMBED + criteo.DENSE, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
    )
    sparse = torch.optim.SparseAdam([wide.weight, deep.weight], lr=lr)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    dense, labels, t_dense = map(torch.from_numpy, (dense, labels, t_dense))

    def logits(ix, x):
        return wide(ix)[:, 0] + net(torch.cat([deep(ix).flatten(1), x], dim=1))[:, 0]

    g = torch.Generator().manual_seed(0)
    # As the job's program: the test AUC at each epoch's first step and
    # before the last one, those steps left out of the timing.
    trained, secs, auc = 0, 0.0, float("nan")
    for epoch in range(epochs):
        order = torch.randperm(rows, generator=g)
        for at in range(0, rows, batch):
            began = time.perf_counter()
            evaluates = at == 0 or (epoch + 1 == epochs and at + batch >= rows)
            if evaluates:
                with torch.no_grad():
                    auc = criteo.auc(logits(test_ix, t_dense).numpy(), t_labels)
            b = order[at : at + batch]
            sparse.zero_grad()
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(logits(train_ix[b], dense[b]), labels[b]).backward()
            sparse.step()
            opt.step()
            if not evaluates:
                trained, secs = trained + len(b), secs + time.perf_counter() - began
    # Its tables' memory: the weights and SparseAdam's two moments of each.
    table = sum(p.numel() * p.element_size() for p in (wide.weight, deep.weight)) * 3
    print("ctr_peer " + json.dumps({"samples_per_sec": trained / secs, "auc": auc, "table_bytes": table}), flush=True)


if __name__ == "__main__":
    main()
