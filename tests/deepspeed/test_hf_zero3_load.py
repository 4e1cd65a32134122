"""transformers' ZeRO-3 loading path on zfunc: ``from_pretrained`` while a ZeRO-3 config is live
builds the model under ``deepspeed.zero.Init`` and writes each module's weights through
``GatheredParameters(params, modifier_rank=0)``; each block's values go to the model's spill and
its parameters become what DeepSpeed leaves (0 elements on the real device, ``ds_shape``), and ``deepspeed.initialize`` reads the spill unit by unit:
every tensor the engine holds equals the file's, bit for bit, on every rank, transformers reports
nothing missing, and a rank other than 0 (which transformers has read the whole checkpoint) grows
by a fraction of the model while loading (tests/harness/hf_zero3_load.py, W = 2 under torchrun)."""
import pytest

import transformers  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)
import accelerate  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)

import hf_trainer  # noqa: E402
import hf_zero3_load  # noqa: E402


def _check(records):
    for rank, record in enumerate(records):
        assert record["missing"] == [], (rank, record["missing"])
        assert record["differ"] == [], (rank, record["differ"])
        assert sorted(record["compared"]) == record["files"], rank
        assert record["placeholders_after_load"], rank


def test_every_tensor_loads_bit_for_bit(tmp_path):
    folder = hf_trainer.save_model_folder(str(tmp_path / "model"))
    _check(hf_zero3_load.run("zfunc", folder, str(tmp_path / "out"), world=2))


def test_a_loaded_model_wrapped_with_a_new_head_loads_and_keeps_the_head_as_under_deepspeed(tmp_path):
    """DeepSpeed-Chat's reward model: the loaded model wrapped by a module of the script's, as
    ``inner``, with a value head built after loading. Every loaded tensor still equals the file's
    (the spill's names follow the model's), the head keeps its value, ``from_pretrained`` drew
    nothing from torch's generator, and ``engine.module.state_dict()`` called by rank 0 alone
    returns at once (DeepSpeed's 0-element placeholders where a unit is sharded); each as real
    DeepSpeed in the same run."""
    folder = hf_trainer.save_model_folder(str(tmp_path / "model"))
    runs = {which: hf_zero3_load.run(which, folder, str(tmp_path / which), world=2, wrap=True)
            for which in ("zfunc", "deepspeed")}
    for which, records in runs.items():
        _check(records)
        assert all(r["head_kept"] for r in records), which
    assert [r["draw"] for r in runs["zfunc"]] == [r["draw"] for r in runs["deepspeed"]]
    ours, theirs = runs["zfunc"][0]["one_rank_state_dict"], runs["deepspeed"][0]["one_rank_state_dict"]
    # DeepSpeed's placeholders, or (units this small are whole on every rank) the weights themselves
    assert list(ours) == list(theirs) and all(theirs[k] == [0] for k in theirs)
    assert ours["head.weight"] in ([0], [1, 32]) and ours["inner.model.embed_tokens.weight"] in ([0], [96, 32])


@pytest.mark.slow
def test_loading_holds_a_block_not_the_model(tmp_path):
    """A 31.6M-parameter Llama (121 MiB in fp32): rank 1's peak RSS grows by under half the model
    while from_pretrained loads it (seen: 49 MiB; 127 MiB before each block's memory was given back,
    and DeepSpeed's 209), and both ranks end bit for bit."""
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=10,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    records = hf_zero3_load.run("zfunc", str(tmp_path / "model"), str(tmp_path / "out"), world=2)
    _check(records)
    assert records[1]["loaded_growth_mib"] < 0.5 * records[1]["model_mib"], records[1]["loaded_growth_mib"]


@pytest.mark.slow
def test_resize_token_embeddings_after_loading_as_under_deepspeed(tmp_path):
    """DeepSpeed-Chat's step: ``resize_token_embeddings`` between ``from_pretrained`` and ``initialize``
    under ZeRO-3. transformers builds the new embedding and lm head "like" the old weights (their
    device and dtype: real, since the loaded parameters are DeepSpeed's 0-element placeholders, not
    meta tensors), initializes the added rows with the model's ``_init_weights`` and copies the old
    rows in under ``GatheredParameters`` (the lm head's absent bias, None, in the list). As under
    real DeepSpeed, in the same environment: the engine holds the new shapes, the old rows equal to
    the file's bit for bit, the added rows the same on both ranks (rank 0's) and drawn from the
    model's init (std 0.02)."""
    folder = hf_trainer.save_model_folder(str(tmp_path / "model"))  # vocabulary 96, lm head untied
    runs = {which: hf_zero3_load.run(which, folder, str(tmp_path / which), world=2, resize=104)
            for which in ("zfunc", "deepspeed")}
    for which, records in runs.items():
        _check(records)
        names = sorted(records[0]["resized"])
        assert names == ["lm_head.weight", "model.embed_tokens.weight"], (which, names)
        for name in names:
            assert records[0]["resized"][name]["shape"] == [104, 32], (which, name)
            assert records[0]["resized"][name] == records[1]["resized"][name], (which, name)
            assert 0.01 < records[0]["resized"][name]["added_std"] < 0.03, (which, name)
    assert runs["zfunc"][0]["resized"].keys() == runs["deepspeed"][0]["resized"].keys()
