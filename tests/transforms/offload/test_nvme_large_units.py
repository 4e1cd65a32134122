"""zf.offload_nvme with units larger than a pool buffer (a GPT whose root, with its embedding, is
several times ``buffer_size``, as a 50K- or 128K-token vocabulary makes it with the defaults):
such a unit is read into a buffer of its own (on a device: through the pool buffers a part at a
time) and its optimizer state is updated and initialized in pieces of at most ``buffer_size``
elements; training equals, bit for bit, the same composition without offload, and its
checkpoints save and load."""
import os
import tempfile

import pytest
import torch

import zfunc as zf
from assertions import assert_close_to, assert_same_run
from cases import _setup, compose, reference, run_composed
from lazy_copies import lazy_copies_run
from models import batch, local
from workers import workers

SWAP = tempfile.mkdtemp(prefix="zfunc-nvme-large-")
GPT = {"vocab": 1200}  # the root (embedding, tied head, positions, final norm): 9664 elements; a block: 848
BUFFER = 1000  # elements; a pool buffer is whole pages: 4096 bytes, under half the root's shard at W = 1, 2


def nvme(**kw) -> dict:
    return {"kind": "nvme", "path": SWAP, "buffer_size": BUFFER, **kw}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("precision,micro", [(None, None), ({"dtype": torch.bfloat16}, 2)])
def test_units_larger_than_a_buffer_train_as_without_offload(precision, micro, world):
    """zero3, fp32 and bf16 with 2 micro-batches and clipping: bit for bit the step without offload,
    with the root read past the pool every time and no pool overflow; the same with the device
    path's copies (the root then passes through the pool buffers, landing late)."""
    args = ("gpt", GPT, 3, 3, 2, 0, precision, micro, 0.5)
    plain = workers(world).run(run_composed, *args)
    swapped = workers(world).run(run_composed, *args, False, None, False, None, nvme())
    lazy = workers(world).run(lazy_copies_run, *args, False, None, False, None, nvme())
    for a, b, c in zip(plain, swapped, lazy):
        assert_same_run(a, b)
        assert_same_run(a, c)
        root = next(padded for name, _, padded in b["units"] if name == "")
        assert root // world * (4 if precision is None else 2) > 2 * 4096
        for r in (b, c):
            assert r["history"][-1]["nvme"]["pool_oversize"] >= 3  # the root, read in every step
            assert all(h["nvme"]["pool_overflow"] == 0 for h in r["history"])  # the pool's buffers sufficed


def _step(swap_dir: str):
    rank, world, model, shape_model, loss_fn = _setup("gpt", GPT, 0)
    offload = nvme(path=os.path.join(swap_dir, f"swap-w{world}"))
    return model, shape_model, compose(3, loss_fn, offload=offload), rank, world


def train_then_save(steps: int, directory: str) -> dict:
    model, shape_model, step, rank, world = _step(directory)
    with step.init(model) as state:
        for i in range(steps):
            state, _ = step(state, local(batch("gpt", shape_model, i, 6), rank, world))
        zf.checkpoint.save(state, os.path.join(directory, "ckpt"), f"step{steps}")
        return {"params": zf.gather_params(state)}


def load_then_train(start: int, steps: int, directory: str) -> dict:
    model, shape_model, step, rank, world = _step(directory)
    with step.init(model) as state:
        state, _ = zf.checkpoint.load(state, os.path.join(directory, "ckpt"))
        loaded = zf.gather_params(state)
        for i in range(start, start + steps):
            state, _ = step(state, local(batch("gpt", shape_model, i, 6), rank, world))
        return {"loaded": loaded, "params": zf.gather_params(state), "count": int(state.count)}


def test_checkpoints_of_units_larger_than_a_buffer_save_and_load(tmp_path):
    """Saved at W = 2 after 2 steps, loaded at W = 1 and 2 (the root in pieces on disk either way),
    trained 2 more: the loaded weights are the saved ones exactly, and the result is plain
    PyTorch's 4 steps (fp32, relative 1e-5)."""
    expected = reference("gpt", GPT, steps=4, batch_size=6)
    directory = str(tmp_path)
    saved = workers(2).run(train_then_save, 2, directory)[0]["params"]
    for world in (1, 2):
        for r in workers(world).run(load_then_train, 2, 2, directory):
            zf.testing.assert_trees_all_equal(r["loaded"], saved)
            assert r["count"] == 4
            assert_close_to(r["params"], expected["params"])
