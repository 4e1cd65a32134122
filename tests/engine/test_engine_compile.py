"""Compiling through the engine: ``engine.compile`` (DeepSpeed's signature) and the config's
``compile`` section (``enabled``/``backend``/``kwargs`` compile the blocks, ``deepcompile`` the
whole step with ``zf.jit``) give the eager engine's losses, compile once (no new graph after
the first step), and checkpoint under plain parameter names that load into an eager engine and
back, at W = 1 and W = 2. Backend ``aot_eager``: the same graphs as inductor's, compiled fast.
"""
import copy
import json
import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import zfunc as zf
from engines import engine_config, gpt_loss, micro_batches
from models import build
from workers import workers
from zfunc.engine import config as zc
from zfunc.engine.compose import compose
from zfunc.testing import assert_trees_all_equal

BACKEND = "aot_eager"
RTOL = 1e-5
STEPS = 3


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def run(config: dict, steps: int = STEPS, compile_args: tuple | None = None, compile_at: int = 0,
        imperative: bool = False) -> dict:
    """A fresh engine on the GPT of tests/harness/models.py; ``compile_args``: ``engine.compile(*compile_args)``
    before step ``compile_at``. Losses, final weights, and the graphs dynamo made after step 1."""
    torch._dynamo.reset()
    model = build("gpt")
    shape = copy.deepcopy(model)
    rank, world = zf.dist.rank(), zf.dist.world_size()
    engine = zf.initialize(model, config, loss_fn=gpt_loss)
    data = micro_batches("gpt", shape, rank, world, engine.gradient_accumulation_steps())
    losses, after_first = [], None
    for i in range(steps):
        if compile_args is not None and i == compile_at:
            engine.compile(*compile_args)
        if imperative:
            for _ in range(engine.gradient_accumulation_steps()):
                engine.backward(engine(next(data)))
                engine.step()
            losses.append(float(engine.last_metrics["loss"]))
        else:
            losses.append(float(engine.train_batch(data)))
        if i == compile_at:
            after_first = _graphs()
    out = {"losses": losses, "params": engine.params(), "new_graphs": _graphs() - after_first,
           "compiled": engine.is_compiled, "composition": engine.step_fn.composition}
    engine.close()
    return out


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == pytest.approx(b["losses"], rel=RTOL)
    assert list(a["params"]) == list(b["params"])
    for k in a["params"]:
        torch.testing.assert_close(a["params"][k], b["params"][k], rtol=RTOL, atol=RTOL)


@pytest.fixture(scope="module")
def eager() -> dict:
    return run(engine_config(3))


# ----------------------------------------------------------------- engine.compile


def test_engine_compile_gives_the_eager_losses_and_compiles_once(eager):
    r = run(engine_config(3), compile_args=(BACKEND,))
    assert r["compiled"] and not eager["compiled"]
    _same(r, eager)
    assert r["new_graphs"] == 0


def test_engine_compile_after_training_started_and_in_the_imperative_style(eager):
    _same(run(engine_config(3), compile_args=(BACKEND, {"fullgraph": True}), compile_at=1), eager)
    _same(run(engine_config(3), compile_args=(BACKEND,), imperative=True), eager)


def test_engine_compile_mirrors_deepspeeds_signature():
    import inspect

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.engine import DeepSpeedEngine

    theirs = list(inspect.signature(DeepSpeedEngine.compile).parameters)
    assert list(inspect.signature(zf.Engine.compile).parameters) == theirs


def test_engine_compile_twice():
    """Again with the same arguments: nothing (DeepSpeed's rule). Other arguments: recompiled
    before the first step, refused after it."""
    model = build("gpt")
    shape = copy.deepcopy(model)
    engine = zf.initialize(model, engine_config(3), loss_fn=gpt_loss)
    engine.compile("eager")
    impl = model.blocks[0]._compiled_call_impl
    engine.compile("eager")
    assert model.blocks[0]._compiled_call_impl is impl
    engine.compile(BACKEND)  # before the first step: recompiled with these
    assert model.blocks[0]._compiled_call_impl is not impl
    engine.train_batch(micro_batches("gpt", shape, 0, 1, 2))
    engine.compile(BACKEND, {})
    with pytest.raises(ValueError, match="already compiled .*backend='aot_eager'.* trained 1 step"):
        engine.compile(BACKEND, {"fullgraph": True})
    with pytest.warns(UserWarning, match="'backend' in compile_kwargs is overridden"):
        engine.compile(BACKEND, {"backend": "inductor"})
    with pytest.raises(ValueError, match="did you mean 'fullgraph'"):
        engine.compile(BACKEND, {"fulgraph": True})
    with pytest.raises(ValueError, match="did you mean 'aot_eager'"):
        engine.compile("aot_eagr")
    with pytest.raises(ValueError, match="not supported yet"):
        engine.compile(BACKEND, schedule=[(0, ["prefetch"])])
    engine.close()


