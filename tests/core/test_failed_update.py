"""A failed optimizer update is final (issue 37, point 1).

The Adam kernel is broken to raise partway through one update, after it has updated the first k
tensors (any unit: host units on offload_cpu's worker with overlap, or on the caller's thread
without; the device units of a split plan; offload_nvme's streamed sub-groups). From then on the
state that update returned, and the state it was given, refuse every use: a step, a checkpoint
(writing nothing), zf.gather_params, zf.memory_report, reading the leaves; each every time it is
tried, on every rank, with an error naming the first failure and saying to load the last
checkpoint. A collective use (a step, a save, a gather) raises on all ranks rather than hanging,
whichever rank failed."""
import importlib
import os
import tempfile
import time

import pytest
import torch
from torch import nn

import zfunc as zf
from workers import workers

adam = importlib.import_module("zfunc.ops.adam")
UNITS = 5  # the root and four blocks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(UNITS - 1))
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class InjectedFault(RuntimeError):
    pass


def break_adam_after(k: int):
    """Make the Adam kernel update ``k`` more tensors, then raise (partway through a call, as a
    kernel that dies half done); returns the function that undoes it."""
    real = adam.adam_update_
    left = [k]

    def broken(params, grads, mu, nu, *, lowp_params=None, **kw):
        n = left[0]
        if len(params) <= n:
            left[0] -= len(params)
            return real(params, grads, mu, nu, lowp_params=lowp_params, **kw)
        if n:
            real(params[:n], grads[:n], mu[:n], nu[:n], lowp_params=None if lowp_params is None else lowp_params[:n],
                 **kw)
        left[0] = 0
        raise InjectedFault(f"the injected kernel fault after {k} tensors")

    adam.adam_update_ = broken
    return lambda: setattr(adam, "adam_update_", real)


TIMEOUT_S = 30  # the steps' collective timeout: every rank must raise far sooner
PROMPT_S = 10  # the most any one use may take on any rank, failing or refusing


def make_step(kind: str, overlap: bool, ratio, folder: str, stage: int = 3):
    """``zero{stage}`` over ``kind``'s offload (zero1/2 keep parameters off the disk: params=False)."""
    holder = []

    def loss_fn(params, b):
        return nn.functional.mse_loss(zf.apply(holder[0], params, b[0]), b[1])

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    if kind == "cpu":
        step = zf.offload_cpu(step, copy_grads_on_host=True, overlap=overlap, ratio=ratio)
    else:  # two units a sub-group: the update streams, the last sub-group stays resident
        step = zf.offload_nvme(step, folder, sub_group_size=150, buffer_size=4096, params=stage == 3,
                               collective_timeout=TIMEOUT_S)
    model = Net()
    holder.append(model)
    stepped = zf.zero3(step, collective_timeout=TIMEOUT_S) if stage == 3 else (zf.zero1, zf.zero2)[stage - 1](step)
    return stepped, model


def batch(rank: int, i: int):
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def _refusals(state, step, folder: str, rank: int, uses: tuple) -> list[str]:
    """Each of ``uses`` on ``state`` twice; each must raise, within ``PROMPT_S``. Returns the messages."""
    out = []
    for use in uses:
        for attempt in range(2):
            where = os.path.join(folder, f"ckpt-{use}-{attempt}")
            began = time.perf_counter()
            with pytest.raises(RuntimeError) as e:
                if use == "step":
                    step(state, batch(rank, 9))
                elif use == "save":
                    zf.checkpoint.save(state, where, "t")
                elif use == "gather":
                    zf.gather_params(state)
                elif use == "report":
                    zf.memory_report(state)
                else:
                    state.params.leaves
            took = time.perf_counter() - began
            assert took < PROMPT_S, f"rank {rank}: {use} took {took:.1f} s to refuse ({e.value})"
            assert not os.path.exists(where), f"{use} wrote {where}"
            text = str(e.value)
            assert "load your last checkpoint" in text, text
            out.append(text)
    return out


