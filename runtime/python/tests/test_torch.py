"""edl.torch's pieces that need no job: optimiser state made up front, the
float32 copies of other tensors, gradients read as they are."""

import io
import pickle
import re

import pytest

# Run with PyTorch by the runtime's test suite (tests/all/torch.rs); an
# environment without it skips this file.
torch = pytest.importorskip("torch")

import edl.torch as et  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _step(model, opt, seed):
    torch.manual_seed(seed)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


OPTIMIZERS = [
    ("RMSprop", lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True)),
    ("Adam amsgrad", lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True)),
    ("AdamW", lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    ("NAdam", lambda p: torch.optim.NAdam(p, lr=0.01)),
    ("Rprop", lambda p: torch.optim.Rprop(p, lr=0.01)),
    ("Adadelta", lambda p: torch.optim.Adadelta(p)),
    ("Adamax", lambda p: torch.optim.Adamax(p, lr=0.01)),
    ("SGD", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
    ("SGD weight decay", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("Adam weight decay", lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01)),
]


@pytest.mark.parametrize("name,make", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_state_made_up_front_trains_exactly_as_state_made_lazily(name, make):
    lazy, early = _model(), _model()
    lazy_opt, early_opt = make(lazy.parameters()), make(early.parameters())
    before = [p.detach().clone() for p in early.parameters()]
    et._materialize(early_opt)
    # The parameters are untouched and every parameter has its state.
    assert all(torch.equal(a, b) for a, b in zip(before, early.parameters()))
    assert all(len(early_opt.state[p]) > 0 for p in early.parameters()), name
    for seed in range(3):
        _step(lazy, lazy_opt, seed)
        _step(early, early_opt, seed)
    for a, b in zip(lazy.parameters(), early.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-7), name


def test_an_optimizer_whose_state_cannot_be_made_up_front_is_refused_by_name():
    with pytest.raises(ValueError, match="optimizer LBFGS"):
        et._materialize(torch.optim.LBFGS(_model().parameters()))
    with pytest.raises(ValueError, match="optimizer SGD: momentum with dampening"):
        et._materialize(torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9, dampening=0.5))


def test_state_already_there_is_left_as_it_is():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, opt, 0)
    head = torch.nn.Linear(2, 2)
    opt.add_param_group({"params": head.parameters()})
    before = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    et._materialize(opt)
    after = opt.state[next(model.parameters())]
    assert all(torch.equal(before[k], after[k]) for k in before), "the trained parameters' state moved"
    assert all(len(opt.state[p]) > 0 for p in head.parameters())


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([0, -1, 2**62, -(2**63), 12345678901], dtype=torch.int64),
        torch.tensor([1.5, -2.0**-30, 3.141592653589793, 1e300], dtype=torch.float64),
        torch.tensor([1.5, -0.25, 65504.0], dtype=torch.float16),
        torch.tensor([1.5, -0.25, 3.0e38], dtype=torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.arange(24, dtype=torch.float32).reshape(1, 2, 3, 4).to(memory_format=torch.channels_last),
    ],
    ids=["int64", "float64", "float16", "bfloat16", "bool", "channels_last"],
)
def test_tensors_the_runtime_cannot_hold_in_place_travel_exactly_through_their_copy(tensor):
    m = et._Mirrored("t", tensor.clone())
    m.pack()
    original = m.tensor.clone()
    with torch.no_grad():
        m.tensor.zero_()
    m.unpack()
    assert torch.equal(m.tensor, original)
    assert m.mirror.dtype.name == "float32"


class _Ring:
    """A step whose ring doubles what it is given (two ranks of the same values)."""

    def __init__(self):
        self.seen = None

    def all_reduce(self, arrays):
        for a in arrays:
            a *= 2
        self.seen = arrays
        return True


def test_gradients_are_read_as_they_are_after_pytorchs_default_zero_grad():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ring = _Ring()
    for _ in range(2):
        opt.zero_grad()  # set_to_none: backward makes new tensors
        model(torch.ones(2, 4)).sum().backward()
        want = [p.grad.clone() * 2 for p in model.parameters()]
        assert et.all_reduce_grads(ring, model)
        for p, w in zip(model.parameters(), want):
            assert torch.equal(p.grad, w)


