"""Per-rank memory: model-state bytes follow the ZeRO formulas (docs/records/benchmarks.md, memory in units of Ψ); a step's objects go when it returns; a long run holds flat memory."""
import pytest
import torch

from zfunc.testing import memory
from cases import meta_init_peak, run_zfunc
from workers import fresh_workers, workers

P = G = 4  # fp32 parameters and gradients
K = 8  # AdamW: fp32 first and second moments
MODEL = ("deep_mlp", {"d_in": 5, "width": 23, "depth": 4, "d_out": 3})


def formula(stage: int, psi: int, world: int) -> int:
    return {
        0: (P + G + K) * psi,
        1: (P + G) * psi + K * psi / world,
        2: P * psi + (G + K) * psi / world,
        3: (P + G + K) * psi / world,
    }[stage]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_follow_zero_formulas(stage, world):
    name, kw = MODEL
    for r in workers(world).run(run_zfunc, name, kw, stage, 1, 2):
        psi = sum(padded for _, _, padded in r["units"])  # parameters plus padding
        held = r["memory"]["param_bytes"] + r["grad_bytes"][-1] + r["memory"]["optimizer_bytes"]
        assert held == pytest.approx(formula(stage, psi, world), rel=0.05)


@pytest.mark.parametrize("world", [2, 3])
def test_zero3_keeps_gathered_units_within_max_live_parameters(world):
    """With a budget of the two largest units plus the root, the coordinator never lets
    more be gathered or in flight at once; with the default budget it prefetches more."""
    name, kw = MODEL
    [probe, *_] = workers(world).run(run_zfunc, name, kw, 3, 3, 2)
    sizes = {unit: padded for unit, _, padded in probe["units"]}
    root = sizes.pop("", 0)
    budget = sum(sorted(sizes.values())[-2:]) + root
    for r in workers(world).run(run_zfunc, name, kw, 3, 3, 2, 0, None, 0, None, "zero3", True, None, False,
                                {"max_live_parameters": budget}):
        assert 0 < r["peak"] <= 4 * budget
        assert all(m["max_live_elements"] <= budget for m in r["prefetch"])
        assert all(m["hits"] > 0 for m in r["prefetch"][1:])  # it still prefetches, within the budget
    assert 4 * budget < probe["peak"] < 4 * sum(p for _, _, p in probe["units"]) + 1


@pytest.mark.parametrize("world", [2, 3])
def test_persistent_units_stay_replicated(world):
    """Units under the persistence threshold keep full parameters, sharded optimizer state."""
    name, kw = MODEL
    [r0, *_] = workers(world).run(run_zfunc, name, kw, 3, 1, 2, 0, None, 10**9)
    psi = sum(padded for _, _, padded in r0["units"])
    assert r0["memory"]["param_bytes"] == P * psi
    assert r0["memory"]["optimizer_bytes"] == pytest.approx(K * psi / world, rel=0.05)
    assert r0["peak"] == 0


def test_meta_device_init_never_holds_the_model():
    """zero3 init of a meta-device model at W = 2: peak RSS above the baseline stays under
    a budget of 3/4 of the model (each rank's half plus a few units), so no rank ever
    held the whole model; the eager path needs the whole model before it starts."""
    with fresh_workers(2) as group:
        for r in group.run(meta_init_peak, 32, 700):
            budget = 0.75 * r["full"]
            assert r["held"] == pytest.approx(r["full"] / 2, rel=0.01)
            assert r["peak"] < budget, f"init peaked at {r['peak'] / 2**20:.1f} MiB above baseline, budget {budget / 2**20:.1f} MiB"
            assert r["peak"] < r["held"] + 6 * r["unit"]


def garbage_cycles_per_step(mode: str, width: int = 32, depth: int = 4) -> int:
    """Objects a step of ``mode`` leaves in reference cycles, after three warm-up steps: they
    (and the tensors they hold) would wait for the collector's next full pass instead of going
    when the step returns."""
    import gc
    import shutil
    import tempfile

    import zfunc as zf
    from models import DeepMLP

    model = DeepMLP(width, width, depth, width)
    batch = (torch.randn(8, width), torch.randn(8, width))

    def loss_fn(params, b):
        return ((zf.apply(model, params, b[0]) - b[1]) ** 2).mean()

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-3))
    if mode == "accumulate":
        step = zf.accumulate(step, 2)
    swap = tempfile.mkdtemp(prefix="zfunc-memory-")
    if mode == "zero3_nvme":
        step = zf.offload_nvme(step, swap)
    if mode != "train_step":
        step = zf.zero3(step)
    state = step.init(model)
    try:
        for _ in range(3):
            state, _ = step(state, batch)
        gc.collect()
        state, _ = step(state, batch)
        return gc.collect()
    finally:
        state.close()
        shutil.rmtree(swap, ignore_errors=True)


