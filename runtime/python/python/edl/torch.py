"""PyTorch on an elastic job: a ``torch.distributed`` process group per
generation, and ``DistributedDataParallel`` rebuilt on it when the job
resizes.

    import edl, edl.torch
    job = edl.Job.from_env()
    state = edl.torch.ElasticState(job, model, opt, scheduler)   # the whole state
    ddp = edl.torch.ElasticDDP(model)            # gloo; backend="nccl" on GPUs
    loader = edl.torch.ElasticLoader(dataset, state, num_workers=2)
    for step, (x, y) in loader:
        try:
            net = ddp.on(step)                   # this generation's DDP module
            opt.zero_grad()
            mean = F.cross_entropy(net(x), y)
            edl.torch.scaled(step, mean).backward()   # DDP sums the gradients
        except RuntimeError as e:                # a peer died mid-collective
            step.abandon(str(e))                 # redone by the next generation
            continue
        opt.step()
        scheduler.step()
        step.commit(loss=mean.item())

The group (``torch.distributed``'s default one, so ``dist.all_reduce`` and
any library that uses it work too) has the job's own store (``step.store()``): it answers only
processes that proved the job's secret for the current generation, and a
new generation starts with an empty one. A membership change drops the old
group (aborted first) and the next step builds the next one.

A step given up (``step.abandon``) ends its generation's group at once, as
the loop goes on to the next step: the survivors still in a collective with
this rank see its connections close and fail too, instead of waiting for
the timeout (a ring's rank waits only on its neighbours, which may both be
alive).
"""

import atexit
import copy
import datetime
import io
import os
import pickle
import socket
import threading
import time
import weakref

import inspect

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import edl

# DDP that can be built without broadcasting the parameters (torch >= 2.4).
_DDP_INIT_SYNC = "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters

__all__ = [
    "EdlStore",
    "ProcessGroups",
    "ElasticDDP",
    "ElasticLoader",
    "ElasticState",
    "SparseEmbedding",
    "SparseEmbeddingBag",
    "all_reduce_grads",
    "load_checkpoint",
    "scaled",
]


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


# What holds a generation's group: ended when a step of it is abandoned.
_HOLDERS = weakref.WeakSet()


def _end_if_abandoned(step):
    """After a step's body: if it gave the step up, end the groups of its
    generation now (their sockets closed), not when the next one comes."""
    if step.abandoned:
        for holder in list(_HOLDERS):
            if holder._generation == step.generation:
                holder.close(failed=True)


def _sockets():
    """This process's sockets: {fd: inode}, or {} where /proc is not there."""
    found = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(name)] = target
    return found


