"""Assertions on pytrees of tensors, with chex's names and no JAX.

Every assertion raises ``AssertionError`` naming the path of each offending leaf
(``tree['layers'][0].weight``), and, for values, the number of mismatching
elements and the largest absolute and relative differences. Trees are flattened
under zfunc's optree namespace, so zfunc's own nodes (sharded parameter sets,
training states) are seen through. Tensors on any device are compared on CPU.

``zfunc.testing.memory`` reads a process's memory as the tests and the benchmarks
measure it: resident now, the peak since a reset, the CUDA allocator's peak.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import optree
import torch

from ..pytree import NAMESPACE, format_path

__all__ = [
    "assert_shape",
    "assert_tree_all_finite",
    "assert_tree_shape_prefix",
    "assert_trees_all_close",
    "assert_trees_all_equal",
    "assert_trees_all_equal_shapes",
    "assert_trees_all_equal_structs",
    "format_path",
]

_MAX_REPORTED = 10  # leaves listed in one error message


def _flatten(tree: Any) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, namespace=NAMESPACE)
    return [format_path(a) for a in accessors], leaves, spec


def _raise(header: str, problems: list[str]) -> None:
    shown = problems[:_MAX_REPORTED]
    more = len(problems) - len(shown)
    lines = [header, *(f"  {p}" for p in shown)]
    if more:
        lines.append(f"  ... and {more} more")
    raise AssertionError("\n".join(lines))


def _flatten_all(trees: Sequence[Any], fn: str) -> tuple[list[str], list[list[Any]]]:
    """Flatten trees that must share one structure; return paths and leaves per tree."""
    if len(trees) < 2:
        raise ValueError(f"{fn} needs at least two trees, got {len(trees)}")
    paths, leaves0, spec0 = _flatten(trees[0])
    all_leaves = [leaves0]
    for i, tree in enumerate(trees[1:], start=1):
        paths_i, leaves_i, spec_i = _flatten(tree)
        if spec_i != spec0:
            set0, set_i = set(paths), set(paths_i)
            only0 = [p for p in paths if p not in set_i]
            only_i = [p for p in paths_i if p not in set0]
            detail = []
            if only0:
                detail.append(f"leaves only in tree 0: {', '.join(only0[:_MAX_REPORTED])}")
            if only_i:
                detail.append(f"leaves only in tree {i}: {', '.join(only_i[:_MAX_REPORTED])}")
            if not detail:
                detail.append("same leaf paths, different node types or None placement")
            raise AssertionError(
                f"{fn}: trees 0 and {i} have different structures ({'; '.join(detail)})\n"
                f"  tree 0: {spec0}\n  tree {i}: {spec_i}"
            )
        all_leaves.append(leaves_i)
    return paths, all_leaves


def _is_numeric(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, numbers.Number)) or hasattr(x, "__array__")


def _to_cpu_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return torch.as_tensor(x)


def _shape(x: Any) -> tuple[int, ...] | None:
    if isinstance(x, numbers.Number):
        return ()
    shape = getattr(x, "shape", None)
    return None if shape is None else tuple(shape)


def _compare_leaf(ref: Any, x: Any, *, rtol: float, atol: float, exact: bool) -> str | None:
    """None if ``x`` matches ``ref``, else a description of the difference."""
    if not (_is_numeric(ref) and _is_numeric(x)):
        return None if ref == x else f"values differ: {ref!r} vs {x!r}"
    a, b = _to_cpu_tensor(ref), _to_cpu_tensor(x)
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    dtype = torch.promote_types(a.dtype, b.dtype)
    if dtype.is_floating_point or dtype.is_complex:
        dtype = torch.promote_types(dtype, torch.float64)
    a, b = a.to(dtype), b.to(dtype)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    both_nan = nan_a & nan_b
    if exact:
        ok = (a == b) | both_nan
    else:
        ok = torch.isclose(b, a, rtol=rtol, atol=atol, equal_nan=True)
    n_bad = int((~ok).sum())
    if n_bad == 0:
        return None
    msg = f"{n_bad} of {a.numel()} elements differ"
    if not exact:
        msg += f" (rtol={rtol:g}, atol={atol:g})"
    one_nan = int((nan_a ^ nan_b).sum())
    if one_nan:
        msg += f"; {one_nan} NaN in only one tree"
    if dtype.is_floating_point or dtype.is_complex:
        comparable = ~(nan_a | nan_b)
        diff = torch.where(comparable, (a - b).abs(), torch.zeros((), dtype=a.abs().dtype))
        denom = a.abs()
        rel = torch.where(denom > 0, diff / denom, torch.where(diff > 0, math.inf, 0.0))
    else:
        diff = (a.double() - b.double()).abs()
        denom = a.double().abs()
        rel = torch.where(denom > 0, diff / denom, torch.where(diff > 0, math.inf, 0.0))
    if diff.numel():
        flat = int(diff.reshape(-1).argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
        msg += (
            f"; max abs diff {float(diff.max()):.6g} at index {index} "
            f"({a.reshape(-1)[flat].item():.9g} vs {b.reshape(-1)[flat].item():.9g})"
            f"; max rel diff {float(rel.max()):.6g}"
        )
    return msg


def _assert_leaves(fn: str, trees: Sequence[Any], **kw) -> None:
    paths, all_leaves = _flatten_all(trees, fn)
    problems = []
    for i, leaves in enumerate(all_leaves[1:], start=1):
        for path, ref, x in zip(paths, all_leaves[0], leaves):
            bad = _compare_leaf(ref, x, **kw)
            if bad is not None:
                problems.append(f"{path}: {bad}" if len(trees) == 2 else f"tree {i} {path}: {bad}")
    if problems:
        _raise(f"{fn}: {len(problems)} leaves differ from tree 0:", problems)


def assert_trees_all_close(*trees: Any, rtol: float = 1e-6, atol: float = 0.0) -> None:
    """Same structure, same leaf shapes, and every element of each tree within
    ``atol + rtol * |ref|`` of the first tree's (``ref``). NaNs match NaNs.
    Non-numeric leaves must compare equal."""
    _assert_leaves("assert_trees_all_close", trees, rtol=rtol, atol=atol, exact=False)


def assert_trees_all_equal(*trees: Any, strict: bool = False) -> None:
    """Same structure, same leaf shapes, equal values (NaNs match NaNs).
    With ``strict=True`` tensor leaves must also agree in dtype and device."""
    _assert_leaves("assert_trees_all_equal", trees, rtol=0.0, atol=0.0, exact=True)
    if strict:
        paths, all_leaves = _flatten_all(trees, "assert_trees_all_equal")
        problems = []
        for i, leaves in enumerate(all_leaves[1:], start=1):
            for path, ref, x in zip(paths, all_leaves[0], leaves):
                for attr in ("dtype", "device"):
                    va, vb = getattr(ref, attr, None), getattr(x, attr, None)
                    if va != vb:
                        problems.append(f"tree {i} {path}: {attr} {va} vs {vb}")
        if problems:
            _raise("assert_trees_all_equal(strict=True): dtypes or devices differ:", problems)


def assert_trees_all_equal_structs(*trees: Any) -> None:
    """Same tree structure (node types, keys, None placement); leaves not compared."""
    _flatten_all(trees, "assert_trees_all_equal_structs")


def assert_trees_all_equal_shapes(*trees: Any) -> None:
    """Same structure and every leaf of the same shape."""
    paths, all_leaves = _flatten_all(trees, "assert_trees_all_equal_shapes")
    problems = []
    for i, leaves in enumerate(all_leaves[1:], start=1):
        for path, ref, x in zip(paths, all_leaves[0], leaves):
            if _shape(ref) != _shape(x):
                problems.append(f"tree {i} {path}: shape {_shape(x)}, tree 0 has {_shape(ref)}")
    if problems:
        _raise("assert_trees_all_equal_shapes: shapes differ:", problems)


def assert_tree_all_finite(tree: Any) -> None:
    """Every floating (or complex) element of every leaf is finite."""
    paths, leaves, _ = _flatten(tree)
    problems = []
    for path, x in zip(paths, leaves):
        if isinstance(x, numbers.Number) and not isinstance(x, bool):
            if not math.isfinite(abs(x)):
                problems.append(f"{path}: {x!r}")
            continue
        if not _is_numeric(x):
            continue
        t = _to_cpu_tensor(x)
        if not (t.is_floating_point() or t.is_complex()):
            continue
        finite = torch.isfinite(t)
        if bool(finite.all()):
            continue
        nan = int(torch.isnan(t).sum())
        inf = int((~finite).sum()) - nan
        problems.append(
            f"{path}: {nan} NaN and {inf} Inf of {t.numel()} elements (shape {tuple(t.shape)})"
        )
    if problems:
        _raise(f"assert_tree_all_finite: {len(problems)} leaves are not finite:", problems)


def assert_tree_shape_prefix(tree: Any, shape_prefix: Sequence[int]) -> None:
    """Every leaf's shape starts with ``shape_prefix``."""
    prefix = tuple(shape_prefix)
    paths, leaves, _ = _flatten(tree)
    problems = [
        f"{path}: shape {_shape(x)}"
        for path, x in zip(paths, leaves)
        if _shape(x) is None or _shape(x)[: len(prefix)] != prefix
    ]
    if problems:
        _raise(f"assert_tree_shape_prefix: leaves without shape prefix {prefix}:", problems)


