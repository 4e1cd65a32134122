"""``import deepspeed`` as zfunc where asked (``zfunc.deepspeed.install()``, ``ZFUNC_AS_DEEPSPEED=1``
through the installed ``.pth`` hook), real DeepSpeed otherwise, and the module tree DeepSpeed's
clients import: each name real (checked against DeepSpeed's own where it computes something) or
refused naming the feature."""
import importlib
import importlib.metadata
import importlib.util
import os
import site
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

import _zfunc_as_deepspeed as switch
import zfunc.deepspeed as zds
from workers import workers

SNIPPET_ON = r"""
import importlib.metadata as md, importlib.util, sys
assert [type(f).__name__ for f in sys.meta_path][0] == "_Finder"
assert importlib.util.find_spec("deepspeed") is not None
print("version", md.version("deepspeed"), md.metadata("deepspeed")["Name"])
import deepspeed
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
from deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec
import zfunc.deepspeed
print("same", deepspeed is zfunc.deepspeed, sys.modules["deepspeed.ops.adam"] is sys.modules["zfunc.deepspeed.ops.adam"],
      deepspeed.__version__, zfunc.deepspeed.__spec__.name)
try:
    import deepspeed.inference
except ModuleNotFoundError as e:
    print("refused", e.name)
"""


def _python(code: str, switch_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != switch.ENV}
    if switch_value is not None:
        env[switch.ENV] = switch_value
    env.update(DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_the_pth_hook_is_installed_in_site_packages():
    folders = site.getsitepackages() + [site.getusersitepackages()]
    assert any(os.path.isfile(os.path.join(f, "zfunc-as-deepspeed.pth")) for f in folders), folders


# A fresh interpreter importing zfunc (~5-10 s here): the slow tier. The fast tier runs the same hook
# (test_a_mistyped_switch_is_an_error_at_start) and the same finder in process (test_install_...).
@pytest.mark.slow
def test_the_switch_at_interpreter_start_makes_deepspeed_zfunc():
    done = _python(SNIPPET_ON, "1")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    version = switch.version()
    assert version.startswith("0.19.8+zfunc.")
    assert f"version {version} deepspeed" in out
    assert f"same True True {version} zfunc.deepspeed" in out
    assert "refused deepspeed.inference" in out


def test_with_the_switch_off_real_deepspeed_is_found():
    code = ("import importlib.metadata as md, importlib.util, sys\n"
            "print(md.version('deepspeed'), importlib.util.find_spec('deepspeed').origin, "
            "any(type(f).__name__ == '_Finder' for f in sys.meta_path))")
    for value in (None, "0", ""):
        done = _python(code, value)
        assert done.returncode == 0, done.stderr[-3000:]
        version, origin, finder = done.stdout.split()
        assert "+zfunc" not in version and finder == "False"
        assert origin.endswith(os.path.join("deepspeed", "__init__.py")) and "zfunc" not in origin


def test_a_mistyped_switch_is_an_error_at_start():
    done = _python("print('ran')", "yes please")
    assert "ZFUNC_AS_DEEPSPEED='yes please'" in done.stderr
    assert switch.switched_on("ON") and not switch.switched_on(None) and not switch.switched_on("0")


@pytest.fixture
def without_deepspeed_modules():
    """This process's deepspeed modules set aside (another test may have imported real DeepSpeed),
    and put back after, with the finder removed."""
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "deepspeed" or k.startswith("deepspeed.")}
    yield
    switch.uninstall()
    for k in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_install_is_idempotent_and_uninstall_undoes_it(without_deepspeed_modules):
    zds.install()
    zds.install()
    assert sum(type(f).__name__ == "_Finder" for f in sys.meta_path) == 1 and zds.installed()
    import deepspeed
    from deepspeed.utils import logger  # noqa: F401
    assert deepspeed is zds and sys.modules["deepspeed.utils"] is zds.utils
    assert importlib.metadata.version("deepspeed") == switch.version()
    import transformers.integrations.deepspeed as hf
    from accelerate.utils import compare_versions, is_deepspeed_available
    assert hf.is_deepspeed_available() and is_deepspeed_available()  # what they check, at call time
    assert compare_versions("deepspeed", ">=", "0.16.4")  # Accelerate's newest version gate
    zds.uninstall()
    assert not zds.installed() and "deepspeed" not in sys.modules
    assert importlib.metadata.version("deepspeed") != switch.version()