def _same_socket(fd, inode):
    """A socket object over a duplicate of ``fd`` (its family and type read
    from the descriptor itself), if ``fd`` still names the socket ``inode``
    (``socket:[N]``); None otherwise. The caller closes it."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if f"socket:[{os.fstat(dup).st_ino}]" != inode:
            os.close(dup)
            return None
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _connections_made(before, store_addr):
    """The TCP connections this process opened since ``before`` (a
    ``_sockets()``), but the one to the group's store: a gloo group's pairs
    to its peers (not its listener, which gloo's thread must go on accepting
    on), and any TCP connection another thread opened meanwhile. (fd,
    inode) each, to shut down when the group fails."""
    made = []
    for fd, inode in _sockets().items():
        if before.get(fd) == inode:
            continue
        s = _same_socket(fd, inode)
        if s is None:
            continue
        with s:
            try:
                if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                if s.getpeername()[:2] == store_addr:
                    continue
            except OSError:
                continue
        made.append((fd, inode))
    return made


def _shut_down(connections):
    """Shuts down each connection still open under its fd (checked on a
    duplicate, so a number given since to another socket is left alone):
    the peers reading from it see it end now, whoever still holds the
    group. The fds are left for their owner to close."""
    for fd, inode in connections:
        s = _same_socket(fd, inode)
        if s is None:
            continue
        with s:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _call_weak(method):
    """Calls a weakly held method, if its object is still there."""
    m = method()
    if m is not None:
        m()


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
        self._connections = []
        # The group's store, held as long as the group: a backend that
        # reaches it after `init_process_group` returned (NCCL makes its
        # communicator at the first collective) finds a Python store whose
        # object is gone unable to answer ("Not implemented").
        self._store = None
        _HOLDERS.add(self)

    def of(self, step, user=()):
        """The process group of ``step``'s generation, built at its first
        step. ``user``: a list holding what used the last generation's
        group (its DDP module), which the old group outlives; emptied here,
        so that no frame of this call holds it."""
        if self._generation == step.generation and dist.is_initialized():
            return dist.group.WORLD
        self._drop(False, later=True, user=user)
        store = EdlStore(step.store(timeout=self.timeout), timeout=self.timeout)
        before = _sockets() if self.backend == "gloo" else {}
        dist.init_process_group(
            backend=self.backend,
            store=store,
            rank=step.rank,
            world_size=step.world,
            timeout=datetime.timedelta(seconds=self.timeout),
        )
        if self.backend == "gloo":
            at = step.rendezvous
            self._connections = _connections_made(before, (at["host"], at["port"]))
        self._generation = step.generation
        self._store = store
        return dist.group.WORLD

    def close(self, failed=False):
        """Drops the current group, aborted first (NCCL's, so that no kernel
        waits on a peer that is gone). ``failed``: a step of it was given
        up, and its connections are shut down too, so that the peers still
        in a collective with this rank fail now: gloo's abort leaves them
        open while anything (a DDP module the program still names) holds
        the group. Earlier generations' groups still held for their DDP
        modules are let go now."""
        self._drop(failed)
        _release(list(_RETIRING))

    def _drop(self, failed, later=False, user=()):
        """Drops the current group; ``later`` (a new generation's start):
        its last reference is let go on a thread of its own, once what the
        list ``user`` holds is gone: a gloo group's teardown waits for ticks of its event loop
        (10 ms each), which would otherwise lengthen the resize's pause,
        and torch lets go of a group's handle without the GIL."""
        self._generation = None
        if failed:
            _shut_down(self._connections)
        self._connections = []
        old = None
        if dist.is_initialized():
            old = dist.group.WORLD
            device = torch.device("cuda" if self.backend == "nccl" else "cpu")
            try:
                old._get_backend(device).abort()
            except (AttributeError, RuntimeError):
                pass
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass
        # Let go of the store only once the group is gone.
        store, self._store = self._store, None
        if old is not None and later:
            held = [old, store]
            del old, store  # the thread's references are to be the last
            _Retiring(held, user)


class _Retiring:
    """Holds an old generation's group (and its store) on a daemon thread
    until what the list ``user`` holds (what used it: its DDP module;
    taken out of the list) is finalized, or
    ``release()``, or ``within`` seconds; then lets go of the group, then of
    the store. A short grace lets the module's own teardown, which its
    finalizer only begins, let go of the group first."""

    GRACE = 0.05

    def __init__(self, held, user=(), within=60.0):
        self._held = [list(held)]
        held.clear()
        self._now = threading.Event()
        self._finalizer = None
        if user:
            self._finalizer = weakref.finalize(user.pop(), self._now.set)
        else:
            self._now.set()
        self.thread = threading.Thread(target=self._run, args=(within,), name="edl-old-group", daemon=True)
        _RETIRING.add(self)
        try:
            self.thread.start()
        except BaseException:
            _RETIRING.discard(self)
            self._held.clear()
            raise

    def release(self):
        self._now.set()

    def _run(self, within):
        items = self._held.pop()
        if self._now.wait(within):
            time.sleep(self.GRACE)
        del items[0]  # the group, then its store
        items.clear()
        if self._finalizer is not None:
            self._finalizer.detach()
        _RETIRING.discard(self)


# Every old group still held (a process has one default group at a time).
_RETIRING = set()


def _release(retiring, within=10.0):
    """Lets go of the groups ``retiring`` holds now and waits (``within``
    seconds at most) for it."""
    for r in retiring:
        r.release()
    for r in retiring:
        r.thread.join(timeout=within)


@atexit.register
def _release_all():
    # A daemon thread still inside a group's teardown when the interpreter
    # ends could race the process's own teardown.
    _release(list(_RETIRING))


class _Measured:
    """The step a DDP module's communication hook tells its norms to, and
    how often it measures."""

    def __init__(self, group, every):
        self.group = group
        self.every = max(1, int(every))
        self.step = None


def _measuring_allreduce(measured, bucket):
    """DDP's own reduction (the mean over the ranks of each gradient
    bucket), telling the step the squared norms of what this rank gave and
    of the mean that came back: the gradient noise scale's measure, without
    a collective of its own. The norms stay 0-d tensors (no device sync)
    until the step's commit reads them. Steps between measured ones (every
    `measured.every`-th is) are reduced alone."""
    tensor = bucket.buffer()
    tensor.div_(measured.group.size())
    step = measured.step
    if step is None or step.step % measured.every:
        return dist.all_reduce(tensor, group=measured.group, async_op=True).get_future().then(lambda f: f.value()[0])
    # Squared in float64: a half-precision gradient's squares would underflow.
    local = torch.linalg.vector_norm(tensor, dtype=torch.float64).square()
    future = dist.all_reduce(tensor, group=measured.group, async_op=True).get_future()

    def reduced(f):
        out = f.value()[0]
        step.gradient_norms(local, torch.linalg.vector_norm(out, dtype=torch.float64).square())
        return out

    return future.then(reduced)


class ElasticDDP:
    """``DistributedDataParallel`` over ``module`` on each generation's group.

    ``on(step)`` gives the DDP module of the step's generation, wrapping the
    same ``module`` (its parameters are the ones registered with the job)
    again when the generation changed. ``ddp_options`` go to
    ``DistributedDataParallel`` (``find_unused_parameters``, ...).

    Its gradients are reduced as DDP's default does (the mean over the
    ranks) by a communication hook that also tells the step their norms, on
    every ``noise_every``-th step (4), from which the runtime measures the
    gradient noise scale. A program with a hook of its own passes
    ``noise_scale=False`` and registers it on the module ``on(step)`` gives.

    ``example``: an input of the module (a tensor, or a tuple of its
    positional arguments, as a batch of the program's): this process runs
    the module on it twice, as it is built, forward and backward, on a copy
    (the module's parameters, buffers and gradients, and the random state,
    are left as they were) wrapped in DDP over a group of this process
    alone (gloo; the module alone with NCCL). A rank that joins a running
    job then takes its first step as fast as the others take theirs (the
    kernels' and DDP's set-up of a fresh process are done before it is
    ready), and the others do not wait for it at the resize. The copy
    lasts as long as the warm-up.

    With ``bare_at_one=True``, in a generation of one rank ``on(step)``
    gives ``module`` itself: there is nothing to reduce (the mean over one
    rank is its own gradient, to the bit), and DDP's reducer would only
    cost time. The generation's process group is built all the same. Off
    by default: what ``on`` gives then has no DDP attributes (``.module``,
    ``no_sync``) and its ``state_dict`` keys lack DDP's ``module.`` prefix.
    """

    def __init__(
        self,
        module,
        backend=None,
        timeout=30.0,
        noise_scale=True,
        noise_every=4,
        bare_at_one=False,
        example=None,
        **ddp_options,
    ):
        self.module = module
        self.groups = ProcessGroups(backend, timeout)
        if example is not None:
            _warm_up(module, example, self.groups.backend, ddp_options)
        self.options = ddp_options
        self.noise_scale = noise_scale
        self.noise_every = noise_every
        self.bare_at_one = bare_at_one
        self._ddp = None
        self._generation = None
        self._measured = None
        _HOLDERS.add(self)

    def on(self, step):
        if self._generation != step.generation:
            # The old wrapper (and its gradient hooks) goes before the new
            # one comes; the old group outlives it (the program may still
            # name it until this returns).
            user, self._ddp = [self._ddp] if self._ddp is not None else [], None
            self._measured = None
            group = self.groups.of(step, user)
            if step.world > 1 or not self.bare_at_one:
                self._wrap(group, step)
            self._generation = step.generation
        if self._measured is not None:
            self._measured.step = step
        return self.module if self._ddp is None else self._ddp

    def _wrap(self, group, step):
        device_ids = None
        if self.groups.backend == "nccl":
            device_ids = [next(self.module.parameters()).device.index]
        self._ddp = DistributedDataParallel(
            self.module, process_group=group, device_ids=device_ids, **self._ddp_options()
        )
        if self.noise_scale:
            self._measured = _Measured(group, self.noise_every)
            self._ddp.register_comm_hook(self._measured, _measuring_allreduce)

    def _ddp_options(self):
        """DDP's options: the program's and, where the module is the job's
        state (``ElasticState``, ``edl.register_torch``), ``init_sync=False``:
        every rank holds rank 0's parameters already (the runtime gave them
        at the generation's start), so DDP's own check and broadcast of them
        would only lengthen each resize's pause. Buffers are still synced at
        each forward, as DDP does by default."""
        options = dict(self.options)
        if _DDP_INIT_SYNC and "init_sync" not in options and self.module in edl._job_modules:
            options["init_sync"] = False
        return options

    def close(self, failed=False):
        self._ddp = None
        self._measured = None
        self._generation = None
        self.groups.close(failed)


def _warm_up(module, example, backend, options):
    """``ElasticDDP``'s ``example``: ``module`` run on it twice, forward
    and backward, on a copy under DDP over a group of this process alone
    (gloo), before any generation's group exists; the random state is put
    back after."""
    if dist.is_initialized():
        raise RuntimeError(
            "ElasticDDP(example=...) warms up before the job's first process group: "
            "build it before anything else initialises torch.distributed"
        )
    args = example if isinstance(example, tuple) else (example,)
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        twin = copy.deepcopy(module)
    except Exception as e:
        raise ValueError(f"ElasticDDP(example=...): the module cannot be copied to warm up on: {e}") from e
    grouped = backend == "gloo"
    try:
        if grouped:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            kept = {k: v for k, v in options.items() if k in ("find_unused_parameters", "static_graph")}
            if _DDP_INIT_SYNC:
                kept["init_sync"] = False
            twin = DistributedDataParallel(twin, **kept)
        for _ in range(2):
            try:
                out = twin(*args)
            except Exception as e:
                raise ValueError(f"ElasticDDP(example=...): the module cannot be run on the example: {e}") from e
            leaves = [t for t in _tensors(out) if t.requires_grad]
            if leaves:
                torch.autograd.backward([t.float().sum() for t in leaves])
    finally:
        del twin
        if grouped and dist.is_initialized():
            dist.destroy_process_group()
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _tensors(out):
    """The tensors in a module's output (a tensor, or tuples, lists and
    dicts of them)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


class _PlannedBatches:
    """The batch sampler of an ``ElasticLoader``'s DataLoader: the index
    lists of the steps fed to it, in order, and, when none is waiting, a
    one-sample stand-in (tagged, and dropped by the loader), so that the
    DataLoader, which asks for its next batch whenever one is consumed, never
    waits on a plan that has not come yet."""

    def __init__(self):
        import collections

        self.waiting = collections.deque()  # (key, indices) fed, not yet given out
        self.given = collections.deque()  # keys of the batches given out, in order
        self.fed = set()

    def feed(self, key, indices, first=False):
        if key in self.fed:
            return
        if len(indices) == 0:
            # No samples here this step: stand-ins, which the rank weighs by 0
            # (``scaled``) but runs through DDP, which every rank must.
            indices = [0, 1]
        self.fed.add(key)
        (self.waiting.appendleft if first else self.waiting.append)((key, [int(i) for i in indices]))

    def __iter__(self):
        return self

    def __next__(self):
        if self.waiting:
            key, indices = self.waiting.popleft()
        else:
            key, indices = None, [0]
        self.given.append(key)
        return indices


class ElasticLoader:
    """Each step's batch from a ``torch.utils.data.DataLoader`` over
    ``dataset``: its worker processes, prefetching, ``collate_fn``,
    ``pin_memory`` and the dataset's own transforms are kept; the samples
    are the step's (``step.indices``), read ahead over the steps the runtime
    has planned.

        loader = edl.torch.ElasticLoader(dataset, state, num_workers=2)
        for step, batch in loader:
            ...

    A rank with no samples in a step (fewer rows than ranks) gets a batch
    of two stand-in samples: DDP needs every rank's forward and backward,
    and ``scaled`` weighs that rank's loss by 0.

    A job launched without ``--samples`` takes ``len(dataset)`` as its
    samples (each worker declares it; one that differs stops the job).

    ``source``: an ``ElasticState`` (its ``steps()``) or a ``Job``. Other
    keyword arguments go to the DataLoader (not ``batch_size``, ``shuffle``,
    ``sampler`` or ``batch_sampler``: the job decides those). A generation
    change drops the batches read ahead for the steps it replans.
    """

    def __init__(self, dataset, source, **loader_options):
        if loader_options.get("in_order") is False:
            raise ValueError("ElasticLoader: in_order=False would pair batches with the wrong steps")
        for fixed in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if fixed in loader_options:
                raise ValueError(f"ElasticLoader: {fixed!r} is the job's to decide (each step's samples)")
        self.dataset, self.source, self.options = dataset, source, loader_options
        self.job = getattr(source, "job", source)
        if self.job.samples == 0:
            # Launched without --samples: the job's samples are the data set's.
            self.job.samples = len(dataset)
        elif self.job.samples > len(dataset):
            raise ValueError(
                f"ElasticLoader: the job has {self.job.samples} samples (--samples), the data set {len(dataset)}"
            )

    def __iter__(self):
        from torch.utils.data import DataLoader

        sampler = _PlannedBatches()
        loader = None
        steps = self.source.steps()
        try:
            for step in steps:
                key = (step.generation, step.step)
                # This step first if it was not read ahead (a new generation
                # replanned it), then the planned ones behind it.
                sampler.feed(key, step.indices, first=True)
                for generation, number, indices in self.job.planned():
                    sampler.feed((generation, number), indices)
                if loader is None:
                    # Made once the first steps are known: its first reads are theirs.
                    loader = iter(DataLoader(self.dataset, batch_sampler=sampler, **self.options))
                while True:
                    # Batches come in the order the sampler gave them out.
                    batch = next(loader)
                    given = sampler.given.popleft()
                    if given == key:
                        break
                    sampler.fed.discard(given)
                sampler.fed.discard(key)
                yield step, batch
                _end_if_abandoned(step)
        finally:
            del loader


def all_reduce_grads(step, module):
    """Sums ``module``'s gradients over the generation's ring (the runtime's
    own, without DDP), in place; False when the ring broke (the step is then
    redone by the next generation). Each parameter's ``.grad`` is read as it
    is now: PyTorch's ``zero_grad()`` replaces the tensors, so views taken
    earlier would sum stale zeros."""
    grads = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad
        if g.dtype != torch.float32 or g.device.type != "cpu" or not g.is_contiguous():
            raise ValueError(
                f"gradient of {name!r}: the runtime's ring sums CPU float32 contiguous gradients "
                f"(got {g.dtype} on {g.device}); use ElasticDDP for others"
            )
        grads.append(g.numpy())
    return step.all_reduce(grads)


def scaled(step, loss):
    """This rank's mean ``loss`` weighted so that DDP's average over the
    ranks is the mean over the step's samples, even when the ranks' shares
    differ (an epoch's last step): ``loss * rows_here * world / global_rows``.
    A rank with no samples in a step (fewer rows than ranks) still runs the
    DDP module forward and backward, on stand-in samples (``ElasticLoader``
    gives it some), so that it takes part in the reduction: its weight is 0."""
    return loss * (step.rows * step.world / max(step.global_rows, 1))


# ---------------------------------------------------------------------------
# Sparse tables on the job's parameter servers, as modules.


class _Lookup(torch.autograd.Function):
    """Rows of a table for ``ids``; backward pushes their gradients."""

    @staticmethod
    def forward(ctx, anchor, table, step, ids):
        flat = ids.reshape(-1).to("cpu", torch.int64).numpy()
        pulled = step.pull(table.name, flat)
        if pulled is None:
            # The runtime abandoned the step (a parameter server gone, or
            # the generation over): the loop's `except RuntimeError` goes on.
            raise RuntimeError(f"table {table.name!r}: the step was abandoned; it is redone")
        rows = torch.from_numpy(pulled).to(anchor.device)
        ctx.table, ctx.step, ctx.ids = table, step, flat
        return rows.reshape(*ids.shape, table.dim)

    @staticmethod
    def backward(ctx, grad):
        _push(ctx.step, ctx.table, ctx.ids, grad)
        return None, None, None, None


def _push(step, table, ids, grad):
    """Pushes the gradient of ``table``'s rows ``ids`` (flat int64 NumPy)."""
    # As DDP reduces the dense gradients: the mean over the ranks (the
    # servers sum the ranks' pushes).
    g = grad.reshape(-1, table.dim).detach().to("cpu", torch.float32)
    if step.world > 1:
        g = g / step.world
    if not step.push(table.name, ids, g.contiguous().numpy()):
        # Abandoned (a server gone, the generation over): `backward()` raises.
        raise RuntimeError(f"table {table.name!r}: the step was abandoned; it is redone")


class _LookupMany(torch.autograd.Function):
    """Rows of several tables, one ``ids`` each, in one flight to the
    servers; backward pushes each table's gradients."""

    @staticmethod
    def forward(ctx, anchor, tables, step, *ids):
        flats, seen = [], {}
        for i in ids:
            # One tensor given for several tables is converted once.
            if id(i) not in seen:
                seen[id(i)] = i.reshape(-1).to("cpu", torch.int64).numpy()
            flats.append(seen[id(i)])
        pulled = step.pull_many([(t.name, f) for t, f in zip(tables, flats)])
        if pulled is None:
            names = ", ".join(repr(t.name) for t in tables)
            raise RuntimeError(f"tables {names}: the step was abandoned; it is redone")
        ctx.tables, ctx.step, ctx.ids = tables, step, flats
        # An output the loss does not use gets None, not zeros: its table is
        # not pushed (a zero gradient would still move Adam's moments).
        ctx.set_materialize_grads(False)
        return tuple(
            torch.from_numpy(p).to(anchor.device).reshape(*i.shape, t.dim) for p, i, t in zip(pulled, ids, tables)
        )

    @staticmethod
    def backward(ctx, *grads):
        for table, ids, grad in zip(ctx.tables, ctx.ids, grads):
            # A table whose rows the loss did not use is pushed empty at the commit.
            if grad is not None:
                _push(ctx.step, table, ids, grad)
        return (None, None, None) + (None,) * len(grads)


class _OnStep(torch.nn.Module):
    """A lookup module given its step at each call, or once by ``on(step)``."""

    def __init__(self):
        super().__init__()
        self._step = None
        # What makes autograd call backward; not a parameter.
        self._anchor = torch.zeros(0, requires_grad=True)

    def on(self, step):
        self._step = step
        return self

    def _step_of(self, step, what):
        step = step if step is not None else self._step
        if step is None:
            raise ValueError(f"{what}: give the step (module(ids, step), or module.on(step) first)")
        return step


class SparseEmbedding(_OnStep):
    """An embedding table on the job's parameter servers (``edl-runtime
    launch --ps-servers N``), for tables too large to replicate: rows made
    on first touch (``init``: ``"uniform"`` in [-scale, scale], ``"normal"``,
    ``"zeros"``), updated on the servers by ``optimizer`` (``"sgd"``,
    ``"adagrad"``, ``"adam"``) at ``lr``; not a parameter of the module, so
    DDP and the dense optimiser leave it alone. Define every table before
    the first step, on every worker alike.

    ``emb(ids, step)`` (or ``emb.on(step)`` then ``emb(ids)``) gives the rows
    of ``ids`` (int64, any shape) as of the steps before this one, shape
    ``ids.shape + (dim,)``; ``backward`` pushes their gradients, averaged
    over the ranks as DDP averages the dense ones, applied once every
    rank's push of the step is in. One lookup a step that trains (put a
    step's features in one ``ids`` tensor); lookups under ``torch.no_grad()``
    (evaluation) are free to repeat. A table a step did not push is pushed
    empty at ``step.commit()``.
    """

    def __init__(self, job, name, dim, optimizer="adagrad", lr=0.05, init="uniform", scale=0.05, seed=0):
        super().__init__()
        job.table(name, dim, optimizer=optimizer, lr=lr, init=init, scale=scale, seed=seed)
        self.name, self.dim = name, dim

    def forward(self, ids, step=None):
        step = self._step_of(step, f"table {self.name!r}")
        return _Lookup.apply(self._anchor, self, step, ids)

    def extra_repr(self):
        return f"{self.name!r}, dim={self.dim}"


class SparseEmbeddingBag(SparseEmbedding):
    """``SparseEmbedding`` whose rows are summed (``mode="sum"``) or averaged
    (``"mean"``) per bag, as ``nn.EmbeddingBag``: ``bag(ids, step)`` with
    ``ids`` of shape ``[bags, n]``, or flat ids and ``offsets`` (each bag's
    first position), gives ``[bags, dim]``."""

    def __init__(self, job, name, dim, mode="sum", **table):
        super().__init__(job, name, dim, **table)
        if mode not in ("sum", "mean"):
            raise ValueError(f"table {name!r}: mode {mode!r} is not sum or mean")
        self.mode = mode

    def forward(self, ids, step=None, offsets=None):
        return self._pool(super().forward(ids, step), ids, offsets)

    def _pool(self, rows, ids, offsets=None):
        if offsets is None:
            if ids.dim() != 2:
                raise ValueError(f"table {self.name!r}: ids of shape {tuple(ids.shape)}: give [bags, n], or offsets")
            return rows.sum(1) if self.mode == "sum" else rows.mean(1)
        lengths = torch.diff(offsets, append=torch.tensor([ids.numel()], device=offsets.device))
        bag = torch.repeat_interleave(torch.arange(len(offsets), device=offsets.device), lengths)
        out = torch.zeros(len(offsets), self.dim, dtype=rows.dtype, device=rows.device).index_add(0, bag, rows)
        if self.mode == "mean":
            out = out / lengths.clamp(min=1).unsqueeze(1).to(out.dtype)
        return out


class SparseEmbeddingCollection(_OnStep):
    """Several ``SparseEmbedding`` (or ``SparseEmbeddingBag``) tables looked
    up together, as TorchRec's ``EmbeddingCollection``: ``tables(ids,
    step)`` (or ``tables.on(step)`` then ``tables(ids)``), with ``ids`` a
    list of one int64 tensor per table (or one tensor for all), gives the
    list of their rows (a bag's pooled; its ids ``[bags, n]``). Every
    table's request goes to the servers before any answer is read: one
    flight a step instead of a round trip per table. Backward pushes each
    table's gradients as a table alone does."""

    def __init__(self, *tables):
        super().__init__()
        if not tables or not all(isinstance(t, SparseEmbedding) for t in tables):
            raise ValueError("SparseEmbeddingCollection takes one or more SparseEmbedding tables")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"tables {names}: each table once")
        self.tables = torch.nn.ModuleList(tables)

    def forward(self, ids, step=None):
        names = [t.name for t in self.tables]
        step = self._step_of(step, f"tables {names}")
        if torch.is_tensor(ids):
            ids = [ids] * len(self.tables)
        ids = list(ids)
        if len(ids) != len(self.tables):
            raise ValueError(f"tables {names}: {len(ids)} ids tensors for {len(self.tables)} tables")
        rows = _LookupMany.apply(self._anchor, tuple(self.tables), step, *ids)
        return [
            t._pool(r, i) if isinstance(t, SparseEmbeddingBag) else r for t, r, i in zip(self.tables, rows, ids)
        ]


# ---------------------------------------------------------------------------
# The whole state of a PyTorch program, kept by the job.

_INT_BITS = 22  # an int64 travels as three float32 values of up to 22 bits: exact


def _materialize(optimizer):
    """Creates the optimizer's per-parameter state now, with the values its
    first step would create it with (an optimizer creates it lazily; the
    ranks and the checkpoints must have it from the start).

    One step runs with zero gradients on a copy of the parameters' values;
    every state entry it creates is recorded as first assigned and put back
    to that value, so the step's arithmetic leaves no trace.
    """

    class _Recording(dict):
        def __init__(self):
            super().__init__()
            self.first = {}

        def __setitem__(self, key, value):
            if key not in self.first:
                self.first[key] = value.detach().clone() if torch.is_tensor(value) else value
            super().__setitem__(key, value)

    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    missing = [p for p in params if len(optimizer.state[p]) == 0]
    if not missing:
        return
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD) and any(
        g.get("momentum", 0) and g.get("dampening", 0) for g in optimizer.param_groups
    ):
        # Its first step takes the gradient whole, later ones damped: a
        # buffer made up front cannot say "first".
        raise ValueError(
            f"optimizer {name}: momentum with dampening makes its first step unlike the others; "
            "edl keeps an optimizer's state from the start, so it cannot keep this one (dampening=0 can)"
        )
    missing_ids = {id(p) for p in missing}
    saved = [(p, p.grad, p.detach().clone()) for p in params]
    decays = [g.get("weight_decay") for g in optimizer.param_groups]
    for p in missing:
        optimizer.state[p] = _Recording()
    try:
        # Zero gradients for the parameters without state only (the others
        # are skipped and keep theirs untouched), and no weight decay, which
        # some optimizers fold into the first buffer.
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in missing_ids else None
        for g in optimizer.param_groups:
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
        optimizer.step()
    except Exception as e:
        raise ValueError(
            f"optimizer {name}: its state cannot be created before its first step ({e}); "
            "edl keeps an optimizer's state from the start, so it cannot keep this one"
        ) from e
    finally:
        for g, decay in zip(optimizer.param_groups, decays):
            if decay is not None:
                g["weight_decay"] = decay
        with torch.no_grad():
            for p, grad, value in saved:
                p.copy_(value)
                p.grad = grad
        for p in missing:
            state = optimizer.state[p]
            if isinstance(state, _Recording):
                plain = {}
                for key, value in dict.items(state):
                    first = state.first.get(key, value)
                    if torch.is_tensor(value) and torch.is_tensor(first):
                        value.copy_(first)
                        plain[key] = value
                    else:
                        plain[key] = first
                optimizer.state[p] = plain


