"""``zf.offload_states`` / ``zf.reload_states``: a training state's parts moved off the compute
device between phases (host memory, or files under ``path``) and back. Training after a reload
continues bit for bit as if nothing moved, under every composition and world size; the memory
really goes (RSS drops by the moved bytes) and stays flat over many cycles; a step, a checkpoint
and ``gather_params`` refuse an offloaded state, naming ``zf.reload_states``; a failed offload
leaves the state usable and no file. On this CPU-only machine the compute device is the host, so
``device="cpu"`` moves nothing; the CUDA paths (page-locked buffers, non-blocking copies) run in the
tests marked for CUDA."""
import gc
import os

import pytest
import torch
from torch import nn

import zfunc as zf
from zfunc import buffers
from zfunc.residency import files as offload_files
from zfunc.residency import host_buffers, HostBuffers
from zfunc.testing import memory
from hf import llama_config
from workers import fresh_workers, workers

import transformers  # noqa: E402  the [test] extra installs it

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host buffers, device memory)")


def llama(width: int = 16, layers: int = 2):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(hidden_size=width, intermediate_size=2 * width,
                                                      num_hidden_layers=layers))


def compose(how: str, model, swap: str):
    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    if how == "zero1":
        return zf.zero1(step)
    if how == "bf16":
        return zf.zero3(zf.mixed_precision(step, torch.bfloat16))
    if how == "offload_cpu":
        return zf.zero3(zf.offload_cpu(step))
    if how == "offload_nvme":
        return zf.zero3(zf.offload_nvme(step, swap))
    return zf.zero3(step)


def batch(i: int, rank: int = 0):
    x = torch.randint(0, 50, (6, 8), generator=torch.Generator().manual_seed(i))  # 2 rows a rank, W <= 3
    return x[2 * rank: 2 * rank + 2]


def offloaded_files(directory: str, rank: int | None = None) -> list[str]:
    """The offload files in ``directory`` (``rank``'s only, if given), finished or being written."""
    prefix = "zfunc-offload" if rank is None else f"zfunc-offload-rank{rank}-"
    return sorted(f for f in os.listdir(directory) if f.startswith(prefix))


def train(how: str, directory: str, offload: str | None, steps: int = 3):
    """Losses and final parameters of ``steps`` steps, the state offloaded and reloaded after each one
    (``offload``: the device, or None), with what each offload looked like on the way."""
    rank = zf.dist.rank()
    model = llama()
    step = compose(how, model, os.path.join(directory, f"swap-{offload}-{rank}"))
    state = step.init(model)
    losses, seen = [], []
    for i in range(steps):
        state, metrics = step(state, batch(i, rank))
        losses.append(metrics["loss"].item())
        if offload is None:
            continue
        given = state
        state = zf.offload_states(state, device=offload, path=directory)
        report = zf.memory_report(state)
        refusals = []
        for use in (lambda: step(state, batch(0, rank)), lambda: zf.gather_params(state),
                    lambda: zf.checkpoint.save(state, os.path.join(directory, "ckpt"), "t"),
                    lambda: step(given, batch(0, rank))):
            with pytest.raises(zf.StateOffloaded) as e:
                use()
            refusals.append(str(e.value))
        seen.append({"moved": state.moved_bytes, "by_home": report["by_home"], "refusals": refusals,
                     "files": offloaded_files(directory, rank), "passes": len(step.coordinator().runs)})
        del given
        state = zf.reload_states(state)
        seen[-1]["files_after"] = offloaded_files(directory, rank)
    params = zf.gather_params(state)
    state.close()
    return losses, params, seen