@pytest.mark.parametrize("mode", ["zero3", "zero3_nvme", "accumulate", "train_step"])
def test_a_step_leaves_no_reference_cycles(mode):
    """Every object a step makes goes when the step returns; none wait for the collector."""
    assert workers(2).run(garbage_cycles_per_step, mode) == [0, 0]


def soak(mode: str, warmup: int, window: int, windows: int, measure: str, width: int = 64, depth: int = 4) -> list:
    """What this rank gains in each of ``windows`` runs of ``window`` steps of ``mode``, after
    ``warmup`` steps have filled what is bounded (malloc's arenas, CPython's free lists, the
    coordinator's recorded order): ``measure="rss"``, bytes of resident memory; ``"objects"``, the
    live Python objects by type whose count changed (tensors also by their bytes)."""
    import collections
    import gc
    import shutil
    import tempfile

    import zfunc as zf
    from models import DeepMLP

    def rss() -> int:
        gc.collect()
        return memory.rss()

    def census() -> collections.Counter:
        gc.collect()
        live = collections.Counter()
        for o in gc.get_objects():
            live[type(o).__name__] += 1
            if isinstance(o, torch.Tensor):  # (its storage's Python object would outlive the census)
                live["tensor bytes"] += o.numel() * o.element_size()
        return live

    torch.manual_seed(0)
    model = DeepMLP(width, width, depth, width)
    g = torch.Generator().manual_seed(zf.dist.rank())
    batch = (torch.randn(8, width, generator=g), torch.randn(8, width, generator=g))

    def loss_fn(params, b):
        return ((zf.apply(model, params, b[0]) - b[1]) ** 2).mean()

    swap = tempfile.mkdtemp(prefix="zfunc-memory-")
    step = zf.train_step(loss_fn, zf.optim.adamw(1e-3))
    if mode == "zero3_nvme":
        step = zf.offload_nvme(step, swap)
    step = zf.zero3(step)
    state = step.init(model)
    try:
        samples = []
        for i in range(warmup + window * windows + 1):
            if i >= warmup and (i - warmup) % window == 0:
                samples.append(rss() if measure == "rss" else census())
            if i < warmup + window * windows:
                state, metrics = step(state, batch)
                metrics["loss"].item()
        if measure == "rss":
            return [b - a for a, b in zip(samples, samples[1:])]
        return [{k: b[k] - a[k] for k in a.keys() | b.keys() if a[k] != b[k]} for a, b in zip(samples, samples[1:])]
    finally:
        state.close()
        shutil.rmtree(swap, ignore_errors=True)


@pytest.mark.parametrize("mode", ["zero3", "zero3_nvme"])
def test_a_run_keeps_no_more_objects(mode):
    """After a warm-up, each of two runs of 60 more steps at W = 2 leaves the same tensor bytes
    and, type by type, the same live Python objects within a few (the worker's own queue traffic
    moves a handful; a leak of one object a step gains 60): what a leak in zfunc holds, counted,
    so the machine's load cannot make it fail (resident memory, below, can only be sampled)."""
    for rank, runs in enumerate(workers(2).run(soak, mode, 50, 60, 2, "objects")):
        for gained in runs:
            assert gained.pop("tensor bytes", 0) == 0, f"rank {rank} holds more tensor bytes after 60 steps of {mode}"
            grown = {kind: n for kind, n in gained.items() if n > 8}
            assert not grown, f"rank {rank} holds more objects after 60 steps of {mode}: {grown}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero3", "zero3_nvme"])
def test_a_long_run_holds_flat_memory(mode):
    """Resident memory per rank stays flat at W = 2 once the first 800 steps have filled what is
    bounded: in at least one of four runs of 400 steps it grows under 64 bytes a step. A leak
    grows in every run (zero3 at main 3814292, with its per-step reference cycles, gained 0.2-0.4
    KiB a step in each); malloc's arenas, on a machine busy with other work, grow in bursts (at
    0dc4f34 on a loaded 2-core machine: 8, 64, 20, 16 and 0 KiB in five runs of 600 steps, with
    the live objects unchanged, as the test above counts), so one flat run is enough and two of
    600 steps were not. torch's c10d flight recorder keeps the last TORCH_FR_BUFFER_SIZE
    collectives with their stacks (default 2,000, about 3 MiB, full within a few hundred zero3
    steps): a small ring here, so what is measured is zfunc's. The 2,000-step soak with DDP
    beside it is benchmarks/soak.py."""
    window = 400
    with fresh_workers(2, env={"TORCH_FR_BUFFER_SIZE": "16"}) as group:
        growth = group.run(soak, mode, 800, window, 4, "rss")
    for rank, g in enumerate(growth):
        assert min(g) < 64 * window, (
            f"rank {rank} gained {', '.join(f'{b / 1024:.0f}' for b in g)} KiB in four runs of {window} steps of {mode}")