def _int_pack(t, out):
    mask = (1 << _INT_BITS) - 1
    if t.numel() == 1:
        # A BatchNorm's counter and the like, packed at every window: one
        # Python integer costs a fraction of the array operations below.
        bits = int(t.item()) & 0xFFFF_FFFF_FFFF_FFFF
        out[0] = (bits & mask, (bits >> _INT_BITS) & mask, bits >> (2 * _INT_BITS))
        return
    bits = t.detach().reshape(-1).to("cpu", torch.int64).numpy().view("uint64")
    out[:, 0] = bits & mask
    out[:, 1] = (bits >> _INT_BITS) & mask
    out[:, 2] = bits >> (2 * _INT_BITS)


def _int_unpack(mirror):
    import numpy as np

    u = mirror.astype(np.uint64)
    bits = u[:, 0] | (u[:, 1] << np.uint64(_INT_BITS)) | (u[:, 2] << np.uint64(2 * _INT_BITS))
    return torch.from_numpy(bits.view(np.int64).copy())


class _Mirrored:
    """A tensor the runtime cannot hold in place (another dtype, another
    device, another memory layout): the runtime holds a float32 copy that is
    written before the runtime may read it and read back after it may have
    changed it (a rollback, a joiner's broadcast, a checkpoint loaded)."""

    def __init__(self, name, tensor):
        import numpy as np

        self.tensor = tensor
        dtype = tensor.dtype
        if dtype in (torch.float32, torch.float16, torch.bfloat16):
            self.codec = "f32"
            self.mirror = np.zeros(max(tensor.numel(), 1), dtype=np.float32)
        elif dtype == torch.float64 or not dtype.is_floating_point and not dtype.is_complex:
            self.codec = "bits" if dtype == torch.float64 else "int"
            self.mirror = np.zeros((max(tensor.numel(), 1), 3), dtype=np.float32)
        else:
            raise ValueError(f"state {name!r}: edl cannot keep {dtype} tensors")
        self.name = f"{name}@{self.codec}"

    def pack(self):
        t = self.tensor.detach()
        if t.numel() == 0:
            return
        if self.codec == "f32":
            self.mirror[: t.numel()] = t.reshape(-1).to("cpu", torch.float32).numpy()
        elif self.codec == "bits":
            _int_pack(t.reshape(-1).contiguous().cpu().view(torch.int64), self.mirror)
        else:
            _int_pack(t, self.mirror)

    def unpack(self):
        t = self.tensor
        if t.numel() == 0:
            return
        with torch.no_grad():
            if self.codec == "f32":
                src = torch.from_numpy(self.mirror[: t.numel()].copy())
            elif self.codec == "bits":
                src = _int_unpack(self.mirror).view(torch.float64)
            else:
                src = _int_unpack(self.mirror)
            t.copy_(src.reshape(t.shape).to(t.device, t.dtype))