ALL_USES = ("step", "save", "gather", "report", "leaves")


def fault_run(kind: str, overlap: bool, ratio, k: int, failing: int, first: str = "step", stage: int = 3) -> dict:
    """On every rank: a clean step, then one whose update breaks after ``k`` tensors on rank
    ``failing`` alone; then every use of the states, ``first`` first. Returns what happened."""
    rank = zf.dist.rank()
    with tempfile.TemporaryDirectory() as folder:
        step, model = make_step(kind, overlap, ratio, folder, stage)
        state = step.init(model)
        state, _ = step(state, batch(rank, 0))
        state.params.leaves  # the first update is over before the kernel breaks
        given = state
        undo = break_adam_after(k) if rank == failing else (lambda: None)
        raised = None
        try:
            began = time.perf_counter()
            try:
                state, _ = step(state, batch(rank, 1))
            except InjectedFault as e:
                raised = str(e) + "\n".join(getattr(e, "__notes__", []))
            except RuntimeError as e:  # offload_nvme: a write after the fault
                raised = str(e)
            took = time.perf_counter() - began
            assert took < PROMPT_S, f"rank {rank}: the failing step took {took:.1f} s"
            if rank == failing and raised is None and kind == "cpu":
                # overlap: the update runs behind the step; a fault there surfaces at the next use
                assert overlap
            uses = (first,) + tuple(u for u in ALL_USES if u != first)
            messages = _refusals(state, step, folder, rank, uses)
            # the state the failed update was given refuses too (on a rank whose step raised, it is the same)
            messages += _refusals(given, step, folder, rank, ("step", "gather", "leaves"))
        finally:
            undo()
        swapped = getattr(state.opt_state, "store", None)
        if swapped is not None:
            state.close()
    return {"raised": raised, "messages": messages}


def _check(results, k: int, failing: int):
    for rank, r in enumerate(results):
        if rank == failing and r["raised"] is not None:
            assert "load your last checkpoint" in r["raised"] or "after writing part of the state" in r["raised"], r
        for text in r["messages"]:
            if rank == failing:  # the first failure is named
                assert f"after {k} tensors" in text, text
            else:
                assert "another rank" in text, text


def _tensors_per_update(kind: str, ratio, stage: int = 3) -> int:
    """How many tensors one update hands the kernel on this rank (a fault may come after any of them)."""
    calls = []
    real = adam.adam_update_
    adam.adam_update_ = lambda params, *a, **kw: calls.append(len(params)) or real(params, *a, **kw)
    try:
        with tempfile.TemporaryDirectory() as folder:
            step, model = make_step(kind, False, ratio, folder, stage)
            state = step.init(model)
            state, _ = step(state, batch(zf.dist.rank(), 0))
            if kind == "nvme":
                state.close()
    finally:
        adam.adam_update_ = real
    return sum(calls)


