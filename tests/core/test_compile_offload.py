"""Compiled micro-batches under offload: ``zf.compile_units(model)`` (and ``zf.jit`` where the
step's tensors stay in RAM) composed with ``offload_cpu`` (its parameter tier ``params=True`` and
the delayed update ``delay=1``) and ``offload_nvme``, under zero2 and zero3 with accumulation, so
a micro-batch under offload runs the same compiled blocks as when the model fits.

Each compiled run equals the eager run of the same composition (fp32 1e-5, bf16 a few units of
its roundoff), makes no new graph after the first step, and runs every block compiled in every
micro-batch: a backend that counts its calls shows dynamo did not fall back to eager (a guard
that failed on every swapped-in buffer would recompile until its cache limit, then run eagerly
without a word). The models: the suite's tied GPT and a Hugging Face Llama built from a config."""
import pytest
import torch
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters

import zfunc as zf
from assertions import UNIT_ROUNDOFF
from cases import compose
from models import batch, build, local, loss
from zfunc.testing import assert_trees_all_close
from workers import workers

STEPS = 4
OFFLOADS = {
    "cpu": {"kind": "cpu"},
    "cpu_params": {"kind": "cpu", "params": True},
    "cpu_delay": {"kind": "cpu", "delay": 1},
    "nvme": {"kind": "nvme", "buffer_size": 1e5},
    "nvme_state": {"kind": "nvme", "params": False, "buffer_size": 1e5},  # zero2's: the optimizer state on disk
    "cpu_copies": {"kind": "cpu", "copy_grads_on_host": True},  # a GPU's path: each gradient copied home
}
# (offload, stage): parameters on the host or on disk need zero3
COMBOS = [("cpu", 2), ("cpu", 3), ("cpu_params", 3), ("cpu_delay", 2), ("cpu_delay", 3), ("nvme", 3), ("nvme_state", 2)]


class _Counting:
    """aot_eager (the graphs inductor would get, without its code generation), counting the
    calls of the compiled forwards: how many blocks ran compiled. ``aot=False``: dynamo's graphs
    run as captured (the fast test's: a third of aot_eager's compile time); ``"inductor"``: the
    default backend's generated code."""

    def __init__(self, aot: bool | str = True):
        self.calls = 0
        self.aot = aot

    def __call__(self, gm, example_inputs):
        if self.aot == "inductor":
            from torch._inductor.compile_fx import compile_fx
            compiled_fn = compile_fx(gm, example_inputs)
        else:
            compiled_fn = aot_eager(gm, example_inputs) if self.aot else gm.forward

        def run(*args):
            self.calls += 1
            return compiled_fn(*args)

        return run


def _llama():
    import transformers
    from hf import llama_config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    model.config.use_cache = False
    return model


def _model_and_loss(name: str):
    if name == "llama":
        model = _llama()
        return model, lambda params, b: zf.apply(model, params, input_ids=b, labels=b).loss
    model = build(name)
    return model, lambda params, b: loss(name, zf.apply(model, params, b[0]), b[1])


def _batch(name: str, model, i: int, size: int):
    if name == "llama":
        return torch.randint(0, 50, (size, 8), generator=torch.Generator().manual_seed(i))
    return batch(name, model, i, size)


