"""``zf.iter_weights``: a state's weights streamed unit by unit in buckets, as an inference engine
takes them; the names and values ``save_hf`` writes, equal to ``gather_params`` cast, a bounded
memory whatever the model's size, and no rank waiting on another's slow consumer."""
import os
import time

import pytest
import torch

import zfunc as zf
from zfunc.checkpoint.stream import iter_weights
from zfunc.testing import memory
from compositions import compose
from hf import build, llama_config, tokens
from peft_models import make_peft
from workers import workers

import transformers  # noqa: E402  the [test] extra installs it
import safetensors.torch as safetensors  # noqa: E402


def hf_model(kind: str, layers: int = 2, width: int = 16):
    torch.manual_seed(0)
    if kind == "gpt2":  # tied head, Conv1D
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=50, n_positions=16, n_embd=width, n_layer=layers, n_head=2, bos_token_id=0, eos_token_id=0))
    if kind == "llama":  # untied head, a non-persistent rotary buffer
        return transformers.LlamaForCausalLM(llama_config(hidden_size=width, intermediate_size=2 * width,
                                                          num_hidden_layers=layers))
    # GPT-NeoX: untied, biases, persistent-less rotary
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=50, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=2, max_position_embeddings=16))


def trained(kind: str, how: str, directory: str):
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = hf_model(kind)

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = compose(how, zf.train_step(loss_fn, zf.optim.adamw(1e-2)), os.path.join(directory, f"swap-{rank}"))
    state = step.init(model)
    for i in range(2):
        x = torch.randint(0, 50, (2 * world, 8), generator=torch.Generator().manual_seed(i))
        state, _ = step(state, x[2 * rank: 2 * rank + 2])
    return model, state


def stream_against_save_hf(kind: str, how: str, directory: str, bucket_bytes: int):
    """What iter_weights yields (fp32 and bf16), save_hf's folder, and gather_params, on each rank."""
    model, state = trained(kind, how, directory)
    with state:
        fp32 = [(n, t.clone()) for n, t in iter_weights(state, bucket_bytes=bucket_bytes)]
        bf16 = dict(iter_weights(state, dtype=torch.bfloat16, bucket_bytes=bucket_bytes))
        buckets = [[(n, t.numel() * t.element_size()) for n, t in b]
                   for b in iter_weights(state, bucket_bytes=bucket_bytes, buckets=True)]
        zf.checkpoint.save_hf(state, os.path.join(directory, "folder"), config=model.config)
        return fp32, bf16, buckets, zf.gather_params(state)


CASES = [
    pytest.param("gpt2", "zero3", 2, 64, id="gpt2-zero3-W2"),
    pytest.param("llama", "bf16", 2, 1, id="llama-bf16-W2"),
    pytest.param("neox", "offload_nvme", 1, 10**9, id="neox-nvme-W1"),
    pytest.param("llama", "zero1", 3, 512, id="llama-zero1-W3", marks=pytest.mark.slow),
    pytest.param("gpt2", "offload_cpu", 3, 256, id="gpt2-offload_cpu-W3", marks=pytest.mark.slow),
    pytest.param("neox", "zero3", 2, 2048, id="neox-zero3-W2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,how,world,bucket", CASES)
def test_the_stream_is_save_hfs_weights_and_loads_as_from_pretrained(kind, how, world, bucket, tmp_path):
    results = workers(world).run(stream_against_save_hf, kind, how, str(tmp_path), bucket)
    fp32, bf16, buckets, params = results[0]
    for other in results[1:]:  # every rank is handed the same weights
        assert [n for n, _ in other[0]] == [n for n, _ in fp32]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(other[0], fp32))
    folder = tmp_path / "folder"
    files = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            files.update(safetensors.load_file(str(folder / f)))
    names = [n for n, _ in fp32]
    assert len(names) == len(set(names)), "a tied weight is handed out once"
    assert set(names) == set(files), "the names save_hf writes"
    for name, t in fp32:
        assert torch.equal(t, files[name]), name
        if name in params:
            assert torch.equal(t, params[name]), name
            assert torch.equal(bf16[name], params[name].to(torch.bfloat16)), name
    # a plain Hugging Face model fed the stream (vLLM's load_weights stands in) is from_pretrained's
    plain = hf_model(kind)
    result = plain.load_state_dict(dict(fp32), strict=False)
    assert not result.unexpected_keys
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    ref = loaded.state_dict()
    for name, t in plain.state_dict().items():
        assert torch.equal(t, ref[name]), name
    # buckets: handed out once full; only a tensor larger than a bucket makes one larger
    sizes = [sum(b for _, b in bucket_) for bucket_ in buckets]
    assert [n for b in buckets for n, _ in b] == names
    for bucket_, size in zip(buckets[:-1], sizes[:-1]):
        assert size >= bucket and size - bucket_[-1][1] < bucket


def streaming_memory(directory: str, bucket_bytes: int) -> tuple[int, int, int, int]:
    """Peak RSS added while a consumer copies the stream into a preallocated plain model, against the
    model's fp32 size, its largest unit and the bucket."""
    torch.set_num_threads(1)
    model = hf_model("llama", layers=24, width=256)
    target = hf_model("llama", layers=24, width=256)  # the inference engine's copy, there before
    target_params = dict(target.named_parameters())
    step = zf.zero3(zf.train_step(lambda p, x: zf.apply(model, p, input_ids=x, labels=x).loss, zf.optim.sgd(0.1)))
    with step.init(model) as state:
        for _ in iter_weights(state, bucket_bytes=bucket_bytes):
            pass  # warm: the code paths, and the allocator's first blocks
        before = memory.rss()
        memory.reset_peak()
        with torch.no_grad():
            for name, t in iter_weights(state, bucket_bytes=bucket_bytes):
                if name in target_params:
                    target_params[name].copy_(t)
        added = memory.peak() - before
        size = sum(p.numel() for p in model.parameters()) * 4
        unit = max(u.trainable.numel for u in state.params.spec.model.units) * 4
        return added, size, unit, bucket_bytes