def test_install_refuses_once_real_deepspeed_is_imported(without_deepspeed_modules):
    sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # stands for real DeepSpeed, imported before
    with pytest.raises(RuntimeError, match="real DeepSpeed is already imported"):
        zds.install()
    assert not zds.installed()


# --------------------------------------------------------------------- the module tree


def _params():
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(3))]


def _train(opt, params, steps=4):
    for i in range(steps):
        opt.zero_grad()
        loss = sum(((p * (i + 1)) ** 2).sum() for p in params)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("cls, kw, torch_cls, torch_kw", [
    ("FusedAdam", dict(weight_decay=0.1), torch.optim.AdamW, dict(weight_decay=0.1)),
    ("FusedAdam", dict(weight_decay=0.1, adam_w_mode=False), torch.optim.Adam, dict(weight_decay=0.1)),
    ("DeepSpeedCPUAdam", dict(weight_decay=0.05), torch.optim.AdamW, dict(weight_decay=0.05)),
    ("DeepSpeedCPUAdam", dict(adamw_mode=False, weight_decay=0.05), torch.optim.Adam, dict(weight_decay=0.05)),
])
def test_deepspeed_adams_step_as_torch_adams(cls, kw, torch_cls, torch_kw):
    ours, theirs = _params(), _params()
    a = _train(getattr(zds.ops.adam, cls)(ours, lr=0.01, betas=(0.8, 0.9), **kw), ours)
    b = _train(torch_cls(theirs, lr=0.01, betas=(0.8, 0.9), **torch_kw), theirs)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_deepspeed_adams_are_read_into_zfuncs_optimizer():
    from zfunc.deepspeed.client import optimizer_from_client

    model = nn.Linear(3, 2)
    opt = zds.ops.adam.FusedAdam([{"params": [model.weight], "weight_decay": 0.1},
                                  {"params": [model.bias], "weight_decay": 0.0}], lr=0.02, betas=(0.9, 0.95))
    assert optimizer_from_client(opt, model).lr(0) == pytest.approx(0.02)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        zds.ops.adam.FusedAdam(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="bias_correction=False"):
        optimizer_from_client(zds.ops.adam.FusedAdam(model.parameters(), bias_correction=False), model)


@pytest.mark.parametrize("make, feature", [
    (lambda: zds.ops.lion.FusedLion([]), "Lion"),
    (lambda: zds.ops.lion.DeepSpeedCPULion([]), "Lion"),
    (lambda: zds.ops.adagrad.DeepSpeedCPUAdagrad([]), "Adagrad"),
    (lambda: zds.init_inference(nn.Linear(2, 2)), "DeepSpeed-Inference"),
    (lambda: zds.launcher.runner.main(), "launcher"),
    (lambda: zds.utils.safe_get_full_grad(nn.Parameter(torch.zeros(1))), "gradient"),
    (lambda: zds.utils.safe_get_full_optimizer_state(nn.Parameter(torch.zeros(1)), "exp_avg"), "optimizer's state"),
    (lambda: zds.checkpointing.configure(object()), "model parallelism"),
    (lambda: zds.pipe.PipelineModule([nn.Linear(2, 2)] * 2, num_stages=1, loss_fn=nn.MSELoss(),
                                     activation_checkpoint_interval=1), "activation checkpointing"),
    (lambda: zds.pipe.PipelineModule([nn.Linear(2, 2)] * 2, topology=object()), "topologies"),
])
def test_what_zfunc_lacks_is_refused_by_name(make, feature):
    with pytest.raises(NotImplementedError, match=feature):
        make()


