"""Pipeline parallelism (zfunc.pipeline.module, zfunc.pipeline.interpreter) against the unpipelined model
on plain PyTorch: fp32 within 1e-5, for P = 2, 3 and P = 2 x DP = 2, 1F1B and GPipe."""
import pytest
import torch
from torch._dynamo.utils import counters

import zfunc as zf
from assertions import assert_close_to
from pipelines import BUILT, D, Dict, LR, Lin, VOCAB, config, lm_loss, micro_batch, pipe
from workers import workers


def run_pipeline(stages: int, micro: int, steps: int, schedule: str, stage: int = 1, extra=None,
                 kind: str = "join") -> dict:
    extra = dict(extra or {})
    compile_engine = extra.pop("compile_engine", False)
    torch._dynamo.reset()  # the worker processes outlive a test
    counters.clear()
    engine = zf.initialize(pipe(stages, schedule, kind=kind), config(micro, stage, **extra))
    if compile_engine:
        engine.compile(backend="aot_eager")
    replica = engine.grid.replica
    losses, graphs = [], []
    for i in range(steps):
        data = iter([micro_batch(i, m, replica) for m in range(micro)])
        losses.append(float(engine.train_batch(data)))
        graphs.append(counters["stats"]["unique_graphs"])
    times = {k: engine.last_metrics[k] for k in ("forward_s", "backward_s", "busy_s", "schedule_s", "schedule_window")}
    return {"stage": engine.grid.stage, "params": engine.params(), "losses": losses, "times": times, "graphs": graphs,
            "eval": float(engine.eval_batch(iter([micro_batch(steps, m, replica) for m in range(micro)])))}


def reference(stages: int, micro: int, steps: int, replicas: int, kind: str = "join") -> dict:
    """The whole model in one process, torch.optim.AdamW, the mean loss over all micro-batches."""
    model = pipe(stages, kind=kind).build_all()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = sum(lm_loss(model(x), y) for m in range(micro) for x, y in [micro_batch(i, m, d) for d in range(replicas)])
        loss = loss / (micro * replicas)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        ev = sum(lm_loss(model(x), y) for m in range(micro) for x, y in [micro_batch(steps, m, d) for d in range(replicas)])
    return {"model": model, "losses": losses, "eval": ev.item() / (micro * replicas)}


def _stage_params(model, p, stage: int) -> dict:
    """The reference's weights named as stage ``stage``'s module names them."""
    stage_module = p.build(stage)
    full = dict(model.named_parameters())
    names = {}
    for i, kind, what in stage_module._calls:
        if kind == "module":
            src = [j for j, k, _ in model._calls if j == i][0]
            for n, _ in stage_module.layers[what].named_parameters():
                names[f"layers.{what}.{n}"] = full[f"layers.{_module_index(model, src)}.{n}"]
        elif kind == "tied":
            k = stage_module.tied_keys.index(what.key)
            for n, _ in stage_module.tied[k].named_parameters():
                names[f"tied.{k}.{n}"] = full[f"tied.{model.tied_keys.index(what.key)}.{n}"]
    return names


def _module_index(model, layer: int) -> int:
    return next(w for j, k, w in model._calls if j == layer and k == "module")


def _check(results, stages, micro, steps, replicas, kind: str = "join"):
    ref = reference(stages, micro, steps, replicas, kind)
    p = pipe(stages, kind=kind)
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["eval"] == pytest.approx(ref["eval"], rel=1e-5)
        expected = _stage_params(ref["model"], p, r["stage"])
        assert_close_to(dict(sorted(r["params"].items())), {k: v.detach() for k, v in sorted(expected.items())})


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("micro", [1, 2, 3, 8])
def test_two_stages_equal_the_unpipelined_model(micro, schedule):
    """P = 2: the embedding and the LM head tied across the first and last stage, a tuple
    activation crossing the cut, micro-batch counts 1 to 8."""
    _check(workers(2).run(run_pipeline, 2, micro, 3, schedule), 2, micro, 3, 1)


