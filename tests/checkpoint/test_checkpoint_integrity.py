"""Damaged checkpoints (zfunc.checkpoint.files): a truncated, flipped, missing or garbled file raises
naming the file and its rank, and nothing of it reaches the state."""
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zfunc as zf
from zfunc.checkpoint.files import DamagedCheckpointError
from models import batch, build, local
from workers import workers


def _fresh():
    """A fresh zero3 state of the test GPT (W = 1 in this process), and its step."""
    model = build("gpt")
    step = zf.zero3(zf.train_step(lambda p, b: zf.apply(model, p, b).float().pow(2).mean(), zf.optim.adamw(1e-3)))
    return lambda: step.init(model, free_model=False), step


def _values(state) -> list[torch.Tensor]:
    """Every tensor of the state, copied: to show a failed load left it as it was."""
    return [t.clone() for t in torch.utils._pytree.tree_leaves(
        [zf.gather_params(state), state.opt_state.mu, state.opt_state.nu, state.count])
        if isinstance(t, torch.Tensor)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A checkpoint of a state two steps in, and the state."""
    directory = str(tmp_path_factory.mktemp("pristine") / "ckpt")
    fresh, step = _fresh()
    state = fresh()
    x = torch.randint(0, 13, (2, 6))
    for _ in range(2):
        state, _ = step(state, x)
    folder = zf.checkpoint.save(state, directory, "t")
    return directory, os.path.basename(folder)


def _copy(pristine, tmp_path) -> tuple[str, str]:
    directory, name = pristine
    shutil.copytree(directory, tmp_path / "ckpt")
    return str(tmp_path / "ckpt"), str(tmp_path / "ckpt" / name)


def _load_fails(directory: str, match: str):
    """Load ``directory`` into a fresh state: it must raise ``match`` and leave the state unchanged."""
    fresh, _ = _fresh()
    state = fresh()
    before = _values(state)
    with pytest.raises(DamagedCheckpointError, match=match) as error:
        zf.checkpoint.load(state, directory)
    assert "earlier checkpoint" in str(error.value)  # what to do
    after = _values(state)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a damaged checkpoint changed the state"
    return error.value


def test_the_pristine_checkpoint_loads(pristine, tmp_path):
    directory, _ = _copy(pristine, tmp_path)
    fresh, _ = _fresh()
    state, manifest = zf.checkpoint.load(fresh(), directory)
    assert int(state.count) == 2 == manifest["count"]


def test_a_truncated_rank_file_names_the_file_and_the_rank(pristine, tmp_path):
    directory, folder = _copy(pristine, tmp_path)
    path = os.path.join(folder, "rank0.bin")
    os.truncate(path, os.path.getsize(path) // 2)
    _load_fails(directory, r"rank0\.bin' \(rank 0\) holds .* bytes but its index says .* \(truncated\?\)")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), length=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_flipped_bytes_anywhere_in_a_rank_file_are_found_before_anything_is_loaded(pristine, tmp_path_factory,
                                                                                   where, length, seed):
    directory, folder = _copy(pristine, tmp_path_factory.mktemp("flip"))
    path = os.path.join(folder, "rank0.bin")
    size = os.path.getsize(path)
    start = int(where * size)
    with open(path, "r+b") as f:
        f.seek(start)
        old = f.read(min(length, size - start))
        noise = torch.randint(1, 256, (len(old),), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
        f.seek(start)
        f.write(bytes(a ^ b for a, b in zip(old, noise.tolist())))  # every byte changes
    _load_fails(directory, r"rank0\.bin' \(rank 0\) is damaged: bytes .* do not match their checksum")


@pytest.mark.parametrize("name", ["rank0.bin", "rank0.json"])
def test_a_missing_rank_file_names_the_file_and_the_rank(pristine, tmp_path, name):
    directory, folder = _copy(pristine, tmp_path)
    os.remove(os.path.join(folder, name))
    _load_fails(directory, rf"{name}' \(rank 0\) is missing")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("name", ["manifest.json", "rank0.json"])
def test_a_damaged_manifest_or_index_names_the_file(pristine, tmp_path, name, damage):
    directory, folder = _copy(pristine, tmp_path)
    path = os.path.join(folder, name)
    with open(path, "rb") as f:
        text = f.read()
    middle = len(text) // 2
    if damage == "flip":  # a digit that still parses: only the checksum can tell
        digit = next(i for i in range(middle, len(text)) if chr(text[i]).isdigit())
        text = text[:digit] + str((int(chr(text[digit])) + 1) % 10).encode() + text[digit + 1:]
    else:
        text = text[:middle]
    with open(path, "wb") as f:
        f.write(text)
    _load_fails(directory, rf"{name}'.* (damaged|truncated)")


def test_consolidate_refuses_a_damaged_file(pristine, tmp_path):
    directory, folder = _copy(pristine, tmp_path)
    path = os.path.join(folder, "rank0.bin")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 6)  # in the parameters, which consolidate reads
        f.write(b"\xff" * 8)
    with pytest.raises(DamagedCheckpointError, match="rank0.bin"):
        zf.checkpoint.consolidate(directory)


def save_at_two(directory: str) -> None:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build("gpt")
    step = zf.zero3(zf.train_step(lambda p, b: zf.apply(model, p, b).float().pow(2).mean(), zf.optim.adamw(1e-3)))
    state = step.init(model)
    x, _ = batch("gpt", build("gpt"), 0, 4)
    state, _ = step(state, local((x,), rank, world)[0])
    zf.checkpoint.save(state, directory, "t")


def load_reports(directory: str) -> tuple[str, bool]:
    """The error this rank's load raised, and whether its state was left as it was."""
    fresh, _ = _fresh()
    state = fresh()
    before = _values(state)
    try:
        zf.checkpoint.load(state, directory)
    except DamagedCheckpointError as e:
        return str(e), all(torch.equal(a, b) for a, b in zip(before, _values(state)))
    return "", False


def test_every_rank_raises_when_one_finds_damage_and_none_loads_anything(tmp_path):
    directory = str(tmp_path / "ckpt")
    workers(2).run(save_at_two, directory)
    path = os.path.join(directory, "t", "rank1.bin")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\x00\x01" * 16)
    (zero, zero_unchanged), (one, one_unchanged) = workers(2).run(load_reports, directory)
    assert "another rank found" in zero and zero_unchanged  # rank 0 reads only its own file at W = 2
    assert "rank1.bin' (rank 1) is damaged" in one and one_unchanged
    [(alone, unchanged)] = workers(1).run(load_reports, directory)  # at W = 1 this rank reads rank 1's file
    assert "rank1.bin' (rank 1) is damaged" in alone and unchanged
