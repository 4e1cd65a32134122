"""``zf.bind(state, model)``: the user's model on the state's current weights, for generation and
evaluation during training. Each test compares with plain Hugging Face / PyTorch holding the
weights ``zf.gather_params`` reads, and training after a bind block with training without one."""
import pytest
import torch
import transformers

import zfunc as zf
import zfunc.materialize
from hf import gpt2_config, llama_config
from workers import workers

VOCAB = 50


def build(kind: str, layers: int = 2):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = gpt2_config(vocab_size=VOCAB, n_positions=32, n_layer=layers, pad_token_id=0)
        return transformers.GPT2LMHeadModel(cfg).eval()
    if kind == "llama":
        cfg = llama_config(vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=32, pad_token_id=0)
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=layers, num_attention_heads=2, max_position_embeddings=32,
                                     rotary_pct=0.5, pad_token_id=0, eos_token_id=0, bos_token_id=0)
    return transformers.GPTNeoXForCausalLM(cfg).eval()


def tokens(seed: int, rows: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def compose(model, composition: str, swap_path: str | None = None) -> zf.Step:
    """``composition``: ``zeroN``, ``+cpu`` / ``+nvme`` offload inside it, ``+bf16`` mixed precision."""
    stage, *extras = composition.split("+")
    step = zf.train_step(lambda p, x: zf.apply(model, p, input_ids=x, labels=x).loss, zf.optim.adamw(1e-2))
    if "bf16" in extras:
        step = zf.mixed_precision(step, torch.bfloat16)
    if "cpu" in extras:
        step = zf.offload_cpu(step)
    if "nvme" in extras:
        step = zf.offload_nvme(step, path=swap_path)
    return {"zero1": zf.zero1, "zero2": zf.zero2, "zero3": zf.zero3}[stage](step)


def plain_like(kind: str, state, dtype=torch.float32, layers: int = 2):
    """A plain Hugging Face model holding the state's weights (in ``dtype``; buffers the state's)."""
    full = zf.gather_params(state)
    plain = build(kind, layers)
    for name, p in plain.named_parameters():
        p.data = full[name].to(dtype)
    for name, b in state.buffers.items():
        path, _, attr = name.rpartition(".")
        plain.get_submodule(path)._buffers[attr] = b.clone()
    return plain


def generate(model, x):
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False, pad_token_id=0)