def _written(obj):
    """What a tensor, a dtype or a device is stored as (a tuple whose first
    item names its kind); None for anything else."""
    if torch.is_tensor(obj):
        t = obj.detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return ("tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
    if isinstance(obj, torch.dtype):
        return ("dtype", str(obj).removeprefix("torch."))
    if isinstance(obj, torch.device):
        return ("device", str(obj))
    return None


class _Pickler(pickle.Pickler):
    """Pickles plain values; a tensor, a dtype or a device is written as a
    call of ``_stored`` (raw bytes, a name, a string), the one callable a
    stored state may name. ``reducer_override`` is asked only about objects
    that are not of a built-in type (a tensor, a dtype, an ``OrderedDict``),
    so the numbers, strings and dicts of a schedule cost no Python call."""

    def reducer_override(self, obj):
        stored = _written(obj)
        return NotImplemented if stored is None else (_stored, stored)


def _item_size(dtype):
    size = getattr(dtype, "itemsize", None)  # torch >= 2.1
    if size is not None:
        return size
    import warnings

    with warnings.catch_warnings():
        # Experimental dtypes warn when a tensor of them is made.
        warnings.simplefilter("ignore")
        try:
            return torch.empty(0, dtype=dtype).element_size()
        except (RuntimeError, TypeError):
            return None


# Every dtype a tensor can be made of, by the name `_Pickler` writes, with
# its size in bytes (a fixed table: a name is never looked up on the torch
# module, whose lazy attributes import code).
_DTYPES = {
    str(d).removeprefix("torch."): (d, size)
    for d in list(vars(torch).values())
    if isinstance(d, torch.dtype) and (size := _item_size(d))
}


def _stored(*args):
    """A tensor, a dtype or a device from what ``_Pickler`` wrote; anything
    else, or a tensor whose bytes do not fill its shape, is refused. What
    is refused is named by its type and size, never printed whole."""

    def refused(why):
        return pickle.UnpicklingError(f"edl state: {why}")

    kind, payload = (args[0], args[1:]) if args else (None, ())
    if kind == "tensor" and len(payload) == 3:
        dtype, shape, raw = payload
        if not isinstance(dtype, str):
            raise refused(f"a tensor's dtype is {type(dtype).__name__}, not a name")
        dt, size = _DTYPES.get(dtype, (None, None))
        if dt is None:
            raise refused(f"unknown tensor dtype {dtype[:40]!r}")
        if not isinstance(shape, tuple) or not all(type(n) is int and 0 <= n < 2**63 for n in shape):
            raise refused(f"a tensor's shape ({type(shape).__name__}) is not a tuple of sizes")
        if not isinstance(raw, bytes):
            raise refused(f"a tensor's data is {type(raw).__name__}, not bytes")
        numel = 0 if 0 in shape else 1
        for n in shape if numel else ():
            numel *= n
            if numel * size > len(raw):
                break
        if numel * size != len(raw):
            raise refused(f"a {dtype} tensor of {len(shape)} dimensions: {len(raw)} bytes do not fill its shape")
        try:
            if not raw:
                return torch.empty(shape, dtype=dt)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)
        except (RuntimeError, TypeError, ValueError) as e:
            raise refused(f"a {dtype} tensor of {len(shape)} dimensions: {str(e)[:200]}") from None
    if kind == "dtype" and len(payload) == 1 and isinstance(payload[0], str) and payload[0] in _DTYPES:
        return _DTYPES[payload[0]][0]
    if kind == "device" and len(payload) == 1 and isinstance(payload[0], str):
        try:
            return torch.device(payload[0])
        except RuntimeError as e:
            raise refused(f"device {payload[0][:40]!r}: {str(e)[:200]}") from None
    name = repr(kind[:40]) if isinstance(kind, str) else f"of type {type(kind).__name__}"
    raise refused(f"unknown stored object {name}")


