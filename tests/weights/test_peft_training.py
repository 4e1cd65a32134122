"""peft training under every composition equals plain PyTorch peft training from the same weights.

A peft model built on the meta device, its base read from the base model's folder, trained under
zero1, zero2, zero3, offload_cpu, offload_nvme, accumulate and bf16 mixed precision at W = 1, 2, 3,
ends where ``from_pretrained`` + ``get_peft_model`` trained in memory ends from the same adapter
values (fp32: AdamW, to the equivalence tests' tolerance; bf16: SGD, within 16 bf16 units of each
tensor's largest move, as tests/core/test_hf_models.py's bf16 test: the reference computes in a bf16
copy with fp32 master adapters). The base never moves, and only the adapters hold optimizer state:
each rank's ``memory_report`` optimizer bytes are its share of the adapters' moments (and, under
bf16, their fp32 master), nothing of the base.
"""
import os

import pytest
import torch

import zfunc as zf
from assertions import assert_close_to
from hf import LR, tokens
from peft_models import is_adapter, meta_peft, peft_config
from workers import workers

import peft  # noqa: E402
import transformers  # noqa: E402

STEPS, PER_RANK, SGD_LR = 2, 2, 0.5


def compose(how: str, loss_fn, swap: str):
    if how == "bf16":
        return zf.zero3(zf.mixed_precision(zf.train_step(loss_fn, zf.optim.sgd(SGD_LR)), torch.bfloat16))
    step = zf.train_step(loss_fn, zf.optim.adamw(LR))
    return {"zero1": zf.zero1, "zero2": zf.zero2, "zero3": zf.zero3,
            "offload_cpu": lambda s: zf.zero3(zf.offload_cpu(s, copy_grads_on_host=True)),
            "offload_nvme": lambda s: zf.zero3(zf.offload_nvme(s, swap, sub_group_size=1)),
            "accumulate": lambda s: zf.zero3(zf.accumulate(s, 2))}[how](step)


def batch(i: int, world: int) -> torch.Tensor:
    return tokens(PER_RANK * world, seed=i)


def train(kind: str, method: str, path: str, how: str, swap: str) -> dict:
    """On each rank: the meta-built peft model read from ``path`` under ``how``, STEPS steps on this
    rank's part of each batch; the values loaded and reached, and this rank's memory report."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = meta_peft(kind, method)

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = compose(how, loss_fn, os.path.join(swap, f"rank{rank}"))
    with step.init(model, weights=path) as state:
        out = {"loaded": zf.gather_params(state), "report": zf.memory_report(state), "losses": []}
        for i in range(STEPS):
            mine = batch(i, world)[rank * PER_RANK: (rank + 1) * PER_RANK]
            state, metrics = step(state, list(mine.chunk(2)) if how == "accumulate" else mine)
            out["losses"].append(float(metrics["loss"]))
        out["stepped"] = zf.gather_params(state)
        out["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out["units"] = state.params.spec.model.units
    return out


def plain(kind: str, method: str, path: str, start: dict, world: int, how: str) -> dict:
    """Plain peft in memory from the same base folder and adapter values, the whole batch each step:
    AdamW in fp32, or (bf16) a bf16 copy computing, its gradients applied by SGD to fp32 masters."""
    base = transformers.AutoModelForCausalLM.from_pretrained(path)
    base.config.use_cache = False
    model = peft.get_peft_model(base, peft_config(kind, method))
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(start[k])
    trainable = [p for p in model.parameters() if p.requires_grad]
    if how != "bf16":
        opt = torch.optim.AdamW(trainable, lr=LR)
        for i in range(STEPS):
            opt.zero_grad(set_to_none=True)
            x = batch(i, world)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.named_parameters()}
    low = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path), peft_config(kind, method))
    with torch.no_grad():
        for (k, lp), mp in zip(low.named_parameters(), model.parameters()):
            lp.data = mp.detach().to(torch.bfloat16)  # every parameter in bf16; buffers in their own dtype
    opt = torch.optim.SGD(trainable, lr=SGD_LR)
    low_trainable = [p for p in low.parameters() if p.requires_grad]
    for i in range(STEPS):
        low.zero_grad(set_to_none=True)
        x = batch(i, world)
        low(input_ids=x, labels=x).loss.backward()
        for mp, lp in zip(trainable, low_trainable):
            mp.grad = lp.grad.float()
        opt.step()
        with torch.no_grad():
            for mp, lp in zip(trainable, low_trainable):
                lp.copy_(mp)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


CASES = [  # every composition at W = 1, 2 and 3 between them; GPT-2, Llama and Qwen2; LoRA, IA3, DoRA
    ("gpt2", "lora", "offload_cpu", 2),
    ("llama", "lora", "zero1", 2), ("gpt2", "ia3", "zero2", 2), ("qwen2", "lora", "zero3", 3),
    ("llama", "dora", "offload_nvme", 2), ("gpt2", "lora", "offload_nvme", 3), ("qwen2", "lora", "accumulate", 2),
    ("llama", "lora", "bf16", 2), ("gpt2", "lora", "bf16", 1), ("llama", "lora", "zero2", 1),
    ("gpt2", "lora", "zero1", 3), ("llama", "ia3", "offload_cpu", 3), ("gpt2", "dora", "accumulate", 1),
]
FAST = 1


@pytest.mark.parametrize("kind,method,how,world", [c if i < FAST else pytest.param(*c, marks=pytest.mark.slow)
                                                   for i, c in enumerate(CASES)],
                         ids=[f"{k}-{m}-{h}-W{w}" for k, m, h, w in CASES])
def test_peft_trains_under_each_composition_like_plain_peft(kind, method, how, world, folder, tmp_path):
    """STEPS steps under ``how`` at W ranks equal plain peft's on the whole batch; the base is where it
    started; the optimizer holds the adapters' state only."""
    path = folder(kind)
    results = workers(world).run(train, kind, method, path, how, str(tmp_path))
    start = results[0]["loaded"]
    want = plain(kind, method, path, start, world, how)
    for r in results:
        assert list(r["stepped"]) == list(want)
        if how == "bf16":
            for k, v in want.items():
                move = (v - start[k]).abs().max().item()
                assert (r["stepped"][k] - v).abs().max().item() <= 16 * 2.0 ** -8 * move, k
        else:
            assert_close_to(r["stepped"], want)
        for k, v in r["stepped"].items():  # the base never moves
            assert is_adapter(k) or "modules_to_save" in k or torch.equal(v, start[k]), k
        assert r["losses"][0] != r["losses"][-1]
        # this rank's share of the adapters' optimizer state (AdamW: two moments; SGD under bf16: the fp32
        # master), each unit padded to a multiple of W; nothing of the base, which is many times larger
        copies = 1 if how == "bf16" else 2
        share = copies * 4 * (r["trainable"] / world + 64 * len(r["units"]))
        assert 0 < r["report"]["optimizer_bytes"] <= share + 512, (r["report"], share)
        assert r["report"]["optimizer_bytes"] < r["report"]["frozen_bytes"]
    held = sum(r["report"]["optimizer_bytes"] for r in results)
    assert held >= (1 if how == "bf16" else 2) * 4 * results[0]["trainable"], [r["report"] for r in results]