# ------------------------------------------------------------------------ shapes

_DimSpec = Any  # int, None (any size), a set of ints, or ... (any number of dims)


def _is_shape_spec(x: Any) -> bool:
    return isinstance(x, (tuple, list, torch.Size)) and all(
        d is None or d is Ellipsis or isinstance(d, (int, set, frozenset)) for d in x
    )


def _shape_matches(shape: tuple[int, ...], spec: Sequence[_DimSpec]) -> bool:
    spec = list(spec)
    if spec.count(Ellipsis) > 1:
        raise ValueError(f"assert_shape: at most one ... in a shape, got {tuple(spec)}")
    if Ellipsis in spec:
        k = spec.index(Ellipsis)
        head, tail = spec[:k], spec[k + 1 :]
        if len(shape) < len(head) + len(tail):
            return False
        pairs = list(zip(shape[: len(head)], head))
        pairs += list(zip(shape[len(shape) - len(tail) :], tail))
    else:
        if len(shape) != len(spec):
            return False
        pairs = list(zip(shape, spec))
    for dim, want in pairs:
        if want is None:
            continue
        if isinstance(want, (set, frozenset)):
            if dim not in want:
                return False
        elif dim != want:
            return False
    return True


def assert_shape(inputs: Any, expected_shapes: Any) -> None:
    """``inputs`` (a tensor or a sequence of tensors) have ``expected_shapes``.

    ``expected_shapes`` is one shape (every input must have it) or a sequence of
    shapes, one per input. A dimension is an int, ``None`` (any size) or a set of
    allowed sizes; one ``...`` in a shape matches any number of dimensions.
    """
    single = _shape(inputs) is not None
    xs = [inputs] if single else list(inputs)
    if _is_shape_spec(expected_shapes):
        specs = [tuple(expected_shapes)] * len(xs)
    elif isinstance(expected_shapes, (list, tuple)) and all(map(_is_shape_spec, expected_shapes)):
        specs = [tuple(s) for s in expected_shapes]
        if len(specs) != len(xs):
            raise AssertionError(
                f"assert_shape: {len(xs)} inputs but {len(specs)} expected shapes"
            )
    else:
        raise ValueError(
            f"assert_shape: expected_shapes must be a shape (tuple of ints, None, sets, ...) "
            f"or a sequence of shapes, got {expected_shapes!r}"
        )
    problems = []
    for i, (x, spec) in enumerate(zip(xs, specs)):
        shape = _shape(x)
        if shape is None:
            problems.append(f"input {i} is a {type(x).__name__}, which has no shape")
        elif not _shape_matches(shape, spec):
            name = "input" if single else f"input {i}"
            problems.append(f"{name} has shape {shape}, expected {_fmt_spec(spec)}")
    if problems:
        _raise("assert_shape: shapes do not match:", problems)


def _fmt_spec(spec: Sequence[_DimSpec]) -> str:
    parts = ["..." if d is Ellipsis else repr(d) for d in spec]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
