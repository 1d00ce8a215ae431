"""A PyTorch student trained with DistributedDataParallel over the job's
gloo process groups (`edl.torch.ElasticDDP`), as the job's workers:

    edl-runtime launch --samples 1397 ... -- python torch_ddp.py

UCI digits (64 features, 10 classes), a 64-32-10 MLP, SGD with momentum.
Each worker prints, when it stops, a digest of its parameters and its test
accuracy: workers that end together must hold the same model.
"""

import hashlib
import os
import sys
import time

import torch
import torch.nn.functional as F

import edl
import edl.torch


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = edl.builtin_data("digits")
    X, Y = torch.from_numpy(data["train_x"]), torch.from_numpy(data["train_y"]).long()
    job = edl.Job.from_env()
    if job is None:
        return 0
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    edl.register_torch(job, model, opt)
    ddp = edl.torch.ElasticDDP(model, backend="gloo", timeout=10.0)
    delay = float(os.environ.get("STEP_DELAY_MS", "0")) / 1000
    generations = set()
    for step in job.steps():
        for g in opt.param_groups:
            g["lr"], g["momentum"] = step.lr, step.momentum
        idx = torch.from_numpy(step.indices).long()
        try:
            net = ddp.on(step)
            generations.add(step.generation)
            opt.zero_grad()
            if len(idx):
                mean = F.cross_entropy(net(X[idx]), Y[idx])
                loss = edl.torch.scaled(step, mean)
            else:
                mean = torch.tensor(0.0)
                loss = edl.torch.zero_loss(net)
            loss.backward()
        except RuntimeError as e:
            step.abandon(f"a collective failed: {e}")
            continue
        opt.step()
        if delay:
            time.sleep(delay)
        step.commit(loss=mean.item())

    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    with torch.no_grad():
        pred = model(torch.from_numpy(data["test_x"])).argmax(dim=1)
        acc = (pred == torch.from_numpy(data["test_y"]).long()).float().mean().item()
    print(
        f"worker {job.worker_id}: {job.stopped}; generations {len(generations)}; "
        f"params {digest.hexdigest()[:16]}; test accuracy {acc * 100:.2f}%",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
