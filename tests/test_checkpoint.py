"""Checkpoints (zfunc.checkpoint): save at one world size, load at another, train on.

The oracle is plain PyTorch trained without interruption: a state saved at W = 2
after k steps, loaded at W = 1, 2 or 3 and trained n more steps on the same global
batches, must equal k + n uninterrupted steps (fp32, 1e-5).
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import zfunc as zf
from cases import _setup, compose, reference
from models import batch, build, local
from test_zero_equivalence import assert_close_to
from workers import workers

GLOBAL_BATCH = 6  # divides over W = 1, 2, 3
COMPOSITIONS = {
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero3": dict(stage=3),
    "zero3_nvme": dict(stage=3, offload="nvme"),
}


def _step(name, how, swap_dir):
    rank, world, model, shape_model, loss_fn = _setup(name, {}, 0)
    offload = {"kind": "nvme", "path": os.path.join(swap_dir, "swap")} if how.get("offload") == "nvme" else None
    return model, shape_model, compose(how["stage"], loss_fn, offload=offload), rank, world


def train_then_save(name: str, how: dict, steps: int, directory: str) -> dict:
    model, shape_model, step, rank, world = _step(name, how, directory)
    state = step.init(model)
    for i in range(steps):
        state, _ = step(state, local(batch(name, shape_model, i, GLOBAL_BATCH), rank, world))
    zf.checkpoint.save(state, os.path.join(directory, "ckpt"), f"step{steps}")
    out = {"params": zf.gather_params(state)}
    state.close()
    return out


def load_then_train(name: str, how: dict, start: int, steps: int, directory: str, tag=None) -> dict:
    model, shape_model, step, rank, world = _step(name, how, directory + f"-w{zf.dist.world_size()}")
    state = step.init(model)
    state, manifest = zf.checkpoint.load(state, os.path.join(directory, "ckpt"), tag)
    loaded = zf.gather_params(state)
    for i in range(start, start + steps):
        state, _ = step(state, local(batch(name, shape_model, i, GLOBAL_BATCH), rank, world))
    out = {"loaded": loaded, "params": zf.gather_params(state), "count": int(state.count),
           "manifest_world": manifest["world"]}
    state.close()
    return out


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
@pytest.mark.parametrize("name", ["gpt", "odd_mlp"])
def test_save_at_two_load_at_one_and_three_trains_on_exactly(name, composition, tmp_path):
    how = COMPOSITIONS[composition]
    expected = reference(name, {}, steps=5, batch_size=GLOBAL_BATCH)
    at_two = reference(name, {}, steps=2, batch_size=GLOBAL_BATCH)
    directory = str(tmp_path)
    for r in workers(2).run(train_then_save, name, how, 2, directory):
        assert_close_to(r["params"], at_two["params"])
    for world in (1, 2, 3):
        for r in workers(world).run(load_then_train, name, how, 2, 3, directory):
            assert r["manifest_world"] == 2 and r["count"] == 5
            assert_close_to(r["loaded"], at_two["params"])
            assert_close_to(r["params"], expected["params"])


def test_consolidated_file_loads_into_a_fresh_model_with_the_same_outputs(tmp_path):
    directory = str(tmp_path)
    [r, _] = workers(2).run(train_then_save, "gpt", {"stage": 3}, 2, directory)
    out = tmp_path / "model.pt"
    subprocess.run([sys.executable, "-m", "zfunc.checkpoint", "consolidate", str(tmp_path / "ckpt"), str(out)],
                   check=True, capture_output=True, timeout=120)
    fresh = build("gpt", seed=123)
    fresh.load_state_dict(torch.load(out))
    trained = build("gpt", seed=123)
    missing, unexpected = trained.load_state_dict(r["params"], strict=False)  # canonical names: the tied head
    assert missing == ["head.weight"] and not unexpected  # shares tok.weight's tensor
    x, _ = batch("gpt", fresh, 9, 4)
    assert torch.equal(fresh(x), trained(x))


def test_a_checkpoint_of_another_model_says_what_differs(tmp_path):
    directory = str(tmp_path)
    workers(1).run(train_then_save, "gpt", {"stage": 3}, 1, directory)
    model = build("odd_mlp")
    step = zf.zero3(zf.train_step(lambda p, b: zf.apply(model, p, b).sum(), zf.optim.adamw(1e-3)))
    state = step.init(model)
    with pytest.raises(ValueError, match="saved from another model: parameter .* in the checkpoint"):
        zf.checkpoint.load(state, str(tmp_path / "ckpt"))


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    import zfunc as zf
    from zfunc import checkpoint
    sys.path.insert(0, {tests!r})
    from models import build
    model = build("gpt")
    step = zf.zero3(zf.train_step(lambda p, b: zf.apply(model, p, b).float().pow(2).mean(), zf.optim.adamw(1e-3)))
    state = step.init(model)
    x = torch.randint(0, 13, (2, 6))
    state, _ = step(state, x)
    checkpoint.save(state, {directory!r}, "first")
    state, _ = step(state, x)
    written = []
    def die_midway(io, data, path, offset):  # the second save dies after its first tensor
        io.pwrite(data, path, offset)
        io.wait()
        written.append(1)
        if len(written) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    checkpoint._write_chunk = die_midway
    checkpoint.save(state, {directory!r}, "second")
""")


def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_latest(tmp_path):
    directory = str(tmp_path / "ckpt")
    script = KILLED_SAVE.format(tests=os.path.dirname(__file__), directory=directory)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert (tmp_path / "ckpt" / "latest").read_text() == "first"
    assert not (tmp_path / "ckpt" / "second").exists()
    model = build("gpt")
    step = zf.zero3(zf.train_step(lambda p, b: zf.apply(model, p, b).float().pow(2).mean(), zf.optim.adamw(1e-3)))
    state, manifest = zf.checkpoint.load(step.init(model), directory)
    assert manifest["count"] == 1 and int(state.count) == 1


def test_consolidate_writes_safetensors(tmp_path):
    import safetensors.torch as safetensors  # in the test extra
    directory = str(tmp_path)
    workers(2).run(train_then_save, "gpt", {"stage": 2}, 1, directory)
    out = tmp_path / "model.safetensors"
    proc = subprocess.run([sys.executable, "-m", "zfunc.checkpoint", "consolidate", str(tmp_path / "ckpt"), str(out),
                           "--safetensors"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    fresh = build("gpt", seed=5)
    fresh.load_state_dict(safetensors.load_file(str(out)))  # tied head included, as its own tensor
    assert torch.equal(fresh.head.weight, fresh.tok.weight)