def _earlier_size(value):
    """The length of the pickle of ``value`` that earlier versions wrote
    (each tensor, dtype and device a persistent id), which the state's copy
    is sized from."""

    class Earlier(pickle.Pickler):
        def persistent_id(self, obj):
            return _written(obj)

    out = io.BytesIO()
    Earlier(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return len(out.getvalue())


class _Unpickler(pickle.Unpickler):
    """Reads what ``_Pickler`` wrote and nothing that could run code: no
    class or function can be named but ``OrderedDict`` and ``_stored``
    (what ``torch.load(weights_only=True)`` guards, at a fraction of its
    cost). Tensors written out of band (persistent ids), as earlier
    versions did, are read too."""

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if name == "_stored" and module in ("edl.torch", __name__):
            # A call of its own for each read: a state that sets attributes
            # on what it names changes nothing beyond itself.
            return lambda *args: _stored(*args)
        raise pickle.UnpicklingError(f"edl state: {module}.{name} is not a plain value")

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and pid:
            return _stored(*pid)
        raise pickle.UnpicklingError(f"edl state: unknown stored object of type {type(pid).__name__}")


def _dumps(value):
    """The Python part of the state as bytes: a pickle of plain values with
    tensors as raw bytes (tens of microseconds for a schedule and an
    optimizer's settings, where ``torch.save`` takes a third of a
    millisecond: it runs at every window's start)."""
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return out.getvalue()


def _loads(data):
    """Reads what ``_dumps`` wrote, allowing plain values and tensors only:
    a checkpoint from elsewhere cannot run code here. (A state that
    ``torch.save`` wrote, as earlier versions did, is read with
    ``weights_only``.)"""
    if data[:2] == b"PK":
        return torch.load(io.BytesIO(data), weights_only=True)
    return _Unpickler(io.BytesIO(data)).load()


class _Blob:
    """Python values (scalars, the scheduler's and the optimizer's settings,
    RNG states), pickled by ``_dumps`` and read back by ``_loads`` (plain
    values and tensors, never code), in a float32 array of bytes of a fixed
    capacity, with its length in front. ``size``: what the capacity is
    sized from (four times it, 16 KiB at least)."""

    def __init__(self, size, capacity=None):
        import numpy as np

        self.capacity = capacity or max(16 * 1024, 4 * size)
        self.mirror = np.zeros(self.capacity + 2, dtype=np.float32)
        self.last = None

    def pack(self, data):
        import numpy as np

        if len(data) > self.capacity:
            raise ValueError(
                f"edl: the program's Python state grew to {len(data)} bytes, over the {self.capacity} "
                "reserved when it was registered (ElasticState(..., python_bytes=N) reserves more)"
            )
        n = len(data)
        # What is past the data is zero (every rank's copy alike): only
        # what a longer value before left there is cleared.
        before = int(self.mirror[0]) | (int(self.mirror[1]) << 16)
        self.mirror[0], self.mirror[1] = n & 0xFFFF, n >> 16
        self.mirror[2 : 2 + n] = np.frombuffer(data, dtype=np.uint8)
        if before > n:
            self.mirror[2 + n : 2 + before] = 0
        self.last = data

    def unpack(self):
        """The bytes there, and whether they differ from the last taken
        (``took``): bytes whose restore failed are read again next time."""
        n = int(self.mirror[0]) | (int(self.mirror[1]) << 16)
        data = self.mirror[2 : 2 + n].astype("uint8").tobytes()
        return data, data != self.last

    def took(self, data):
        """``data`` was read back into the program."""
        self.last = data


class ElasticState:
    """Registers, in one call, everything of a PyTorch program that must
    stay the same on every rank and survive a dead worker: the model's
    parameters and buffers of any dtype (float32 held in place; float16,
    bfloat16, float64, integer and boolean ones, CUDA and channels_last
    tensors through a float32 copy the runtime holds), the optimizer's
    state (any ``torch.optim`` optimizer: its lazily created state is made
    now, and a state entry that appears later is an error naming it), its
    settings (learning rates a scheduler changes), the LR scheduler, named
    Python scalars (``epoch=0``: read and set as ``state.epoch``) and, with
    ``rng=True``, the RNG states (the same on every rank).

    Iterate ``state.steps()`` instead of ``job.steps()``: it brings the
    copies up to date around the runtime's own work between steps.
    ``edl.torch.load_checkpoint`` puts a checkpoint back into a plain model.
    """

    def __init__(self, job, model, optimizer=None, scheduler=None, rng=False, python_bytes=None, **scalars):
        object.__setattr__(self, "_scalars", dict(scalars))
        self.job, self.model, self.optimizer, self.scheduler, self.rng = job, model, optimizer, scheduler, rng
        self._mirrored = []
        for name, t in model.state_dict(keep_vars=True).items():
            self._add(f"model.{name}", t)
        edl._job_modules.add(model)
        self._optimizer_sets = {}
        if optimizer is not None:
            _materialize(optimizer)
            for i, p in enumerate(self._params()):
                for key, value in sorted(optimizer.state[p].items()):
                    if torch.is_tensor(value):
                        self._add(f"optimizer.{i}.{key}", value)
                self._optimizer_sets[i] = frozenset(optimizer.state[p])
        value = self._python_value()
        # Sized as earlier versions sized it (from their pickle's length),
        # so that the copy's shape, which checkpoints and joiners check,
        # stays the same.
        self._blob = _Blob(_earlier_size(value), python_bytes)
        self._blob.pack(_dumps(value))
        job.register("python@torch", self._blob.mirror)
        for m in self._mirrored:
            m.pack()
        # The copies are written when the runtime reads them and read back
        # when it wrote them, not around every step. Held weakly: the job
        # does not keep this state alive.
        pack, unpack = weakref.WeakMethod(self.pack), weakref.WeakMethod(self.unpack)
        job._state_hooks(lambda: _call_weak(pack), lambda: _call_weak(unpack))

    def _params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _add(self, name, t):
        direct = t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
        if direct:
            view = t.detach().reshape(-1) if t.dim() == 0 else t.detach()
            self.job.register(name, view.numpy())
        else:
            m = _Mirrored(name, t)
            self.job.register(m.name, m.mirror)
            self._mirrored.append(m)

    def _check_optimizer(self):
        optimizer = self.optimizer
        for i, p in enumerate(self._params()):
            state = optimizer.state[p]
            known = self._optimizer_sets.get(i, frozenset())
            if state.keys() == known:
                continue
            new, gone = sorted(set(state) - known), sorted(known - set(state))
            change = f"state {new} of parameter {i} appeared" if new else f"state {gone} of parameter {i} went away"
            raise RuntimeError(
                f"optimizer {type(optimizer).__name__}: {change} after the state was registered; "
                "edl cannot keep it consistent across workers"
            )

    def _python(self):
        """The Python part of the state, as bytes."""
        return _dumps(self._python_value())

    def _python_value(self):
        value = {"scalars": self._scalars}
        if self.optimizer is not None:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            loose = {
                i: {k: v for k, v in self.optimizer.state[p].items() if not torch.is_tensor(v)}
                for i, p in enumerate(self._params())
            }
            value["optimizer"] = {"groups": groups, "loose": loose}
        if self.scheduler is not None:
            value["scheduler"] = self.scheduler.state_dict()
        if self.rng:
            value["rng"] = torch.get_rng_state()
        return value

    def _restore_python(self, value):
        self._scalars.clear()
        self._scalars.update(value["scalars"])
        if self.optimizer is not None and "optimizer" in value:
            for g, saved in zip(self.optimizer.param_groups, value["optimizer"]["groups"]):
                g.update(saved)
            for i, p in enumerate(self._params()):
                self.optimizer.state[p].update(value["optimizer"]["loose"].get(i, {}))
        if self.scheduler is not None and "scheduler" in value:
            self.scheduler.load_state_dict(value["scheduler"])
        if "rng" in value:
            torch.set_rng_state(value["rng"])

    def pack(self):
        """Writes the copies the runtime holds; the runtime calls it just
        before it reads them. An optimizer state entry that appeared since
        the state was registered is an error here."""
        if self.optimizer is not None:
            self._check_optimizer()
        for m in self._mirrored:
            m.pack()
        self._blob.pack(self._python())

    def unpack(self):
        """Reads back the copies the runtime may have changed."""
        for m in self._mirrored:
            m.unpack()
        data, changed = self._blob.unpack()
        if changed:
            self._restore_python(_loads(data))
            self._blob.took(data)

    def steps(self):
        """The job's steps. The state's copies are written just before the
        runtime reads them (a window's rollback point, a checkpoint, a
        joiner's broadcast) and read back just after it wrote them (a
        rollback, rank 0's state, a checkpoint loaded), not around every
        step."""
        for step in self.job.steps():
            yield step
            _end_if_abandoned(step)

    def __getattr__(self, name):
        scalars = object.__getattribute__(self, "_scalars")
        if name in scalars:
            return scalars[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name in self.__dict__.get("_scalars", {}):
            self._scalars[name] = value
        else:
            object.__setattr__(self, name, value)


def load_checkpoint(path, model, optimizer=None, scheduler=None):
    """Puts an edl checkpoint (a ``step-...`` directory an ``ElasticState``
    job wrote, or the job's checkpoint directory: its newest complete
    checkpoint, which its ``latest`` file names) back into a plain PyTorch
    ``model`` (and ``optimizer``,
    ``scheduler``). Returns the named scalars and the checkpoint's step and
    epoch: ``{"scalars": {...}, "step": N, "epoch": E}``."""
    import numpy as np

    from . import read_checkpoint

    ckpt = read_checkpoint(str(path))
    tensors = ckpt["tensors"]

    def value(name, like):
        for codec in ("", "@f32", "@int", "@bits"):
            if name + codec in tensors:
                raw = tensors[name + codec]
                break
        else:
            raise KeyError(f"checkpoint {path}: no tensor {name!r}")
        held = raw.size // (3 if codec in ("@int", "@bits") else 1)
        if held != max(like.numel(), 1):
            raise ValueError(
                f"checkpoint {path}: tensor {name!r} holds {held} values, the model's {tuple(like.shape)} "
                f"{like.numel()}: another model's checkpoint?"
            )
        if codec in ("", "@f32"):
            src = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)[: like.numel()].copy())
        elif codec == "@int":
            src = _int_unpack(raw.reshape(-1, 3))
        else:
            src = _int_unpack(raw.reshape(-1, 3)).view(torch.float64)
        return src.reshape(like.shape).to(like.device, like.dtype)

    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            t.copy_(value(f"model.{name}", t))
    blob = tensors["python@torch"].reshape(-1)
    n = int(blob[0]) | (int(blob[1]) << 16)
    python = _loads(blob[2 : 2 + n].astype("uint8").tobytes())
    if optimizer is not None:
        _materialize(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        with torch.no_grad():
            for i, p in enumerate(params):
                for key, v in optimizer.state[p].items():
                    if torch.is_tensor(v):
                        v.copy_(value(f"optimizer.{i}.{key}", v))
        saved = python.get("optimizer", {})
        for g, s in zip(optimizer.param_groups, saved.get("groups", [])):
            g.update(s)
        for i, p in enumerate(params):
            optimizer.state[p].update(saved.get("loose", {}).get(i, {}))
    if scheduler is not None and "scheduler" in python:
        scheduler.load_state_dict(python["scheduler"])
    return {"scalars": python["scalars"], "step": ckpt["step"], "epoch": ckpt["epoch"]}
