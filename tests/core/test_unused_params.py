"""A parameter the loss does not read gets no update, as ``torch.optim`` leaves a parameter whose
``.grad`` is None (``zero_grad(set_to_none=True)``): no weight decay, no moment update, no step
count, so one first read later gets its own bias correction, though its unit is used every step.

Two models (tests/harness/models.py): ``external``'s ``gate.0.bias`` is never read, though its unit is
(``gate.0.weight``); ``sometimes``'s ``extra`` (in the root unit) is read from the second step on,
by the first example only: at W = 2 by rank 0 only, under ``accumulate(2)`` (as it always runs
here) by its first micro-batch only. Three steps of 4 examples a rank equal plain PyTorch on the
global batch (torch.optim.AdamW, SGD with momentum and weight decay): in fp32 to 1e-5, the
equivalence tests' bound (``extra`` updated while unread, or bias-corrected from its unit's first
step, is off by far more); under bf16 with fp32 masters within test_precision's bounds; a
parameter never read bit for bit at its initial value; offload bit for bit the step without it.
"""
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from assertions import UNIT_ROUNDOFF, assert_close_to, assert_within_roundoff
from cases import reference, reference_mixed, run_composed
from checkpoints import GLOBAL_BATCH, load_then_train, train_then_save
from compositions import COMPOSITIONS
from models import batch, build, loss
from workers import workers
from zfunc.ops import adam, cpu_adam, cuda_adam
from zfunc.checkpoint import sharded as checkpoint_format
from zfunc.tree import Params

NAMES = ["external", "sometimes"]
NEVER_READ = {"external": ["gate.0.bias"], "sometimes": []}
MICRO = {"external": None, "sometimes": 2}
SGD = {"momentum": 0.9, "weight_decay": 0.01}
BF16 = {"dtype": torch.bfloat16}


def _args(name: str, stage: int, precision=None, sgd=False, offload=None, compile=None) -> tuple:
    """``run_composed``'s arguments: 3 steps of 4 examples a rank."""
    return name, {}, stage, 3, 4, 0, precision, MICRO[name], None, False, None, sgd, None, offload, compile


def _expected(name: str, world: int, dtype=torch.float32, sgd=False) -> dict:
    return reference_mixed(name, {}, dtype, 3, 4 * world, sgd=sgd)["params"]


def _init(name: str) -> dict:
    return reference(name, {}, steps=0)["params"]


def _untouched(name: str, got: dict, init: dict) -> None:
    for k in NEVER_READ[name]:
        assert torch.equal(got[k], init[k]), f"{k} moved, though no gradient ever reached it"


def _fp32_equals_torch(name: str, got: dict, expected: dict, init: dict) -> None:
    assert_close_to(got, expected)
    _untouched(name, got, init)


def _bf16_equals_torch(name: str, got: dict, expected: dict, init: dict) -> None:
    _untouched(name, got, init)
    trained = {k: v for k, v in expected.items() if k not in NEVER_READ[name]}
    assert_within_roundoff(got, trained, init, UNIT_ROUNDOFF[torch.bfloat16], False)


def _comparable(name: str, world: int) -> bool:
    """Whether offload is bit for bit the step without it here: not for ``external`` at W = 2,
    which reads ``emb.0``'s unit twice, whose two gradients a grad sink (offload_nvme's) adds
    before reducing them where autograd adds them reduced, a rounding apart that predates this."""
    return name != "external" or world == 1


def _same(a: dict, b: dict) -> None:
    """Bit for bit, as tests/transforms/offload/test_cpu_offload.py compares offload with the step without it."""
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_fp32_equals_torch_at_every_stage(name, world):
    """AdamW at zero0-3, SGD with momentum and weight decay at zero0 and zero3."""
    init = _init(name)
    for sgd, stages in ((False, (0, 1, 2, 3)), (SGD, (0, 3))):
        expected = _expected(name, world, sgd=sgd)
        for stage in stages:
            for r in workers(world).run(run_composed, *_args(name, stage, sgd=sgd)):
                _fp32_equals_torch(name, r["params"], expected, init)


def _offloads(stage: int, path: str) -> list[dict]:
    """Offloads for ``stage``, so that the stages cover each: NVMe at zero0 (parameters on disk
    too), zero2 (gradients and state only: zero1/2 keep whole parameters) and zero3, the CPU at
    zero1, its parameter tier at zero3 (which it needs)."""
    nvme = {"kind": "nvme", "path": path, "params": stage in (0, 3), "sub_group_size": 100}
    return {0: [nvme], 1: [{"kind": "cpu"}], 2: [nvme], 3: [{"kind": "cpu", "params": True}, nvme]}[stage]


