"""``metrics["comm"]`` counts exactly the collectives each layout implies (zfunc.dist's counts).

The expected calls and bytes are derived here from the model's unit sizes and the layouts'
documented behaviour, not read back from zfunc: a unit's flat buffer holds its parameters padded to
a multiple of W; zero3 gathers every unit in forward and again in backward except the root and the
unit forward released last (zfunc.coordinator's docstring); under gloo a gradient that goes home is
all-reduced in full (``reduce_scatter_mean_start(scratch=True)``: an all-reduce on the wire, counted
as one); zero1/zero2 gather the updated slices after the update, which on the host first agrees in
one float64 flag whether every rank's update went through (zfunc.transforms.zero); ``accumulate``
reduces sharded gradients every micro-batch and whole ones once (zfunc.transforms.accumulate);
every buffer is broadcast from rank 0 each step. Sizes follow nccl-tests: an all-gather's gathered
output, a reduce-scatter's full input, the tensor of the rest.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from workers import workers

WIDTHS = (3, 7, 5)  # the blocks' hidden sizes: every unit has its own size
STEPS = 2  # the first records the trace (its collectives checked), the second follows it


class Net(nn.Module):
    """A residual MLP with a buffer: the root unit (inp, out), one unit per block."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, h), nn.Tanh(), nn.Linear(h, 4)) for h in WIDTHS)
        self.out = nn.Linear(4, 2)
        self.register_buffer("shift", torch.zeros(6))

    def forward(self, x):
        h = self.inp(x)
        h = h + self.shift[:4].to(h.dtype)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def unit_numels() -> tuple[int, list[int]]:
    """The parameters of the root unit and of each block, counted from the layers' shapes."""
    linear = lambda i, o: i * o + o  # noqa: E731
    return linear(3, 4) + linear(4, 2), [linear(4, h) + linear(h, 4) for h in WIDTHS]


def build(composition: str):
    """``composition``: stages and transforms joined by '+', e.g. 'zero3+bf16+acc2'."""
    torch.manual_seed(0)
    model = Net()

    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(zf.apply(model, params, x), y)

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    parts = composition.split("+")
    if "bf16" in parts:
        step = zf.mixed_precision(step)
    if "bf16reduce" in parts:
        step = zf.mixed_precision(step, reduce_dtype=torch.bfloat16)
    n = next((int(p[3:]) for p in parts if p.startswith("acc")), 1)
    if n > 1:
        step = zf.accumulate(step, n)
    if "cpu" in parts:
        step = zf.offload_cpu(step, pin_memory=False)
    stage = parts[0]
    if stage != "replicated":
        step = getattr(zf, stage)(step)
    return model, step, n


def run_counts(composition: str) -> list[dict]:
    """``metrics["comm"]`` of each of ``STEPS`` steps of ``composition`` on this rank."""
    model, step, n = build(composition)
    state = step.init(model)
    counts = []
    for i in range(STEPS):
        g = torch.Generator().manual_seed(100 * i + zf.dist.rank())
        micro = [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]
        state, metrics = step(state, micro if n > 1 else micro[0])
        counts.append(metrics["comm"])
    return counts


def expected(composition: str, w: int) -> dict:
    """The data collectives one step of ``composition`` issues at ``w`` ranks: {kind: {calls, bytes}}."""
    parts = composition.split("+")
    stage = parts[0]
    n = next((int(p[3:]) for p in parts if p.startswith("acc")), 1)
    low = "bf16" in parts or "bf16reduce" in parts
    gather_size = 2 if low else 4  # parameters are gathered in the compute dtype
    reduce_size = 2 if "bf16reduce" in parts else 4
    root, blocks = unit_numels()
    padded = [math.ceil(u / w) * w for u in (root, *blocks)]
    full = sum(padded)
    out: dict = {}

    def add(kind, calls, nbytes):
        c = out.setdefault(kind, {"calls": 0, "bytes": 0})
        c["calls"] += calls
        c["bytes"] += nbytes

    add("broadcast", 1, 6 * 4)  # the buffer, rank 0's, every step
    reductions = n if stage in ("zero2", "zero3") else 1  # sharded gradients every micro-batch, whole ones once
    add("all_reduce", reductions * len(padded), reductions * reduce_size * full)
    if stage == "zero3":
        regathered = padded[1:-1]  # backward: every block but the last forward released; the root is kept
        add("all_gather", n * (len(padded) + len(regathered)), n * gather_size * (full + sum(regathered)))
    if stage in ("zero1", "zero2"):
        add("all_gather", len(padded), gather_size * full)  # the updated slices, back to every rank
        add("all_reduce", 1, 8)  # the host update's agreement (one float64 flag)
    return out


def check(results: list[list[dict]], composition: str, w: int) -> None:
    want = expected(composition, w)
    for rank, steps in enumerate(results):
        for i, comm in enumerate(steps):
            assert set(comm) == {"world"}, (rank, i, comm)
            got = dict(comm["world"])
            agreement = got.pop("agreement")  # the step's agreement vector (and at first, the lockstep checks)
            assert agreement["calls"] >= 1 and agreement["bytes"] >= 8, agreement
            assert got == want, f"{composition} at W = {w}, rank {rank}, step {i}: {got} != {want}"