CASES = [
    pytest.param("zero3", 2, id="zero3-W2"),
    pytest.param("bf16", 1, id="bf16-W1", marks=pytest.mark.slow),
    pytest.param("offload_nvme", 2, id="offload_nvme-W2"),
    pytest.param("zero1", 1, id="zero1-W1", marks=pytest.mark.slow),
    pytest.param("zero1", 2, id="zero1-W2", marks=pytest.mark.slow),
    pytest.param("zero3", 1, id="zero3-W1", marks=pytest.mark.slow),
    pytest.param("bf16", 2, id="bf16-W2", marks=pytest.mark.slow),
    pytest.param("offload_cpu", 1, id="offload_cpu-W1", marks=pytest.mark.slow),
    pytest.param("offload_cpu", 2, id="offload_cpu-W2", marks=pytest.mark.slow),
    pytest.param("offload_nvme", 1, id="offload_nvme-W1", marks=pytest.mark.slow),
    pytest.param("zero3", 3, id="zero3-W3", marks=pytest.mark.slow),
    pytest.param("bf16", 3, id="bf16-W3", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("how,world", CASES)
def test_nvme_offload_and_reload_continue_training_bit_for_bit(how, world, tmp_path):
    group = workers(world)
    plain = group.run(train, how, str(tmp_path), None)
    moved = group.run(train, how, str(tmp_path), "nvme")
    for (losses, params, _), (losses_m, params_m, seen) in zip(plain, moved):
        assert losses_m == losses  # exact: the values came back bit for bit
        assert params_m.keys() == params.keys()
        for name in params:
            assert torch.equal(params_m[name], params[name]), name
        for s in seen:
            moved_bytes = sum(s["moved"].values())
            assert moved_bytes > 0
            if how == "offload_nvme":  # on disk already: only the optimizer's counts were in memory
                assert s["moved"]["params"] == 0 and s["moved"]["optimizer"] < 1024
            else:
                assert s["moved"]["params"] > 0 and s["moved"]["optimizer"] > 0
            if how == "bf16":
                assert s["moved"]["master"] > 0
            assert s["by_home"]["device"] < 1024  # what stays: buffers and the step count
            assert all("zf.reload_states" in r for r in s["refusals"])
            assert len(s["files"]) == 1 and s["files"][0].endswith(".bin") and s["files_after"] == []  # gone on reload
            assert s["passes"] == 0  # the coordinator's last passes let go of the units
    assert offloaded_files(str(tmp_path)) == []


def test_cpu_on_a_cpu_machine_moves_nothing_and_still_refuses_until_reloaded(tmp_path):
    model = llama()
    step = compose("zero3", model, "")
    state, _ = step(step.init(model), batch(0))
    leaves = state.params.leaves
    values = [t.clone() for t in leaves]
    before = zf.memory_report(state)
    off = zf.offload_states(state, device="cpu")
    assert off.moved_bytes == {"params": 0, "frozen": 0, "master": 0, "optimizer": 0}
    report = zf.memory_report(off)
    assert report["by_home"] == before["by_home"] and report["offloaded"]["device"] == "cpu"
    with pytest.raises(zf.StateOffloaded, match=r"zf\.reload_states"):
        step(off, batch(1))
    with pytest.raises(zf.StateOffloaded, match=r"zf\.reload_states"):
        step(state, batch(1))  # the state given is used up, even though nothing moved
    with pytest.raises(zf.StateOffloaded, match=r"zf\.reload_states"):
        zf.gather_params(off)
    back = zf.reload_states(off)
    assert all(a is b for a, b in zip(back.params.leaves, leaves))  # the same tensors: nothing moved
    assert all(torch.equal(a, b) for a, b in zip(back.params.leaves, values))
    with pytest.raises(ValueError, match="reloaded already"):
        zf.reload_states(off)
    after, m = step(back, batch(1))
    ref = compose("zero3", llama(), "")
    ref_state, _ = ref(ref.init(llama()), batch(0))
    ref_state, ref_m = ref(ref_state, batch(1))
    assert m["loss"].item() == ref_m["loss"].item()


def test_deepspeeds_offload_enums_are_importable_from_zfunc_as_deepspeeds():
    """``from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum`` in
    a script under the switch: zfunc's have DeepSpeed's names and values."""
    from deepspeed.runtime.zero import offload_config as theirs
    from zfunc.deepspeed.runtime.zero import offload_config as ours
    for name in ("OffloadDeviceEnum", "OffloadStateTypeEnum"):
        assert {m.name: m.value for m in getattr(ours, name)} == {m.name: m.value for m in getattr(theirs, name)}


@pytest.mark.parametrize("enums", ["deepspeed", "zfunc.deepspeed"])
def test_include_moves_only_the_named_parts_by_zfunc_or_deepspeed_names(tmp_path, enums):
    import importlib
    OffloadStateTypeEnum = importlib.import_module(f"{enums}.runtime.zero.offload_config").OffloadStateTypeEnum

    model = llama()
    step = compose("bf16", model, "")
    state, _ = step(step.init(model), batch(0))
    params = state.params.leaves
    off = zf.offload_states(state, device="nvme", path=str(tmp_path), include=[OffloadStateTypeEnum.hp_params])
    assert off.parts == ("master",)
    assert [k for k, v in off.moved_bytes.items() if v] == ["master"]
    back = zf.reload_states(off)
    assert all(a is b for a, b in zip(back.params.leaves, params))  # the parameters never moved
    off = zf.offload_states(back, device="nvme", path=str(tmp_path), include=["optim_states", "lp_grads"])
    assert [k for k, v in off.moved_bytes.items() if v] == ["optimizer"]
    back = zf.reload_states(off)
    off = zf.offload_states(back, device="nvme", path=str(tmp_path), include=["lp_grads", "contiguous_grad_buffer"])
    assert not any(off.moved_bytes.values())  # zfunc keeps no gradient between steps
    back = zf.reload_states(off)
    with pytest.raises(ValueError, match="'grads' is not a part"):
        zf.offload_states(back, device="nvme", path=str(tmp_path), include=["grads"])
    step(back, batch(1))  # a refused include moved nothing: the state trains on


def test_bad_input_is_named(tmp_path):
    model = llama()
    step = compose("zero3", model, "")
    state = step.init(model)
    with pytest.raises(ValueError, match="give 'cpu'"):
        zf.offload_states(state, device="gpu")
    with pytest.raises(ValueError, match="give path="):
        zf.offload_states(state, device="nvme")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(NotADirectoryError, match="a_file"):
        zf.offload_states(state, device="nvme", path=str(tmp_path / "a_file"))
    (tmp_path / "a_file").unlink()
    with pytest.raises(TypeError, match="returned"):
        zf.reload_states(state)
    off = zf.offload_states(state, device="nvme", path=str(tmp_path))
    with pytest.raises(ValueError, match="offloaded already"):
        zf.offload_states(off, device="nvme", path=str(tmp_path))
    with pytest.raises(zf.StateOffloaded):
        zf.checkpoint.save(off, str(tmp_path / "ckpt"), "t")
    zf.reload_states(off)
    state = step.init(llama())
    off = zf.offload_states(state, device="nvme", path=str(tmp_path))
    assert os.path.exists(off.file)
    off.close()  # given up without a reload: its file goes
    assert os.listdir(tmp_path) == []


def test_a_missing_folder_is_made_and_goes_with_the_file(tmp_path):
    """As offload_nvme makes its own swap folder: the folders made go again when the file does
    (reload or close); a folder the user made stays."""
    model = llama()
    step = compose("zero3", model, "")
    state = step.init(model)
    before = zf.gather_params(state)
    off = zf.offload_states(state, device="nvme", path=str(tmp_path / "made" / "deeper"))
    assert os.path.dirname(off.file) == str(tmp_path / "made" / "deeper")
    state = zf.reload_states(off)
    assert os.listdir(tmp_path) == []
    after = zf.gather_params(state)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    (tmp_path / "mine").mkdir()
    zf.offload_states(state, device="nvme", path=str(tmp_path / "mine" / "made")).close()
    assert os.listdir(tmp_path) == ["mine"] and os.listdir(tmp_path / "mine") == []


def test_a_failed_offload_leaves_the_state_usable_and_no_file(tmp_path, monkeypatch):
    model = llama()
    step = compose("zero3", model, "")
    state, _ = step(step.init(model), batch(0))
    calls = []
    append = offload_files.OffloadFile.append

    def failing(self, data):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return append(self, data)

    monkeypatch.setattr(offload_files.OffloadFile, "append", failing)
    with pytest.raises(OSError, match="No space"):
        zf.offload_states(state, device="nvme", path=str(tmp_path))
    assert os.listdir(tmp_path) == []
    calls.clear()
    with pytest.raises(OSError, match="No space"):  # the folders it made go too
        zf.offload_states(state, device="nvme", path=str(tmp_path / "made"))
    assert os.listdir(tmp_path) == []
    state, m = step(state, batch(1))  # usable, and unchanged
    ref = compose("zero3", llama(), "")
    ref_state, _ = ref(ref.init(llama()), batch(0))
    _, ref_m = ref(ref_state, batch(1))
    assert m["loss"].item() == ref_m["loss"].item()


def test_a_cut_file_fails_the_reload_which_can_be_tried_again(tmp_path):
    model = llama()
    step = compose("zero3", model, "")
    state, _ = step(step.init(model), batch(0))
    expected = zf.gather_params(state)
    off = zf.offload_states(state, device="nvme", path=str(tmp_path))
    whole = open(off.file, "rb").read()
    with open(off.file, "wb") as f:
        f.write(whole[:-8])
    with pytest.raises(OSError, match="ends 8 bytes early"):
        zf.reload_states(off)
    with open(off.file, "wb") as f:
        f.write(whole)
    back = zf.reload_states(off)
    assert all(torch.equal(v, expected[k]) for k, v in zf.gather_params(back).items())
    assert os.listdir(tmp_path) == []


def rss_over_cycles(directory: str, cycles: int, width: int) -> dict:
    """RSS with the state on the device and offloaded to files, cycle after cycle, and its size."""
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])

    def loss_fn(params, x):
        return zf.apply(model, params, x).pow(2).mean()

    step = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(model)
    x = torch.randn(4, width)
    state, _ = step(state, x)
    # the state's bytes in RAM: "device" on a CPU-only machine, "host" where CUDA exists
    size = sum(v for home, v in zf.memory_report(state)["by_home"].items() if home != "disk")
    on, off = [], []
    for _ in range(cycles):
        state, _ = step(state, x)
        gc.collect()
        buffers.trim()
        on.append(memory.rss())
        state = zf.offload_states(state, device="nvme", path=directory)
        off.append(memory.rss())
        state = zf.reload_states(state)
    return {"size": size, "on": on, "off": off}


