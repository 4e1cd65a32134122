"""Hybrid sharding (zero1/2/3(mesh=...), FSDP2's HSDP, DeepSpeed's MiCS): sharded within each shard
group, replicated across, gradients averaged over the replicas once a step. Equal to flat sharding at
the same W and to plain PyTorch, its gradient norm counted once (not once per replica), and its
checkpoints load flat and under other meshes, and back."""
import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import zfunc as zf
from assertions import assert_close_to
from cases import LR, micro_batches, reference, reference_mixed
from models import DEEP_MLP as MLP, batch, build, local, loss
from workers import workers



def _mesh(layout):
    """None (flat), ``("named", shard)`` (zf.dist.mesh), or ``("positional", replicas, shard)``
    (a DeviceMesh without dim names: dim 0 replicates)."""
    if layout is None:
        return None
    if layout[0] == "named":
        return zf.dist.mesh(shard=layout[1])
    return init_device_mesh("cpu", tuple(layout[1:]))


def _step(model, stage, layout, micro=None, precision=None, offload=None, clip=None):
    def loss_fn(params, b):
        return loss("deep_mlp", zf.apply(model, params, b[0]), b[1])

    opt = zf.optim.adamw(LR, weight_decay=0.01)
    if clip is not None:
        opt = zf.optim.chain(zf.optim.clip_by_global_norm(clip), opt)
    step = zf.train_step(loss_fn, opt)
    if micro is not None:
        step = zf.accumulate(step, micro)
    if precision is not None:
        step = zf.mixed_precision(step, **precision)
    if offload is not None:
        kw = dict(offload)
        step = getattr(zf, "offload_" + kw.pop("kind"))(step, **kw)
    return {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](step, mesh=_mesh(layout))


def run_hybrid(layout, stage, steps=3, micro=None, precision=None, offload=None, clip=None, per_rank=4,
               compiled=False) -> dict:
    """``steps`` steps of ``zeroN(...)`` flat or under the mesh ``layout`` on this rank's part of each
    global batch (``compiled``: each unit's module compiled in place, zf.compile_units); the full
    parameters, the losses and gradient norms."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, shape_model = build("deep_mlp", 0, **MLP), build("deep_mlp", 0, **MLP)
    if compiled:
        torch._dynamo.reset()
        zf.compile_units(model, backend="aot_eager", fullgraph=True)
    step = _step(model, stage, layout, micro, precision, offload, clip)
    state = step.init(model)
    history = []
    for i in range(steps):
        b = local(batch("deep_mlp", shape_model, i, per_rank * world), rank, world)
        state, metrics = step(state, micro_batches(b, micro) if micro else b)
        history.append({"loss": metrics["loss"].item(), "grad_norm": metrics["grad_norm"]})
    eval_loss = None
    if precision is None and offload is None:  # an eval step composed as the train step: the mean over every rank
        evaluate = {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](
            zf.eval_step(lambda p, b: loss("deep_mlp", zf.apply(model, p, b[0]), b[1])), mesh=_mesh(layout))
        b = local(batch("deep_mlp", shape_model, steps, per_rank * world), rank, world)
        eval_loss = evaluate(state, b)["loss"].item()
    with state:
        from torch._dynamo.utils import counters
        return {"params": zf.gather_params(state), "history": history, "composition": step.composition,
                "shard": [t.numel() for t in state.params.leaves], "eval_loss": eval_loss,
                "graphs": counters["stats"]["unique_graphs"]}


def plain_grad_norm(world: int, per_rank: int = 4) -> float:
    """Plain PyTorch's gradient norm on the first global batch."""
    model = build("deep_mlp", 0, **MLP)
    x, y = batch("deep_mlp", model, 0, per_rank * world)
    loss("deep_mlp", model(x), y).backward()
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))