# ------------------------------------------------------------ the config section


def test_config_enabled_compiles_the_blocks_at_initialize(eager):
    r = run(engine_config(3, compile={"enabled": True, "backend": BACKEND, "kwargs": {"fullgraph": True}}))
    assert r["compiled"]
    _same(r, eager)
    assert r["new_graphs"] == 0


def test_config_backend_and_kwargs_reach_torch_compile():
    model = build("gpt")
    engine = zf.initialize(model, engine_config(3, compile={"enabled": True, "backend": BACKEND,
                                                      "kwargs": {"dynamic": False}}), loss_fn=gpt_loss)
    assert engine._compiled == {"dynamic": False, "backend": BACKEND}
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    engine.compile(BACKEND, {"dynamic": False})  # what the config did: nothing to do
    engine.close()


def test_config_deepcompile_is_the_jit_step(eager):
    """DeepSpeed 0.19's way: deepcompile in the config, the backend given to engine.compile."""
    r = run(engine_config(3, compile={"deepcompile": True}), compile_args=(BACKEND,))
    assert r["compiled"] and r["composition"].startswith("jit(zero3(")
    _same(r, eager)
    assert r["new_graphs"] == 0


def test_deepcompile_with_nvme_offload_is_refused_at_initialize(tmp_path):
    cfg = zc.parse(engine_config(3, compile={"deepcompile": True}, zero_optimization={
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}), 1)
    with pytest.raises(ValueError, match="'compile.deepcompile' = true with offload to nvme is not supported yet"):
        compose(cfg, zf.train_step(lambda p, b: 0, zf.optim.sgd(0.1)))


@pytest.mark.parametrize("section, message", [
    ({"enabeld": True}, "unknown key 'compile.enabeld': did you mean 'enabled'?"),
    ({"enabled": True, "kwargs": {"fulgraph": True}}, "unknown key 'compile.kwargs.fulgraph': did you mean 'fullgraph'?"),
    ({"enabled": True, "kwargs": {"backend": "eager"}}, "compile.kwargs.backend: give the backend as compile.backend"),
    ({"deepcompile": True, "offload_activation": True}, "'compile.offload_activation' = true: .* not supported yet"),
    ({"deepcompile": True, "passes": ["autotp"]}, "'autotp' pass .* not supported yet"),
    ({"enabled": "yes"}, "compile.enabled must be true or false"),
])
def test_config_section_errors(section, message):
    with pytest.raises(ValueError, match=message):
        zc.parse(engine_config(3, compile=section), 1)


def test_an_unknown_backend_is_named_at_initialize():
    with pytest.raises(ValueError, match="compile.backend 'inductr'.*did you mean 'inductor'"):
        zf.initialize(build("gpt"), engine_config(3, compile={"enabled": True, "backend": "inductr"}), loss_fn=gpt_loss)


def test_the_section_is_read():
    c = zc.parse(engine_config(3, compile={"enabled": True, "backend": BACKEND, "kwargs": {"mode": "default"},
                                     "free_activation": True}), 1)
    assert c.compile == zc.CompileConfig(enabled=True, backend=BACKEND, kwargs={"mode": "default"})
    assert c.ignored == ("compile.free_activation",)  # tunes DeepCompile only
    off = zc.parse(engine_config(3, compile={"enabled": False, "free_activation": True}), 1)
    assert not off.compile.on and off.ignored == ("compile",)  # compiles nothing: listed whole
    auto = zc.parse(engine_config(3, compile={"enabled": "auto", "backend": "auto"}), 1)  # as accelerate writes it
    assert auto.compile == zc.CompileConfig()


