"""Hybrid sharding's mesh: a 2-D ``DeviceMesh`` read into the shard group and the replicate group.

FSDP2 takes HSDP as ``fully_shard(module, mesh=mesh)`` with a 2-D mesh whose dim 0 replicates and
dim 1 shards; zfunc reads the same mesh, by its dim names where they are ``"replicate"`` and
``"shard"`` (either order), else by position. ``zf.dist.mesh()`` builds the usual one (a node's
ranks shard, the nodes replicate). The step's agreement spans every rank of the mesh, so the mesh
must span the world. Also here: hpZ's secondary groups (``zero3(reshard_after_forward=k)``), k
consecutive ranks within each shard group, which every rank makes from the mesh's shard groups.
"""
from __future__ import annotations

from .. import dist

NAMES = ("replicate", "shard")


def read_mesh(mesh, where: str):
    """``(shard group, replicate group, every shard group's global ranks)`` of ``mesh``; the replicate
    group is None where the mesh has one replica (flat sharding over the shard group). A clear error
    for anything else."""
    ndim = getattr(mesh, "ndim", None)
    if ndim is None or not hasattr(mesh, "get_group"):
        raise TypeError(f"{where}: mesh= takes a torch DeviceMesh (zf.dist.mesh(), or torch.distributed."
                        f"device_mesh.init_device_mesh(device, (replicas, shard_size), mesh_dim_names={NAMES})), "
                        f"got {type(mesh).__name__}")
    if ndim != 2:
        raise ValueError(f"{where}: mesh= takes a 2-D DeviceMesh with dims {NAMES} (hybrid sharding), got one "
                         f"with {ndim} dim(s); for flat sharding over one group give group= instead")
    names = tuple(mesh.mesh_dim_names or ())
    if set(names) == set(NAMES):
        rep_dim, shard_dim = names.index("replicate"), names.index("shard")
    else:
        rep_dim, shard_dim = 0, 1  # FSDP2's positional convention
    replicas, shard_size = mesh.size(rep_dim), mesh.size(shard_dim)
    world = dist.world_size()
    if replicas * shard_size != world:
        raise ValueError(f"{where}: the mesh spans {replicas} x {shard_size} = {replicas * shard_size} ranks but the "
                         f"world has {world}: hybrid sharding agrees each step over every rank, so its mesh must "
                         "span the world")
    if shard_size == 1:
        raise ValueError(f"{where}: the mesh's shard dim has 1 rank, so nothing is sharded: that is data "
                         f"parallelism over {replicas} replicas, zf.train_step without a ZeRO stage (or give the "
                         "mesh a shard dim of 2 or more)")
    ranks = mesh.mesh if shard_dim == 1 else mesh.mesh.transpose(0, 1)
    rows = [row.tolist() for row in ranks]
    if replicas == 1:  # one shard group: the world's, flat sharding
        return None, None, rows
    shard, replicate = mesh.get_group(shard_dim), mesh.get_group(rep_dim)
    dist.label_group(shard, "shard")  # how metrics["comm"] names them
    dist.label_group(replicate, "replicate")
    return shard, replicate, rows


def secondary_group(reshard_after_forward, shard, rows):
    """hpZ's group for ``zero3(reshard_after_forward=k)``: this rank's k consecutive ranks within its
    shard group (``rows``: every shard group's ranks, None: the world's one), made on every rank;
    None for True. Every rank makes every such group, in the same order, as new_group asks."""
    if reshard_after_forward is True:
        return None
    if reshard_after_forward is False or not isinstance(reshard_after_forward, int):
        raise ValueError(f"zero3: reshard_after_forward takes True or an int k (the ranks a unit stays sharded over "
                         f"between forward and backward), got {reshard_after_forward!r}; keeping whole units "
                         "(False) is not supported yet")
    k, size = reshard_after_forward, dist.world_size(shard)
    if rows is None:
        if shard is not None:
            raise ValueError("zero3: reshard_after_forward=k with group= is not supported yet: its groups are made "
                             "on every rank, which needs every shard group's ranks; give mesh= instead")
        rows = [list(range(size))]
    if k < 2 or size % k:
        raise ValueError(f"zero3: reshard_after_forward={k} must be 2 or more and divide the shard group's "
                         f"{size} ranks")
    if k == size:
        return None  # sharded as the shard group already is
    mine, me = None, dist.rank()
    for row in rows:
        for at in range(0, len(row), k):
            group = dist.new_group(row[at : at + k])
            if me in row[at : at + k]:
                mine = group
    dist.label_group(mine, "secondary")
    return mine