def check_flat(r: dict) -> None:
    size = r["size"]
    freed = [a - b for a, b in zip(r["on"], r["off"])]
    assert min(freed) > 0.8 * size, (freed, size)  # the moved bytes left RAM
    # flat: the last cycles hold what the second did (the first still settles the allocator)
    assert max(r["off"][1:]) - min(r["off"][1:]) < 0.1 * size, r["off"]
    assert max(r["on"][1:]) - min(r["on"][1:]) < 0.1 * size, r["on"]


def test_nvme_frees_the_states_memory_and_ten_cycles_stay_flat(tmp_path):
    [r] = workers(1).run(rss_over_cycles, str(tmp_path), 10, 512)  # 4 x 1 MiB parameters: 12 MiB of state
    check_flat(r)


@pytest.mark.slow
def test_a_hundred_cycles_leave_memory_flat(tmp_path):
    with fresh_workers(1) as group:
        [r] = group.run(rss_over_cycles, str(tmp_path), 100, 1024)
    check_flat(r)


def engine_run(directory: str, offload: bool) -> list[float]:
    model = llama()
    config = {"train_batch_size": 2 * zf.dist.world_size(), "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3}}
    engine = zf.initialize(model, config, loss_fn=lambda m, x: m(input_ids=x, labels=x).loss)
    rank, losses = zf.dist.rank(), []
    for i in range(3):
        if offload:
            engine.offload_states(device="nvme", path=directory)
            with pytest.raises(zf.StateOffloaded, match="reload_states"):
                engine.train_batch(iter([batch(i, rank)]))
            engine.reload_states()
            engine.reload_states()  # nothing to do, as DeepSpeed's
        losses.append(float(engine.train_batch(iter([batch(i, rank)]))))
    return losses


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_engine_offload_states_and_reload_states(world, tmp_path):
    group = workers(world)
    assert group.run(engine_run, str(tmp_path), True) == group.run(engine_run, str(tmp_path), False)


def test_host_buffers_are_reused_by_size():
    pool = HostBuffers()
    a = pool.take(1024, pin=False)
    ptr = a.data_ptr()
    pool.give(a)
    assert pool.held_bytes() == 1024
    b = pool.take(1024, pin=False)
    assert b.data_ptr() == ptr and pool.held_bytes() == 0
    c = pool.take(2048, pin=False)
    assert c.data_ptr() != ptr and c.numel() == 2048
    pool.give(b)
    pool.give(c)
    pool.clear()
    assert pool.held_bytes() == 0


def cuda_cycles(non_blocking: bool, directory: str) -> dict:
    model = llama(64)
    step = compose("bf16", model, "")
    state = step.init(model, device="cuda")
    state, _ = step(state, batch(0).cuda())
    expected = zf.gather_params(state)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    held, freed = [], []
    for device in ["cpu"] * 5 + ["nvme"]:
        state = zf.offload_states(state, device=device, path=directory, non_blocking=non_blocking)
        torch.cuda.synchronize()
        freed.append(before - torch.cuda.memory_allocated())
        report = zf.memory_report(state)
        held.append(host_buffers.held_bytes())
        state = zf.reload_states(state, non_blocking=non_blocking)
    got = zf.gather_params(state)
    return {"equal": all(torch.equal(got[k], v) for k, v in expected.items()), "freed": freed,
            "moved": sum(state_bytes for state_bytes in [zf.memory_report(state)["by_home"]["device"]]),
            "held": held, "report": report}


@cuda
@pytest.mark.parametrize("non_blocking", [False, True])
def test_cuda_offload_to_pinned_host_buffers_reused_across_cycles(non_blocking, tmp_path):
    r = cuda_cycles(non_blocking, str(tmp_path))
    assert r["equal"]
    assert min(r["freed"]) > 0.9 * r["moved"]  # the device memory went
    assert len(set(r["held"][1:5])) == 1  # the same host buffers, cycle after cycle
    assert offloaded_files(str(tmp_path)) == []
