"""Click-through data in Criteo's shape: 13 dense (count) features and 26
categorical ones per row, and a click label.

`synthetic(rows, seed)` makes such data with a known structure: each
categorical field's values are Zipf-distributed (a few very frequent ids,
a long tail), and the label is drawn from a hidden logistic model over
per-id weights and the dense features, so that a model that learns the ids
reaches a test AUC well above 0.5 and the ceiling is known.

`read_tsv(path, limit)` reads a real Criteo file (Display Advertising
Challenge / Terabyte format: label, 13 integers, 26 hex strings, tab
separated, empty fields allowed) into the same arrays.

Categorical values become 64-bit ids unique across fields: the field's
number in the high bits, the value in the low 40.
"""

import numpy as np

DENSE = 13
FIELDS = 26


def _field_ids(field, values):
    return (np.int64(field) << np.int64(40)) | values.astype(np.int64)


def _hidden_weight(ids, seed):
    """A fixed weight per id: a hash of the id, spread as N(0, 0.8)."""
    x = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)) & np.uint64((1 << 64) - 1)
    x ^= x >> np.uint64(31)
    u1 = ((x >> np.uint64(40)).astype(np.float64) + 0.5) / float(1 << 24)
    u2 = (((x >> np.uint64(16)) & np.uint64(0xFFFFFF)).astype(np.float64) + 0.5) / float(1 << 24)
    return 0.8 * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def synthetic(rows, seed=0, vocab=100_000, zipf=1.2):
    """`rows` rows: (dense float32 [rows, 13], ids int64 [rows, 26], labels float32 [rows])."""
    rng = np.random.default_rng(seed)
    dense = np.log1p(rng.lognormal(1.0, 1.2, size=(rows, DENSE))).astype(np.float32)
    ids = np.empty((rows, FIELDS), dtype=np.int64)
    for f in range(FIELDS):
        values = (rng.zipf(zipf, size=rows) - 1) % vocab
        ids[:, f] = _field_ids(f, values)
    hidden = rng.normal(0.0, 0.3, size=DENSE)
    logit = _hidden_weight(ids, 1234).sum(axis=1) / np.sqrt(FIELDS) * 1.6
    logit += (dense - dense.mean(axis=0)) @ hidden - 1.0
    labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return dense, ids, labels


def read_tsv(path, limit=None):
    """A Criteo TSV file's first `limit` rows, as `synthetic` returns them."""
    dense, ids, labels = [], [], []
    with open(path, encoding="ascii", errors="replace") as f:
        for n, line in enumerate(f):
            if limit is not None and n >= limit:
                break
            cols = line.rstrip("\n").split("\t")
            if len(cols) != 1 + DENSE + FIELDS:
                raise ValueError(f"{path}:{n + 1}: {len(cols)} columns, not {1 + DENSE + FIELDS}")
            labels.append(float(cols[0]))
            dense.append([np.log1p(max(int(c), 0)) if c else 0.0 for c in cols[1 : 1 + DENSE]])
            # An empty value is a value of its own (0).
            ids.append([(f << 40) | (int(c, 16) & ((1 << 40) - 1)) if c else (f << 40) for f, c in enumerate(cols[1 + DENSE :])])
    return (
        np.asarray(dense, dtype=np.float32),
        np.asarray(ids, dtype=np.int64),
        np.asarray(labels, dtype=np.float32),
    )


def auc(scores, labels):
    """Area under the ROC curve (ties counted half), from the ranks."""
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    # Each distinct score's average rank (1-based) among all scores.
    ends = np.cumsum(counts)
    average = ends - (counts - 1) / 2.0
    ranks = average[inverse]
    pos = float(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2.0) / (pos * neg))