class _Native:
    def __init__(self):
        self.d = {}
        self.generation = 7

    def set(self, k, v):
        self.d[k] = v

    def get(self, k, timeout):
        return self.d[k]

    def add(self, k, n):
        self.d[k] = str(int(self.d.get(k, b"0")) + n).encode()
        return int(self.d[k])

    def compare_set(self, k, e, v):
        if self.d.get(k, b"") == e:
            self.d[k] = v
        return self.d.get(k, e)

    def check(self, keys):
        return all(k in self.d for k in keys)

    def wait(self, keys, timeout):
        assert self.check(keys)

    def delete_key(self, k):
        return self.d.pop(k, None) is not None

    def num_keys(self):
        return len(self.d)


def test_the_store_speaks_c10d():
    import torch.distributed as dist

    store = et.EdlStore(_Native(), timeout=5)
    assert isinstance(store, dist.Store)
    store.set("a", "x")
    assert store.get("a") == b"x"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.check(["a", "n"]) and not store.check(["b"])
    assert store.delete_key("a") and store.num_keys() == 1
    assert store.generation == 7


def test_the_python_state_round_trips_with_its_tensors_dtypes_and_schedules():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.99))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=50)
    for seed in range(3):
        _step(model, opt, seed)
        sched.step()
    value = {
        "scheduler": sched.state_dict(),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "rng": torch.get_rng_state(),
        "misc": (torch.float16, torch.device("cpu"), {1, 2}, b"\x00\xff", None, 2**70, torch.zeros(0, 3)),
        "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    }
    back = et._loads(et._dumps(value))
    assert back["scheduler"] == value["scheduler"]
    assert back["groups"] == value["groups"]
    assert torch.equal(back["rng"], value["rng"])
    assert back["misc"][:6] == value["misc"][:6]
    assert back["misc"][6].shape == (0, 3)
    assert back["half"].dtype == torch.bfloat16 and torch.equal(back["half"], value["half"])
    # A schedule loaded from it goes on exactly where the first one was.
    other = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=50)
    other.load_state_dict(back["scheduler"])
    assert other.get_last_lr() == sched.get_last_lr() and other.last_epoch == sched.last_epoch


class _Boom:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_a_python_state_that_names_code_is_refused_without_running_it():
    import pickle

    with pytest.raises(pickle.UnpicklingError, match="posix.system is not a plain value"):
        et._loads(pickle.dumps({"scheduler": _Boom()}))
    # A state written by torch.save (as earlier versions did) is still read, with weights_only.
    import io

    buf = io.BytesIO()
    torch.save({"scalars": {"epoch": 3}}, buf)
    assert et._loads(buf.getvalue()) == {"scalars": {"epoch": 3}}


class _Earlier(pickle.Pickler):
    """How earlier versions pickled the Python state: every tensor, dtype
    and device a persistent id."""

    def persistent_id(self, obj):
        if torch.is_tensor(obj):
            raw = obj.reshape(-1).view(torch.uint8).numpy().tobytes() if obj.numel() else b""
            return ("tensor", str(obj.dtype).removeprefix("torch."), tuple(obj.shape), raw)
        if isinstance(obj, torch.dtype):
            return ("dtype", str(obj).removeprefix("torch."))
        if isinstance(obj, torch.device):
            return ("device", str(obj))
        return None