def run_offloaded(name: str, stage: int, offload: str, how: str | None, precision=None, micro: int = 2,
                  path: str | None = None, aot: bool = True) -> dict:
    """``STEPS`` steps of ``zeroN(offload(mixed_precision(accumulate(train_step))))`` on this rank's
    part of each global batch (``micro`` None: no accumulate); ``how``: None (eager), ``"blocks"``
    (zf.compile_units) or ``"jit"``.
    Per step: the losses, dynamo's unique graphs, graph breaks, and the compiled forwards run."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, loss_fn = _model_and_loss(name)
    torch._dynamo.reset()
    counters.clear()
    backend = _Counting(aot)
    if how == "blocks":
        zf.compile_units(model, backend=backend, fullgraph=True)
    kw = dict(OFFLOADS[offload]) | ({"path": path} if path else {})
    step = compose(stage, loss_fn, precision=None if precision is None else {"dtype": precision}, micro=micro,
                   offload=kw)
    if how == "jit":
        step = zf.jit(step, backend=backend)
    history = []
    with step.init(model) as state:
        for i in range(STEPS):
            n = micro or 1
            b = _batch(name, model, i, 2 * n * world)
            b = local(b if isinstance(b, tuple) else (b,), rank, world)
            b = [tuple(t.chunk(n)[j] for t in b) for j in range(n)]
            if name == "llama":
                b = [m[0] for m in b]
            if micro is None:  # no accumulate: the one batch
                b = b[0]
            state, metrics = step(state, b)
            history.append({"loss": metrics["loss"].item(), "graphs": counters["stats"]["unique_graphs"],
                            "breaks": sum(counters["graph_break"].values()), "calls": backend.calls})
        return {"params": zf.gather_params(state), "history": history}


def _same(got: dict, want: dict, precision, rel: float = 1e-5) -> None:
    rel = rel if precision is None else 4 * UNIT_ROUNDOFF[precision]
    scale = max(v.abs().max().item() for v in want["params"].values())
    assert_trees_all_close(got["params"], want["params"], rtol=rel, atol=rel * scale)
    assert [h["loss"] for h in got["history"]] == pytest.approx([h["loss"] for h in want["history"]], rel=rel,
                                                                abs=1e-6)


def _compiled_every_step(r: dict, per_step: int) -> None:
    """Graphs made in the first step only; no graph break; ``per_step`` compiled calls each step."""
    graphs = [h["graphs"] for h in r["history"]]
    assert graphs[0] > 0 and graphs[-1] == graphs[0], f"new graphs after the first step: {graphs}"
    assert r["history"][-1]["breaks"] == 0, r["history"]
    calls = [h["calls"] for h in r["history"]]
    ran = [b - a for a, b in zip([0] + calls, calls)]
    assert ran[1:] == [per_step] * (STEPS - 1), f"compiled calls per step {ran}, want {per_step} after the first"


def _check(name, stage, offload, how, world, precision=None, tmp_path=None, aot: bool | str = True, micro=2,
           rel: float = 1e-5) -> None:
    path = str(tmp_path) if offload.startswith("nvme") else None
    args = (name, stage, offload)
    eager = workers(world).run(run_offloaded, *args, None, precision, micro, path)
    blocks = 2 if name == "llama" else len(build(name).blocks)
    per_step = (micro or 1) * (blocks if how == "blocks" else 1)  # each block, or the program, per micro-batch
    for r, e in zip(workers(world).run(run_offloaded, *args, how, precision, micro, path, aot), eager):
        _same(r, e, precision, rel)
        _compiled_every_step(r, per_step)


def test_compiled_blocks_under_offload_cpu_equal_eager_without_recompiles():
    """The fast case: zero3(offload_cpu(accumulate)) on the GPT at W = 1, dynamo's graphs run as
    captured (the slow tests run them through aot_eager)."""
    _check("gpt", 3, "cpu", "blocks", 1, aot=False)


@pytest.mark.slow
@pytest.mark.parametrize("offload,stage,world", [(o, s, w) for w in (1, 2) for o, s in COMBOS
                                                  if (o, s, w) != ("cpu", 3, 1)])  # the fast test's
def test_compiled_blocks_under_every_offload(offload, stage, world, tmp_path):
    _check("gpt", stage, offload, "blocks", world, tmp_path=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("offload,how", [("cpu", "blocks"), ("cpu_delay", "blocks"), ("nvme", "blocks"),
                                         ("cpu", "jit"), ("cpu_delay", "jit")])
def test_llama_compiled_under_offload_in_bf16(offload, how, tmp_path):
    _check("llama", 3, offload, how, 2, torch.bfloat16, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("offload,stage", [c for c in COMBOS if c[0].startswith("cpu")])
def test_jit_under_offload_cpu(offload, stage):
    _check("gpt", stage, offload, "jit", 2)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["blocks", "jit"])
@pytest.mark.parametrize("stage", [2, 3])
def test_under_offload_cpu_copying_each_gradient_home(stage, how):
    """Without accumulate, where the parameters live on an accelerator, offload_cpu copies each
    unit's gradient home as backward finishes (here forced on the CPU): compiled blocks leave that
    to zfunc's hooks; zf.jit's program reduces the gradients itself and hands each to that copy
    (its ``take_home``). Both equal the eager step."""
    _check("gpt", stage, "cpu_copies", how, 2, micro=None)


def test_jit_refuses_gradients_sent_to_disk(tmp_path):
    """zero2(offload_nvme(params=False)) writes each gradient to its swap file as backward ends:
    no tensor of a program, so zf.jit says so and names what composes (the blocks compiled)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    step = zf.jit(zf.zero2(zf.offload_nvme(zf.train_step(lambda p, x: zf.apply(model, p, x).sum(), zf.optim.sgd(0.1)),
                                           path=str(tmp_path), params=False)), backend="aot_eager")
    with step.init(model) as state:
        with pytest.raises(zf.CompileError, match=r"offload_nvme's swap files.*Compile the blocks instead"):
            step(state, torch.ones(2, 4))


def test_jit_refuses_parameters_copied_in_from_the_host(monkeypatch):
    """offload_cpu(params=True) on an accelerator copies each unit's host shard to the device as it
    is used, outside any program: zf.jit says so, naming the device and what composes. The group's
    compute device is made to read 'cuda' after init (on a CPU group the copy is plain: traced)."""
    import zfunc.dist

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    rates = zf.Rates(host_update=1e9, device_update=1e10, pcie=1e10)  # given: nothing measured on the stand-in device
    step = zf.jit(zf.zero3(zf.offload_cpu(zf.train_step(lambda p, x: zf.apply(model, p, x).sum(), zf.optim.sgd(0.1)),
                                          params=True, rates=rates)), backend="aot_eager")
    with step.init(model) as state:
        monkeypatch.setattr(zfunc.dist, "compute_device", lambda group=None: torch.device("cuda"))
        with pytest.raises(zf.CompileError, match=r"offload_cpu\(params=True\) on cuda.*Compile the blocks instead"):
            step(state, torch.ones(2, 4))


@pytest.mark.slow
def test_inductor_blocks_under_the_parameter_tier():
    """The default backend's generated code on blocks whose unit is copied in from host memory
    every micro-batch (a new buffer each time): zero3(offload_cpu(params=True)) at W = 2, equal to
    eager within inductor's reordering of float reductions (test_compile.test_inductor's bound),
    compiled once."""
    _check("gpt", 3, "cpu_params", "blocks", 2, aot="inductor", rel=1e-4)
