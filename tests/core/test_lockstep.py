"""Ranks that diverge never issue collectives of different sizes (zfunc.coordinator's gate).

gloo aborts the process on a collective whose size differs across ranks, and nccl's result
is undefined; so divergence must be found before any such collective is issued, whatever the
units' sizes, in forward or only in backward, at the recording step or after it. Each rank
writes down every collective zfunc.dist issues, (op, elements, dtype), and the ranks' lists
must agree wherever both have an entry.
"""
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from workers import workers

WIDTHS = (3, 7, 12, 20)  # the blocks' hidden sizes: every unit has its own size


class Blocks(nn.Module):
    """A residual MLP whose rank-dependent ``skip`` leaves a block out (forward and backward
    differ) and ``detach`` cuts a block off the loss (only backward differs)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, h), nn.Tanh(), nn.Linear(h, 4)) for h in WIDTHS)
        self.out = nn.Linear(4, 2)
        self.skip = self.detach = None

    def forward(self, x):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                y = block(h)
                h = h + (y.detach() if i == self.detach else y)
        return self.out(h)


class _Logged:
    """torch.distributed as zfunc.dist sees it, writing down each collective it issues."""

    def __init__(self, real):
        self.real, self.log = real, []

    def __getattr__(self, name):
        f = getattr(self.real, name)
        if name not in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                        "all_reduce", "broadcast"):
            return f

        def logged(*args, **kw):
            t = args[1] if name.endswith(("_single", "_tensor")) else args[0]
            self.log.append((name, t.numel(), str(t.dtype)))
            return f(*args, **kw)

        return logged


def _step(transform: str, timeout: float, folder: str, model):
    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(zf.apply(model, params, x), y)

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    if transform == "zero2":
        return zf.zero2(step)
    if transform == "nvme":
        return zf.zero3(zf.offload_nvme(step, folder), collective_timeout=timeout)
    return zf.zero3(step, collective_timeout=timeout)


def run_logged(transform: str, changes: list, at_step: int, timeout: float, folder: str) -> dict:
    """Train ``Blocks``; at ``at_step`` rank r sets ``changes[r]`` (attribute, block) on the model.
    Returns the step that raised (None if none), its error, and every collective issued."""
    import zfunc.dist as zdist

    rank, world = zf.dist.rank(), zf.dist.world_size()
    logged = zdist.dist = _Logged(zdist.dist)
    try:
        torch.manual_seed(0)
        model = Blocks()
        step = _step(transform, timeout, f"{folder}/rank{rank}", model)
        state = step.init(model)
        for i in range(at_step + 1):
            model.skip = model.detach = None
            if i == at_step and changes[rank] is not None:
                setattr(model, *changes[rank])
            g = torch.Generator().manual_seed(100 * i + rank)
            start = time.monotonic()
            try:
                state, _ = step(state, (torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)))
            except zf.RanksDivergedError as e:
                return {"step": i, "error": str(e), "seconds": time.monotonic() - start, "log": logged.log}
        return {"step": None, "log": logged.log}
    finally:
        zdist.dist = logged.real


def assert_never_mismatched(results):
    """Wherever two ranks both issued an i-th collective, it is the same op of the same size."""
    logs = [r["log"] for r in results]
    for rank, log in enumerate(logs[1:], 1):
        n = min(len(log), len(logs[0]))
        diff = next((i for i in range(n) if log[i] != logs[0][i]), None)
        assert diff is None, f"collective {diff}: rank 0 issued {logs[0][diff]}, rank {rank} {log[diff]}"


CHANGES = {
    "skips_a_block": [None, ("skip", 1)],  # forward: the gathers differ (zero3), then the reductions
    "skips_the_last": [None, ("skip", 3)],  # rank 1's order is a prefix of rank 0's
    "backward_only": [None, ("detach", 2)],  # same forward; rank 1 neither re-gathers nor reduces block 2
    "each_its_own": [("skip", 2), ("skip", 1)],  # both depart, differently
}


# every change under every transform after two agreed steps; at the first step (no agreed order yet), under zero3
DIVERGENCES = [(t, how, 2) for t in ("zero3", "zero2", "nvme") for how in CHANGES] + [("zero3", how, 0) for how in CHANGES]
FAST = {("zero3", "each_its_own", 2), ("nvme", "skips_the_last", 2)}
DIVERGENCES = [d if d in FAST else pytest.param(*d, marks=pytest.mark.slow) for d in DIVERGENCES]


@pytest.mark.parametrize("transform, how, at_step", DIVERGENCES)
def test_diverging_ranks_raise_and_never_issue_mismatched_collectives(transform, how, at_step, tmp_path):
    """Every rank raises RanksDivergedError at the step that diverged, well within the timeout,
    naming a block; no rank issued a collective its peer did not issue alike."""
    timeout = 20.0
    try:
        results = workers(2).run(run_logged, transform, CHANGES[how], at_step, timeout, str(tmp_path))
    finally:
        workers(2).restart()  # a rank that left the agreed order may have left collectives behind
    assert_never_mismatched(results)
    for r in results:
        assert r["step"] == at_step, r
        assert "ranks materialized different units" in r["error"] and "'blocks." in r["error"], r["error"]
        assert r["seconds"] < timeout / 4, r


def test_three_ranks_one_departs_after_recording(tmp_path):
    results = None
    try:
        results = workers(3).run(run_logged, "zero3", [None, None, ("skip", 0)], 2, 20.0, str(tmp_path))
    finally:
        workers(3).restart()
    for r in results:
        assert r["step"] == 2 and "rank 2: 'blocks.1'" in r["error"] and "rank 0: 'blocks.0'" in r["error"], r
    assert_never_mismatched(results)


@pytest.mark.parametrize("transform", [pytest.param("zero3", marks=pytest.mark.slow), "zero2"])
def test_a_change_every_rank_makes_goes_on_checked(transform, tmp_path):
    """All ranks skip the same block after recording: they agree they left the trace alike, go on
    checking each collective, and the step completes; every collective matched."""
    results = workers(2).run(run_logged, transform, [("skip", 1), ("skip", 1)], 2, 20.0, str(tmp_path))
    assert all(r["step"] is None for r in results), results
    assert_never_mismatched(results)
    assert len(results[0]["log"]) == len(results[1]["log"])
