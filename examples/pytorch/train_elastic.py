"""The built-in student (784-128-10 MLP on MNIST 5k) in PyTorch (CPU),
stop-free through the `edl` package:

    pip install torch ./runtime/python
    edl-runtime launch --samples 4000 --no-distill --policy plugins/autoscale.wasm \
        -- python examples/pytorch/train_elastic.py

The model, the SGD optimiser's momentum buffers and nothing else are the
job's state: `edl.register_torch` hands the runtime their memory (zero copy),
which it snapshots, restores, broadcasts to joiners and checkpoints.
"""

import sys

import torch
import torch.nn.functional as F

import edl


def main():
    data = edl.builtin_data("mnist5k")
    X, Y = torch.from_numpy(data["train_x"]), torch.from_numpy(data["train_y"])
    job = edl.Job.from_env()
    if job is None:
        return 0
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    # Every worker starts from the same weights: the built-in student's under the job's seed.
    with torch.no_grad():
        for layer, (w, b) in zip((model[0], model[2]), edl.mlp_init([784, 128, 10], job.seed)):
            layer.weight.copy_(torch.from_numpy(w).T)
            layer.bias.copy_(torch.from_numpy(b))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    edl.register_torch(job, model, opt)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    grads = [p.grad.numpy() for p in model.parameters()]

    for step in job.steps():
        for g in opt.param_groups:  # the batch adapter may change them
            g["lr"], g["momentum"] = step.lr, step.momentum
        opt.zero_grad(set_to_none=False)
        idx = torch.from_numpy(step.indices)
        loss = 0.0
        if len(idx):
            # Summed over this rank's samples / the step's rows: the ring's sum is the mean.
            out = model(X[idx])
            total = F.cross_entropy(out, Y[idx], reduction="sum")
            (total / step.global_rows).backward()
            loss = total.item() / len(idx)
        if not step.all_reduce(grads):
            continue  # a peer is gone: the runtime redoes the step
        opt.step()
        step.commit(loss=loss)

    with torch.no_grad():
        pred = model(torch.from_numpy(data["test_x"])).argmax(dim=1)
        acc = (pred == torch.from_numpy(data["test_y"])).float().mean().item()
    print(f"worker {job.worker_id}: {job.stopped}; test accuracy {acc * 100:.2f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
