"""zf.optim.multi's members hold their state for their own parameters only (zfunc.optim.held): the
same numbers as each member holding it over every parameter, through offload_nvme's pieces (an
elementwise member's units streamed in pieces smaller than a shard), checkpoints across world sizes
and compositions (zero3(offload_nvme) at W = 2 -> zero2(offload_cpu) at W = 3) and flat -> mesh."""
from __future__ import annotations

import os
import tempfile

import torch

import zfunc as zf
from assertions import assert_close_to
from checkpoints import assert_same_entries
from models import batch, build, local, loss
from optim_reference import ADAMW, recipe_label, torch_recipe, train_torch, zfunc_recipe
from workers import workers

STEPS = 3
BEFORE, AFTER = 2, 2
GLOBAL = 12  # divides over W = 2, 3, 4
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}


def _sgd_adamw():
    return zf.optim.multi({"muon": zf.optim.sgd(**SGD), "adamw": zf.optim.adamw(**ADAMW)}, recipe_label)  # "muon": the matrices


def _torch_sgd_adamw(model) -> list:
    named = list(model.named_parameters())
    return [torch.optim.SGD([p for n, p in named if recipe_label(n) == "muon"], **SGD),
            torch.optim.AdamW([p for n, p in named if recipe_label(n) != "muon"], **ADAMW)]


def _step(opt, stage: int, offload: str | None = None, swap_dir: str | None = None, mesh: int | None = None, **nvme):
    model = build("gpt").double()

    def loss_fn(params, b):
        return loss("gpt", zf.apply(model, params, b[0]), b[1])

    step = zf.train_step(loss_fn, opt)
    if offload == "nvme":
        step = zf.offload_nvme(step, swap_dir, **nvme)
    elif offload == "cpu":
        step = zf.offload_cpu(step)
    zero = {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage]
    return model, zero(step, **({} if mesh is None else {"mesh": zf.dist.mesh(shard=mesh)}))


def _chained_sgd_adamw():
    """``_sgd_adamw`` with each member a ``chain`` behind a clip that never clips."""
    clip = zf.optim.clip_by_global_norm(1e9)
    return zf.optim.multi({"muon": zf.optim.chain(clip, zf.optim.sgd(**SGD)),
                           "adamw": zf.optim.chain(clip, zf.optim.adamw(**ADAMW))}, recipe_label)


def train_sgd_adamw(offload: str | None, chained: bool = False) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    swap = os.path.join(tempfile.gettempdir(), f"zfunc-held-nvme-{os.getpid()}")
    # pieces of 64 elements: the held elements of each piece, unit by unit
    opt = _chained_sgd_adamw() if chained else _sgd_adamw()
    model, step = _step(opt, 3, offload, swap, sub_group_size=64, buffer_size=64)
    twin = build("gpt").double()
    state = step.init(model)
    sizes = [t.numel() for t in zf.pytree.tree_leaves(state.opt_state) if t.is_floating_point()]
    for i in range(STEPS):
        state, _ = step(state, local(batch("gpt", twin, i, 2 * world), rank, world))
    out = {"params": zf.gather_params(state), "state_elements": sum(sizes)}
    if hasattr(state, "close"):
        state.close()
    return out


def test_an_elementwise_members_state_streams_in_pieces_under_offload_nvme():
    """SGD's momentum on the matrices and AdamW's moments on the rest, each held for its own
    parameters only, streamed 64 elements at a time: equal bit for bit to zero3 without offload, and
    to torch's SGD and AdamW side by side."""
    plain = workers(2).run(train_sgd_adamw, None)
    swapped = workers(2).run(train_sgd_adamw, "nvme")
    expected = train_torch("gpt", _torch_sgd_adamw, STEPS, 4, dtype=torch.float64)
    params = sum(p.numel() for p in build("gpt").parameters())
    matrices = sum(p.numel() for n, p in build("gpt").named_parameters() if recipe_label(n) == "muon")
    for a, b in zip(plain, swapped):
        assert a["params"].keys() == b["params"].keys()
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
        assert_close_to(a["params"], expected)
    # each rank about its share of SGD's 1 and AdamW's 2 elements per own parameter (the layout's padding aside)
    assert sum(r["state_elements"] for r in plain) == matrices + 2 * (params - matrices)


def test_a_chain_member_holds_its_optimizers_state_for_its_own_parameters_only():
    """Each member a ``chain`` (a clip before the optimizer): the optimizer in it restricted to the
    member's parameters as the bare one is, the same elements of state and the same numbers."""
    bare = workers(2).run(train_sgd_adamw, None)
    chained = workers(2).run(train_sgd_adamw, None, True)
    for a, b in zip(bare, chained):
        assert a["state_elements"] == b["state_elements"]
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k


def save_after(stage: int, offload, directory: str, mesh=None) -> None:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, step = _step(zfunc_recipe(torch.float64), stage, offload, os.path.join(directory, f"swap-save-{rank}"),
                        mesh=mesh)
    twin = build("gpt").double()
    state = step.init(model)
    for i in range(BEFORE):
        state, _ = step(state, local(batch("gpt", twin, i, GLOBAL), rank, world))
    zf.checkpoint.save(state, os.path.join(directory, "saved"), "a")
    if hasattr(state, "close"):
        state.close()


def load_and_go_on(stage: int, offload, directory: str, mesh=None) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, step = _step(zfunc_recipe(torch.float64), stage, offload, os.path.join(directory, f"swap-load-{rank}"),
                        mesh=mesh)
    twin = build("gpt").double()
    state, _ = zf.checkpoint.load(step.init(model), os.path.join(directory, "saved"), "a")
    zf.checkpoint.save(state, os.path.join(directory, f"again-w{world}"), "a")
    for i in range(BEFORE, BEFORE + AFTER):
        state, _ = step(state, local(batch("gpt", twin, i, GLOBAL), rank, world))
    out = zf.gather_params(state)
    if hasattr(state, "close"):
        state.close()
    return out


def test_held_state_checkpoint_moves_from_nvme_at_w2_to_cpu_offload_at_w3(tmp_path):
    """The recipe saved from zero3(offload_nvme(f)) at W = 2 loads into zero2(offload_cpu(f)) at W = 3
    holding the same numbers, parameter by parameter (the moments and the momentum written laid out
    like the parameters, compacted on load), and training goes on equal to torch without a break."""
    directory = str(tmp_path)
    workers(2).run(save_after, 3, "nvme", directory)
    expected = train_torch("gpt", torch_recipe, BEFORE + AFTER, GLOBAL, dtype=torch.float64)
    for got in workers(3).run(load_and_go_on, 2, "cpu", directory):
        assert_close_to(got, expected)
    assert_same_entries(os.path.join(directory, "saved"), os.path.join(directory, "again-w3"))


def test_held_state_checkpoint_moves_from_flat_w2_to_a_2x2_mesh(tmp_path):
    """Saved flat at W = 2 (zero3), loaded into zero1 over a 2 x 2 mesh (two replicas of a 2-way shard
    group): the same numbers, and training goes on equal to torch."""
    directory = str(tmp_path)
    workers(2).run(save_after, 3, None, directory)
    expected = train_torch("gpt", torch_recipe, BEFORE + AFTER, GLOBAL, dtype=torch.float64)
    for got in workers(4).run(load_and_go_on, 1, None, directory, 2):
        assert_close_to(got, expected)
    assert_same_entries(os.path.join(directory, "saved"), os.path.join(directory, "again-w4"))