@pytest.mark.parametrize("micro", [1, 3])
def test_an_activation_the_next_stage_drops_gets_a_zero_gradient(micro):
    """A stage's input gradients go back from inside its backward, once autograd has every one;
    one that never gets a gradient (the next stage ignores it) goes back as zeros after it."""
    _check(workers(2).run(run_pipeline, 2, micro, 3, "1f1b", 1, None, "first"), 2, micro, 3, 1, "first")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_three_stages_equal_the_unpipelined_model(schedule):
    results = workers(3).run(run_pipeline, 3, 4, 3, schedule)
    _check(results, 3, 4, 3, 1)
    # what benchmarks/pipeline.py measures the bubble from: busy time inside each stage's own
    # window, and windows on one clock that overlap (the stages run the step together)
    for r in results:
        t = r["times"]
        assert 0 < t["forward_s"] and 0 < t["backward_s"] and t["busy_s"] == t["forward_s"] + t["backward_s"]
        start, end = t["schedule_window"]
        assert t["busy_s"] <= t["schedule_s"] == pytest.approx(end - start)
    assert max(r["times"]["schedule_window"][0] for r in results) < min(r["times"]["schedule_window"][1] for r in results)


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_two_stages_by_two_replicas_with_zero_inside_each_stage(stage):
    """P = 2 x DP = 2 on W = 4: zero1/zero2 inside each stage's data-parallel group."""
    results = workers(4).run(run_pipeline, 2, 3, 3, "1f1b", stage)
    assert sorted(r["stage"] for r in results) == [0, 0, 1, 1]  # DeepSpeed's order: rank = stage * D + replica
    _check(results, 2, 3, 3, 2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_per_stage_trains_close_to_fp32(precision):
    """bf16, and fp16 with DeepSpeed's dynamic loss scaling agreed on by every stage."""
    results = workers(2).run(run_pipeline, 2, 2, 3, "1f1b", 1, {precision: {"enabled": True}})
    ref = reference(2, 2, 3, 1)
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=2e-2)


def fp16_overflow() -> dict:
    """fp16 with a loss scale so large that the first step overflows: skipped on every stage."""
    engine = zf.initialize(pipe(2), config(2, fp16={"enabled": True, "initial_scale_power": 120, "hysteresis": 1}))
    before = engine.params()
    engine.train_batch(iter([micro_batch(0, m, 0) for m in range(2)]))
    return {"skipped": engine.last_metrics["skipped"], "scale": engine.last_metrics["loss_scale"],
            "next": float(engine.state.loss_scale.scale), "same": all(torch.equal(before[k], v)
                                                                      for k, v in engine.params().items())}


def test_fp16_overflow_on_any_stage_skips_the_step_on_every_stage():
    for r in workers(2).run(fp16_overflow):
        assert r["skipped"] and r["same"] and r["next"] < r["scale"]


def build_one_stage(stages: int, method: str) -> dict:
    BUILT.clear()
    p = pipe(stages, method=method)
    counted = list(BUILT)
    BUILT.clear()
    module = p.build(zf.dist.rank() % stages)
    return {"counted": counted, "built": list(BUILT), "parts": p.parts,
            "params": sum(t.numel() for t in module.parameters())}


def test_a_stage_builds_only_its_layers():
    """With 'uniform' no constructor of another stage runs; 'parameters' counts on the meta device."""
    [first, last] = workers(2).run(build_one_stage, 2, "uniform")
    assert first["counted"] == [] and last["counted"] == []
    assert first["built"] == [("Emb", 1), ("Lin", 2), ("Lin", 3)]
    assert last["built"] == [("Lin", 4), ("Lin", 5), ("Emb", 1)]
    whole = sum(t.numel() for t in pipe(2).build_all().parameters())
    assert first["params"] + last["params"] == whole + VOCAB * D  # the tied embedding twice, all else once
    [by_params, _] = workers(2).run(build_one_stage, 2, "parameters")
    assert len(by_params["counted"]) == 6  # every LayerSpec with parameters, once, on the meta device


def test_partition_methods():
    assert pipe(2, method="uniform").parts == [0, 4, 8]
    assert pipe(2, method="type:lin").parts[1] in (3, 4, 5, 6)
    weights = zf.pipeline.balance([5, 1, 1, 1, 1, 5], 2)
    assert weights == [0, 3, 6]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="9 stages need at least 9 layers; this model has 8"):
        pipe(9)
    with pytest.raises(ValueError, match="partition_method must be"):
        pipe(2, method="size")
    with pytest.raises(ValueError, match="matches 0 layers"):
        pipe(2, method="type:conv")
    bad = zf.PipelineModule([zf.LayerSpec(Lin, 1), zf.LayerSpec(Dict), zf.LayerSpec(Lin, 2)], 1, lm_loss)
    with pytest.raises(TypeError, match=r"pipeline layer 1 \(Dict\) returned a dict"):
        bad.build_all()(torch.zeros(2, D))


def grid_of_three() -> str:
    try:
        zf.initialize(pipe(2), config(1))
    except ValueError as e:
        return str(e)
    return ""


def test_a_world_the_grid_does_not_divide_is_named():
    for message in workers(3).run(grid_of_three):
        assert "world size 3 does not split into 2 pipeline stages" in message


def save_then_go_on(stages: int, micro: int, directory: str, phase: str) -> dict:
    """phase "save": 2 steps, save; "load": load, 1 step; "whole": 3 steps."""
    engine = zf.initialize(pipe(stages), config(micro))
    replica = engine.grid.replica
    start = 0
    if phase == "load":
        engine.load_checkpoint(directory)
        start = engine.global_steps
    steps = {"save": 2, "load": 1, "whole": 3}[phase]
    for i in range(start, start + steps):
        engine.train_batch(iter([micro_batch(i, m, replica) for m in range(micro)]))
    if phase == "save":
        engine.save_checkpoint(directory)
    return {"stage": engine.grid.stage, "params": engine.params(), "steps": engine.global_steps}


