"""Training that saves a checkpoint, and training that loads one and goes on, run on each rank; the
checkpoint tests, the GPU check and the unused-parameter tests compare them with plain PyTorch trained
without a break. ``how``: a ``compositions.COMPOSITIONS`` entry (its stage; NVMe offload gets its swap
folder next to the checkpoint). ``assert_same_numbers``: two checkpoints hold the same values;
``assert_same_entries``: the same numbers parameter by parameter, where their flat layouts differ."""
import os

import torch

import zfunc as zf
from zfunc.checkpoint.hf_export import entry_offsets
from cases import _setup, compose
from models import batch, local

GLOBAL_BATCH = 6  # divides over W = 1, 2, 3


def _step(name, how, swap_dir):
    rank, world, model, shape_model, loss_fn = _setup(name, {}, 0)
    offload = how.get("offload")
    if offload is not None and offload["kind"] == "nvme":
        offload = {**offload, "path": os.path.join(swap_dir, "swap")}
    return model, shape_model, compose(how["stage"], loss_fn, offload=offload), rank, world


def train_then_save(name: str, how: dict, steps: int, directory: str, device: str = "cpu") -> dict:
    """``device``: where the model and batches live (``"cuda"`` under a nccl group)."""
    model, shape_model, step, rank, world = _step(name, how, directory)
    state = step.init(model.to(device))
    for i in range(steps):
        state, _ = step(state, local(batch(name, shape_model, i, GLOBAL_BATCH, 0, device), rank, world))
    zf.checkpoint.save(state, os.path.join(directory, "ckpt"), f"step{steps}")
    out = {"params": zf.gather_params(state)}
    state.close()
    return out


def load_then_train(name: str, how: dict, start: int, steps: int, directory: str, tag=None,
                    device: str = "cpu") -> dict:
    model, shape_model, step, rank, world = _step(name, how, directory + f"-w{zf.dist.world_size()}")
    state = step.init(model.to(device))
    state, manifest = zf.checkpoint.load(state, os.path.join(directory, "ckpt"), tag)
    loaded = zf.gather_params(state)
    for i in range(start, start + steps):
        state, _ = step(state, local(batch(name, shape_model, i, GLOBAL_BATCH, 0, device), rank, world))
    out = {"loaded": loaded, "params": zf.gather_params(state), "count": int(state.count),
           "manifest_world": manifest["world"], "devices": sorted({str(t.device) for t in state.params.leaves})}
    state.close()
    return out


def assert_same_numbers(source: str, target: str) -> None:
    """Every part of the target checkpoint holds the source's numbers (in the target's dtype)."""
    src = zf.checkpoint.Saved(zf.checkpoint.resolve(source))
    tgt = zf.checkpoint.Saved(zf.checkpoint.resolve(target))
    fp32 = "master" if "master" in src.layouts else "params"  # the checkpoint's full-precision weights
    for role, units in tgt.layouts.items():
        if units == "tensor":
            assert torch.equal(tgt.tensor(role), src.tensor(role).to(tgt.tensor(role).dtype)), role
            continue
        for i, unit in enumerate(units):
            if unit is None or (unit["numel"] == 0 and tgt.files[0].entry(f"{role}#{i}")["shape"]):
                continue  # an empty unit
            expected = src.unit(fp32 if role in ("params", "master") else role, i)
            got = tgt.unit(role, i)
            assert got.dtype == (torch.bfloat16 if role == "params" and "master" in tgt.layouts else expected.dtype)
            assert torch.equal(got, expected.to(got.dtype)), (role, i)


def assert_same_entries(source: str, target: str) -> int:
    """Every part of the two checkpoints holds the same numbers, parameter by parameter: the units'
    flat layouts differ where an owner layout's gaps depend on the world size. Returns how many
    units' layouts differ."""
    differ = 0
    src = zf.checkpoint.Saved(zf.checkpoint.resolve(source))
    tgt = zf.checkpoint.Saved(zf.checkpoint.resolve(target))
    assert src.layouts.keys() == tgt.layouts.keys()
    for role, units in tgt.layouts.items():
        if units == "tensor":
            assert torch.equal(tgt.tensor(role), src.tensor(role)), role
            continue
        if not isinstance(units, list):
            continue
        for i, unit in enumerate(units):
            if unit is None:
                continue
            a, b = src.unit(role, i), tgt.unit(role, i)
            if not b.dim() or not b.is_floating_point():  # step counts: one per parameter, no layout
                assert torch.equal(a, b), (role, i)
                continue
            kind = "frozen" if role == "frozen" else "trainable"
            segs = [s.manifest["model"]["units"][i][kind] for s in (src, tgt)]
            differ += entry_offsets(segs[0]) != entry_offsets(segs[1])
            for (name, shape), x, y in zip(segs[0]["entries"], entry_offsets(segs[0]), entry_offsets(segs[1])):
                n = torch.Size(shape).numel()
                assert torch.equal(a[x : x + n], b[y : y + n]), (role, name)
    return differ
