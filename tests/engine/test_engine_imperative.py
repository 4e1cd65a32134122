"""The engine's imperative style (``out = engine(batch); engine.backward(loss); engine.step()``) as
DeepSpeed runs it: every backward's gradients count (each scaled by 1/gradient_accumulation_steps,
summed until the step at the boundary), ``engine(batch)`` returns what the model returns and is the
forward the backward differentiates (no second one), under ``torch.no_grad()`` nothing is kept."""
import copy
import gc

import pytest
import torch

import zfunc as zf
from cases import LR as HF_LR
from engines import hf_batch, hf_gpt2, hf_reference
from models import batch, build, local, loss
from workers import workers
from zfunc.materialize import Tracker
from zfunc.testing import assert_trees_all_close

RTOL = 1e-5  # fp32 equivalence
GLOBAL = 4  # examples per micro-batch over all ranks
LR, MOMENTUM = 0.05, 0.9
EVAL = 1000  # the batch evaluated under no_grad during each update


def _config(stage: int, gas: int, clip: float = 0.0, offload: bool = False, **extra) -> dict:
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": GLOBAL // zf.dist.world_size(), "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}}, "gradient_clipping": clip,
            "zero_optimization": zero, **extra}


def _backwards(pattern: str, k: int, last: bool) -> list[list[int]]:
    """The backwards of one micro-step from micro-batch ``k`` on, each the micro-batches whose losses it sums."""
    if pattern == "deepspeed":
        return [[k]]
    if pattern == "many":  # DeepSpeed's TestZero3ParamPartitioningBase: several backwards, one step
        return [[k], [k + 1], [k + 2]]
    if pattern == "fused":  # two forwards, one backward of their losses' sum
        return [[k, k + 1]]
    if pattern == "separate":  # two forwards, then a backward of each
        return [[k], [k + 1]]
    if pattern == "skip":  # the boundary's micro-step has no backward
        return [] if last else [[k]]
    raise ValueError(pattern)


def _micro_step(engine, name, shape, pattern, k, last, first, with_loss_fn, evals):
    rank, world = zf.dist.rank(), zf.dist.world_size()

    def inputs(j):
        return local(batch(name, shape, j, GLOBAL), rank, world)

    def the_loss(out, j):
        return out if with_loss_fn else loss(name, out, inputs(j)[1])

    def run(j):
        return engine(inputs(j)) if with_loss_fn else engine(inputs(j)[0])

    groups = _backwards(pattern, k, last)
    outs = {j: run(j) for group in groups for j in group}  # every forward first, then the backwards
    if first:  # an evaluation in the middle of the step: no effect on it
        with torch.no_grad():
            evals.append(float(the_loss(engine(inputs(EVAL)) if with_loss_fn else engine(inputs(EVAL)[0]), EVAL)))
    for group in groups:
        engine.backward(sum(the_loss(outs[j], j) for j in group))
    engine.step()
    return sum(len(g) for g in groups)


def imperative(name: str, config: dict, pattern: str, steps: int, with_loss_fn: bool = False) -> dict:
    model = build(name)
    shape = copy.deepcopy(model)
    kw = {"loss_fn": lambda m, b: loss(name, m(b[0]), b[1])} if with_loss_fn else {}
    engine = zf.initialize(model, config, **kw)
    gas = engine.gradient_accumulation_steps()
    k, losses, norms, evals = 0, [], [], []
    for _ in range(steps):
        for i in range(gas):
            k += _micro_step(engine, name, shape, pattern, k, i == gas - 1, i == 0, with_loss_fn, evals)
        losses.append(float(engine.last_metrics["loss"]))
        norms.append(engine.last_metrics["grad_norm"])
    state = engine.state
    return {"params": engine.params(), "losses": losses, "norms": norms, "evals": evals,
            "buffers": {n: b.float() for n, b in state.buffers.items()}, "steps": engine.global_steps}


