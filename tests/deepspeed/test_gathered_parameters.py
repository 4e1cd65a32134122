"""``zfunc.deepspeed.zero.GatheredParameters`` after ``initialize``: the listed parameters read as
``zf.gather_params`` reads them; a change made on ``modifier_rank`` goes into the engine's state (the
parameters, and the fp32 master weights under mixed precision; moments kept), so training goes on as
plain PyTorch goes on after the same change; ``modifier_rank=None`` discards it; bad uses are named."""
import shutil

import pytest
import torch
from torch import nn

import zfunc as zf
import zfunc.deepspeed as deepspeed
from zfunc.checkpoint.sharded import _parts
from zfunc.state import unit_values
from zfunc.tree import Params
from deepspeed_models import EPS, LR, batch, build, config, loss_of
from workers import workers

# the change made inside the block: an embedding scaled, a bias (Llama: a norm) set
CHANGED = {"gpt2": ("transformer.wte.weight", "transformer.h.0.attn.c_attn.bias"),
           "llama": ("model.embed_tokens.weight", "model.layers.1.input_layernorm.weight"),
           "plain": ("embed.weight", "blocks.1.0.bias")}


def change(params: dict, rank: int) -> None:
    """What every rank does to the gathered ``params`` (name -> parameter): only the modifier's counts."""
    with torch.no_grad():
        emb, other = params.values()
        emb.mul_(0.5 if rank == 0 else 0.25)
        other.fill_(0.0 if rank == 0 else 1.0)


def plain_run(kind: str, world: int, steps: int, at: int, modifier: int | None) -> dict:
    """Plain PyTorch on every rank's batches (their mean loss), the change of ``modifier`` made before step ``at``."""
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    named = dict(model.named_parameters())
    for i in range(steps):
        if i == at and modifier is not None:
            change({n: named[n] for n in CHANGED[kind]}, modifier)
        opt.zero_grad()
        loss = sum(loss_of(model(**batch(100 * i + r))) for r in range(world)) / world
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def moments(state) -> dict:
    """Every optimizer moment, each unit whole (``opt_state.mu`` ...)."""
    roles, nodes, _ = _parts(state)
    return {f"{role}[{i}]": unit_values(node, i).clone() for role, node in zip(roles, nodes)
            if isinstance(node, Params) and role.startswith("opt_state") for i in range(len(node.leaves))
            if node.leaves[i] is not None and node.leaves[i].is_floating_point()}


def train_with_change(kind: str, composition: str, modifier: int | None, steps: int = 4, at: int = 2) -> dict:
    """``steps`` steps through ``zfunc.deepspeed.initialize``; before step ``at`` every rank enters
    GatheredParameters over two parameters and changes them (``change``)."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build(kind)
    cfg = config(composition, world)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    out = {}
    try:
        for i in range(steps):
            if i == at:
                full = zf.gather_params(engine.state)
                before = moments(engine.state)
                mods = dict(model.named_parameters())
                listed = {n: mods[n] for n in CHANGED[kind]}
                with deepspeed.zero.GatheredParameters(list(listed.values()), modifier_rank=modifier):
                    out["read"] = all(torch.equal(p.detach().cpu(), full[n]) for n, p in listed.items())
                    change(listed, rank)
                after = zf.gather_params(engine.state)
                out["moments_kept"] = all(torch.equal(v, moments(engine.state)[k]) for k, v in before.items())
                out["kept_elsewhere"] = all(torch.equal(after[n], full[n]) for n in full if n not in listed)
                out["changed"] = {n: after[n] for n in listed}
                out["bf16_params"] = _low_precision_match(engine.state, after)
            engine.train_batch(iter([batch(100 * i + rank)]))
        out["params"] = zf.gather_params(engine.state)
        return out
    finally:
        engine.close()
        shutil.rmtree(cfg["zero_optimization"].get("offload_param", {}).get("nvme_path", ""), ignore_errors=True)


def _low_precision_match(state, full: dict) -> bool:
    """Under mixed precision, the stored bf16 parameters are the master weights cast (changed ones too)."""
    params = state.params
    for i in range(len(params.leaves)):
        if params.leaves[i] is None or params.leaves[i].dtype == torch.float32:
            continue
        for name, v in params.spec.segment(i).unflatten(unit_values(params, i)).items():
            if not torch.equal(v, full[name].to(v.dtype)):
                return False
    return True


def check_against_plain(kind: str, composition: str, world: int, modifier: int = 0) -> None:
    got = workers(world).run(train_with_change, kind, composition, modifier)
    want = plain_run(kind, world, 4, 2, modifier)
    for rank_out in got:
        assert rank_out["read"] and rank_out["moments_kept"] and rank_out["kept_elsewhere"], rank_out.keys()
        assert rank_out["bf16_params"]
        for name, value in rank_out["params"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-6, msg=f"{composition} {name}")


@pytest.mark.parametrize("composition", ["zero3", "zero1", "zero3+cpu", "zero3+nvme"])
def test_a_change_on_the_modifier_rank_trains_on_as_plain_pytorch(composition):
    """A plain model at W = 2: the embedding scaled and a bias zeroed on rank 0 (rank 1 changes them
    otherwise, and is overwritten); two more steps equal plain PyTorch with the same change."""
    check_against_plain("plain", composition, 2)


def test_the_modifier_may_be_another_rank():
    check_against_plain("plain", "zero3", 2, modifier=1)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_models(kind, world):
    check_against_plain(kind, "zero3", world)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama", "plain"])
@pytest.mark.parametrize("composition", ["zero1", "zero2", "zero3+cpu", "zero2+cpu", "zero3+nvme"])
def test_each_composition_and_family(kind, composition):
    check_against_plain(kind, composition, 2)


@pytest.mark.slow
def test_three_ranks():
    check_against_plain("llama", "zero3", 3, modifier=2)


@pytest.mark.parametrize("kind,composition", [("plain", "zero3+bf16"),
                                              pytest.param("gpt2", "zero3+bf16", marks=pytest.mark.slow),
                                              pytest.param("llama", "zero2+cpu+bf16", marks=pytest.mark.slow),
                                              pytest.param("gpt2", "zero3+nvme+bf16", marks=pytest.mark.slow)])
def test_mixed_precision_writes_the_master_weights(kind, composition):
    """bf16: the fp32 master weights hold the change (what zf.gather_params reads), the bf16 parameters
    are them cast, the moments are kept."""
    got = workers(2).run(train_with_change, kind, composition, 0, 3, 2)
    # what the master held before the change is rank-independent; the change is rank 0's
    for rank_out in got:
        assert rank_out["read"] and rank_out["moments_kept"] and rank_out["kept_elsewhere"]
        assert rank_out["bf16_params"]
    emb, bias = CHANGED[kind]
    assert torch.equal(got[0]["changed"][bias], torch.zeros_like(got[0]["changed"][bias]))
    assert torch.equal(got[0]["changed"][emb], got[1]["changed"][emb])
    assert not torch.equal(got[0]["params"][emb], got[0]["changed"][emb])  # the step after trained it


def discards(kind: str) -> dict:
    """modifier_rank=None: changes inside the block do not reach the state."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build(kind)
    engine, *_ = deepspeed.initialize(model=model, config=config("zero3", world))
    try:
        engine.train_batch(iter([batch(rank)]))
        full = zf.gather_params(engine.state)
        mods = dict(model.named_parameters())
        listed = [mods[n] for n in CHANGED[kind]]
        with deepspeed.zero.GatheredParameters(listed, modifier_rank=None):
            change(dict(zip(CHANGED[kind], listed)), 0)
            inside = float(listed[0].abs().sum())
        after = zf.gather_params(engine.state)
        return {"kept": all(torch.equal(after[n], full[n]) for n in full),
                "changed_inside": inside != float(full[CHANGED[kind][0]].abs().sum())}
    finally:
        engine.close()