@pytest.mark.slow
def test_the_memory_held_is_a_bucket_and_a_unit_not_the_model(tmp_path):
    added, size, unit, bucket = workers(2).run(streaming_memory, str(tmp_path), 2**20)[0]
    assert size > 10 * (bucket + unit)  # the whole gather is far above the bound
    print(f"added {added / 2**20:.1f} MiB, model {size / 2**20:.1f} MiB, unit {unit / 2**20:.1f} MiB")
    assert added <= 1.2 * bucket + 2 * unit + 4 * 2**20, (added, size, unit, bucket)  # + 4 MiB of allocator slack


def slow_consumer(directory: str) -> tuple[list[str], float]:
    """Rank 1 takes its time over every tensor; every rank still runs through the stream."""
    model, state = trained("gpt2", "zero3", directory)
    start, names = time.perf_counter(), []
    with state:
        for name, _ in iter_weights(state, bucket_bytes=1):
            names.append(name)
            if zf.dist.rank() == 1:
                time.sleep(0.02)
    return names, time.perf_counter() - start


def test_a_slow_consumer_on_one_rank_holds_no_other_inside_a_gather(tmp_path):
    results = workers(2).run(slow_consumer, str(tmp_path))
    assert results[0][0] == results[1][0]
    assert results[1][1] >= 0.02 * len(results[1][0])


def test_one_rank_streams_its_units_where_they_are_without_a_copy(tmp_path):
    """At W = 1 a sharded unit is its own shard: the stream reads it where the state computes. It
    once copied every unit to where the collectives want tensors, which without a process group
    is the CPU: on an H200 a GPU state streamed at 3.5 GB/s, through the host and back."""
    _, state = trained("llama", "bf16", str(tmp_path))  # no process group here: W = 1
    master = zf.state.master_params(state)
    real = zf.dist.device_of
    zf.dist.device_of = lambda group=None: torch.device("meta")  # collectives that want tensors elsewhere
    try:
        assert all(zf.state.unit_values(master, i).data_ptr() == master.leaves[i].data_ptr()
                   for i in range(len(master.leaves)))
    finally:
        zf.dist.device_of = real
    assert zf.dist.compute_device(state.params.spec.process_group) == torch.device("cpu")


def bad_arguments(directory: str) -> list[str]:
    _, state = trained("gpt2", "zero3", directory)
    errors = []
    with state:
        for kw in (dict(names="vllm"), dict(bucket_bytes=0), dict(bucket_bytes=1.5)):
            try:
                iter_weights(state, **kw)
            except ValueError as e:
                errors.append(str(e))
    return errors


def test_bad_arguments_are_named():
    errors = workers(1).run(bad_arguments, "/tmp")[0]
    assert "names='vllm'" in errors[0] and "only names='hf'" in errors[0]
    assert all("positive whole number of bytes" in e for e in errors[1:])


def peft_stream(kind: str, method: str, how: str, base: str, out: str):
    """A peft model trained under ``how``: the merged stream, the adapter's stream, and save_hf's
    merged folder and adapter folder of the same state."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = make_peft(kind, method)
    step = compose(how, zf.train_step(lambda p, x: zf.apply(model, p, input_ids=x, labels=x).loss,
                                           zf.optim.adamw(1e-2)), os.path.join(out, f"swap-{rank}"))
    with step.init(model, weights=base) as state:
        for i in range(2):
            state, _ = step(state, tokens(2 * world, seed=i)[2 * rank: 2 * rank + 2])
        merged = [(n, t.clone()) for n, t in iter_weights(state, model=model, bucket_bytes=4096)]
        adapter = dict(iter_weights(state, model=model, merged=False, bucket_bytes=1))
        zf.checkpoint.save_hf(state, os.path.join(out, "merged"), model=model, merged=True)
        zf.checkpoint.save_hf(state, os.path.join(out, "adapter"), model=model)
        errors = []
        for kw in (dict(), dict(model=model, adapter="default")):
            try:
                iter_weights(state, **kw)
            except ValueError as e:
                errors.append(str(e))
        return merged, adapter, errors


@pytest.mark.parametrize("kind,method,how,world", [
    pytest.param("llama", "lora", "zero3", 2, id="llama-lora-zero3-W2"),
    pytest.param("gpt2", "ia3", "bf16", 3, id="gpt2-ia3-bf16-W3", marks=pytest.mark.slow),
])
def test_a_peft_model_streams_its_merged_weights_or_its_adapter(kind, method, how, world, tmp_path):
    """The merged stream is save_hf(merged=True)'s folder (merge_and_unload()'s weights, tested against
    peft in test_peft_export); the adapter's stream is the adapter file peft reads."""
    base = tmp_path / "base"
    build(kind).save_pretrained(base)
    merged, adapter, errors = workers(world).run(peft_stream, kind, method, how, str(base), str(tmp_path))[0]
    files = {}
    for f in os.listdir(tmp_path / "merged"):
        if f.endswith(".safetensors"):
            files.update(safetensors.load_file(str(tmp_path / "merged" / f)))
    assert [n for n, _ in merged] and {n for n, _ in merged} == set(files)
    assert all(torch.equal(t, files[n]) for n, t in merged)
    want = safetensors.load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert set(adapter) == set(want) and all(torch.equal(adapter[k], v) for k, v in want.items())
    assert "peft model's" in errors[0] and "pass model=" in errors[0]
    assert "pass merged=False" in errors[1]