def _check(layout, world, stage, **kw):
    """Hybrid equals flat at the same W (parameters, losses, gradient norms) and plain PyTorch."""
    hybrid = workers(world).run(run_hybrid, layout, stage, 3, kw.get("micro"), kw.get("precision"),
                                kw.get("offload"), kw.get("clip"))
    flat = workers(world).run(run_hybrid, None, stage, 3, kw.get("micro"), kw.get("precision"),
                              kw.get("offload"), kw.get("clip"))
    if kw.get("precision"):
        expected = reference_mixed("deep_mlp", MLP, kw["precision"]["dtype"], steps=3, batch_size=4 * world,
                                   clip=kw.get("clip"))
        tol = dict(rtol=2e-2, atol=2e-2)  # bf16's rounding of the forward and backward
    else:
        expected = reference("deep_mlp", MLP, steps=3, batch_size=4 * world, clip=kw.get("clip"))
        tol = None
    for h, f in zip(hybrid, flat):
        assert "mesh=" in h["composition"]
        if tol is None:
            assert_close_to(h["params"], expected["params"])
        else:
            for k, v in expected["params"].items():
                torch.testing.assert_close(h["params"][k].float(), v, **tol)
        for k in f["params"]:
            torch.testing.assert_close(h["params"][k], f["params"][k], rtol=1e-5, atol=1e-6)
        assert [x["loss"] for x in h["history"]] == pytest.approx([x["loss"] for x in f["history"]], rel=1e-5)
        assert [x["grad_norm"] for x in h["history"]] == pytest.approx([x["grad_norm"] for x in f["history"]],
                                                                       rel=1e-5)
        if f["eval_loss"] is None:  # no eval step under precision or offload (pytest 9's approx refuses None)
            assert h["eval_loss"] is None
        else:
            assert h["eval_loss"] == pytest.approx(f["eval_loss"], rel=1e-5)
    if not kw.get("precision"):
        assert hybrid[0]["history"][0]["grad_norm"] == pytest.approx(plain_grad_norm(world), rel=1e-5)
    return hybrid


@pytest.mark.slow
def test_compiled_units_under_a_mesh_equal_eager():
    """zf.compile_units (torchtitan's recipe, as users compile) under a 2 x 2 mesh with accumulate:
    the same parameters, losses and gradient norms as the eager step under the same mesh."""
    compiled = workers(4).run(run_hybrid, ("named", 2), 3, 3, 2, None, None, None, 4, True)
    eager = workers(4).run(run_hybrid, ("named", 2), 3, 3, 2, None, None, None, 4, False)
    for c, e in zip(compiled, eager):
        assert c["graphs"] > 0  # the units ran compiled, not eager
        for k in e["params"]:
            torch.testing.assert_close(c["params"][k], e["params"][k], rtol=1e-5, atol=1e-6)
        assert [x["loss"] for x in c["history"]] == pytest.approx([x["loss"] for x in e["history"]], rel=1e-5)
        assert [x["grad_norm"] for x in c["history"]] == pytest.approx([x["grad_norm"] for x in e["history"]],
                                                                       rel=1e-5)