def test_small_helpers_do_what_deepspeeds_do():
    from zfunc.pipeline import PipelineModule as ZfuncPipeline

    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 1)))
    assert zds.compression.helper.recursive_getattr(model, "1.1") is model[1][1]
    zds.compression.helper.recursive_setattr(model, "1.0", nn.Tanh())
    assert isinstance(model[1][0], nn.Tanh)
    t = torch.arange(10.0)
    saved = zds.checkpoint.utils.clone_tensors_for_torch_save({"a": [t[2:4]], "b": (t, 1)})
    assert saved["a"][0].untyped_storage().nbytes() == 8 and saved["b"][1] == 1
    assert torch.equal(saved["b"][0], t) and saved["b"][0].data_ptr() != t.data_ptr()
    assert zds.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME == os.getenv("DS_ENV_FILE", ".deepspeed_env")
    assert [type(m) for m in zds.utils.set_z3_leaf_modules(model, [nn.Linear])] == [nn.Linear, nn.Linear]
    assert zds.utils.z3_leaf_module(model[0]) and zds.utils.get_z3_leaf_modules(model) == [model[0], model[1][1]]
    pipe = zds.pipe.PipelineModule([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)], num_stages=2, loss_fn=nn.MSELoss())
    assert isinstance(pipe, ZfuncPipeline) and pipe.num_stages == 2
    assert zds.get_accelerator() is zds.accelerator.get_accelerator()
    x = torch.randn(4, 2, requires_grad=True)
    zds.checkpointing.configure(None, partition_activations=True)
    zds.checkpointing.checkpoint(model, x).sum().backward()
    g, x.grad = x.grad, None
    model(x).sum().backward()
    torch.testing.assert_close(g, x.grad)


def test_moe_utils_pass_dense_groups_through_and_moe_is_refused():
    model = nn.Linear(2, 2)
    group = {"params": list(model.parameters()), "name": "parameters"}
    assert zds.moe.utils.split_params_into_different_moe_groups_for_optimizer(group) == [group]
    model.weight.allreduce = False  # what DeepSpeed's MoE layers mark their experts with
    with pytest.raises(NotImplementedError, match="expert"):
        zds.moe.utils.split_params_into_different_moe_groups_for_optimizer([group])
    with pytest.raises(NotImplementedError, match="mixture of experts"):
        zds.moe.layer.MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2)


def test_full_fp32_params_read_and_written_through_the_engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    engine, *_ = zds.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    weight = model[0].weight
    before = zds.utils.safe_get_full_fp32_param(weight)
    assert before.dtype == torch.float32 and before.shape == (4, 3)
    zds.utils.safe_set_full_fp32_param(weight, torch.full((4, 3), 0.25))
    torch.testing.assert_close(zds.utils.safe_get_full_fp32_param(weight), torch.full((4, 3), 0.25))
    torch.testing.assert_close(engine.params()["0.weight"], torch.full((4, 3), 0.25))


def test_process_groups_as_deepspeeds_clients_read_them():
    groups = zds.utils.groups
    assert groups._get_data_parallel_world_size() == 1 and groups._get_data_parallel_rank() == 0
    assert groups._get_sequence_parallel_world_size() == 1 and groups._get_model_parallel_world_size() == 1
    with pytest.raises(NotImplementedError, match="sequence parallelism"):
        groups._get_sequence_parallel_group()


