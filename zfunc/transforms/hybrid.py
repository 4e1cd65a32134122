"""Hybrid sharding's mesh: a 2-D ``DeviceMesh`` read into the shard group and the replicate group.

FSDP2 takes HSDP as ``fully_shard(module, mesh=mesh)`` with a 2-D mesh whose dim 0 replicates and
dim 1 shards; zfunc reads the same mesh, by its dim names where they are ``"replicate"`` and
``"shard"`` (either order), else by position. ``zf.dist.mesh()`` builds the usual one (a node's
ranks shard, the nodes replicate). The step's agreement spans every rank of the mesh, so the mesh
must span the world.
"""
from __future__ import annotations

from .. import dist

NAMES = ("replicate", "shard")


def read_mesh(mesh, where: str):
    """``(shard group, replicate group)`` of ``mesh``; the replicate group is None where the mesh has
    one replica (flat sharding over the shard group). A clear error for anything else."""
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
    shard = mesh.get_group(shard_dim)
    replicate = mesh.get_group(rep_dim) if replicas > 1 else None
    dist.label_group(shard, "shard")  # how metrics["comm"] names them
    if replicate is not None:
        dist.label_group(replicate, "replicate")
    return shard, replicate