def _earlier(value):
    buf = io.BytesIO()
    _Earlier(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue()


def test_a_python_state_written_with_tensors_out_of_band_is_still_read():
    value = {"rng": torch.arange(5, dtype=torch.int16), "dtype": torch.float64, "at": torch.device("cpu")}
    back = et._loads(_earlier(value))
    assert torch.equal(back["rng"], value["rng"]) and back["dtype"] is torch.float64 and back["at"] == value["at"]
    # What is written now names `edl.torch._stored`, under the package's own name.
    assert b"edl.torch" in et._dumps(value) and b"_stored" in et._dumps(value)


@pytest.mark.parametrize(
    "pid,why",
    [
        (("module", "os"), "unknown stored object 'module'"),
        (("dtype", "_dynamo"), "unknown stored object 'dtype'"),
        (("tensor", "_inductor", (1,), b"x"), "unknown tensor dtype '_inductor'"),
        (("tensor", "float32", (2, 2), b"\0" * 4), "4 bytes do not fill its shape"),
        (("tensor", "float32", (3,), 12), "data is int, not bytes"),
        (("tensor", "float32", (-1,), b""), "not a tuple of sizes"),
        (("tensor", "float32", [4], b"\0" * 16), "not a tuple of sizes"),
        (("tensor", "float32", (0, 2**63), b""), "not a tuple of sizes"),
        (("tensor", "float32", (2**62, 2**62, 3), b"\0" * 8), "8 bytes do not fill its shape"),
        (("tensor", [10**5000], (1,), b""), "dtype is list, not a name"),
        ((), "unknown stored object of type tuple"),
        (("device", "warp-drive"), "device 'warp-drive'"),
        ("tensor", "unknown stored object of type str"),
    ],
)
def test_a_stored_object_that_is_not_what_edl_writes_is_refused_by_name(pid, why):
    class Crafted(pickle.Pickler):
        def persistent_id(self, obj):
            return pid if obj == "here" else None

    buf = io.BytesIO()
    Crafted(buf, protocol=pickle.HIGHEST_PROTOCOL).dump({"x": "here"})
    with pytest.raises(pickle.UnpicklingError, match=re.escape(why)):
        et._loads(buf.getvalue())


def test_a_dtype_is_read_from_a_fixed_table_never_looked_up_on_torch(monkeypatch):
    # A name torch answers (its lazy attributes import modules) is not a dtype edl wrote.
    monkeypatch.setattr(torch, "edl_alias", torch.float32, raising=False)
    with pytest.raises(pickle.UnpicklingError, match="unknown stored object 'dtype'"):
        et._stored("dtype", "edl_alias")
    assert et._stored("dtype", "bfloat16") is torch.bfloat16


def test_a_state_reads_under_the_name_the_package_was_imported_as(monkeypatch):
    value = {"t": torch.ones(2)}
    written = et._dumps(value)
    monkeypatch.setattr(et, "__name__", "vendored.edl.torch")
    assert torch.equal(et._loads(written)["t"], value["t"])


def test_a_state_that_changes_what_it_names_changes_nothing_for_the_next_read():
    # BUILD with slot state sets attributes on the callable the pickle named.
    crafted = (
        b"\x80\x04" + b"\x8c\x09edl.torch\x8c\x07_stored\x93"
        + b"N}\x8c\x0a__module__\x8c\x02oss\x86b" + b"."
    )
    named = et._loads(crafted)
    assert named.__module__ == "os"
    value = {"t": torch.ones(2)}
    assert torch.equal(et._loads(et._dumps(value))["t"], value["t"])
    with pytest.raises(pickle.UnpicklingError, match="edl.torch.load_checkpoint is not a plain value"):
        et._loads(b"\x80\x04\x8c\x09edl.torch\x8c\x0fload_checkpoint\x93.")


class _StateJob:
    """Takes an ElasticState's registrations: the arrays and its two hooks."""

    samples = 0

    def __init__(self):
        self.arrays = {}

    def register(self, name, array):
        self.arrays[name] = array

    def _state_hooks(self, pack, unpack):
        self.pack, self.unpack = pack, unpack


def test_the_python_copy_past_a_shorter_value_is_zero_as_on_a_fresh_rank():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    job = _StateJob()
    state = et.ElasticState(job, model, opt, note="x" * 300)
    blob = job.arrays["python@torch"]
    state.note = ""
    state.pack()
    fresh_job = _StateJob()
    et.ElasticState(fresh_job, _model(), torch.optim.AdamW(_model().parameters(), lr=0.01), note="")
    assert blob.tobytes() == fresh_job.arrays["python@torch"].tobytes()
    # What the runtime writes there (rank 0's copy, at a generation's start) is read back.
    other = _StateJob()
    et.ElasticState(other, _model(), torch.optim.AdamW(_model().parameters(), lr=0.01), note="rank 0's")
    blob[:] = other.arrays["python@torch"]
    state.unpack()
    assert state.note == "rank 0's"


def test_a_python_copy_that_could_not_be_read_back_is_read_again_not_taken_as_read():
    model = _model()
    job = _StateJob()
    state = et.ElasticState(job, model, torch.optim.AdamW(model.parameters(), lr=0.01), note="mine")
    blob = job.arrays["python@torch"]
    # Bytes that are not a state the package wrote (a pickle naming a
    # function): refused, and refused again at the next read (not skipped
    # as already read back).
    bad = pickle.dumps(print)
    blob[0], blob[1] = len(bad) & 0xFFFF, len(bad) >> 16
    blob[2 : 2 + len(bad)] = list(bad)
    for _ in range(2):
        with pytest.raises(pickle.UnpicklingError, match="print"):
            state.unpack()
        assert state.note == "mine"
    # Rank 0's copy written there afterwards is read back.
    other = _StateJob()
    et.ElasticState(other, _model(), torch.optim.AdamW(_model().parameters(), lr=0.01), note="rank 0's")
    blob[:] = other.arrays["python@torch"]
    state.unpack()
    assert state.note == "rank 0's"


def test_the_python_copy_keeps_the_size_earlier_versions_gave_it():
    # With the RNG state (5 KiB) the capacity follows the pickle's length:
    # sized from the earlier pickle, checkpoints written before still fit.
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    job = _StateJob()
    state = et.ElasticState(job, model, opt, sched, rng=True)
    earlier = len(_earlier(state._python_value()))
    assert earlier > 4 * 1024
    assert len(job.arrays["python@torch"]) == 4 * earlier + 2
    assert len(state._python()) != earlier, "the pickle itself differs from the earlier one"


def test_optimizer_state_that_appears_or_goes_after_registration_is_named():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = et.ElasticState(_StateJob(), model, opt)
    state.pack()
    first = next(iter(model.parameters()))
    opt.state[first]["extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"state \['extra'\] of parameter 0 appeared after"):
        state.pack()
    del opt.state[first]["extra"]
    state.pack()
    del opt.state[first]["momentum_buffer"]
    with pytest.raises(RuntimeError, match=r"state \['momentum_buffer'\] of parameter 0 went away after"):
        state.pack()


class _Tables:
    """A job and a step with tables in memory: rows id * 0.1 + column,
    and the pushes recorded."""

    world = 2

    def __init__(self):
        self.defined, self.pushed = {}, []

    def table(self, name, dim, **options):
        self.defined[name] = dim

    def pull(self, name, ids):
        import numpy as np

        dim = self.defined[name]
        return (np.asarray(ids, dtype=np.float32)[:, None] * 0.1 + np.arange(dim, dtype=np.float32)).astype(np.float32)

    def push(self, name, ids, grads):
        self.pushed.append((name, list(ids), grads.copy()))
        return True


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_sparse_bags_reduce_their_rows_and_push_each_rows_gradient_averaged_over_the_ranks(mode):
    tables = _Tables()
    bag = et.SparseEmbeddingBag(tables, "t", 2, mode=mode)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = bag(ids, tables)
    rows = torch.tensor([[i * 0.1, i * 0.1 + 1] for i in range(1, 7)]).reshape(2, 3, 2)
    want = rows.sum(1) if mode == "sum" else rows.mean(1)
    assert torch.allclose(out, want)
    # The same bags as flat ids and offsets, one of them empty.
    flat = bag(torch.tensor([1, 2, 3, 4, 5, 6]), tables, offsets=torch.tensor([0, 3, 6]))
    assert torch.allclose(flat[:2], want) and (flat[2] == 0).all()
    weights = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    (out * weights).sum().backward()
    name, pushed_ids, grads = tables.pushed[0]
    assert name == "t" and pushed_ids == [1, 2, 3, 4, 5, 6]
    per = 1.0 if mode == "sum" else 1.0 / 3
    want_grads = weights.repeat_interleave(3, dim=0) * per / tables.world
    assert torch.allclose(torch.from_numpy(grads), want_grads)
    with pytest.raises(ValueError, match="give the step"):
        et.SparseEmbedding(tables, "u", 2)(ids)


class _ManyTables(_Tables):
    """`_Tables` whose step also reads several tables in one call."""

    def __init__(self):
        super().__init__()
        self.flights = []

    def pull_many(self, reads):
        self.flights.append([name for name, _ in reads])
        return [self.pull(name, ids) for name, ids in reads]


def test_a_collection_reads_its_tables_in_one_flight_as_each_alone_and_pushes_each():
    tables = _ManyTables()
    deep, bag = et.SparseEmbedding(tables, "deep", 3), et.SparseEmbeddingBag(tables, "wide", 1)
    both = et.SparseEmbeddingCollection(deep, bag)
    ids = torch.tensor([[1, 2], [3, 1]])
    rows, pooled = both(ids, tables)
    assert tables.flights == [["deep", "wide"]]
    assert torch.equal(rows, deep(ids, tables)) and torch.equal(pooled, bag(ids, tables))
    tables.pushed.clear()
    (rows.sum() * 2 + pooled.sum()).backward()
    pushed = {name: (ids, grads) for name, ids, grads in tables.pushed}
    assert set(pushed) == {"deep", "wide"}
    assert pushed["deep"][0] == [1, 2, 3, 1] and (pushed["deep"][1] == 2.0 / tables.world).all()
    assert (pushed["wide"][1] == 1.0 / tables.world).all()
    # A table whose rows the loss does not use is not pushed (the commit pushes it empty).
    tables.pushed.clear()
    rows, _ = both([ids, torch.tensor([[5, 6]])], tables)
    rows.sum().backward()
    assert [name for name, _, _ in tables.pushed] == ["deep"]
    with pytest.raises(ValueError, match="1 ids tensors for 2 tables"):
        both([ids], tables)
    with pytest.raises(ValueError, match="each table once"):
        et.SparseEmbeddingCollection(deep, deep)
    with pytest.raises(ValueError, match="give the step"):
        et.SparseEmbeddingCollection(deep)(ids)


class _Job:
    """Takes registrations and keeps their names."""

    def __init__(self):
        self.names = []

    def register(self, name, array):
        self.names.append(name)


def test_ddp_skips_its_broadcast_only_for_a_module_whose_state_the_job_holds():
    import edl

    held, loose = _model(), _model()
    job = _Job()
    edl.register_torch(job, held)
    assert "0.weight" in job.names
    ddp = et.ElasticDDP(held)
    if et._DDP_INIT_SYNC:
        # The runtime gave every rank rank 0's parameters at the generation's start.
        assert ddp._ddp_options() == {"init_sync": False}
    else:
        assert ddp._ddp_options() == {}
    # Not the job's state: DDP's own broadcast makes the ranks agree.
    assert et.ElasticDDP(loose)._ddp_options() == {}
    # The program's own choice stands.
    assert et.ElasticDDP(held, init_sync=True)._ddp_options() == {"init_sync": True}


class _Step:
    """A generation's step as ElasticDDP reads it: one rank, a store."""

    def __init__(self, generation):
        self.generation, self.rank, self.world, self.step = generation, 0, 1, 0
        self.rendezvous = {"host": "127.0.0.1", "port": 1}

    def store(self, timeout):
        return _Native()


def test_an_old_generations_group_is_let_go_on_a_thread_of_its_own_once_its_ddp_module_is_gone():
    import threading

    def old_group_threads():
        return [t for t in threading.enumerate() if t.name == "edl-old-group"]

    ddp = et.ElasticDDP(_model(), backend="gloo", noise_scale=False)
    try:
        first = ddp.on(_Step(1))
        assert not old_group_threads()
        second = ddp.on(_Step(2))
        assert second is not first
        # The program still names the first generation's module: its group
        # is held (a gloo group's teardown waits on its event loop, which
        # would lengthen the resize's pause), not let go on this thread.
        waiting = old_group_threads()
        assert len(waiting) == 1 and waiting[0].is_alive()
        del first
        waiting[0].join(timeout=30)
        assert not waiting[0].is_alive(), "the old group is let go once its module is gone"
        third = ddp.on(_Step(3))
        assert third is not second
        [held] = old_group_threads()
        # Closing (the job's end, a failed step) lets go of it now, though
        # the program still names the second generation's module.
        ddp.close()
        assert not held.is_alive()
        del second, third
    finally:
        ddp.close()
    assert not old_group_threads()


def test_an_example_warms_a_copy_up_and_leaves_the_module_and_the_random_state_as_they_were():
    # Dropout draws from the random state as it runs.
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.Dropout(0.5), torch.nn.Flatten()
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    example = torch.randn(5, 1, 6, 6)
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    ddp = et.ElasticDDP(model, example=example)
    # Run on a copy (the hook came with it), forward and backward, twice.
    assert len(calls) == 2
    assert ddp.module is model
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "parameters and running statistics untouched"
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    # No group is left behind: the job's first generation builds the default one.
    assert not dist.is_initialized()


def test_an_example_the_module_cannot_take_is_refused_by_name_and_leaves_no_group():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"ElasticDDP\(example=\.\.\.\): the module cannot be run on the example"):
        et.ElasticDDP(model, example=torch.randn(4, 5))
    assert not dist.is_initialized()
    # A tuple is the module's positional arguments.
    bilinear = torch.nn.Bilinear(2, 3, 1)
    et.ElasticDDP(bilinear, example=(torch.randn(4, 2), torch.randn(4, 3)))
    assert all(p.grad is None for p in bilinear.parameters())
