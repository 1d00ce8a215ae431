"""A small CNN with BatchNorm (an int64 buffer), AdamW or RMSprop
(`OPTIMIZER`; RMSprop makes its state lazily) and a cosine LR schedule,
kept whole by `edl.torch.ElasticState` and trained with DDP over the job's
gloo groups:

    edl-runtime launch --samples 1397 ... -- python torch_state.py

When a worker stops it prints a digest of its model's parameters and its
test accuracy; at its first step it prints where the optimizer and the
scheduler stand; at the start of every `DIGEST_EVERY`th step and of each
generation's first, a digest of the parameters (the same on every rank of a
generation, and on every attempt of a step that a generation starts at).
`python torch_state.py --check CKPT` loads a checkpoint into a plain model
with `edl.torch.load_checkpoint` and prints the same digest and accuracy.
`python torch_state.py --plain SAMPLES BATCH` trains the same model the
same number of epochs in one process without edl (a shuffled DataLoader of
global batches) and prints its test accuracy.
"""

import hashlib
import os
import sys
import time

import torch
import torch.nn.functional as F

import edl
import edl.torch

EPOCHS = int(os.environ.get("EPOCHS", "4"))


class Digits(torch.utils.data.Dataset):
    """The training images, with each sample's index (to check that every
    batch holds the step's samples)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 64, 10),
    )
    if os.environ.get("OPTIMIZER", "adamw") == "rmsprop":
        opt = torch.optim.RMSprop(model.parameters(), lr=0.002, momentum=0.5)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.005, weight_decay=0.01)
    steps = EPOCHS * 22  # digits: 1397 samples, 64 a step
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    return model, opt, sched


def digest(model):
    """Of the parameters: the same on every rank. (BatchNorm's running
    statistics are each rank's own between two forwards; DDP sends rank 0's
    at the next one.)"""
    d = hashlib.sha256()
    for t in model.parameters():
        d.update(t.detach().contiguous().numpy().tobytes())
    return d.hexdigest()[:16]


def accuracy(model, data):
    model.eval()
    with torch.no_grad():
        x = torch.from_numpy(data["test_x"]).reshape(-1, 1, 8, 8)
        pred = model(x).argmax(dim=1)
        acc = (pred == torch.from_numpy(data["test_y"]).long()).float().mean().item()
    model.train()
    return acc


def optimizer_steps(opt):
    state = opt.state[next(iter(opt.param_groups[0]["params"]))]
    return int(state["step"]) if "step" in state else -1


def plain(samples, batch):
    """The same script without edl: one process, the same seed, model,
    optimizer, schedule, epochs and global batch."""
    torch.set_num_threads(1)
    data = edl.builtin_data("digits")
    X = torch.from_numpy(data["train_x"]).reshape(-1, 1, 8, 8)[:samples]
    Y = torch.from_numpy(data["train_y"]).long()[:samples]
    model, opt, sched = build()
    loader = torch.utils.data.DataLoader(
        Digits(X, Y), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    for _ in range(EPOCHS):
        for xb, yb, _ in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            sched.step()
    print(f"plain: test accuracy {accuracy(model, data) * 100:.2f}%", flush=True)
    return 0


def check(path):
    data = edl.builtin_data("digits")
    model, opt, sched = build()
    info = edl.torch.load_checkpoint(path, model, opt, sched)
    print(
        f"checkpoint step {info['step']}: params {digest(model)}; test accuracy {accuracy(model, data) * 100:.2f}%; "
        f"optimizer steps {optimizer_steps(opt)}; scheduler steps {sched.last_epoch}; epochs {info['scalars']['epochs_done']}",
        flush=True,
    )
    return 0


def main():
    torch.set_num_threads(1)
    data = edl.builtin_data("digits")
    X = torch.from_numpy(data["train_x"]).reshape(-1, 1, 8, 8)
    Y = torch.from_numpy(data["train_y"]).long()
    job = edl.Job.from_env()
    if job is None:
        return 0
    model, opt, sched = build()
    state = edl.torch.ElasticState(job, model, opt, sched, epochs_done=0)
    # The collectives' timeout: a lost rank must fail them long before it.
    timeout = float(os.environ.get("COLLECTIVE_TIMEOUT_S", "10"))
    ddp = edl.torch.ElasticDDP(model, backend="gloo", timeout=timeout)
    loader = edl.torch.ElasticLoader(Digits(X, Y), state, num_workers=2)
    delay = float(os.environ.get("STEP_DELAY_MS", "0")) / 1000
    # Steps slow down until the job has grown to this many workers, so that a
    # test sees the growth however long PyTorch takes to start on its machine.
    hold = int(os.environ.get("HOLD_UNTIL_WORLD", "0"))
    every = int(os.environ.get("DIGEST_EVERY", "0"))
    first, generations = True, set()
    for step, batch in loader:
        if first:
            print(
                f"worker {job.worker_id}: first step {step.step}; optimizer steps {optimizer_steps(opt)}; "
                f"scheduler steps {sched.last_epoch}",
                flush=True,
            )
            first = False
        # Every `every`th step, and the first this process takes in each
        # generation: where a generation starts (a rollback point, or the
        # boundary a resize fell on), every attempt of the step agrees.
        if every and (step.step % every == 0 or step.generation not in generations):
            print(
                f"worker {job.worker_id}: step {step.step} of generation {step.generation} "
                f"starts at params {digest(model)}",
                flush=True,
            )
        idx = torch.from_numpy(step.indices).long()
        xb, yb, ib = batch
        if len(idx):
            # The DataLoader's worker processes read exactly the step's samples.
            assert torch.equal(ib, idx), f"step {step.step}: batch {ib.tolist()} for {idx.tolist()}"
        try:
            net = ddp.on(step)
            generations.add(step.generation)
            opt.zero_grad()
            # Without samples here (fewer rows than ranks) the batch holds
            # stand-ins: DDP still needs this rank, and `scaled` weighs it 0.
            out = net(xb)
            mean = F.cross_entropy(out, yb)
            loss = edl.torch.scaled(step, mean)
            hits = (out.argmax(dim=1) == yb).float().mean().item()
            loss.backward()
        except RuntimeError as e:
            step.abandon(f"a collective failed: {e}")
            continue
        opt.step()
        sched.step()
        state.epochs_done = step.epoch
        if hold and step.world >= hold:
            hold = 0
        if delay or hold:
            time.sleep(delay + (0.2 if hold else 0))
        step.commit(loss=mean.item(), accuracy=hits)
    print(
        f"worker {job.worker_id}: {job.stopped}; generations {len(generations)}; params {digest(model)}; "
        f"test accuracy {accuracy(model, data) * 100:.2f}%",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        sys.exit(check(sys.argv[2]))
    if len(sys.argv) == 4 and sys.argv[1] == "--plain":
        sys.exit(plain(int(sys.argv[2]), int(sys.argv[3])))
    sys.exit(main())
