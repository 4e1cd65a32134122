"""Pytree helpers: optree under the ``zfunc`` namespace, mirrored into torch's pytree.

Every tree operation in zfunc goes through here so that our own nodes (sharded
parameter sets, the training state) are seen by optree *and* by torch.func.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import optree
import torch
import torch.utils._pytree as torch_pytree

NAMESPACE = "zfunc"


def register_node(cls: type, flatten: Callable, unflatten: Callable) -> type:
    """Register ``cls`` with optree (our namespace) and torch's pytree.

    ``flatten(node) -> (children, aux)``; ``unflatten(aux, children) -> node``.
    """
    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)
    torch_pytree.register_pytree_node(
        cls,
        lambda node: (list(flatten(node)[0]), flatten(node)[1]),
        lambda children, aux: unflatten(aux, children),
    )
    return cls


tree_map = functools.partial(optree.tree_map, namespace=NAMESPACE)
tree_leaves = functools.partial(optree.tree_leaves, namespace=NAMESPACE)
tree_structure = functools.partial(optree.tree_structure, namespace=NAMESPACE)
tree_flatten = functools.partial(optree.tree_flatten, namespace=NAMESPACE)
tree_unflatten = optree.tree_unflatten


def format_path(accessor: Iterable[optree.PyTreeEntry], root: str = "tree") -> str:
    """``tree['a'][0].field``-style path of a leaf from its optree accessor."""
    parts = []
    for entry in accessor:
        if isinstance(entry, optree.FlattenedEntry):
            parts.append(f"[{entry.entry}]")
        else:
            parts.append(entry.codify(""))
    return root + "".join(parts)


def _has_own_norm(node: Any) -> bool:
    return hasattr(node, "sum_of_squares")


def global_norm(tree: Any) -> torch.Tensor:
    """L2 norm over every tensor leaf of ``tree``, as an fp32 scalar.

    Nodes that know they are sharded across ranks (they define
    ``sum_of_squares()``) contribute their whole-model sum, so the norm covers
    the whole model even when each rank holds only a slice.
    """
    total = torch.zeros((), dtype=torch.float32)
    for node in optree.tree_leaves(tree, is_leaf=_has_own_norm, namespace=NAMESPACE):
        if _has_own_norm(node):
            part = node.sum_of_squares()
        elif isinstance(node, torch.Tensor) and node.is_floating_point():
            part = node.detach().float().pow(2).sum()
        else:
            continue
        total = total.to(part.device) + part
    return total.sqrt()
