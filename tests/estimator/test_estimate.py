"""zf.estimate against what zfunc does: its memory against ``zf.memory_report`` of the state the
composition builds (exact, every part and home), its bytes against ``metrics["comm"]`` of real steps
at W = 2 (exact, calls and bytes of every data collective), its step time against measured gloo
steps here (within a stated factor), and its reading of configs, the command line and bad input."""
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from zfunc.estimator import Cluster, Composition, Link, model_shape
from zfunc.estimator.memory import memory
from zfunc.estimator.traffic import collectives, comm
from cases import compose, _setup_loss
from models import batch, build, local
from workers import workers

PARTS = ("param_bytes", "optimizer_bytes", "frozen_bytes", "buffer_bytes")
DATA_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "send", "recv")

# (stage, mixed precision dtype, offload, accumulate, persistence threshold)
COMPOSITIONS = {
    "zero0": (0, None, None, 1, 0),
    "zero1-bf16-acc2": (1, torch.bfloat16, None, 2, 0),
    "zero2-acc2": (2, None, None, 2, 0),
    "zero3": (3, None, None, 1, 0),
    "zero3-bf16-cpu": (3, torch.bfloat16, "cpu", 1, 0),
    "zero3-nvme-acc2": (3, None, "nvme", 2, 0),
    "zero3-threshold": (3, None, None, 1, 200),
    "zero2-bf16-moments": (2, None, None, 1, 0),  # zf.optim.adamw(state_dtype=torch.bfloat16)
}


def _state_dtype(key: str) -> torch.dtype:
    return torch.bfloat16 if key.endswith("bf16-moments") else torch.float32


def _composition(key: str) -> Composition:
    stage, dtype, offload, micro, threshold = COMPOSITIONS[key]
    return Composition(stage=stage, dtype=dtype, offload=offload, accumulate=micro, persistence_threshold=threshold,
                       state_dtype=_state_dtype(key))


def _step(key: str, model, name: str, swap: str | None, mesh=None):
    stage, dtype, offload, micro, threshold = COMPOSITIONS[key]
    kw = None if offload is None else {"kind": offload, **({"path": swap} if offload == "nvme" else {})}
    opt = zf.optim.adamw(1e-3, weight_decay=0.01, state_dtype=_state_dtype(key))
    inner = compose(stage if mesh is None else None, _setup_loss(name, model), threshold=threshold,
                    precision=None if dtype is None else {"dtype": dtype}, offload=kw,
                    micro=micro if micro > 1 else None, opt=opt)
    if mesh is None:
        return inner
    extra = {"persistence_threshold": threshold} if stage == 3 else {}
    return {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](inner, mesh=mesh, **extra)


