"""Elastic training for your own program.

Run the program under ``edl-runtime launch --samples N -- python train.py``;
inside it::

    import edl
    job = edl.Job.from_env()
    job.register("w", w)            # float32 arrays the runtime keeps consistent
    for step in job.steps():
        x, y = X[step.indices], Y[step.indices]
        ...                          # gradients, summed over this rank's samples / step.global_rows
        if not step.all_reduce([gw]):
            continue                 # the ring broke: the step is redone in the next generation
        w -= step.lr * gw            # in place: the runtime holds these arrays
        step.commit(loss=loss)

See docs/your-own-program.md.
"""

import weakref

from ._edl import EdlError, Job, Step, Steps, builtin_data, mlp_init, read_checkpoint

# Modules whose parameters and buffers are registered as a job's state
# (`register_torch`, `edl.torch.ElasticState`): at each generation's start
# the runtime gives every rank rank 0's.
_job_modules = weakref.WeakSet()

__all__ = ["EdlError", "Job", "Step", "Steps", "builtin_data", "mlp_init", "read_checkpoint", "register_torch"]


def register_torch(job, module, optimizer=None, prefix=""):
    """Registers a ``torch.nn.Module``'s parameters and buffers, and the
    optimizer's state, as the job's state (zero copy: the runtime reads and
    writes the tensors' memory through their NumPy views). CPU float32 only.

    The optimizer's per-parameter state is created here when the optimizer
    would create it lazily at its first step (SGD momentum buffers, Adam's
    moments and step counts), so that every worker registers the same
    tensors from the start.
    """
    import torch

    for name, t in module.state_dict(keep_vars=True).items():
        _register_tensor(job, prefix + name, t)
    _job_modules.add(module)
    if optimizer is None:
        return
    names = {id(p): n for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) > 0:
                state.setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))
            elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
                state.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
                state.setdefault("exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))
            for key, value in sorted(state.items()):
                if torch.is_tensor(value):
                    _register_tensor(job, f"{prefix}optimizer.{names.get(id(p), id(p))}.{key}", value)


def _register_tensor(job, name, t):
    import torch

    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"state {name!r}: only CPU float32 tensors can be registered (got {t.dtype} on {t.device})")
    job.register(name, t.detach().numpy())