def pytorch(name: str, pattern: str, steps: int, gas: int, clip: float) -> dict:
    """Plain PyTorch on the global micro-batches: each backward's loss / gas, summed until the step."""
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    k, losses, norms, evals = 0, [], [], []
    for _ in range(steps):
        opt.zero_grad()
        values = []
        for i in range(gas):
            groups = _backwards(pattern, k, i == gas - 1)
            step = [sum(loss(name, model(x), y) for x, y in (batch(name, model, j, GLOBAL) for j in group))
                    for group in groups]
            if i == 0:  # in the same order as the engine's calls (running statistics depend on it)
                with torch.no_grad():
                    x, y = batch(name, model, EVAL, GLOBAL)
                    evals.append(float(loss(name, model(x), y)))
            for value in step:
                (value / gas).backward()
                values.append(value.item())
            k += sum(len(g) for g in groups)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        norms.append(float(norm))
        opt.step()
        losses.append(sum(values) / len(values))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "losses": losses,
            "norms": norms, "evals": evals, "buffers": dict(model.named_buffers())}


def _assert_close(got: dict, expected: dict) -> None:
    scale = max(v.abs().max().item() for v in expected.values())
    assert list(got) == list(expected)
    assert_trees_all_close(got, expected, rtol=RTOL, atol=RTOL * scale)


CASES = [  # name, world, stage, gas, pattern, clip, offload, with_loss_fn
    ("gpt", 2, 3, 1, "many", 0.5, False, False),
    ("gpt", 2, 1, 2, "deepspeed", 0.0, False, True),
    ("gpt", 2, 2, 1, "fused", 0.0, True, False),
    ("gpt", 2, 0, 2, "skip", 0.5, False, False),
    ("checkpointed", 2, 3, 2, "separate", 0.0, False, False),
    ("reusing", 2, 3, 1, "many", 0.0, False, False),
    ("external", 2, 3, 2, "fused", 0.0, False, False),
    ("frozen_bn", 1, 3, 2, "many", 0.3, False, False),
]