@pytest.mark.parametrize("world", [1, 2])
def test_mixed_precision_and_every_offload(world, tmp_path):
    """bf16 with fp32 masters at zero0-3 equals torch doing the same, and so do offload_cpu, its
    parameter tier and offload_nvme (sub-groups of 100 elements, so units stream apart), bit for
    bit the step without offload (``_comparable``)."""
    for name in NAMES:
        init, expected = _init(name), _expected(name, world, torch.bfloat16)
        for stage in (0, 1, 2, 3):
            plain = workers(world).run(run_composed, *_args(name, stage, BF16))
            for r in plain:
                _bf16_equals_torch(name, r["params"], expected, init)
            for offload in _offloads(stage, str(tmp_path / "swap")):
                for a, b in zip(plain, workers(world).run(run_composed, *_args(name, stage, BF16, offload=offload))):
                    _bf16_equals_torch(name, b["params"], expected, init)
                    if _comparable(name, world):
                        _same(a, b)


@pytest.mark.parametrize("world", [1, 2])
def test_offload_nvme_updating_a_unit_in_pieces_keeps_each_parameters_count(world, tmp_path):
    """offload_nvme updates a unit a piece at a time (here 16 elements, so ``sometimes``'s root unit
    of 86 is six pieces, ``extra`` spanning three): each piece updates only the parameters in it
    that got a gradient, with their own counts, bit for bit the step without offload and equal to
    torch, in fp32 and bf16."""
    name, init = "sometimes", _init("sometimes")
    nvme = {"kind": "nvme", "path": str(tmp_path / "swap"), "params": True, "sub_group_size": 16}
    for precision, equals in ((None, _fp32_equals_torch), (BF16, _bf16_equals_torch)):
        expected = _expected(name, world, torch.float32 if precision is None else torch.bfloat16)
        plain = workers(world).run(run_composed, *_args(name, 3, precision))
        for a, b in zip(plain, workers(world).run(run_composed, *_args(name, 3, precision, offload=nvme))):
            equals(name, b["params"], expected, init)
            _same(a, b)


@pytest.mark.parametrize("world", [1, 2])
def test_fp32_offload_with_sgd(world, tmp_path):
    """SGD's momentum buffers under offload_cpu (zero1) and offload_nvme (zero3) equal torch and,
    bit for bit, the step without offload (``_comparable``)."""
    for name in NAMES:
        init, expected = _init(name), _expected(name, world, sgd=SGD)
        for stage in (1, 3):
            plain = workers(world).run(run_composed, *_args(name, stage, sgd=SGD))
            for offload in _offloads(stage, str(tmp_path / "swap"))[-1:]:  # the CPU at zero1, NVMe at zero3
                for a, b in zip(plain, workers(world).run(run_composed, *_args(name, stage, sgd=SGD, offload=offload))):
                    _fp32_equals_torch(name, b["params"], expected, init)
                    if _comparable(name, world):
                        _same(a, b)


def _emulated_cuda_kernel(calls: list):
    """The CUDA Adam kernel's CPU emulation, where zfunc.ops.adam sends tensors no kernel took."""
    module = cuda_adam.emulated()
    assert module is not None, "the CUDA Adam kernel's CPU emulation did not build"

    def update(ps, gs, ms, vs, *, lowp_params=None, **kw):
        calls.append(len(ps))
        module.adam_update(ps, gs, ms, vs, [] if lowp_params is None else lowp_params, **kw)

    return update


@pytest.mark.parametrize("kernel", ["cpu_adam", pytest.param("cuda_adam.emulated", marks=pytest.mark.slow), "torch"])  # the emulation is a native build
def test_every_adam_kernel_updates_only_what_got_a_gradient(kernel, monkeypatch):
    """The update narrows each unit's leaf to what got a gradient: the fused CPU kernel, the CUDA
    kernel (its CPU emulation) and torch's fused Adam each equal torch.optim (W = 1, zero3)."""
    calls = []
    if kernel == "cpu_adam":
        assert cpu_adam.available(), "the CPU Adam kernel did not build (python -m zfunc.ops says why)"
    if kernel != "cpu_adam":
        monkeypatch.setattr(cpu_adam, "load", lambda: None)
    if kernel == "cuda_adam.emulated":
        monkeypatch.setattr(adam, "torch_adam_", _emulated_cuda_kernel(calls))
    for name in NAMES:
        init = _init(name)
        _fp32_equals_torch(name, run_composed(*_args(name, 3))["params"], _expected(name, 1), init)
        _bf16_equals_torch(name, run_composed(*_args(name, 3, BF16))["params"], _expected(name, 1, torch.bfloat16),
                           init)
    assert (len(calls) > 0) == (kernel == "cuda_adam.emulated")