@pytest.mark.slow  # W = 4 workers alone cost the fast tier 13 s; the fast tier keeps its siblings
def test_zero3_2x2_equals_pytorch():
    """The fast case: W = 4 as 2 replicas of 2 shards, zero3, two steps, with clipping (a norm
    counted once per replica would clip by sqrt(2) times the norm); the slow tests below add flat
    sharding at the same W, every stage and composition."""
    expected = reference("deep_mlp", MLP, steps=2, batch_size=16, clip=0.05)
    hybrid = workers(4).run(run_hybrid, ("named", 2), 3, 2, None, None, None, 0.05)
    for h in hybrid:
        assert_close_to(h["params"], expected["params"])
        assert [x["loss"] for x in h["history"]] == pytest.approx(expected["losses"], rel=1e-5)
    assert hybrid[0]["history"][0]["grad_norm"] == pytest.approx(plain_grad_norm(4), rel=1e-5)
    assert hybrid[0]["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)  # the mean over every rank
    whole = sum(v.numel() for v in hybrid[0]["params"].values())
    assert hybrid[0]["shard"] == hybrid[2]["shard"] and sum(hybrid[0]["shard"]) <= whole * 0.6  # halves, twice


@pytest.mark.slow
@pytest.mark.parametrize("world,layout", [(4, ("positional", 2, 2)), (6, ("named", 3)), (6, ("named", 2))])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stages_equal_flat_and_pytorch(stage, world, layout):
    """W = 4 (2 x 2, a mesh without dim names: dim 0 replicates) and W = 6 (2 x 3, 3 x 2), each stage."""
    _check(layout, world, stage)


@pytest.mark.slow
@pytest.mark.parametrize("world,layout", [(4, ("named", 2)), (6, ("named", 3)), (6, ("named", 2))])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulate_and_clipping(stage, world, layout):
    """Micro-batches summed in the shard group, the sum averaged over the replicas once, after the
    last micro-batch's shard is added (PyTorch #125484's trap); clipped by the norm counted once."""
    _check(layout, world, stage, micro=2, clip=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_with_accumulate(stage):
    """bf16 compute, fp32 reduction and master weights: equal to flat to fp32's rounding, to plain
    PyTorch's mixed precision within bf16's."""
    _check(("named", 2), 4, stage, micro=2, precision={"dtype": torch.bfloat16})


@pytest.mark.slow
@pytest.mark.parametrize("world,layout", [(4, ("named", 2)), (6, ("named", 3))])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_cpu(stage, world, layout):
    """The update in host memory (where MiCS refuses CPU offload), with accumulation and clipping."""
    _check(layout, world, stage, micro=2, clip=0.05, offload={"kind": "cpu"})


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_cpu_sums_in_host_memory(stage):
    """accumulate_on='host': the shard group's sums live in host memory; the replicas' average of
    the whole sum comes after the last micro-batch's add."""
    _check(("named", 2), 4, stage, micro=2, clip=0.05, offload={"kind": "cpu", "accumulate_on": "host"})


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_nvme(stage, tmp_path):
    """Gradients, their sums and the optimizer state in swap files: the replicas' average happens
    before a sum is written (with its norm) to its file."""
    _check(("named", 2), 4, stage, micro=2, clip=0.05, offload={"kind": "nvme", "path": str(tmp_path),
                                                               "params": stage == 3})


# ------------------------------------------------------------------ checkpoints across layouts

GLOBAL = 12  # the global batch at every W (2, 4 and 6 divide it), so runs at different W see the same data


def save_then_go_on(layout, stage, directory, steps=2) -> dict:
    """``steps`` steps, a checkpoint, one step more; the parameters at the save and after."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, shape_model = build("deep_mlp", 0, **MLP), build("deep_mlp", 0, **MLP)
    step = _step(model, stage, layout)
    state = step.init(model)
    for i in range(steps):
        state, _ = step(state, local(batch("deep_mlp", shape_model, i, GLOBAL), rank, world))
    folder = zf.checkpoint.save(state, directory, "t")
    saved = zf.gather_params(state)
    state, _ = step(state, local(batch("deep_mlp", shape_model, steps, GLOBAL), rank, world))
    return {"saved": saved, "after": zf.gather_params(state), "folder": folder}


def load_then_go_on(layout, stage, directory, steps=2) -> dict:
    """A fresh state loaded from the checkpoint, then the step after the save."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, shape_model = build("deep_mlp", 1, **MLP), build("deep_mlp", 0, **MLP)  # other initial values
    step = _step(model, stage, layout)
    state, manifest = zf.checkpoint.load(step.init(model), directory, "t")
    loaded = zf.gather_params(state)
    state, _ = step(state, local(batch("deep_mlp", shape_model, steps, GLOBAL), rank, world))
    return {"loaded": loaded, "after": zf.gather_params(state), "count": int(state.count)}


def _exactly(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _continues(got: dict, expected: dict, where="") -> None:
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} {k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_saved_under_a_mesh_loads_anywhere(stage, tmp_path):
    """Saved under 2 x 2 (only the first replica's ranks write, one file per shard rank): loaded flat
    at W = 4 and W = 2, under the same mesh and a 3 x 2 one at W = 6, exactly, and each goes on
    as the saved run did."""
    saved = workers(4).run(save_then_go_on, ("named", 2), stage, str(tmp_path))
    folder = saved[0]["folder"]
    import os
    assert sorted(f for f in os.listdir(folder) if f.endswith(".bin")) == ["rank0.bin", "rank1.bin"]
    for world, layout in ((4, ("named", 2)), (4, None), (2, None), (6, ("named", 2))):
        for r in workers(world).run(load_then_go_on, layout, stage, str(tmp_path)):
            _exactly(r["loaded"], saved[0]["saved"])
            assert r["count"] == 3
            _continues(r["after"], saved[0]["after"], f"W = {world}, {layout}")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_flat_checkpoint_loads_under_meshes_and_back(stage, tmp_path):
    """Saved flat at W = 4, loaded under 2 x 2 and under 2 x 3 (W = 6) exactly; saved again under
    2 x 3, loaded flat at W = 2 exactly."""
    flat = workers(4).run(save_then_go_on, None, stage, str(tmp_path / "flat"))
    for world, layout in ((4, ("named", 2)), (6, ("named", 3))):
        for r in workers(world).run(load_then_go_on, layout, stage, str(tmp_path / "flat")):
            _exactly(r["loaded"], flat[0]["saved"])
            _continues(r["after"], flat[0]["after"])
    meshed = workers(6).run(save_then_go_on, ("named", 3), stage, str(tmp_path / "mesh"))
    for r in workers(2).run(load_then_go_on, None, stage, str(tmp_path / "mesh")):
        _exactly(r["loaded"], meshed[0]["saved"])
        _continues(r["after"], meshed[0]["after"])


# ------------------------------------------------------------------ DeepSpeed's MiCS keys


def test_mics_keys_are_read_not_refused():
    """``mics_shard_size`` is hybrid sharding's shard size; ``mics_hierarchical_params_gather`` is
    accepted (it only routes MiCS's gathers); nonsense values are named."""
    from zfunc.engine import config as zc

    base = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    c = zc.parse({**base, "zero_optimization": {"stage": 3, "mics_shard_size": 2,
                                                "mics_hierarchical_params_gather": True}}, 4)
    assert (c.zero.mics_shard_size, c.zero.mics_hierarchical_params_gather, c.ignored) == (2, True, ())
    with pytest.raises(ValueError, match="mics_shard_size is 0"):
        zc.parse({**base, "zero_optimization": {"stage": 3, "mics_shard_size": 0}}, 4)
    with pytest.raises(ValueError, match="needs a ZeRO stage"):
        zc.parse({**base, "zero_optimization": {"stage": 0, "mics_shard_size": 2}}, 4)
    c = zc.parse({**base, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, 4)
    assert (c.zero.zero_hpz_partition_size, c.ignored) == (2, ())
    with pytest.raises(ValueError, match="set zero_optimization.stage to 3"):
        zc.parse({**base, "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}, 4)


def engine_run(stage: int, mics: int, gas: int, hpz: int = 1) -> dict:
    """``zf.initialize`` with ``mics_shard_size`` (-1: off) and ``zero_hpz_partition_size``, two steps of
    ``gas`` micro-batches."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, shape_model = build("deep_mlp", 0, **MLP), build("deep_mlp", 0, **MLP)
    config = {"train_batch_size": 4 * world, "gradient_accumulation_steps": gas, "gradient_clipping": 0.05,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "mics_shard_size": mics, "stage3_param_persistence_threshold": 0,
                                    "zero_hpz_partition_size": hpz}}
    engine = zf.initialize(model, config, loss_fn=lambda run, b: loss("deep_mlp", run(b[0]), b[1]))
    losses = []
    for i in range(2):
        b = local(batch("deep_mlp", shape_model, i, 4 * world), rank, world)
        losses.append(float(engine.train_batch(iter(micro_batches(b, gas)))))
    out = {"params": zf.gather_params(engine.state), "losses": losses, "composition": engine.step_fn.composition}
    engine.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_initialize_maps_mics_shard_size_onto_a_mesh(stage):
    """At W = 4, ``mics_shard_size: 2`` trains as flat sharding does (with accumulation and clipping)."""
    hybrid = workers(4).run(engine_run, stage, 2, 2)
    flat = workers(4).run(engine_run, stage, -1, 2)
    for h, f in zip(hybrid, flat):
        assert "mesh=2x2" in h["composition"] and "mesh=" not in f["composition"]
        assert h["losses"] == pytest.approx(f["losses"], rel=1e-5)
        for k in f["params"]:
            torch.testing.assert_close(h["params"][k], f["params"][k], rtol=1e-5, atol=1e-6)


def refusals() -> list:
    """What ``mesh=`` refuses, each with the error's text (W = 4)."""
    def loss_fn(p, b):
        return p["w"].sum()

    base = zf.train_step(loss_fn, zf.optim.adamw(LR))
    out = []
    for make in (lambda: zf.zero3(base, mesh=init_device_mesh("cpu", (4,))),
                 lambda: zf.zero3(base, mesh=zf.dist.mesh(shard=1)),
                 lambda: zf.zero2(base, mesh=zf.dist.mesh(shard=2), group=zf.dist.new_group([0, 1])),
                 lambda: zf.zero3(base, mesh="2x2"),
                 lambda: zf.jit(zf.zero3(base, mesh=zf.dist.mesh(shard=2))),
                 lambda: zf.dist.mesh(shard=3)):
        try:
            make()
            out.append(None)
        except (TypeError, ValueError) as e:
            out.append(str(e))
    return out


@pytest.mark.slow
def test_bad_meshes_are_named():
    for r in workers(4).run(refusals):
        assert "1 dim(s)" in r[0]
        assert "shard dim has 1 rank" in r[1]
        assert "not both" in r[2]
        assert "DeviceMesh" in r[3]
        assert "zf.jit of a hybrid-sharded step" in r[4]
        assert "divides the world size, 4" in r[5]


# ------------------------------------------------------------------ divergence under a mesh


def diverge_under_a_mesh(skip_rank: int, timeout: float) -> dict:
    """A residual MLP under zero3 over a 2 x 2 mesh whose rank ``skip_rank`` skips a block at step 0."""
    import time

    from cases import _setup

    rank, world, model, shape_model, loss_fn = _setup("skipping", {"depth": 4}, 0)
    step = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(LR)), mesh=zf.dist.mesh(shard=2),
                    collective_timeout=timeout)
    state = step.init(model)
    model.skip = 1 if rank == skip_rank else None
    start = time.monotonic()
    try:
        step(state, local(batch("skipping", shape_model, 0, 2 * world), rank, world))
    except zf.RanksDivergedError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.slow
def test_divergence_in_one_shard_group_is_named_on_every_rank():
    """Rank 3 (the second shard group) runs another block: the ranks of the other shard group, whose
    gathers agree, raise too, each naming every rank's unit where the orders differ."""
    timeout = 3.0
    try:
        results = workers(4).run(diverge_under_a_mesh, 3, timeout)
    finally:
        workers(4).restart()  # a timed-out collective leaves the process group unusable
    for r in results:
        assert r["error"] is not None and "ranks materialized different units" in r["error"], r
        for other in range(4):
            assert f"rank {other}: " in r["error"]
        assert r["seconds"] < 4 * timeout, r


# ------------------------------------------------------------------ what crosses the replicate dim


def replicate_traffic(stage: int, micro: int) -> dict:
    """Two steps of ``zeroN(accumulate(f, micro), mesh=2 x 2)``; the second's ``metrics["comm"]``, the
    units and this rank's gradient shard bytes."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, shape_model = build("deep_mlp", 0, **MLP), build("deep_mlp", 0, **MLP)
    step = _step(model, stage, ("named", 2), micro=micro)
    state = step.init(model)
    for i in range(2):
        b = local(batch("deep_mlp", shape_model, i, 4 * world), rank, world)
        state, metrics = step(state, micro_batches(b, micro))
    return {"comm": metrics["comm"], "units": len(state.params.spec.model.units), "grad_bytes": metrics["grad_bytes"]}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_replicas_average_once_a_step(stage):
    """Under accumulate(3): one all-reduce per unit per step on the replicate dim, of the fp32 sum in
    its home form (a shard under zero3, the whole gradient under zero1), none per micro-batch; no
    gather crosses it."""
    for r in workers(4).run(replicate_traffic, stage, 3):
        assert set(r["comm"]["replicate"]) == {"all_reduce"}, r["comm"]
        assert r["comm"]["replicate"]["all_reduce"] == {"calls": r["units"], "bytes": r["grad_bytes"]}, r
        assert "all_gather" in r["comm"]["shard"] or stage == 1


def mesh_groups() -> dict:
    """The shard and replicate groups' ranks a step reads from meshes laid out three ways (W = 4)."""
    import os

    import torch.distributed as tdist

    def base(p, b):
        return p["w"].sum()

    def groups(mesh):
        step = zf.zero3(zf.train_step(base, zf.optim.adamw(LR)), mesh=mesh)
        return tdist.get_process_group_ranks(step.group), tdist.get_process_group_ranks(step.replicate)

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as torchrun sets it on 2 nodes of 2 ranks
    try:
        from_env = groups(zf.dist.mesh())
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    return {"env": from_env, "reversed": groups(init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))),
            "positional": groups(init_device_mesh("cpu", (2, 2)))}


@pytest.mark.slow
def test_mesh_layouts():
    """zf.dist.mesh() shards over LOCAL_WORLD_SIZE consecutive ranks (a node's); dim names are read in
    either order; a mesh without names replicates over dim 0, as FSDP2's."""
    for rank, r in enumerate(workers(4).run(mesh_groups)):
        node = [rank // 2 * 2, rank // 2 * 2 + 1]
        peers = [rank % 2, rank % 2 + 2]
        assert r["env"] == (node, peers)
        assert r["positional"] == (node, peers)
        assert r["reversed"] == (peers, node)  # dim 0 is the shard dim here


# ------------------------------------------------------------------ hpZ: reshard_after_forward=k


def run_hpz(k, layout, steps: int = 2, micro=None) -> dict:
    """``zero3(..., reshard_after_forward=k)`` (True: not hpZ) flat or under ``layout``; the parameters,
    losses and the last step's metrics['comm']."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, shape_model = build("deep_mlp", 0, **MLP), build("deep_mlp", 0, **MLP)

    def loss_fn(params, b):
        return loss("deep_mlp", zf.apply(model, params, b[0]), b[1])

    step = zf.train_step(loss_fn, zf.optim.adamw(LR, weight_decay=0.01))
    if micro is not None:
        step = zf.accumulate(step, micro)
    step = zf.zero3(step, mesh=_mesh(layout), reshard_after_forward=k)
    state = step.init(model)
    losses = []
    for i in range(steps):
        b = local(batch("deep_mlp", shape_model, i, 4 * world), rank, world)
        state, metrics = step(state, micro_batches(b, micro) if micro else b)
        losses.append(metrics["loss"].item())
    return {"params": zf.gather_params(state), "losses": losses, "comm": metrics["comm"],
            "composition": step.composition, "peak": metrics["peak_materialized_bytes"]}


@pytest.mark.slow
@pytest.mark.parametrize("world,layout,k,micro", [(4, None, 2, None), (4, None, 2, 2), (6, ("named", 6), 3, None),
                                                  (8, ("named", 4), 2, 2)])
def test_hpz_equals_zero3_and_gathers_backward_among_k(world, layout, k, micro):
    """W = 4 with k = 2 (with and without accumulation), W = 6 with k = 3 through a mesh of one
    replica, W = 8 as 2 replicas of 4 shards with k = 2: the same numbers as zero3 (the secondary copy
    holds the same values), backward's all-gathers on the k ranks' group, as many fewer over the
    shard group."""
    hpz = workers(world).run(run_hpz, k, layout, 2, micro)
    plain = workers(world).run(run_hpz, True, layout, 2, micro)
    expected = reference("deep_mlp", MLP, steps=2, batch_size=4 * world)
    shard = "world" if layout is None or layout[1] == world else "shard"  # one replica: the world's
    for h, p in zip(hpz, plain):
        assert f"reshard_after_forward={k}" in h["composition"]
        _exactly(h["params"], p["params"])
        assert_close_to(h["params"], expected["params"])
        assert h["losses"] == p["losses"]
        assert h["comm"]["secondary"]["all_gather"]["calls"] > 0
        assert h["peak"] > p["peak"]  # the secondary parts held from forward to backward count
        assert h["comm"][shard]["all_gather"]["calls"] < p["comm"][shard]["all_gather"]["calls"]
        assert (h["comm"][shard]["all_gather"]["calls"] + h["comm"]["secondary"]["all_gather"]["calls"]
                == p["comm"][shard]["all_gather"]["calls"])


@pytest.mark.slow
def test_initialize_maps_zero_hpz_partition_size():
    """At W = 4, ``zero_hpz_partition_size: 2`` is zero3(reshard_after_forward=2): the same numbers."""
    hpz = workers(4).run(engine_run, 3, -1, 2, 2)
    plain = workers(4).run(engine_run, 3, -1, 2, 1)
    for h, p in zip(hpz, plain):
        assert "reshard_after_forward=2" in h["composition"]
        assert h["losses"] == p["losses"]
        _exactly(h["params"], p["params"])
