"""Whole-tensor optimizers (Muon + AdamW, Adafactor) under every composition: accumulate (Newton-Schulz
once per optimizer step, equal to the big batch), clip_by_global_norm (the norm counted once),
mixed precision (fp32 masters and state), offload_cpu and offload_nvme (equal to no offload), at
W = 2; and DeepSpeed's three Muon bugs as tests."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

import zfunc as zf
from assertions import assert_close_to
from cases import compose
from models import batch, build, local, loss
from optim_reference import torch_recipe, train_torch, zfunc_recipe
from workers import workers
from zfunc.testing import assert_trees_all_close

STEPS = 3


def train(stage: int, opt_name: str = "recipe", micro: int | None = None, clip: float | None = None,
          precision: dict | None = None, offload: dict | None = None, dtype=torch.float32, per_rank: int = 2,
          count_ns: bool = False) -> dict:
    """``STEPS`` steps of the composed step on this rank's part of each global batch; the parameters
    (and with ``count_ns``, Newton-Schulz's calls per step, and the masters' dtypes)."""
    import sys
    from unittest import mock

    muon_module = sys.modules["zfunc.optim.muon"]  # (zf.optim.muon is the function)

    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, twin = build("gpt").to(dtype), build("gpt").to(dtype)

    def loss_fn(params, b):
        x, y = b
        return loss("gpt", zf.apply(model, params, x), y)

    opt = zfunc_recipe(torch.float64 if dtype == torch.float64 else torch.bfloat16) if opt_name == "recipe" \
        else zf.optim.adafactor(0.05)
    kw = dict(offload or {})
    if kw.get("kind") == "nvme":
        kw["path"] = os.path.join(tempfile.gettempdir(), f"zfunc-whole-nvme-{os.getpid()}")
    step = compose(stage, loss_fn, clip=clip, precision=precision, micro=micro, opt=opt, offload=kw or None)
    state = step.init(model)
    calls, original = [], muon_module.newton_schulz
    with mock.patch.object(muon_module, "newton_schulz", lambda *a, **k: (calls.append(1), original(*a, **k))[1]):
        per_step = []
        for i in range(STEPS):
            b = local(batch("gpt", twin, i, per_rank * world), rank, world)
            if micro:
                n = b[0].shape[0] // micro
                b = [tuple(t[k * n : (k + 1) * n] for t in b) for k in range(micro)]
            before = len(calls)
            state, _ = step(state, b)
            per_step.append(len(calls) - before)
    out = {"params": zf.gather_params(state)}
    if count_ns:
        out["ns_calls"] = per_step
        out["float_dtypes"] = sorted({str(t.dtype) for t in zf.pytree.tree_leaves(state.opt_state)
                                      if t.is_floating_point()})
    if hasattr(state, "close"):
        state.close()
    return out


def test_accumulate_equals_the_big_batch_and_orthogonalizes_once_per_step():
    """DeepSpeed's bug: Muon under gradient accumulation. Two micro-batches of 2 per rank at W = 2
    equal torch on the global batch of 8, and Newton-Schulz runs once per matrix per step."""
    expected = train_torch("gpt", torch_recipe, STEPS, 8, dtype=torch.float64)
    matrices = sum(1 for n, p in build("gpt").named_parameters() if n.startswith("blocks.") and p.dim() == 2
                   and ".ln" not in n)
    for stage in (2, 3):
        results = workers(2).run(train, stage, "recipe", 2, None, None, None, torch.float64, 4, True)
        for r in results:
            assert_close_to(r["params"], expected)
        assert sum(r["ns_calls"][0] for r in results) == matrices  # each matrix once, by its owner
        assert all(r["ns_calls"] == [r["ns_calls"][0]] * STEPS for r in results)


def test_clip_by_global_norm_counts_the_norm_once():
    expected = train_torch("gpt", torch_recipe, STEPS, 4, dtype=torch.float64, clip=0.05)
    for stage in (1, 3):
        for r in workers(2).run(train, stage, "recipe", None, 0.05, None, None, torch.float64):
            assert_close_to(r["params"], expected)


def test_stage0_runs_muon_not_sgd():
    """DeepSpeed's bug: at ZeRO stage 0 its engine fell back to SGD for Muon's parameters. Here stage 0
    (train_step alone, DDP) equals torch's Muon, and differs from SGD's result."""
    expected = train_torch("gpt", torch_recipe, STEPS, 4, dtype=torch.float64)
    got = workers(2).run(train, 0, "recipe", None, None, None, None, torch.float64)
    for r in got:
        assert_close_to(r["params"], expected)
    sgd = train_torch("gpt", lambda m: [torch.optim.SGD(m.parameters(), lr=0.02)], STEPS, 4, dtype=torch.float64)
    assert not torch.allclose(got[0]["params"]["blocks.0.qkv.weight"].double(), sgd["blocks.0.qkv.weight"])


@pytest.mark.parametrize("kind", ["cpu", pytest.param("nvme", marks=pytest.mark.slow)])
def test_offload_equals_no_offload(kind):
    """DeepSpeed's bug: Muon with offloaded optimizer state diverged from the same run without. Here
    zero3(offload_*(f)) equals zero3(f) bit for bit, for Muon + AdamW and for Adafactor."""
    for opt_name in ("recipe", "adafactor"):
        plain = workers(2).run(train, 3, opt_name)
        off = workers(2).run(train, 3, opt_name, None, None, None, {"kind": kind})
        for a, b in zip(plain, off):
            assert_trees_all_close(a["params"], b["params"], rtol=0, atol=0)


def test_mixed_precision_keeps_fp32_masters_and_state():
    """bf16 parameters, fp32 masters, momentum, moments and Adafactor's factors; the run close to fp32's."""
    fp32 = workers(2).run(train, 3, "recipe")[0]["params"]
    for opt_name in ("recipe", "adafactor"):
        for r in workers(2).run(train, 3, opt_name, None, None, {"dtype": torch.bfloat16}, None, torch.float32, 2,
                                True):
            assert r["float_dtypes"] == ["torch.float32"]
            if opt_name == "recipe":
                for k, v in fp32.items():
                    assert (r["params"][k] - v).abs().max().item() < 0.05, k


def _nvme_small_buffers() -> str:
    try:
        train(3, "recipe", offload={"kind": "nvme", "buffer_size": 64, "sub_group_size": 64})
    except NotImplementedError as e:
        return str(e)
    return "no error"


def test_offload_nvme_smaller_than_a_shard_is_refused_naming_the_knobs():
    """A whole-tensor optimizer needs each unit's shard at once: offload_nvme streaming a unit in
    64-element pieces is refused, saying which knobs to raise and to what (the largest shard)."""
    message = workers(2).run(_nvme_small_buffers)[0]
    assert "a piece at a time" in message and "sub_group_size >= 552" in message and "buffer_size >= 552" in message
