"""A ``step.init`` that raises leaves nothing behind (issue 37, point 7): whatever the cause
(missing weights, weights of another model, a plan for another model, an ``init_fn`` that
raises, an optimizer whose init raises, too little host memory, an interrupt), the swap path is
left exactly as it was: the files and folders init made are removed, a folder the user had
(and what is in it) stays, and no swap store stays open. W = 1 and 2."""
import importlib
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

import zfunc as zf
from workers import workers
from zfunc.swap.placeholders import open_stores


class Chain(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, width), nn.Linear(width, width), nn.Linear(width, 2)])


def _unit(name, m) -> bool:
    return isinstance(m, nn.Linear)


class Boom(Exception):
    pass


def _raising_init_fn(after: int):
    """An ``init_fn`` that raises on the ``after``-th module it initializes (after the swap files
    of the units before it were written)."""
    seen = []

    def init_fn(module):
        seen.append(module)
        if len(seen) > after:
            raise Boom(f"init_fn failed on {type(module).__name__}")
        for p in module.parameters(recurse=False):
            nn.init.normal_(p)

    return init_fn


def _failing_optimizer(inner):
    """``inner`` whose init raises: every unit's shards are on disk by then."""

    def init(params):
        raise Boom("the optimizer's init failed")

    return zf.optim.Optimizer(init, inner.update, fuses=True)


COMPOSITIONS = {
    "zero3 params": lambda f, path, **kw: zf.zero3(zf.offload_nvme(f, path, **kw)),
    "zero2": lambda f, path, **kw: zf.zero2(zf.offload_nvme(f, path, params=False, **kw)),
    "bf16 no stage": lambda f, path, **kw: zf.offload_nvme(zf.mixed_precision(f, torch.bfloat16), path, **kw),
    "optimizer in RAM": lambda f, path, **kw: zf.zero3(zf.offload_nvme(f, path, optimizer=False, **kw)),
    "host budget": lambda f, path, **kw: zf.zero3(zf.offload_nvme(f, path, host_budget=kw.pop("host_budget", 600),
                                                                 **kw)),
}
CAUSES = ["missing weights", "other weights", "bad plan", "init_fn", "optimizer", "host memory", "interrupt"]


def _fail(cause: str, composition: str, path: str, scratch: str, monkeypatch=None) -> str:
    """Run an init of ``composition`` under ``path`` that fails for ``cause``; the error's text."""
    opt = zf.optim.adamw(1e-2)
    if cause == "optimizer":
        opt = _failing_optimizer(opt)
    f = zf.train_step(lambda p, b: 0, opt, units=_unit)
    kw, init = {}, {}
    model = Chain()
    if cause == "missing weights":
        init["weights"] = os.path.join(scratch, "no-such-folder")
    elif cause == "other weights":
        other = os.path.join(scratch, "other.safetensors")
        save_file({k: v.contiguous() for k, v in nn.Linear(3, 3).state_dict().items()}, other)
        with torch.device("meta"):
            model = Chain()
        init["weights"] = other
    elif cause == "bad plan":
        kw["plan"] = zf.OffloadPlan((), ("layers.0",), disk_units=("layers.1", "nope"))
        if composition in ("optimizer in RAM", "host budget"):
            composition = "zero3 params"  # those take no plan
    elif cause in ("init_fn", "interrupt"):
        with torch.device("meta"):
            model = Chain()
        init["init_fn"] = _raising_init_fn(1)
        if cause == "interrupt":  # not an Exception: init cleans up on anything that leaves it
            raising = init["init_fn"]

            def interrupted(module):
                try:
                    raising(module)
                except Boom as e:
                    raise KeyboardInterrupt(str(e)) from None

            init["init_fn"] = interrupted
    elif cause == "host memory":
        composition = "host budget"
        kw["host_budget"] = 10**15
        plans = importlib.import_module("zfunc.transforms.offload.plan")
        monkeypatch.setattr(plans, "available_memory", lambda: 1)
    step = COMPOSITIONS[composition](f, path, **kw)
    try:
        step.init(model, **init)
    except (Exception, KeyboardInterrupt) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"init did not fail ({cause}, {composition})")