def bound_matches_plain(kinds, composition: str, swap_path: str | None = None) -> dict:
    """Per family: logits and greedy tokens under bind against the plain model, after one step."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    out = {}
    for kind in kinds:
        model = build(kind)
        step = compose(model, composition, swap_path)
        with step.init(model) as state:
            state, _ = step(state, tokens(rank))
            dtype = torch.bfloat16 if "bf16" in composition else torch.float32
            plain = plain_like(kind, state, dtype)
            x = tokens(100 + world)  # the same on every rank
            with zf.bind(state, model) as bound:
                logits = bound(input_ids=x).logits
                generated = generate(bound, x)
            with torch.no_grad():
                want_logits = plain(input_ids=x).logits
            out[kind] = (torch.equal(logits, want_logits), (logits - want_logits).abs().max().item(),
                         torch.equal(generated, generate(plain, x)), generated.shape)
            for wrong, error in ((build(kind, 3), "built for a different model"), (state.params, "takes the State")):
                try:
                    with zf.bind(wrong if error == "takes the State" else state,
                                 model if error == "takes the State" else wrong):
                        pass
                    out.setdefault("errors", []).append(f"no error for {error}")
                except (ValueError, TypeError) as e:
                    out.setdefault("errors", []).append("ok" if error in str(e) else str(e))
            try:
                model(input_ids=x)
                out[kind] += ("the model ran outside the block",)
            except RuntimeError as e:
                out[kind] += ("held by a zfunc State" in str(e) and "ok" or str(e),)
    return out


def check(results, kinds):
    for per_rank in results:
        assert per_rank.pop("errors") == ["ok", "ok"] * len(kinds)
        for kind in kinds:
            same_logits, diff, same_tokens, shape, outside = per_rank[kind]
            assert same_logits, (kind, diff)
            assert same_tokens and shape == (2, 10), kind
            assert outside == "ok", outside


@pytest.mark.parametrize("world", [1, 2])
def test_bind_runs_gpt2_on_the_states_weights(world):
    """``model(x)`` and ``model.generate`` inside the block equal the plain model with the gathered
    weights; outside it the model refuses use with the error that says how to run it."""
    check(workers(world).run(bound_matches_plain, ["gpt2"], "zero3"), ["gpt2"])


def test_bind_generates_as_hugging_face_for_three_families():
    check(workers(2).run(bound_matches_plain, ["llama", "gpt_neox"], "zero3"), ["llama", "gpt_neox"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_bind_families_at_other_worlds(world):
    kinds = ["gpt2", "llama", "gpt_neox"]
    check(workers(world).run(bound_matches_plain, kinds, "zero3"), kinds)


@pytest.mark.parametrize("composition", ["zero1", "zero2", "zero3+cpu", "zero3+bf16",
                                         pytest.param("zero3+nvme", marks=pytest.mark.slow),
                                         pytest.param("zero2+cpu+bf16", marks=pytest.mark.slow)])
def test_bind_under_each_composition(composition, tmp_path):
    check(workers(2).run(bound_matches_plain, ["gpt2"], composition, str(tmp_path)), ["gpt2"])


def train_around_bind(kind: str, composition: str, swap_path: str, with_bind: bool) -> dict:
    """Two steps, a bind block (a forward and a generation) or nothing, two more steps."""
    rank = zf.dist.rank()
    model = build(kind)
    step = compose(model, composition, swap_path)
    with step.init(model) as state:
        losses = []
        for i in range(4):
            if i == 2 and with_bind:
                with zf.bind(state, model) as bound:
                    bound(input_ids=tokens(7))
                    generate(bound, tokens(8))
            state, metrics = step(state, tokens(10 * i + rank))
            losses.append(metrics["loss"].item())
        return {"params": zf.gather_params(state), "losses": losses}


@pytest.mark.parametrize("composition", ["zero3", "zero3+nvme+bf16"])
def test_training_after_bind_continues_bit_for_bit(composition, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    got = workers(2).run(train_around_bind, "llama", composition, str(tmp_path / "a"), True)
    want = workers(2).run(train_around_bind, "llama", composition, str(tmp_path / "b"), False)
    for g, w in zip(got, want):
        assert g["losses"] == w["losses"]
        for name in w["params"]:
            assert torch.equal(g["params"][name], w["params"][name]), name


def peak_under_bind(layers: int) -> dict:
    """The most bytes of gathered units alive at once while a bound GPT-2 generates, with the
    bytes of its root unit (embeddings, final norm), of one block and of the whole model."""
    model = build("gpt2", layers)
    step = compose(model, "zero3")
    state = step.init(model)
    seen = {"peak": 0}
    allocated = zfunc.materialize.Tracker.allocated

    def counting(tracker, buf):
        allocated(tracker, buf)
        seen["peak"] = max(seen["peak"], tracker.current)

    zfunc.materialize.Tracker.allocated = counting
    try:
        with zf.bind(state, model) as bound:
            generate(bound, tokens(3))
    finally:
        zfunc.materialize.Tracker.allocated = allocated
    sizes = {u.name: sum(e.numel for e in state.params.spec.segment(i).entries) * 4
             for i, u in enumerate(state.params.spec.model.units)}
    return {"peak": seen["peak"], "root": sizes[""], "block": sizes["transformer.h.0"],
            "whole": sum(sizes.values())}


def test_bind_gathers_a_unit_or_two_at_a_time():
    """Under zero3 at W = 2 a bound GPT-2 of 8 blocks holds its root and one block, never the model."""
    for got in workers(2).run(peak_under_bind, 8):
        assert got["root"] + got["block"] <= got["peak"] <= got["root"] + 2 * got["block"], got
        assert got["peak"] < got["whole"] / 2, got


def engine_module(kind: str) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build(kind)
    config = {"train_batch_size": 2 * world, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine = zf.initialize(model, config, loss_fn=lambda m, x: m(input_ids=x, labels=x).loss)
    try:
        engine.train_batch(iter([tokens(rank)]))
        plain = plain_like(kind, engine.state)
        x = tokens(50)
        logits = engine.module(input_ids=x).logits
        with torch.no_grad():
            same = torch.equal(logits, plain(input_ids=x).logits)
        tokens_same = torch.equal(generate(engine.module, x), generate(plain, x))
        engine.train_batch(iter([tokens(rank + 1)]))  # the engine trains on after
        return {"logits": same, "tokens": tokens_same, "config": engine.module.config is model.config}
    finally:
        engine.close()


@pytest.mark.parametrize("world", [1, 2])
def test_engine_module_runs_on_the_engines_weights(world):
    for got in workers(world).run(engine_module, "gpt2"):
        assert got == {"logits": True, "tokens": True, "config": True}


def kept_model_binds() -> dict:
    """``init(free_model=False)``: inside the block the model reads the state's weights, not its
    own; after it, its own parameters are back."""
    model = build("gpt2")
    own = {k: v.detach().clone() for k, v in model.named_parameters()}
    step = compose(model, "zero3")
    state = step.init(model, free_model=False)
    state, _ = step(state, tokens(zf.dist.rank()))
    plain = plain_like("gpt2", state)
    x = tokens(9)
    with torch.no_grad():
        with zf.bind(state, model) as bound:
            inside = torch.equal(bound(input_ids=x).logits, plain(input_ids=x).logits)
        after = {k: torch.equal(v, own[k]) for k, v in model.named_parameters()}
        runs_own = torch.equal(model(input_ids=x).logits, plain_like("gpt2", step.init(build("gpt2")))(input_ids=x).logits)
    return {"inside": inside, "own_back": all(after.values()), "runs_own": runs_own}


def test_bind_a_model_that_kept_its_parameters():
    for got in workers(1).run(kept_model_binds):
        assert got == {"inside": True, "own_back": True, "runs_own": True}
