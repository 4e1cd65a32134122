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
from zfunc.checkpoint import folders as checkpoint_folders
from assertions import assert_close_to
from cases import reference
from checkpoints import GLOBAL_BATCH, load_then_train, train_then_save
from compositions import COMPOSITIONS
from models import batch, build
from workers import workers

HOW = {name: COMPOSITIONS[name] for name in ("zero1", "zero2", "zero3", "zero3-offload_nvme")}


@pytest.mark.parametrize("composition", list(HOW))
@pytest.mark.parametrize("name", ["gpt", pytest.param("odd_mlp", marks=pytest.mark.slow)])
def test_save_at_two_load_at_one_and_three_trains_on_exactly(name, composition, tmp_path):
    how = HOW[composition]
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


@pytest.mark.slow
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
    from zfunc.checkpoint import files as checkpoint_io
    sys.path.insert(0, {tests!r})
    from models import build
    model = build("gpt")
    step = zf.zero3(zf.train_step(lambda p, b: zf.apply(model, p, b).float().pow(2).mean(), zf.optim.adamw(1e-3)))
    state = step.init(model)
    x = torch.randint(0, 13, (2, 6))
    state, _ = step(state, x)
    checkpoint.save(state, {directory!r}, "first")
    state, _ = step(state, x)
    where, k = {kill!r}
    calls = []
    def killed(original):
        def call(*args, **kw):
            calls.append(1)
            if len(calls) == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kw)
        return call
    if where == "write":  # the second save dies after its first tensor
        def die_midway(io, data, path, offset):
            io.pwrite(data, path, offset)
            io.wait()
            killed(lambda: None)()
        checkpoint_io._write_chunk = die_midway
    else:  # the second save dies just before its k-th rename (files, the folder, latest, the old folder)
        os.replace, os.rename = killed(os.replace), killed(os.rename)
    checkpoint.save(state, {directory!r}, {tag!r})
""")


def _gpt_zero3():
    """The step of KILLED_SAVE, and a function that makes it a fresh state."""
    model = build("gpt")
    step = zf.zero3(zf.train_step(lambda p, b: zf.apply(model, p, b).float().pow(2).mean(), zf.optim.adamw(1e-3)))
    return lambda: step.init(model, free_model=False), step


@pytest.mark.parametrize("tag,kill", [("second", ("write", 2)), ("first", ("rename", 3)),
                                      pytest.param("first", ("rename", 4), marks=pytest.mark.slow),
                                      pytest.param("first", ("rename", 5), marks=pytest.mark.slow)])
def test_a_save_killed_midway_leaves_a_checkpoint_that_loads(tag, kill, tmp_path):
    """SIGKILL in a save (a new tag, or the tag of the previous save): ``latest`` and the tag still load,
    the previous checkpoint or the new one."""
    directory = str(tmp_path / "ckpt")
    harness = os.path.join(os.path.dirname(os.path.dirname(__file__)), "harness")
    script = KILLED_SAVE.format(tests=harness, directory=directory, kill=kill, tag=tag)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    fresh, step = _gpt_zero3()
    for which in (None, tag):
        try:
            state, manifest = zf.checkpoint.load(fresh(), directory, which)
        except FileNotFoundError:
            assert which == "second" and "rename" not in kill  # a new tag killed before it was published
            continue
        assert manifest["count"] in (1, 2) and int(state.count) == manifest["count"]
        if which is None and kill[0] == "write":
            assert manifest["count"] == 1  # killed before anything was published: the previous one
    zf.checkpoint.save(state, directory, tag)  # the next save cleans up what the killed one left
    _assert_tidy(directory, {"first", tag})


def _assert_tidy(directory: str, tags: set) -> None:
    """One folder per tag, ``latest``, and nothing a killed save left (staging, trash)."""
    entries = os.listdir(directory)
    assert not [e for e in entries if e.startswith(".") or ".tmp-" in e], entries
    assert len(entries) == len(tags) + 1 and all(len(checkpoint_folders.folders_of(directory, t)) == 1 for t in tags)


_STEPS = ("replace", "rename", "remove", "unlink", "rmdir")


@pytest.mark.parametrize("tag", ["a", "b"])
def test_a_save_interrupted_at_every_step_leaves_latest_and_the_tag_loadable(tag, tmp_path, monkeypatch):
    """Each file-system step of a save (a rename, a removal) in turn raises SystemExit, as if the job were
    killed there: after every one ``latest`` and the tag load a complete checkpoint, old or new."""
    directory = str(tmp_path / "ckpt")
    fresh, step = _gpt_zero3()
    x = torch.randint(0, 13, (2, 6))
    state, _ = step(fresh(), x)
    zf.checkpoint.save(state, directory, "a")  # count 1
    state, _ = step(state, x)  # count 2
    originals = {name: getattr(os, name) for name in _STEPS}
    k = 0
    while True:
        k += 1
        calls = []

        def interrupt_at_k(original):
            def call(*args, **kw):
                calls.append(1)
                if len(calls) == k:
                    raise SystemExit(f"killed at step {k}")
                return original(*args, **kw)
            return call

        for name in _STEPS:
            monkeypatch.setattr(os, name, interrupt_at_k(originals[name]))
        try:
            zf.checkpoint.save(state, directory, tag)
            finished = True
        except SystemExit:
            finished = False
        for name in _STEPS:
            monkeypatch.setattr(os, name, originals[name])
        counts = set()
        for which in (None, "a", tag):
            try:
                _, manifest = zf.checkpoint.load(fresh(), directory, which)
            except FileNotFoundError:
                assert which == tag == "b", f"killed at step {k}: {which!r} does not load"
                continue
            counts.add((which, manifest["count"]))
            assert manifest["count"] in (1, 2)
            if which == "a" and tag == "b":
                assert manifest["count"] == 1
        if finished:
            assert counts == {(None, 2), ("a", 2 if tag == "a" else 1), (tag, 2)}
            _assert_tidy(directory, {"a", tag})
            break
        assert k < 200
    assert k > 5  # every step was interrupted once


def test_consolidate_writes_safetensors(tmp_path):
    import safetensors.torch as safetensors  # in the test extra
    directory = str(tmp_path)
    workers(2).run(train_then_save, "gpt", {"stage": 2}, 1, directory)
    out = tmp_path / "model.safetensors"
    proc = subprocess.run([sys.executable, "-m", "zfunc.checkpoint", "consolidate", str(tmp_path / "ckpt"), str(out),
                           "--safetensors"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tensors = safetensors.load_file(str(out))
    assert "head.weight" not in tensors  # Hugging Face's form: a tied weight once, under its first name
    fresh = build("gpt", seed=5)
    missing, unexpected = fresh.load_state_dict(tensors, strict=False)
    assert missing == ["head.weight"] and not unexpected  # the tie gives it
    assert torch.equal(fresh.head.weight, tensors["tok.weight"])
    assert torch.equal(fresh.state_dict()["blocks.0.qkv.weight"], tensors["blocks.0.qkv.weight"])
