"""``zfunc.deepspeed.utils.zero_to_fp32`` on zfunc's checkpoints, in one process: the fp32
state_dict is the engine's weights (tied names, buffers; frozen parameters left out when asked),
the files are written in the dtype asked, one or in shards, whole or not at all, and a model an
engine held loads them into parameters of its own. Against real DeepSpeed's own functions on its
own checkpoints: tests/deepspeed/test_script_against_deepspeed.py (slow)."""
import json
import os

import pytest
import safetensors.torch
import torch
from torch import nn

import zfunc as zf
import zfunc.deepspeed as zds
from zfunc.deepspeed.utils import zero_to_fp32


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight
        self.body.bias.requires_grad_(False)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.body(self.embed(x))))).logsumexp(-1).mean() * self.scale.mean()


def trained(tmp_path, stage=3, bf16=False):
    model = Tied()
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, **({"bf16": {"enabled": True}} if bf16 else {})}
    engine, *_ = zds.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                config=cfg)
    for i in range(2):
        engine.backward(engine(torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(i))))
        engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="step2")
    return engine, model


@pytest.mark.parametrize("stage, bf16", [(3, False), (2, True)])
def test_the_fp32_state_dict_is_the_engines_weights(stage, bf16, tmp_path):
    engine, model = trained(tmp_path, stage, bf16)
    got = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    want = zf.gather_params(engine.state)  # fp32: the master weights under bf16
    assert list(got) == list(Tied().state_dict())  # the model's own keys, the tied head and the buffer too
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], t), name
    assert torch.equal(got["head.weight"], got["embed.weight"])
    assert torch.equal(got["scale"], torch.full((8,), 0.5))
    lean = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="step2",
                                                                  exclude_frozen_parameters=True)
    assert "body.bias" not in lean and set(got) - set(lean) == {"body.bias"}
    engine.close()


def test_files_in_the_dtype_asked_in_shards_with_an_index(tmp_path):
    engine, _ = trained(tmp_path)
    want = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    out = tmp_path / "bf16"
    zero_to_fp32.convert_zero_checkpoint_to_state_dict(str(tmp_path / "ckpt"), str(out), dtype="bf16",
                                                       max_shard_size=400, safe_serialization=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert sorted(os.listdir(out)) == sorted(files + ["model.safetensors.index.json"]) and len(files) > 1
    written = {k: v for f in files for k, v in safetensors.torch.load_file(out / f).items()}
    assert set(written) == set(want)
    for name, t in want.items():
        expected = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert written[name].dtype == expected.dtype and torch.equal(written[name], expected), name
    one = tmp_path / "one"
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(one), max_shard_size=None)
    assert os.listdir(one) == ["pytorch_model.bin"]
    assert all(torch.equal(v, want[k]) for k, v in torch.load(one / "pytorch_model.bin").items())
    with pytest.raises(ValueError, match="dtype"):
        zero_to_fp32.convert_zero_checkpoint_to_state_dict(str(tmp_path / "ckpt"), str(one), dtype=torch.int8)
    engine.close()


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    engine, _ = trained(tmp_path)
    real, calls = torch.save, []

    def failing(obj, path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", failing)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(out), max_shard_size=400)
    assert os.listdir(out) == []
    engine.close()


def test_a_model_an_engine_held_loads_the_weights_into_its_own_parameters(tmp_path):
    engine, model = trained(tmp_path)
    want = zf.gather_params(engine.state)
    loaded = zero_to_fp32.load_state_dict_from_zero_checkpoint(model, str(tmp_path / "ckpt"))
    assert loaded is model and loaded.head.weight is loaded.embed.weight  # the tie kept
    for name, p in loaded.named_parameters():
        assert type(p) is nn.Parameter and torch.equal(p.detach(), want[name]), name
    assert not loaded.body.bias.requires_grad
    x = torch.randint(0, 10, (4,))
    assert torch.isfinite(loaded.eval()(x))  # a plain model now, outside the engine
    other = Tied()
    other.extra = nn.Parameter(torch.ones(3))
    engine2, *_ = zds.initialize(model=other, model_parameters=[p for p in other.parameters() if p.requires_grad],
                                 config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    with pytest.raises(ValueError, match="lacks \\['extra'\\]"):  # another model's checkpoint: named, not left unset
        zero_to_fp32.load_state_dict_from_zero_checkpoint(other, str(tmp_path / "ckpt"))
    engine2.close()
    for refused in (zero_to_fp32.get_optim_files, zero_to_fp32.get_model_state_file):
        with pytest.raises(NotImplementedError, match="get_fp32_state_dict_from_zero_checkpoint"):
            refused(str(tmp_path / "ckpt"), *([3] if refused is zero_to_fp32.get_model_state_file else []))
    engine.close()
