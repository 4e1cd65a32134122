"""The engine's DeepSpeed methods: the config's values as DeepSpeed's own config object reads
them, the step's (``was_step_applied``, the accumulation boundary, the gradient norm) against
plain PyTorch, the model's mode, ``save_16bit_model``'s file, and checkpoints with
``client_state`` and ``latest`` as DeepSpeed's. The same engine as ``zf.initialize``'s:
methods, not properties (``engine.gradient_accumulation_steps()``)."""
import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zfunc as zf
import zfunc.deepspeed as zds
from deepspeed_script import Net, dataset
from workers import workers

CONFIGS = [
    {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "bf16": {"enabled": True},
     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "steps_per_print": 10,
     "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}},
    {"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 128}, "gradient_clipping": 0.5,
     "zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}},
    {"train_batch_size": 4, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
     "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.9]}}},
]


@pytest.mark.parametrize("config", CONFIGS, ids=["bf16-zero2-offload", "fp16-zero1-sgd", "zero3-offload-param"])
def test_the_configs_values_are_deepspeeds(config):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    theirs = DeepSpeedConfig(copy.deepcopy(config))
    engine = zf.initialize(Net(), config)
    assert engine.train_batch_size() == theirs.train_batch_size
    assert engine.train_micro_batch_size_per_gpu() == theirs.train_micro_batch_size_per_gpu
    assert engine.gradient_accumulation_steps() == theirs.gradient_accumulation_steps
    assert engine.get_batch_info() == (theirs.train_batch_size, theirs.train_micro_batch_size_per_gpu,
                                       theirs.gradient_accumulation_steps)
    assert engine.zero_optimization_stage() == theirs.zero_optimization_stage
    assert engine.zero_optimization() == theirs.zero_enabled
    assert engine.fp16_enabled() == theirs.float16_config.enabled
    assert engine.bfloat16_enabled() == theirs.bfloat16_config.enabled
    assert engine.gradient_clipping() == theirs.gradient_clipping
    assert engine.loss_scale() == theirs.float16_config.loss_scale
    assert engine.dynamic_loss_scale() == (theirs.float16_config.loss_scale == 0)
    assert engine.steps_per_print() == theirs.steps_per_print
    assert engine.optimizer_name() == theirs.optimizer_name or engine.optimizer_name().lower() == theirs.optimizer_name
    for ours, section in ((engine.zero_offload_optimizer(), theirs.zero_config.offload_optimizer),
                          (engine.zero_offload_param(), theirs.zero_config.offload_param)):
        assert (ours is None) == (section is None)
        if section is not None:
            assert ours.device == getattr(section.device, "value", section.device)  # a str enum in DeepSpeed
    offloaded = theirs.zero_config.offload_optimizer
    assert engine.zero_cpu_offload() == (offloaded is not None and offloaded.device == "cpu")
    assert (engine.global_rank, engine.world_size, engine.dp_world_size, engine.local_rank) == (0, 1, 1, 0)
    assert engine.device == torch.device("cpu")
    engine.close()


def test_was_step_applied_the_boundary_and_the_grad_norm_as_torch():
    """gas 2: ``step()`` updates every second call; the norm is the true gradient's, before clipping."""
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.01,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    engine, optimizer, loader, _ = zds.initialize(model=model, config=config, training_data=dataset(16))
    assert engine.was_step_applied() is False and engine.get_global_grad_norm() is None
    boundaries, applied, norms = [], [], []
    batches = list(loader)
    for x, y in batches:
        boundaries.append(engine.is_gradient_accumulation_boundary())
        loss = F.cross_entropy(engine(x), y)
        assert float(engine.backward(loss)) == pytest.approx(loss.item() / 2)
        if not engine.is_gradient_accumulation_boundary():
            with pytest.raises(NotImplementedError, match="zero_grad\\(\\) in the middle of a gradient accumulation"):
                optimizer.zero_grad()
        engine.step()
        applied.append(engine.was_step_applied())
        norms.append(engine.get_global_grad_norm())
    assert boundaries == applied == [False, True, False, True]
    ref_norms = []
    for k in (0, 2):  # plain torch: the mean of two micro-batches' gradients, then clipped SGD
        sum(F.cross_entropy(ref(x), y) / 2 for x, y in batches[k:k + 2]).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)))
        torch.optim.SGD(ref.parameters(), lr=0.1).step()
        ref.zero_grad()
    assert norms[1] == pytest.approx(ref_norms[0], rel=1e-5) and norms[3] == pytest.approx(ref_norms[1], rel=1e-5)
    assert norms[2] == norms[1]  # kept until the next update, as DeepSpeed caches it
    optimizer.zero_grad()  # nothing pending after an update
    engine.zero_grad()
    assert loader is engine.training_dataloader
    assert optimizer.state_dict()["state"]["step"] == 2 == engine.global_steps
    for name, p in ref.named_parameters():
        torch.testing.assert_close(engine.params()[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_train_and_eval_set_the_models_mode():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    engine = zf.initialize(model, {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.eval() is engine and not model.training and not engine.training
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(engine(x), engine(x))  # no dropout in eval mode
    assert engine.train() is engine and model.training and engine.training
    engine.close()


def test_the_engines_optimizer_is_a_deepspeed_optimizer():
    """Lightning Fabric's checkpoint load asks ``isinstance(optimizer, DeepSpeedOptimizer)`` to decide
    whether to load the optimizer's states."""
    from zfunc.deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    engine, optimizer, _, _ = zds.initialize(model=Net(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert isinstance(optimizer, DeepSpeedOptimizer) and not isinstance(torch.zeros(1), DeepSpeedOptimizer)


def forward_only(stage: int, bf16: bool) -> dict:
    """An engine made with no optimizer (TRL's reference model): its eval forward is the model's (in
    bf16: the bf16 model's), and it holds no optimizer state (no fp32 master copy)."""
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model).to(torch.bfloat16 if bf16 else torch.float32).eval()
    engine, optimizer, _, scheduler = zds.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
        "zero_optimization.stage3_param_persistence_threshold": 40})  # a path as a key: ignored, as by DeepSpeed
    engine.eval()
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    with torch.no_grad():
        ours, theirs = engine(x.to(plain.head.weight.dtype)).float(), plain(x.to(plain.head.weight.dtype)).float()
        same = torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    state_bytes = zf.memory_report(engine.state)["optimizer_bytes"]
    engine.train()
    engine.backward(engine(x).sum())
    try:
        engine.step()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return {"same": same, "refused": refused, "scheduler": scheduler, "state_bytes": state_bytes}


@pytest.mark.parametrize("stage, bf16", [(0, False), (3, False), (3, True)])
def test_an_engine_without_an_optimizer_runs_forward_only(stage, bf16):
    """``deepspeed.initialize`` with no optimizer in the config or the call, as TRL makes its reference
    model (W = 2): the eval forward equals the model's, no optimizer state is held (in bf16 no fp32
    master copy), and a step raises, naming the missing optimizer."""
    for out in workers(2).run(forward_only, stage, bf16):
        assert out["same"] and out["scheduler"] is None and out["state_bytes"] == 0, out
        assert "made without an optimizer" in out["refused"], out


class Tied(nn.Module):
    """Tied weights and both kinds of buffer: what a state_dict holds beyond plain parameters."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((6,), 0.5))
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def forward(self, x):
        h = self.embed(x)
        h = h * self.scale.to(h.dtype)  # zfunc keeps buffers in fp32 under bf16 (DeepSpeed casts them)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def save_16bit(folder: str, stage: int, bf16: bool, gather: bool) -> dict:
    zero = {"stage": stage, **({"stage3_gather_16bit_weights_on_model_save": True} if gather else {})}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero, "bf16": {"enabled": bf16},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}}
    torch.manual_seed(0)
    model = Tied()
    keys = list(model.state_dict())
    engine, *_ = zds.initialize(model=model, config=config)
    x = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(zf.dist.rank()))
    loss = F.cross_entropy(engine(x).flatten(0, 1), x.flatten())
    engine.backward(loss)
    engine.step()
    params = engine.params()
    with pytest.warns(UserWarning, match="stage3_gather_16bit_weights_on_model_save") if stage == 3 and not gather \
            else _nothing():
        wrote = engine.save_16bit_model(folder, "model.bin")
    out = {"wrote": wrote, "exists": os.path.exists(os.path.join(folder, "model.bin"))}
    if wrote and zf.dist.rank() == 0:
        saved = torch.load(os.path.join(folder, "model.bin"))
        dtype = torch.bfloat16 if bf16 else torch.float32
        assert list(saved) == keys
        assert saved["head.weight"].data_ptr() == saved["embed.weight"].data_ptr()  # one tensor, as state_dict's
        for name, p in params.items():
            assert saved[name].dtype == dtype
            assert torch.equal(saved[name], p.to(dtype)), name
        assert torch.equal(saved["scale"], torch.full((6,), 0.5, dtype=dtype))
    engine.close()
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("stage, bf16, gather", [(3, False, True), (3, True, True), (3, False, False), (1, True, False)])
def test_save_16bit_model_writes_the_state_dict_as_deepspeed(stage, bf16, gather, tmp_path):
    """Under ZeRO-3 only with the config's gather switch (else False and nothing written, as
    DeepSpeed); the model's state_dict keys, tied names one tensor, bf16 when training in bf16."""
    out = workers(2).run(save_16bit, str(tmp_path / f"s{stage}{bf16}{gather}"), stage, bf16, gather)
    assert out[0] == out[1] == {"wrote": gather or stage != 3, "exists": gather or stage != 3}


def test_checkpoints_keep_client_state_and_latest(tmp_path):
    """``client_state`` comes back from ``load_checkpoint``: plain data, and what JSON cannot hold
    (Lightning's callback states: tensors) pickled beside the manifest; what cannot be pickled is
    refused before anything is written."""
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    torch.manual_seed(0)
    engine, optimizer, loader, scheduler = zds.initialize(model=Net(), config=config, training_data=dataset(8))
    for x, y in loader:
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    assert scheduler.state_dict() == {"last_batch_iteration": 1}
    folder = engine.save_checkpoint(str(tmp_path), client_state={"epoch": 4, "best": [0.5]})
    assert os.path.basename(folder) == "global_step2" and (tmp_path / "latest").read_text() == "global_step2"
    with pytest.raises(TypeError, match="client_state could not be saved"):
        engine.save_checkpoint(str(tmp_path), tag="bad", client_state={"f": lambda: 0})
    assert sorted(os.listdir(tmp_path)) == ["global_step2", "latest"]  # the refused save wrote nothing
    pickled = {"callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.25)}}, "epoch": 4}
    other = engine.save_checkpoint(str(tmp_path / "pickled"), client_state=pickled)
    fresh, fresh_opt, _, fresh_sched = zds.initialize(model=Net(), config=config)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    path, client_state = fresh.load_checkpoint(str(tmp_path))
    assert torch.equal(torch.rand(3), expected)  # DeepSpeed's load leaves the RNG alone (zfunc's restores it)
    assert (path, client_state) == (folder, {"epoch": 4, "best": [0.5]})
    path, client_state = fresh.load_checkpoint(str(tmp_path / "pickled"))  # what JSON cannot hold: pickled beside
    assert path == other and client_state["epoch"] == 4
    assert torch.equal(client_state["callbacks"]["ModelCheckpoint"]["best_model_score"], torch.tensor(0.25))
    assert fresh.global_steps == 2 and fresh_sched.state_dict() == scheduler.state_dict()
    assert fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    for name, p in engine.params().items():
        assert torch.equal(fresh.params()[name], p)
    with pytest.warns(UserWarning, match="no 'latest' file"):
        assert fresh.load_checkpoint(str(tmp_path / "empty")) == (None, None)
    for kw, named in (({"load_lr_scheduler_states": False}, "load_lr_scheduler_states=False"),
                      ({"custom_load_fn": print}, "custom_load_fn")):  # the partial loads: test_hf_engine.py
        with pytest.raises(NotImplementedError, match=named):
            fresh.load_checkpoint(str(tmp_path), **kw)
    with pytest.raises(NotImplementedError, match="save_latest=False"):
        fresh.save_checkpoint(str(tmp_path), save_latest=False)