def measured(name: str, keys: list, swap: str, steps: int = 2, shard: int | None = None) -> dict:
    """On each rank: for each composition, ``memory_report`` of the state after ``steps`` steps and
    the last step's ``metrics["comm"]``. ``shard``: hybrid sharding over ``zf.dist.mesh(shard=)``."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    mesh = None if shard is None else zf.dist.mesh(shard=shard)
    out = {}
    for key in keys:
        model, twin = build(name), build(name)
        step = _step(key, model, name, os.path.join(swap, f"{key}-{rank}"), mesh)
        micro = COMPOSITIONS[key][3]
        with step.init(model) as state:
            for i in range(steps):
                b = local(batch(name, twin, i, 4 * world), rank, world)
                if micro > 1:
                    b = list(zip(*(t.chunk(micro) for t in b)))
                state, metrics = step(state, b)
            out[key] = {"memory": zf.memory_report(state), "comm": metrics["comm"]}
    return out


def _data(comm_counts: dict) -> dict:
    """``metrics["comm"]`` less the control kinds (the agreement's vectors, barriers)."""
    out = {label: {k: v for k, v in kinds.items() if k in DATA_KINDS} for label, kinds in comm_counts.items()}
    return {label: kinds for label, kinds in out.items() if kinds}


def _check(name: str, key: str, got: dict, world: int, shard: int | None = None) -> None:
    comp = _composition(key)
    nodes, per_node = (1, world) if shard is None else (world // shard, shard)
    if shard is not None:
        comp = Composition(**{**comp.__dict__, "hybrid": True})
    shape = model_shape(build(name), shard_size=per_node)
    want = memory(shape, comp, per_node, accelerator=False)
    assert {k: got["memory"][k] for k in PARTS} == {k: want[k] for k in PARTS}, (name, key)
    for home in ("device", "disk"):
        assert got["memory"]["by_home"][home] == want["by_home"][home], (name, key, home)
    if world > 1:
        assert _data(got["comm"]) == comm(collectives(shape, comp, nodes, per_node, "gloo")), (name, key)


def keys_for(name: str) -> list:
    """The compositions ``name`` trains under (frozen_bn's inputs are fp32: no mixed precision)."""
    return [k for k in COMPOSITIONS if name != "frozen_bn" or COMPOSITIONS[k][1] is None]


def test_memory_is_memory_report_at_one_rank(tmp_path):
    """Every part of the state and every home, to the byte, for each composition (W = 1; odd_mlp:
    units of 1 to 24 elements)."""
    got = measured("odd_mlp", list(COMPOSITIONS), str(tmp_path), steps=1)
    for key in COMPOSITIONS:
        _check("odd_mlp", key, got[key], 1)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_bf16_model_without_mixed_precision(state_dtype):
    """A model stored in bf16: bf16 weights, and Adam's moments in fp32 unless asked for bf16."""
    model = build("odd_mlp").to(torch.bfloat16)
    step = zf.zero3(zf.train_step(lambda p, b: F.mse_loss(zf.apply(model, p, b[0]).float(), b[1]),
                                  zf.optim.adamw(1e-3, state_dtype=state_dtype)))
    got = zf.memory_report(step.init(model))
    want = memory(model_shape(build("odd_mlp").to(torch.bfloat16)), Composition(stage=3, state_dtype=state_dtype), 1,
                  accelerator=False)
    assert {k: got[k] for k in PARTS} == {k: want[k] for k in PARTS}


def test_memory_and_comm_at_two_ranks(tmp_path):
    """W = 2 (shards, padding to 2): memory exact, and every data collective's calls and bytes equal
    to the step's own ``metrics["comm"]`` (the tied GPT: a root unit kept for backward)."""
    keys = ["zero1-bf16-acc2", "zero3"]
    got = workers(2).run(measured, "gpt", keys, str(tmp_path))
    for key in keys:
        _check("gpt", key, got[0][key], 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["odd_mlp", "frozen_bn", "gpt"])
def test_memory_and_comm_every_composition(name, world, tmp_path):
    """Every composition, models whose units do not split evenly (odd_mlp: a one-element unit, padded)
    or hold frozen parameters and buffers (frozen_bn: broadcast each step), at W = 1, 2 and 3."""
    got = measured(name, keys_for(name), str(tmp_path)) if world == 1 else workers(world).run(
        measured, name, keys_for(name), str(tmp_path))
    for rank_got in got if world > 1 else [got]:
        for key in keys_for(name):
            _check(name, key, rank_got[key], world)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "odd_mlp"])
def test_memory_and_comm_under_a_mesh(name, tmp_path):
    """Hybrid sharding at W = 4 as 2 x 2 (``zf.dist.mesh(shard=2)``): the state sharded over 2, and
    the collectives on each mesh dim ("shard", "replicate", the buffers' and flags' "world")."""
    keys = [k for k in COMPOSITIONS if COMPOSITIONS[k][0] > 0]
    got = workers(4).run(measured, name, keys, str(tmp_path), 2, 2)
    for rank_got in got:
        for key in keys:
            _check(name, key, rank_got[key], 4, shard=2)


def hpz_comm(name: str, k: int, micro: int) -> dict:
    """The last of two steps' ``metrics["comm"]`` under ``zero3(reshard_after_forward=k)`` (hpZ)."""
    model, twin = build(name), build(name)
    rank, world = zf.dist.rank(), zf.dist.world_size()
    step = zf.zero3(compose(None, _setup_loss(name, model), micro=micro if micro > 1 else None),
                    reshard_after_forward=k)
    state = step.init(model)
    for i in range(2):
        b = local(batch(name, twin, i, 4 * world), rank, world)
        state, metrics = step(state, list(zip(*(t.chunk(micro) for t in b))) if micro > 1 else b)
    return metrics["comm"]