def test_the_config_object_reads_as_deepspeeds():
    cfg = zds.DeepSpeedConfig({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                               "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 2)
    assert cfg.zero_optimization_stage == 2 and cfg.zero_enabled and cfg.bfloat16_enabled and not cfg.fp16_enabled
    with pytest.raises(zds.DeepSpeedConfigError):
        zds.DeepSpeedConfig({"train_batch_size": 8, "zero_optimisation": {}})


# ------------------------------------------------------------------------ lr schedules

SCHEDULES = [
    ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.02, warmup_num_steps=5, warmup_type="linear")),
    ("WarmupLR", dict(warmup_num_steps=6)),  # log warmup to each group's own lr
    ("WarmupDecayLR", dict(total_num_steps=12, warmup_min_lr=[0.0, 0.001], warmup_max_lr=0.02, warmup_num_steps=4)),
    ("WarmupCosineLR", dict(total_num_steps=12, warmup_min_ratio=0.1, warmup_num_steps=3, cos_min_ratio=0.01)),
    ("OneCycle", dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=3, cycle_second_step_size=4,
                      decay_lr_rate=0.5, decay_step_size=2, cycle_min_mom=0.85, cycle_max_mom=0.95,
                      decay_mom_rate=0.1)),
    ("OneCycle", dict(cycle_min_lr=[0.001, 0.002], cycle_max_lr=0.01, cycle_first_step_size=4,
                      cycle_first_stair_count=2)),
    ("LRRangeTest", dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=3, lr_range_test_step_rate=2.0)),
    ("LRRangeTest", dict(lr_range_test_min_lr=[0.001, 0.01], lr_range_test_step_size=2,
                         lr_range_test_staircase=True)),
]


def _groups():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    return torch.optim.Adam([{"params": [a]}, {"params": [b], "lr": 0.005}], lr=0.01)


@pytest.mark.parametrize("name, kw", SCHEDULES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SCHEDULES)])
def test_lr_schedulers_set_deepspeeds_values_at_every_step(name, kw):
    real = importlib.import_module("deepspeed.runtime.lr_schedules")  # DeepSpeed's own, the reference
    assert not real.__name__.startswith("zfunc")
    assert zds.runtime.lr_schedules.VALID_LR_SCHEDULES == real.VALID_LR_SCHEDULES
    ours_opt, theirs_opt = _groups(), _groups()
    ours = getattr(zds.runtime.lr_schedules, name)(ours_opt, **kw)
    theirs = getattr(real, name)(theirs_opt, **kw)
    for step in range(16):
        for g, h in zip(ours_opt.param_groups, theirs_opt.param_groups):
            assert g["lr"] == pytest.approx(h["lr"], rel=1e-12, abs=1e-15), (step, g["lr"], h["lr"])
            assert tuple(g["betas"]) == pytest.approx(tuple(h["betas"]), rel=1e-12), step
        assert ours.get_lr() == pytest.approx(theirs.get_lr(), rel=1e-12)
        if step:
            assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=1e-12)
        assert ours.state_dict() == theirs.state_dict()
        ours.step()
        theirs.step()


# ------------------------------------------------------------------------ deepspeed.comm


def _collectives() -> list:
    comm, rank = zds.comm, zds.comm.get_rank()
    t = torch.tensor([1.0, 2.0]) * (rank + 1)
    comm.all_reduce(t, op=comm.ReduceOp.SUM, log_name="x")
    b = torch.full((2,), float(rank))
    comm.broadcast(b, 1)
    parts = [torch.zeros(2) for _ in range(comm.get_world_size())]
    comm.all_gather(parts, torch.full((2,), float(rank)))
    flat = torch.zeros(2 * comm.get_world_size())
    comm.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    mine = torch.zeros(1)
    comm.reduce_scatter_tensor(mine, torch.arange(float(comm.get_world_size())) + rank)
    return [t.tolist(), b.tolist(), [p.tolist() for p in parts], flat.tolist(), mine.tolist()]


def test_the_scripts_own_collectives_are_torchs():
    out = workers(2).run(_collectives)
    assert out[0][:4] == out[1][:4] == [[3.0, 6.0], [1.0, 1.0], [[0.0, 0.0], [1.0, 1.0]], [0.0, 0.0, 1.0, 1.0]]
    assert [o[4] for o in out] == [[1.0], [3.0]]  # element r of (arange(2) + rank) summed over the ranks


def test_collectives_without_a_group_act_as_one_rank():
    if torch.distributed.is_initialized():
        pytest.skip("this process has a group")
    assert _collectives() == [[1.0, 2.0], [0.0, 0.0], [[0.0, 0.0]], [0.0, 0.0], [0.0]]
