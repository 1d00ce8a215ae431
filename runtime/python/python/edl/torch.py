"""PyTorch on an elastic job: a ``torch.distributed`` process group per
generation, and ``DistributedDataParallel`` rebuilt on it when the job
resizes.

    import edl, edl.torch
    job = edl.Job.from_env()
    edl.register_torch(job, model, opt)
    ddp = edl.torch.ElasticDDP(model)           # gloo; backend="nccl" on GPUs
    for step in job.steps():
        try:
            net = ddp.on(step)                   # this generation's DDP module
            opt.zero_grad()
            loss = edl.torch.scaled(step, F.cross_entropy(net(x), y))
            loss.backward()                      # DDP sums the gradients
        except RuntimeError as e:                # a peer died mid-collective
            step.abandon(str(e))                 # redone by the next generation
            continue
        opt.step()
        step.commit(loss=loss.item())

The group (``torch.distributed``'s default one, so ``dist.all_reduce`` and
any library that uses it work too) has the job's own store (``step.store()``): it answers only
processes that proved the job's secret for the current generation, and a
new generation starts with an empty one. A membership change drops the old
group (``abort`` on NCCL) and the next step builds the next one.
"""

import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["EdlStore", "ProcessGroups", "ElasticDDP", "scaled", "zero_loss"]


def _bytes(value):
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _seconds(timeout):
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class EdlStore(dist.Store):
    """A c10d ``Store`` over a generation's key-value store (``step.store()``)."""

    def __init__(self, native, timeout=30.0):
        super().__init__()
        self._native = native
        self._timeout = float(timeout)

    @property
    def generation(self):
        return self._native.generation

    def set(self, key, value):
        self._native.set(key, _bytes(value))

    def get(self, key):
        return self._native.get(key, self._timeout)

    def add(self, key, amount):
        return self._native.add(key, int(amount))

    def compare_set(self, key, expected, desired):
        return self._native.compare_set(key, _bytes(expected), _bytes(desired))

    def check(self, keys):
        return self._native.check(list(keys))

    def wait(self, keys, timeout=None):
        t = _seconds(timeout)
        self._native.wait(list(keys), self._timeout if t is None else t)

    def delete_key(self, key):
        return self._native.delete_key(key)

    def num_keys(self):
        return self._native.num_keys()

    def set_timeout(self, timeout):
        self._timeout = _seconds(timeout)


def _default_backend():
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


class ProcessGroups:
    """``torch.distributed``'s default process group, built for each
    generation of the job: ``dist.all_reduce``, DDP and any other code that
    uses the default group work on the generation's ranks.

    ``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors; the
    default when CUDA is available). ``timeout`` (seconds) bounds every
    collective and the group's set-up: a peer that dies makes the others'
    collectives fail within it, never hang.
    """

    def __init__(self, backend=None, timeout=30.0):
        self.backend = backend or _default_backend()
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {self.backend!r}: edl builds gloo or nccl process groups")
        self.timeout = float(timeout)
        self._generation = None

    def of(self, step):
        """The process group of ``step``'s generation, built at its first step."""
        if self._generation == step.generation and dist.is_initialized():
            return dist.group.WORLD
        self.close()
        store = EdlStore(step.store(timeout=self.timeout), timeout=self.timeout)
        dist.init_process_group(
            backend=self.backend,
            store=store,
            rank=step.rank,
            world_size=step.world,
            timeout=datetime.timedelta(seconds=self.timeout),
        )
        self._generation = step.generation
        return dist.group.WORLD

    def close(self):
        """Drops the current group; NCCL's is aborted first, so that no
        kernel waits on a peer that is gone."""
        self._generation = None
        if not dist.is_initialized():
            return
        if self.backend == "nccl":
            try:
                backend = dist.group.WORLD._get_backend(torch.device("cuda"))
                backend.abort()
            except (AttributeError, RuntimeError):
                pass
        try:
            dist.destroy_process_group()
        except RuntimeError:
            pass


class ElasticDDP:
    """``DistributedDataParallel`` over ``module`` on each generation's group.

    ``on(step)`` gives the DDP module of the step's generation, wrapping the
    same ``module`` (its parameters are the ones registered with the job)
    again when the generation changed. ``ddp_options`` go to
    ``DistributedDataParallel`` (``find_unused_parameters``, ...).
    """

    def __init__(self, module, backend=None, timeout=30.0, **ddp_options):
        self.module = module
        self.groups = ProcessGroups(backend, timeout)
        self.options = ddp_options
        self._ddp = None
        self._generation = None

    def on(self, step):
        if self._generation != step.generation or self._ddp is None:
            # The old wrapper (and its gradient hooks) goes before the new one comes.
            self._ddp = None
            group = self.groups.of(step)
            device_ids = None
            if self.groups.backend == "nccl":
                device_ids = [next(self.module.parameters()).device.index]
            self._ddp = DistributedDataParallel(
                self.module, process_group=group, device_ids=device_ids, **self.options
            )
            self._generation = step.generation
        return self._ddp

    def close(self):
        self._ddp = None
        self._generation = None
        self.groups.close()


def scaled(step, loss):
    """This rank's mean ``loss`` weighted so that DDP's average over the
    ranks is the mean over the step's samples, even when the ranks' shares
    differ (an epoch's last step): ``loss * rows_here * world / global_rows``."""
    rows = len(step.indices)
    return loss * (rows * step.world / max(step.global_rows, 1))


def zero_loss(module):
    """A loss of 0 that reaches every parameter: what a rank with no samples
    in a step backpropagates, so that it still takes part in DDP's reduction."""
    return sum(p.sum() for p in module.parameters() if p.requires_grad) * 0.0