def _faults(n: int) -> list[int]:
    """Where to break an update of ``n`` tensors: eight places and the last (offload_nvme's many
    pieces: 0 breaks its first sub-group before any write, the last one after the others' writes)."""
    return sorted({*range(0, n, max(1, n // 8)), n - 1})


FAST = [("cpu", True, None, 2), ("cpu", False, None, 2), ("cpu", True, 0.5, 0), ("nvme", False, None, 3)]


@pytest.mark.parametrize("kind, overlap, ratio, k", FAST)
def test_a_fault_in_the_update_refuses_every_later_use(kind, overlap, ratio, k):
    (r,) = workers(1).run(fault_run, kind, overlap, ratio, k, 0)
    _check([r], k, 0)


@pytest.mark.parametrize("overlap, first", [(True, "step"), (False, "step"), (True, "gather"), (False, "save")])
def test_one_rank_failing_refuses_on_every_rank(overlap, first):
    results = workers(2).run(fault_run, "cpu", overlap, None, 2, 1, first)
    _check(results, 2, 1)
    assert results[0]["raised"] is None  # rank 0's own update went through


# where the fault comes: "first", the first tensor (before any of offload_nvme's writes); "last", after them
@pytest.mark.parametrize("kind, stage, where", [("nvme", 3, "last"), ("cpu", 1, "last")])
def test_one_rank_failing_raises_promptly_on_every_rank(kind, stage, where):
    """offload_nvme (whose failed store reads nothing more) and zero1/2 (whose update ends in
    all-gathers): every rank raises at once, within PROMPT_S, not at the collective timeout."""
    n = workers(2).run(_tensors_per_update, kind, None, stage)[1]
    k = 0 if where == "first" else n - 1
    results = workers(2).run(fault_run, kind, False, None, k, 1, "step", stage)
    _check(results, k, 1)
    assert results[1]["raised"] is not None
    if stage == 3:
        assert results[0]["raised"] is None  # rank 0's own update went through; it learns at its next step
    else:  # zero1/2 agree before gathering: rank 0's step raises too
        assert "another rank" in results[0]["raised"], results[0]["raised"]


@pytest.mark.slow
@pytest.mark.parametrize("kind, stage", [("nvme", 3), ("nvme", 2), ("nvme", 1), ("cpu", 1), ("cpu", 2)])
@pytest.mark.parametrize("failing", [0, 1])
def test_a_fault_anywhere_on_either_rank_raises_promptly_on_every_rank(kind, stage, failing):
    n = workers(2).run(_tensors_per_update, kind, None, stage)[failing]
    # zero3: the other rank learns at its next collective use; zero1/2 tell it in the failing step
    firsts = ("step", "save", "gather") if stage == 3 else ALL_USES
    for k, first in zip(_faults(n), firsts * n):
        results = workers(2).run(fault_run, kind, False, None, k, failing, first, stage)
        _check(results, k, failing)


@pytest.mark.slow
@pytest.mark.parametrize("kind, overlap, ratio", [("cpu", True, None), ("cpu", False, None), ("cpu", True, 0.5),
                                                  ("cpu", False, 0.5), ("nvme", False, None)])
def test_a_fault_at_any_tensor_of_the_update(kind, overlap, ratio):
    n = _tensors_per_update(kind, ratio)
    assert n >= UNITS
    for k in _faults(n):
        (r,) = workers(1).run(fault_run, kind, overlap, ratio, k, 0)
        _check([r], k, 0)


@pytest.mark.slow
@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("overlap, ratio", [(True, None), (False, None), (True, 0.5)])
def test_a_fault_at_any_unit_on_either_rank(failing, overlap, ratio):
    for k, first in zip(range(UNITS), ("step", "save", "gather", "step", "save")):
        results = workers(2).run(fault_run, "cpu", overlap, ratio, k, failing, first)
        _check(results, k, failing)


def test_a_state_whose_update_went_through_is_untouched_by_all_this():
    """The checks cost a clean state nothing: it steps, saves, gathers and reports as before."""
    with tempfile.TemporaryDirectory() as folder:
        step, model = make_step("cpu", True, None, folder)
        state = step.init(model)
        for i in range(3):
            state, _ = step(state, batch(0, i))
        zf.gather_params(state)
        zf.memory_report(state)
        assert os.path.isdir(zf.checkpoint.save(state, os.path.join(folder, "ckpt"), "t"))


@pytest.mark.parametrize("overlap", [True, False])
def test_the_last_checkpoint_trains_on_as_if_nothing_had_failed(tmp_path, overlap):
    """What the error says to do works: a state built again and loaded from the last checkpoint,
    on the same step, trains bit for bit as a run in which the update never failed."""
    import copy

    step, model = make_step("cpu", overlap, None, str(tmp_path))
    spare = copy.deepcopy(model)
    clean = step.init(copy.deepcopy(model))
    for i in range(3):
        clean, _ = step(clean, batch(0, i))
    expected = zf.gather_params(clean)

    state = step.init(model)
    state, _ = step(state, batch(0, 0))
    zf.checkpoint.save(state, str(tmp_path / "ckpt"), "last")
    undo = break_adam_after(2)
    try:
        try:
            state, _ = step(state, batch(0, 1))
        except InjectedFault:
            assert not overlap
        with pytest.raises(zf.UpdateFailed, match="after 2 tensors"):
            step(state, batch(0, 1))
    finally:
        undo()
    state, _ = zf.checkpoint.load(step.init(spare), str(tmp_path / "ckpt"))
    for i in (1, 2):
        state, _ = step(state, batch(0, i))
    zf.testing.assert_trees_all_equal(zf.gather_params(state), expected)


def pipeline_fault_run(stages: int, zero_stage: int, failing: int, k: int) -> dict:
    """A pipeline of ``stages`` (zero inside each stage's data-parallel group): a clean batch, then
    one whose update breaks after ``k`` tensors on rank ``failing`` alone; then train_batch,
    eval_batch and save_checkpoint twice each. Returns what each raised and how long it took."""
    from pipelines import config, micro_batch, pipe

    rank = zf.dist.rank()
    engine = zf.initialize(pipe(stages), config(2, zero_stage))
    data = lambda i: iter([micro_batch(i, m, engine.grid.replica) for m in range(2)])  # noqa: E731
    engine.train_batch(data(0))
    engine.state.params.leaves
    undo = break_adam_after(k) if rank == failing else (lambda: None)
    out = {"raised": None, "messages": [], "slowest": 0.0}
    try:
        out["stage"] = engine.grid.stage
        try:
            engine.train_batch(data(1))
        except (InjectedFault, zf.UpdateFailed) as e:  # the second: the failed rank's data-parallel peers
            out["raised"] = str(e)
        with tempfile.TemporaryDirectory() as folder:
            for use in ("train", "train", "eval", "save", "eval", "train"):
                began = time.perf_counter()
                with pytest.raises(zf.UpdateFailed) as e:
                    if use == "train":
                        engine.train_batch(data(2))
                    elif use == "eval":
                        engine.eval_batch(data(2))
                    else:
                        engine.save_checkpoint(folder, "t")
                out["slowest"] = max(out["slowest"], time.perf_counter() - began)
                out["messages"].append(str(e.value))
            assert not os.listdir(folder), os.listdir(folder)
    finally:
        undo()
    return out


def _check_pipeline(results, k: int, failing: int):
    for rank, r in enumerate(results):
        peer = rank != failing and r["stage"] == results[failing]["stage"]  # zero1/2 agree on the update
        assert (r["raised"] is not None) == (rank == failing or peer), (rank, r["raised"])
        assert not peer or "another rank" in r["raised"], r["raised"]
        assert r["slowest"] < PROMPT_S, (rank, r["slowest"])
        for text in r["messages"]:
            assert "load your last checkpoint" in text, text
            assert (f"after {k} tensors" in text) if rank == failing else ("another rank" in text), (rank, text)


def test_a_failed_stage_of_a_pipeline_raises_on_every_stage():
    """The other stages learn of it at the pipeline's own agreement (it passes agreement= to the
    stage's step), which the failed stage reaches by running the schedule on what its update left."""
    _check_pipeline(workers(2).run(pipeline_fault_run, 2, 1, 1, 2), 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_a_fault_on_any_rank_of_a_pipeline_with_data_parallel_stages(zero_stage):
    """P = 2 x DP = 2: the failed rank's data-parallel peer raises in the same update (zero1/2
    agree before gathering), every stage at the pipeline's next agreement."""
    for failing, k in ((0, 0), (1, 2), (2, 1), (3, 2)):  # each stage's update hands the kernel three tensors
        _check_pipeline(workers(4).run(pipeline_fault_run, 2, zero_stage, failing, k), k, failing)