@pytest.mark.parametrize("name,world,stage,gas,pattern,clip,offload,with_loss_fn", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_every_backward_counts_as_in_pytorch(name, world, stage, gas, pattern, clip, offload, with_loss_fn):
    expected = pytorch(name, pattern, 3, gas, clip)
    config = _config(stage, gas, clip, offload)
    results = workers(world).run(imperative, name, config, pattern, 3, with_loss_fn)
    # under no_grad each rank gets its own slice's output, as with DeepSpeed: their mean is the batch's
    evals = [sum(r["evals"][i] for r in results) / world for i in range(3)]
    assert evals == pytest.approx(expected["evals"], rel=RTOL)
    for r in results:
        _assert_close(r["params"], expected["params"])
        assert r["losses"] == pytest.approx(expected["losses"], rel=RTOL)
        assert r["norms"] == pytest.approx(expected["norms"], rel=RTOL)
        assert r["steps"] == 3
        if name == "frozen_bn":  # running statistics: every forward of the step updates them
            assert_trees_all_close(r["buffers"], {n: b.float() for n, b in expected["buffers"].items()},
                                   rtol=RTOL, atol=RTOL)


def by_train_batch(name: str, config: dict, steps: int) -> dict:
    model = build(name)
    shape = copy.deepcopy(model)
    rank, world = zf.dist.rank(), zf.dist.world_size()
    engine = zf.initialize(model, config, loss_fn=lambda m, b: loss(name, m(b[0]), b[1]))
    data = (local(batch(name, shape, k, GLOBAL), rank, world) for k in range(10 ** 6))
    losses = [float(engine.train_batch(data)) for _ in range(steps)]
    return {"params": engine.params(), "losses": losses}


@pytest.mark.parametrize("precision,stage,world,offload", [("bf16", 3, 2, False), ("fp16", 2, 2, False),
                                                           ("fp16", 3, 1, True)])
def test_mixed_precision_takes_the_same_steps_as_train_batch(precision, stage, world, offload):
    """bf16 and fp16 (the loss scale applied in backward, unscaled in the update): the same
    micro-batches give the same steps, bit for bit, as train_batch, which equals the step by hand."""
    extra = ({"bf16": {"enabled": True}} if precision == "bf16"
             else {"fp16": {"enabled": True, "initial_scale_power": 12}})
    config = _config(stage, 2, 0.5, offload, **extra)
    for a, b in zip(workers(world).run(by_train_batch, "gpt", config, 3),
                    workers(world).run(imperative, "gpt", config, "deepspeed", 3, True)):
        assert a["losses"] == b["losses"]
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k


def _open_passes() -> int:
    """Materializations alive and not closed (a closed tracker has let go of its units)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, Tracker) and o.units)


def held_between_steps(steps: int) -> dict:
    model = build("gpt")
    shape = copy.deepcopy(model)
    rank, world = zf.dist.rank(), zf.dist.world_size()
    engine = zf.initialize(model, _config(3, 2))
    inputs = lambda k: local(batch("gpt", shape, k, GLOBAL), rank, world)  # noqa: E731
    seen = {"after_no_grad": [], "after_dropped": [], "after_step": [], "trackers": []}
    for s in range(steps):
        for i in range(2):
            x, y = inputs(2 * s + i)
            with torch.no_grad():
                engine(x)
            seen["after_no_grad"].append(_open_passes())
            engine(x)  # an evaluation with gradients on, its output dropped
            out = engine(x)
            seen["after_dropped"].append(_open_passes())  # the dropped one is gone: only `out` is open
            engine.backward(loss("gpt", out, y))
            engine.step()
        seen["after_step"].append(_open_passes())
        del out
        gc.collect()
        seen["trackers"].append(sum(1 for o in gc.get_objects() if isinstance(o, Tracker)))
    return seen


@pytest.mark.slow
def test_nothing_is_held_across_calls():
    """No pass stays open once its backward ran, its output is gone, or the step is made; a forward
    under no_grad opens none; no materialization outlives its step (memory does not creep)."""
    for r in workers(2).run(held_between_steps, 3):
        assert r["after_no_grad"] == [0] * 6
        assert r["after_dropped"] == [1] * 6
        assert r["after_step"] == [0] * 3
        assert len(set(r["trackers"])) == 1  # the same few, closed, step after step


def misuse() -> list[str]:
    model = build("gpt")
    shape = copy.deepcopy(model)
    engine = zf.initialize(model, _config(3, 1))
    x, y = batch("gpt", shape, 0, GLOBAL)
    errors = []

    def expect(kind, fn):
        with pytest.raises(kind) as e:
            fn()
        errors.append(str(e.value))

    expect(ValueError, lambda: engine.backward(torch.ones((), requires_grad=True) * 2))
    expect(ValueError, lambda: engine.step())
    out = engine(x)
    kept = loss("gpt", out, y)
    engine.backward(loss("gpt", out, y), retain_graph=True)
    engine.step()
    expect(RuntimeError, lambda: kept.backward())
    engine.backward(loss("gpt", engine(x), y))
    expect(ValueError, lambda: engine.train_batch(iter([(x, y)])))
    engine.step()
    expect(TypeError, lambda: engine.backward(engine(x)))
    with_loss_fn = zf.initialize(build("gpt"), _config(3, 1), loss_fn=lambda m, b: loss("gpt", m(b[0]), b[1]))
    expect(TypeError, lambda: with_loss_fn(x, y))
    return errors


def test_misuse_is_named():
    [errors] = workers(1).run(misuse)
    assert "built from what engine(batch) returned" in errors[0]
    assert "no engine.backward(loss) since the last update" in errors[1]
    assert "pass is over" in errors[2]
    assert "in the middle of an imperative step" in errors[3]
    assert "scalar loss tensor" in errors[4]
    assert "with loss_fn, engine(batch) takes one batch" in errors[5]


def hf_calls(steps: int, config: dict) -> dict:
    """GPT2LMHeadModel driven as Hugging Face scripts drive DeepSpeed: engine(**batch).loss."""
    model = hf_gpt2()
    rank, world = zf.dist.rank(), zf.dist.world_size()
    engine = zf.initialize(model, config)
    k = 0
    for _ in range(steps * engine.gradient_accumulation_steps()):
        n = 4 // world
        out = engine(**{key: v[rank * n:(rank + 1) * n] for key, v in hf_batch(k).items()})
        engine.backward(out.loss)
        engine.step()
        k += 1
    return {"params": engine.params()}


def test_hugging_face_model_output_through_engine_calls_equals_plain_pytorch():
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": HF_LR, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    expected = hf_reference(3, 2, 1.0)
    for r in workers(2).run(hf_calls, 3, config):
        got = {k: v for k, v in r["params"].items() if k in expected["params"]}
        _assert_close(got, {k: expected["params"][k] for k in got})