def test_pipeline_checkpoint_resumes_at_another_data_parallel_size(tmp_path):
    """Saved at P = 2 x DP = 2 (W = 4) after 2 steps, one more step at P = 2 x DP = 1 (W = 2): equal to
    the unpipelined model trained on the same micro-batches (both replicas' for 2 steps, then one's)."""
    directory = str(tmp_path / "ckpt")
    workers(4).run(save_then_go_on, 2, 2, directory, "save")
    resumed = workers(2).run(save_then_go_on, 2, 2, directory, "load")
    model = pipe(2).build_all()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for i, replicas in ((0, 2), (1, 2), (2, 1)):
        opt.zero_grad()
        loss = sum(lm_loss(model(x), y) for m in range(2) for x, y in [micro_batch(i, m, d) for d in range(replicas)])
        (loss / (2 * replicas)).backward()
        opt.step()
    p = pipe(2)
    for r in resumed:
        assert r["steps"] == 3
        expected = _stage_params(model, p, r["stage"])
        assert_close_to(dict(sorted(r["params"].items())), {k: v.detach() for k, v in sorted(expected.items())})


def save_then_go_on_as(stages: int, micro: int, directory: str, phase: str) -> dict:
    """``save_then_go_on`` with a pipeline of ``stages`` stages (all ranks one replica each)."""
    engine = zf.initialize(pipe(stages), config(micro))
    client = {}
    if phase == "load":
        _, client = engine.load_checkpoint(directory)
    start = engine.global_steps
    for i in range(start, start + (2 if phase == "save" else 1)):
        engine.train_batch(iter([micro_batch(i, m, engine.grid.replica) for m in range(micro)]))
    if phase == "save":  # a client state JSON cannot hold: pickled beside the manifest
        engine.save_checkpoint(directory, client_state={"best": torch.tensor([0.5]), "epoch": 1})
    return {"stage": engine.grid.stage, "params": engine.params(), "steps": engine.global_steps, "client": client}


@pytest.mark.parametrize("stages", [1, 3])
def test_pipeline_checkpoint_loads_at_another_pipeline_shape(stages, tmp_path):
    """Saved as 2 stages, resumed as 1 or 3 (other cuts): each layer's state comes from the stage that
    saved it, the tied embedding from its first; training goes on as the unpipelined model; every
    stage gets the client state back."""
    directory = str(tmp_path / "ckpt")
    workers(2).run(save_then_go_on_as, 2, 2, directory, "save")
    resumed = workers(stages).run(save_then_go_on_as, stages, 2, directory, "load")
    model = pipe(stages).build_all()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for i in range(3):
        opt.zero_grad()
        (sum(lm_loss(model(x), y) for m in range(2) for x, y in [micro_batch(i, m, 0)]) / 2).backward()
        opt.step()
    p = pipe(stages)
    for r in resumed:
        assert r["steps"] == 3
        assert r["client"]["epoch"] == 1 and torch.equal(r["client"]["best"], torch.tensor([0.5]))
        expected = _stage_params(model, p, r["stage"])
        assert_close_to(dict(sorted(r["params"].items())), {k: v.detach() for k, v in sorted(expected.items())})


@pytest.mark.slow
def test_the_gpt_example_trains_as_a_pipeline_under_torchrun():
    """examples/train_gpt.py --pipeline 2 under torchrun --nproc_per_node 2 (the head tied to the embedding)."""
    import os
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt.py")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", example,
           "--pipeline", "2", "--steps", "3", "--mb", "0.2", "--layers", "2", "--width", "32", "--seq", "32",
           "--batch", "4", "--accumulate", "2"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 pipeline stages x 1 data-parallel replica(s)" in proc.stdout


@pytest.mark.slow  # compiled blocks are in the fast tier through test_compile and test_engine_compile
@pytest.mark.parametrize("how", ["config", "engine"])
def test_compiled_layers_train_as_the_eager_pipeline(how):
    """Each stage's layers compiled (the config's compile section, or engine.compile()): the
    unpipelined model's numbers, tied embedding and head across stages included."""
    extra = {"compile": {"enabled": True, "backend": "aot_eager"}} if how == "config" else {"compile_engine": True}
    results = workers(2).run(run_pipeline, 2, 2, 3, "1f1b", 1, extra)
    _check(results, 2, 2, 3, 1)
    for r in results:
        assert r["graphs"][0] > 0 and r["graphs"][-1] == r["graphs"][0], r["graphs"]