def test_every_key_of_deepspeeds_compile_section_is_known():
    """DeepSpeed 0.19's CompileConfig, each key at its default: accepted; and never 'unknown key'."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.compile.config import CompileConfig

    for key, field in CompileConfig.model_fields.items():
        value = field.get_default(call_default_factory=True)
        zc.parse(engine_config(3, compile={key: value}), 1)
        flipped = (not value) if isinstance(value, bool) else value
        try:
            zc.parse(engine_config(3, compile={key: flipped}), 1)
        except ValueError as e:
            assert "not supported yet" in str(e), (key, str(e))


def test_a_pipeline_stage_refuses_deepcompile():
    """A stage's layers compile (tests/pipeline/test_pipeline.py); its step, driven by the schedule, is not traced whole."""
    cfg = zc.parse(engine_config(1, compile={"deepcompile": True}), 1)
    with pytest.raises(ValueError, match="PipelineModule: a stage's step is driven by its schedule"):
        compose(cfg, zf.train_step(lambda p, b: 0, zf.optim.sgd(0.1)), accumulate_micro=False)
    compose(zc.parse(engine_config(1, compile={"enabled": True}), 1), zf.train_step(lambda p, b: 0, zf.optim.sgd(0.1)),
            accumulate_micro=False)


# -------------------------------------------------------------------- checkpoints


def _engine(kind: str):
    """A GPT engine whose blocks are: eager, compiled in place by the config, or wrapped
    by torch.compile (their names then carry _orig_mod.)."""
    model = build("gpt")
    shape = copy.deepcopy(model)
    if kind == "wrapped":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=BACKEND)
        assert any("_orig_mod." in k for k in model.state_dict())
    extra = {"compile": {"enabled": True, "backend": BACKEND}} if kind == "config" else {}
    engine = zf.initialize(model, engine_config(3, **extra), loss_fn=gpt_loss)
    return engine, shape


def _steps(engine, shape, n: int) -> list[float]:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    data = micro_batches("gpt", shape, rank, world, engine.gradient_accumulation_steps(), engine.global_steps)
    return [float(engine.train_batch(data)) for _ in range(n)]


def _plain(folder: str) -> None:
    with open(os.path.join(folder, "manifest.json")) as f:
        text = f.read()
    assert "_orig_mod" not in text
    assert "blocks.0.ln1.weight" in json.loads(text)["content"]["state_dict_keys"]


def test_a_compiled_checkpoint_loads_into_an_eager_engine_and_back(tmp_path):
    compiled, shape = _engine("config")
    _steps(compiled, shape, 2)
    _plain(compiled.save_checkpoint(str(tmp_path / "a")))

    eager, shape = _engine("eager")
    eager.load_checkpoint(str(tmp_path / "a"))
    assert_trees_all_equal(eager.params(), compiled.params())
    assert eager.global_steps == 2
    _steps(eager, shape, 1)
    _plain(eager.save_checkpoint(str(tmp_path / "b")))
    at_b = eager.params()
    next_loss = _steps(eager, shape, 1)

    for kind in ("wrapped", "config"):  # back into compiled engines, which go on as the eager one did
        back, shape = _engine(kind)
        back.load_checkpoint(str(tmp_path / "b"))
        assert_trees_all_equal(back.params(), at_b)
        assert _steps(back, shape, 1) == pytest.approx(next_loss, rel=RTOL)
        _plain(back.save_checkpoint(str(tmp_path / kind)))
        again, _ = _engine("eager")
        again.load_checkpoint(str(tmp_path / kind))
        assert_trees_all_equal(again.params(), back.params())


# ------------------------------------------------------------------------- W = 2


def compiled_at_two(directory: str) -> dict:
    """Eager, engine.compile and the config's deepcompile at this world size; an engine compiled
    by the config's enabled trains and saves a checkpoint."""
    out = {"eager": run(engine_config(3)), "method": run(engine_config(3), compile_args=(BACKEND,)),
           "deepcompile": run(engine_config(3, compile={"deepcompile": True, "backend": BACKEND}))}
    engine, shape = _engine("config")
    _steps(engine, shape, 2)
    engine.save_checkpoint(directory)
    out["saved"] = engine.params()
    engine.close()
    return out


@pytest.mark.slow
def test_two_ranks(tmp_path):
    directory = str(tmp_path / "ckpt")
    results = workers(2).run(compiled_at_two, directory)
    for r in results:
        for kind in ("method", "deepcompile"):
            _same(r[kind], r["eager"])
            assert r[kind]["new_graphs"] == 0, kind
    _same(results[0]["eager"], results[1]["eager"])
    eager, _ = _engine("eager")  # W = 2 compiled -> W = 1 eager
    eager.load_checkpoint(directory)
    assert_trees_all_equal(eager.params(), results[0]["saved"])