FAST = ["zero3", "zero2", "zero1", "replicated"]
SLOW = ["zero3+cpu", "zero2+cpu+acc2", "zero3+acc2", "zero2+acc3", "zero1+acc2", "replicated+acc2", "zero3+bf16", "zero3+bf16reduce",
        "zero2+bf16", "zero3+bf16+acc2"]


def run_many(compositions: list[str]) -> dict:
    return {c: run_counts(c) for c in compositions}


def test_each_stage_counts_what_its_layout_implies_w2():
    """Every stage at W = 2, two steps each (the first records the trace: the same data collectives)."""
    results = workers(2).run(run_many, FAST)
    for c in FAST:
        check([r[c] for r in results], c, 2)


@pytest.mark.slow
@pytest.mark.parametrize("w", [2, 3])
def test_accumulation_and_mixed_precision_count_what_they_imply(w):
    compositions = SLOW + (FAST if w == 3 else [])
    results = workers(w).run(run_many, compositions)
    for c in compositions:
        check([r[c] for r in results], c, w)


# ------------------------------------------------------------------ zfunc.dist's counting itself


def run_kinds() -> dict:
    """Each collective of zfunc.dist once, on the world and on the subgroup of ranks 0 and 2 (W = 3),
    unlabelled and then labelled; point to point from rank 0 to 1; one collective from a thread."""
    import threading

    from zfunc import dist
    from zfunc.deepspeed import comm as ds_comm

    r = dist.rank()
    pair = dist.new_group([0, 2])
    out = {}
    with dist.counting() as out["world"]:
        dist.all_gather(torch.ones(5))  # 3 x 5 float32 gathered
        dist.all_gather_inplace_start(torch.zeros(9, dtype=torch.float64)).wait()
        dist.reduce_scatter_mean_start(torch.ones(6)).wait()  # a reduce-scatter of 6 float32
        dist.reduce_scatter_mean_start(torch.ones(6), scratch=True).wait()  # gloo: an all-reduce
        dist.all_reduce_mean(torch.ones(4, dtype=torch.bfloat16))
        dist.all_reduce_sum(torch.ones(2, dtype=torch.int64))
        dist.broadcast(torch.ones(3, dtype=torch.int64))
        dist.barrier()
        ds_comm.barrier()  # a ported script's deepspeed.comm.barrier() is zfunc.dist's
        dist.same_everywhere((1, 2))
        if r == 0:
            dist.send_start(torch.ones(7), 1).wait()
        elif r == 1:
            dist.recv(torch.zeros(7), 0)
        thread = threading.Thread(target=dist.all_reduce_sum, args=(torch.ones(10),))
        thread.start()
        thread.join()
    with dist.counting() as out["pair"]:
        if r != 1:
            dist.all_reduce_sum(torch.ones(3), pair)
            dist.label_group(pair, "pair")
            dist.all_gather(torch.ones(2, dtype=torch.float16), pair)
    return out


@pytest.mark.slow  # W = 3, 7 s; the fast tier keeps its siblings
def test_each_kind_counts_its_whole_buffer_per_group():
    results = workers(3).run(run_kinds)
    for rank, got in enumerate(results):
        world = {"all_gather": {"calls": 2, "bytes": 3 * 5 * 4 + 9 * 8}, "reduce_scatter": {"calls": 1, "bytes": 24},
                 "all_reduce": {"calls": 4, "bytes": 24 + 4 * 2 + 2 * 8 + 10 * 4}, "broadcast": {"calls": 1, "bytes": 24},
                 "barrier": {"calls": 2, "bytes": 8}, "agreement": {"calls": 1, "bytes": 3 * 2 * 8}}
        if rank == 0:
            world["send"] = {"calls": 1, "bytes": 28}
        if rank == 1:
            world["recv"] = {"calls": 1, "bytes": 28}
        assert got["world"] == {"world": world}, (rank, got["world"])
        pair = {} if rank == 1 else {"ranks(0,2)": {"all_reduce": {"calls": 1, "bytes": 12}},
                                     "pair": {"all_gather": {"calls": 1, "bytes": 2 * 2 * 2}}}
        assert got["pair"] == pair, (rank, got["pair"])