def _snapshot(root) -> dict:
    """Every file and folder under ``root``: relative path -> its bytes (None for a folder)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(folder, d), root)] = None
        for name in files:
            with open(os.path.join(folder, name), "rb") as fh:
                out[os.path.relpath(os.path.join(folder, name), root)] = fh.read()
    return out


def _prepare(root, where: str) -> str:
    """The swap path as the user left it: missing (two levels), an empty folder, or a folder with
    their own files, a ``rank0`` folder and an older state folder in it."""
    if where == "missing":
        return os.path.join(root, "not", "yet")
    path = os.path.join(root, "swap")
    os.makedirs(path)
    if where == "occupied":
        os.makedirs(os.path.join(path, "rank0", "state-mine"))
        for name, text in (("notes.txt", "mine"), ("rank0/keep.swp", "also mine"),
                           ("rank0/state-mine/u000.swp", "an old state's")):
            with open(os.path.join(path, name), "w") as fh:
                fh.write(text)
    return path


EXPECTED = {"missing weights": r"weights '.*no-such-folder' do not exist", "other weights": r"",
            "bad plan": r"made for other units", "init_fn": r"Boom: init_fn failed",
            "optimizer": r"Boom: the optimizer's init failed", "host memory": r"MemoryError: offload_nvme needs .*optimizer state kept in host memory",
            "interrupt": r"KeyboardInterrupt: init_fn failed"}


@settings(max_examples=40, deadline=None)
@given(cause=st.sampled_from(CAUSES), composition=st.sampled_from(sorted(COMPOSITIONS)),
       where=st.sampled_from(["missing", "empty", "occupied"]))
def test_a_failed_init_leaves_the_swap_path_as_it_was(tmp_path_factory, cause, composition, where):
    root = tmp_path_factory.mktemp("cleanup")
    path = _prepare(str(root), where)
    before, stores = _snapshot(root), set(open_stores)
    with pytest.MonkeyPatch.context() as monkeypatch:
        message = _fail(cause, composition, path, str(tmp_path_factory.mktemp("scratch")), monkeypatch)
    assert __import__("re").search(EXPECTED[cause], message), message
    assert _snapshot(root) == before, message
    assert set(open_stores) == stores  # no store left open (its handles and pool went with it)


def test_nine_failed_inits_in_one_process_leave_no_file(tmp_path):
    """The issue's case: ``zero3(offload_nvme(...)).init(model, weights="/missing")``, nine times;
    then a good init in the same folder runs, and its close leaves the folder as it was too."""
    path = tmp_path / "swap"
    step = zf.zero3(zf.offload_nvme(zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-2), units=_unit), path))
    for _ in range(9):
        with pytest.raises(Exception, match="do not exist"):
            step.init(Chain(), weights=str(tmp_path / "missing"))
    assert list(tmp_path.iterdir()) == []
    with step.init(Chain()) as state:
        assert os.listdir(state.opt_state.store.dir)
    assert list(tmp_path.iterdir()) == []


def fail_on_every_rank(cause: str, composition: str, path: str, scratch: str) -> str:
    return _fail(cause, composition, path, os.path.join(scratch, f"rank{torch.distributed.get_rank()}"))


@pytest.mark.parametrize("cause, where", [("missing weights", "missing"), ("init_fn", "occupied"),
                                          ("optimizer", "empty")])
def test_a_failed_init_across_ranks_leaves_the_swap_path_as_it_was(tmp_path, cause, where):
    path = _prepare(str(tmp_path / "root"), where) if where != "missing" else str(tmp_path / "root" / "a" / "b")
    os.makedirs(tmp_path / "root", exist_ok=True)
    for r in range(2):
        os.makedirs(tmp_path / "scratch" / f"rank{r}")
    before = _snapshot(tmp_path / "root")
    messages = workers(2).run(fail_on_every_rank, cause, "zero3 params", path, str(tmp_path / "scratch"))
    assert all(__import__("re").search(EXPECTED[cause], m) for m in messages), messages
    assert _snapshot(tmp_path / "root") == before


@pytest.mark.parametrize("first_to_close", [0, 1])
def test_the_last_rank_to_close_removes_what_another_made(tmp_path, first_to_close):
    """Rank 0 makes the missing ``a/b`` before rank 1 looks: whichever closes last removes it, and a
    folder the user made stays (the race a failed init across ranks ran into)."""
    import shutil

    from zfunc.swap import folders

    (tmp_path / "user").mkdir()
    path = tmp_path / "user" / "a" / "b"
    states = [folders.fresh_folder(str(path / f"rank{r}")) for r in range(2)]
    for r in (first_to_close, 1 - first_to_close):
        shutil.rmtree(states[r])
        folders.remove_made(str(path / f"rank{r}"))
        assert path.exists() == (r == first_to_close)
    assert os.listdir(tmp_path) == ["user"] and os.listdir(tmp_path / "user") == []