@pytest.mark.slow
@pytest.mark.parametrize("name,micro", [("gpt", 1), ("gpt", 2), ("odd_mlp", 1)])
def test_comm_under_hpz(name, micro):
    """zero3's secondary partition at W = 4, k = 2: forward gathers over every rank, backward's among
    the 2 of the "secondary" group, as many calls and bytes as the estimate says."""
    got = workers(4).run(hpz_comm, name, 2, micro)
    comp = Composition(stage=3, accumulate=micro, reshard_after_forward=2)
    want = comm(collectives(model_shape(build(name), shard_size=4), comp, 1, 4, "gloo"))
    assert "secondary" in want
    for rank_got in got:
        assert _data(rank_got) == want


class Wide(nn.Module):
    """Large enough that its matrix products, not Python, take the step's time."""

    def __init__(self, width: int = 512, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def timed_steps(stage: int, tokens: int, steps: int = 3) -> dict:
    """The median seconds of ``steps`` steps of ``Wide`` under ZeRO-``stage`` on this rank's ``tokens``
    rows (the first, which records the trace, left out), and this machine's rates measured between
    the steps (the median of each), so that both see the same load of a shared machine."""
    from zfunc.estimator import probes

    torch.manual_seed(0)
    model = Wide()
    loss_fn = lambda params, b: F.mse_loss(zf.apply(model, params, b[0]), b[1])  # noqa: E731
    step = {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(model)
    x = torch.randn(tokens, 512)
    times, flops, memory_rates, links = [], [], [], []
    for i in range(steps + 1):
        zf.dist.barrier()
        t0 = time.perf_counter()
        state, _ = step(state, (x, x))
        times.append(time.perf_counter() - t0)
        flops.append(probes.compute_rate(n=512, repeats=1))
        memory_rates.append(probes.memory_rate(numel=1 << 22, repeats=1))
        links.append(probes.link_rate(large=1 << 20, repeats=1))
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    return {"step": median(times[1:]), "flops": median(flops), "memory_rate": median(memory_rates),
            "link": Link(median([k.bandwidth for k in links]), median([k.latency for k in links]))}


FACTOR = 3.0  # the stated bound: a shared 2-core machine, gloo's threads competing with compute


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_step_time_against_gloo_here(stage):
    """The predicted step time of ``Wide`` (8.4M parameters, 256 tokens a rank) at W = 2 from rates
    measured here (matrix product, copy, gloo all-reduce) is within a factor of 3 of the measured one,
    with the overlap the estimate assumes on a CPU: none (two processes on two cores have none to spare)."""
    rates = workers(2).run(timed_steps, stage, 256)[0]
    measured_s = rates["step"]
    cluster = Cluster(1, 2, rates["link"], flops=rates["flops"], memory_rate=rates["memory_rate"], accelerator=False,
                      backend="gloo")
    with torch.device("meta"):
        model = Wide()
    predicted = zf.estimate(model, Composition(stage=stage, micro_batch_tokens=256), cluster, overlap=False)
    ratio = predicted.time["step"] / measured_s
    assert 1 / FACTOR <= ratio <= FACTOR, (predicted.time, measured_s, rates)


def test_a_module_on_the_meta_device_and_the_links_per_mesh_dim():
    """A meta-device model costs nothing to read; under hybrid sharding on 2 nodes x 4 the gathers and
    reduce-scatters stay on the node's link, and one all-reduce of each gradient shard a step crosses
    nodes: (R-1)/R * 2 of a shard's bytes per rank, on a quarter of the node's network each (the four
    replicate groups reduce at once)."""
    with torch.device("meta"):
        model = Wide(width=64, depth=3)
    cluster = Cluster(2, 4, Link(100e9, 1e-6), Link(10e9, 5e-6), flops=1e12, memory_rate=1e11)
    est = zf.estimate(model, Composition(stage=3, accumulate=2, hybrid=True), cluster)
    units = est.model.units
    padded = [-(-u.trainable // 4) * 4 for u in units]
    assert set(est.comm) == {"shard", "replicate"}
    assert [u.name for u in units] == ["blocks.0", "blocks.1", "blocks.2"]  # no root unit: no parameters there
    assert est.comm["replicate"] == {"all_reduce": {"calls": 3, "bytes": sum(p // 4 * 4 for p in padded)}}
    assert est.comm["shard"]["reduce_scatter"] == {"calls": 2 * 3, "bytes": 2 * sum(p * 4 for p in padded)}
    # forward gathers each block; backward only the middle one: the last is kept, and the first's
    # input needs no gradient (no embedding before it), so its backward reads no weight
    assert est.comm["shard"]["all_gather"] == {"calls": 2 * 4, "bytes": 2 * (sum(padded) + padded[1]) * 4}
    assert est.links["shard"]["link"] == "intra" and est.links["replicate"]["link"] == "inter"
    assert est.links["replicate"]["wire_bytes"] == pytest.approx(sum(p // 4 * 4 for p in padded) * 2 * (2 - 1) / 2)
    assert cluster.link("replicate").bandwidth == 10e9 / 4 and cluster.link("world").bandwidth == 10e9
    assert est.memory["param_bytes"] == sum(p // 4 * 4 for p in padded)  # sharded over a node's 4, not 8
    assert est.time["step"] >= est.time["compute"] > 0
    flat = zf.estimate(model, Composition(stage=3, accumulate=2), cluster)
    assert set(flat.comm) == {"world"} and flat.links["world"]["link"] == "inter"
    assert flat.time["step"] > est.time["step"]  # every gather on the slow link


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        Composition(stage=4)
    with pytest.raises(ValueError, match="offload must be None, 'cpu' or 'nvme'"):
        Composition(offload="disk")
    with pytest.raises(ValueError, match="offload needs a ZeRO stage"):
        Composition(stage=0, offload="cpu")
    with pytest.raises(ValueError, match="need the link between them"):
        Cluster(2, 8, Link(1e11))
    with pytest.raises(ValueError, match="state_dtype must be torch.float32 or torch.bfloat16"):
        Composition(state_dtype=torch.float16)
    with pytest.raises(ValueError, match="reshard_after_forward is zero3's hpZ group size"):
        Composition(stage=2, reshard_after_forward=2)
    with pytest.raises(ValueError, match="must divide the shard group"):
        zf.estimate(Wide(8, 1), Composition(reshard_after_forward=3), Cluster(1, 4, Link(1e9)))
    with pytest.raises(ValueError, match="accumulate must be a positive int"):
        Composition(accumulate=0)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        zf.estimate("/no/such/folder", cluster=Cluster(1, 1, Link(1e9)))
    with pytest.raises(ValueError, match="a link is measured between ranks"):
        from zfunc.estimator.probes import link_rate
        link_rate()


LLAMA_3_1_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                "tie_word_embeddings": False}


@pytest.mark.slow
def test_a_hugging_face_config_and_the_command_line(tmp_path):
    """Llama 3.1 8B's config (its published 8,030,261,248 parameters) on the meta device; the command
    line prints the same estimate as the function, as JSON."""
    import json

    cluster = Cluster(1, 8, Link(150e9, 5e-6), flops=4e14, memory_rate=2e12)
    comp = Composition(stage=3, dtype=torch.bfloat16, micro_batch_tokens=8192)
    est = zf.estimate(LLAMA_3_1_8B, comp, cluster, seq_len=8192)
    assert est.model.trainable == 8_030_261_248
    assert est.memory["param_bytes"] == sum(-(-u.trainable // 8) for u in est.model.units) * 2
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_1_8B))
    run = subprocess.run([sys.executable, "-m", "zfunc.estimator", str(config), "--precision", "bf16", "--tokens",
                          "8192", "--seq-len", "8192", "--per-node", "8", "--intra-bandwidth", "150e9",
                          "--flops", "4e14", "--memory-rate", "2e12", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = json.loads(run.stdout)
    assert printed["memory"] == est.memory and printed["comm"] == est.comm
    assert printed["time"]["step"] == pytest.approx(est.time["step"])