@pytest.mark.parametrize("world", [1, 2])
def test_modifier_rank_none_discards(world):
    for got in workers(world).run(discards, "plain"):
        assert got == {"kept": True, "changed_inside": True}


def refusals() -> list:
    """Each bad use and the start of what it raises (every rank)."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build("plain")
    engine, *_ = deepspeed.initialize(model=model, config=config("zero3", world))
    out = []

    def attempt(fn):
        try:
            fn()
            out.append("no error")
        except (ValueError, RuntimeError, TypeError) as e:
            out.append(str(e))

    def enter(*args, **kw):
        with deepspeed.zero.GatheredParameters(*args, **kw):
            pass

    def unlisted():
        with deepspeed.zero.GatheredParameters(model.head.weight):
            model.head.bias + 1

    other = build("plain")
    zf_engine = zf.initialize(other, config("zero3", world))  # zfunc's own: not registered
    attempt(lambda: enter(other.head.weight))
    attempt(unlisted)
    attempt(lambda: enter([model.head.weight] if rank == 0 else [model.head.bias]))  # ranks disagree
    attempt(lambda: enter(model.head.weight, modifier_rank=world))
    with torch.device("meta"):
        stray = nn.Linear(2, 2)
    attempt(lambda: enter(stray.weight))
    attempt(lambda: enter([model.head.weight, other.head.weight]))
    attempt(lambda: enter(["head.weight"]))

    def nested(inner):
        with deepspeed.zero.GatheredParameters(model.head.weight):
            with deepspeed.zero.GatheredParameters(inner):
                model.head.weight.sum() + model.head.bias.sum()  # the outer block's too

    attempt(lambda: nested(model.head.weight))
    attempt(lambda: nested(model.head.bias))
    engine.backward(engine(batch(rank)))
    attempt(lambda: enter(model.head.weight))  # between backward and step
    engine.step()
    # the engine still trains after all of these
    engine.train_batch(iter([batch(rank)]))
    engine.close()
    zf_engine.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_bad_uses_are_named(world):
    for got in workers(world).run(refusals):
        assert "'head.weight' is held by a zfunc State that no live engine registered" in got[0]
        assert "'head.bias' is held by the engine's state and was not listed" in got[1]
        assert ("entered with different parameters" in got[2]) if world > 1 else got[2] == "no error"
        assert f"modifier_rank={world}" in got[3]
        assert "not built inside zfunc.deepspeed.zero.Init" in got[4]
        assert "no live engine registered" in got[5]  # the unregistered one is named first
        assert "takes a parameter or an iterable of parameters, got str" in got[6]
        assert "already gathered by an enclosing block" in got[7]
        assert got[8] == "no error"
        assert "in the middle of an imperative step" in got[9]