def test_counts_from_many_threads_add_up():
    """The counters take a lock: counts from threads running at once are all there."""
    import threading

    from zfunc import dist

    def issue():
        for _ in range(2000):
            dist._count("send", None, 3)

    with dist.counting() as comm:
        threads = [threading.Thread(target=issue) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert comm == {"world": {"send": {"calls": 16000, "bytes": 48000}}}


def test_label_group_refuses_bad_labels():
    from zfunc import dist

    with pytest.raises(ValueError, match="non-empty string"):
        dist.label_group(object(), "")
    with pytest.raises(ValueError, match="always counted as 'world'"):
        dist.label_group(None, "shard")


# ------------------------------------------------------------------ the engines pass it on


def run_engine(stage: int, gas: int, imperative: bool) -> list[dict]:
    """``engine.last_metrics["comm"]`` of each of ``STEPS`` updates of ``zf.initialize``'s engine."""
    torch.manual_seed(0)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    if stage == 3:  # as zf.zero3's defaults: release each unit after use, persist none
        config["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_param_persistence_threshold=0)
    engine = zf.initialize(model, config, loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]))
    g = torch.Generator().manual_seed(zf.dist.rank())
    data = iter(lambda: (torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)), None)
    counts = []
    for _ in range(STEPS):
        if imperative:
            for _ in range(gas):
                engine.backward(engine(next(data)))
                engine.step()
        else:
            engine.train_batch(data)
        counts.append(engine.last_metrics["comm"])
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("imperative", [False, True], ids=["train_batch", "imperative"])
@pytest.mark.parametrize("stage, gas", [(3, 1), (3, 2), (2, 2), (1, 2), (0, 1)])
def test_the_engine_reports_each_updates_collectives(stage, gas, imperative):
    composition = ("replicated" if stage == 0 else f"zero{stage}") + (f"+acc{gas}" if gas > 1 else "")
    check(workers(2).run(run_engine, stage, gas, imperative), composition, 2)


class PipeLin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(PIPE_D, PIPE_D)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


PIPE_D, PIPE_B = 8, 2  # the activations' width and the micro-batch size


def run_pipeline(micro: int) -> dict:
    """Two stages of two layers each, ``micro`` micro-batches a step: each stage's ``metrics["comm"]``."""
    torch.manual_seed(0)
    pipe = zf.PipelineModule([zf.LayerSpec(PipeLin) for _ in range(4)], 2, F.mse_loss, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": PIPE_B, "gradient_accumulation_steps": micro,
              "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1}}
    engine = zf.initialize(pipe, config)
    g = torch.Generator().manual_seed(0)
    counts = []
    for _ in range(STEPS):
        data = iter([(torch.randn(PIPE_B, PIPE_D, generator=g), torch.randn(PIPE_B, PIPE_D, generator=g))
                     for _ in range(micro)])
        engine.train_batch(data)
        counts.append(engine.last_metrics["comm"])
    return {"stage": engine.grid.stage, "counts": counts}


@pytest.mark.slow
def test_the_pipeline_counts_its_activations_and_gradients_point_to_point():
    """Each micro-batch stage 0 sends its activation and receives its gradient, stage 1 the reverse,
    PIPE_B x PIPE_D float32 each; the first step also sends each link's shapes, once: their length
    (one int64) and their code (count, dtype, dims, the two sizes: five int64)."""
    micro = 3
    act = PIPE_B * PIPE_D * 4
    for r in workers(2).run(run_pipeline, micro):
        for i, comm in enumerate(r["counts"]):
            got = dict(comm["world"])
            assert got.pop("agreement")["calls"] >= 1, comm
            shapes = {"calls": 2, "bytes": 8 + 5 * 8} if i == 0 else {"calls": 0, "bytes": 0}
            want = {kind: {"calls": micro + shapes["calls"], "bytes": micro * act + shapes["bytes"]}
                    for kind in ("send", "recv")}
            assert got == want, (r["stage"], i, comm)
            assert set(comm) == {"world"}, comm


def run_eval(stage: str) -> list[dict]:
    """``metrics["comm"]`` of an eval step composed like ``stage``'s train step, on its state."""
    model, step, _ = build(stage)
    state = step.init(model)
    evaluate = getattr(zf, stage)(zf.eval_step(lambda params, b: F.mse_loss(zf.apply(model, params, b[0]), b[1])))
    g = torch.Generator().manual_seed(zf.dist.rank())
    return [evaluate(state, (torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)))["comm"]
            for _ in range(STEPS)]


@pytest.mark.slow
@pytest.mark.parametrize("w", [2, 3])
def test_an_eval_step_counts_its_forward_gathers(w):
    """zero3's eval step gathers each unit once (no backward), broadcasts the buffer, reduces nothing."""
    root, blocks = unit_numels()
    full = sum(math.ceil(u / w) * w for u in (root, *blocks))
    want = {"all_gather": {"calls": 1 + len(blocks), "bytes": 4 * full}, "broadcast": {"calls": 1, "bytes": 24}}
    for rank, steps in enumerate(workers(w).run(run_eval, "zero3")):
        for comm in steps:
            got = dict(comm["world"])
            assert got.pop("agreement")["calls"] >= 1, comm
            assert got == want, (rank, comm)


def test_alone_a_step_issues_nothing():
    """W = 1 (no process group in this process): no collective, an empty count."""
    model, step, _ = build("zero3")
    state = step.init(model)
    _, metrics = step(state, (torch.randn(4, 3), torch.randn(4, 2)))
    assert metrics["comm"] == {}
