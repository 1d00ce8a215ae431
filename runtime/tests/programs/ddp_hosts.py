"""A plain torchrun DDP script (gloo) for a group across hosts: it prints
the environment the launcher gave it, trains a small MLP on seeded data,
keeps the usual torchrun snapshot (rank 0 writes it after each epoch,
every rank loads it when it starts) and, while its group has
`HOLD_WHILE_WORLD` ranks, waits after its first epoch (so that a test can
take a host away at a known point); with `HOLD_UNTIL=FILE` it waits there
once, until FILE exists, and goes on (so that a test can take the
launcher away while the group runs).

    python ddp_hosts.py SNAPSHOT EPOCHS
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    snapshot, epochs = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                      "GROUP_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT")}
    print("env " + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(512, 16)
    y = (x[:, :8].sum(dim=1) > x[:, 8:].sum(dim=1)).long()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    done = 0
    if os.path.exists(snapshot):
        snap = torch.load(snapshot)
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        done = snap["epochs_done"]
    ddp = DDP(model)
    hold = int(os.environ.get("HOLD_WHILE_WORLD", "0"))
    until = os.environ.get("HOLD_UNTIL")
    per = 64 // world
    for epoch in range(done, epochs):
        if epoch > done and world == hold:
            print(f"rank {rank}: holding with {world} ranks", flush=True)
            while True:
                time.sleep(1)
        if epoch > done and until:
            print(f"rank {rank}: holding until {until} (pid {os.getpid()})", flush=True)
            while not os.path.exists(until):
                time.sleep(0.2)
            until = None
        g = torch.Generator().manual_seed(epoch)
        order = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), 64):
            idx = order[i + rank * per : i + (rank + 1) * per]
            opt.zero_grad()
            F.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epochs_done": epoch + 1},
                       snapshot + ".tmp")
            os.replace(snapshot + ".tmp", snapshot)
        dist.barrier()
        print(f"rank {rank}/{world}: epoch {epoch} done", flush=True)
    if rank == 0:
        with torch.no_grad():
            acc = (model(x).argmax(dim=1) == y).float().mean().item()
        print(f"rank 0: trained {epochs} epochs; accuracy {acc:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