@pytest.mark.slow
def test_the_compiled_step_equals_torch_or_refuses_to_guess():
    """zf.jit: which parameters got a gradient comes out of the compiled program (its probes). Past
    a graph break (``sometimes`` branches on its batch) a parameter not read this step cannot be
    told from one whose gradient is zero: the step refuses, naming it."""
    how = {"how": "jit", "backend": "aot_eager"}
    _fp32_equals_torch("external", run_composed(*_args("external", 3, compile=how))["params"],
                       _expected("external", 1), _init("external"))
    with pytest.raises(zf.CompileError, match="cannot tell whether parameter 'extra.weight' got a gradient"):
        run_composed(*_args("sometimes", 3, compile=how))


def test_the_engines_imperative_step_equals_torch():
    """engine(x); engine.backward(loss); engine.step(): the gradients of its backwards say which
    parameters got one."""
    model, twin = build("external"), build("external")
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    engine = zf.initialize(model, config)
    for i in range(3):
        x, y = batch("external", twin, i, 4)
        engine.backward(loss("external", engine(x), y))
        engine.step()
    _fp32_equals_torch("external", engine.params(), reference("external", {}, steps=3, batch_size=4)["params"],
                       _init("external"))


def test_checkpoints_keep_each_parameters_count(tmp_path):
    """Saved at W = 2 (zero3) after a step ``extra`` missed, loaded at W = 1 (zero3 on NVMe) and
    trained on: ``extra``'s own count came back, so it equals torch trained without a break."""
    directory = str(tmp_path)
    workers(2).run(train_then_save, "sometimes", {"stage": 3}, 1, directory)
    (r,) = workers(1).run(load_then_train, "sometimes", COMPOSITIONS["zero3-offload_nvme"], 1, 2, directory)
    assert_close_to(r["params"], reference("sometimes", {}, steps=3, batch_size=GLOBAL_BATCH)["params"])


def test_a_format_2_checkpoint_gives_each_parameter_its_units_count(tmp_path, monkeypatch):
    """Format 2 kept one 0-d step count per unit: each parameter of the unit loads it."""
    model = build("external")
    step = zf.zero1(zf.train_step(lambda p, b: loss("external", zf.apply(model, p, b[0]), b[1]), zf.optim.adamw(1e-3)))
    state = step.init(model)
    steps = state.opt_state.steps
    per_unit = Params(steps.spec, [torch.tensor(5 + i) for i in range(len(steps.leaves))])
    monkeypatch.setattr(checkpoint_format, "FORMAT", 2)
    zf.checkpoint.save(dataclasses.replace(state, opt_state=state.opt_state._replace(steps=per_unit)),
                       os.path.join(tmp_path, "ckpt"), "old")
    fresh = step.init(build("external"))
    fresh, manifest = zf.checkpoint.load(fresh, os.path.join(tmp_path, "ckpt"))
    assert manifest["format"] == 2
    assert [t.tolist() for t in fresh.opt_state.steps.leaves] == [[5 + i] * len(t) for i, t in
                                                                   enumerate(steps.leaves)]


class Unread(nn.Module):
    """A pipeline layer whose forward never reads its bias."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.weight = nn.Parameter(torch.randn(4, 4, generator=g) * 0.3)
        self.bias = nn.Parameter(torch.randn(4, generator=g) * 0.1)

    def forward(self, x):
        return torch.tanh(x @ self.weight.t())


def pipeline_steps() -> dict:
    """Two steps of a two-stage pipeline of ``Unread`` layers: which of this stage's parameters moved."""
    pipe = zf.PipelineModule([zf.LayerSpec(Unread), zf.LayerSpec(Unread)], 2, F.mse_loss)
    engine = zf.initialize(pipe, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                  "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}})
    before = engine.params()
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        engine.train_batch(iter([(torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)) for _ in range(2)]))
    return {k: not torch.equal(v, before[k]) for k, v in engine.params().items()}


def test_a_pipeline_stage_leaves_what_its_layers_do_not_read():
    """Each stage's update leaves its layer's unread bias alone (P = 2; the tracker's record)."""
    for moved in workers(2).run(pipeline_steps):
        assert moved and all(v == (not k.endswith("bias")) for k, v in moved.items()), moved
