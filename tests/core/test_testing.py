"""zfunc.testing: each assertion passes on matching trees and explains a mismatch."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from zfunc.pytree import register_node
from zfunc.testing import assert_shape, assert_tree_all_finite, assert_tree_shape_prefix, assert_trees_all_close, assert_trees_all_equal, assert_trees_all_equal_shapes, assert_trees_all_equal_structs


class Pair(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor


class Flat:
    """A custom node, like zfunc's sharded parameter sets."""

    def __init__(self, x, y):
        self.x, self.y = x, y


register_node(Flat, lambda n: ((n.x, n.y), None), lambda aux, children: Flat(*children))


def make_tree(scale=1.0):
    return {
        "layers": [Pair(torch.arange(6.0).reshape(2, 3) * scale, torch.ones(3) * scale)],
        "unit": Flat(torch.tensor([1.0, 2.0]) * scale, torch.zeros(1)),
        "step": 3,
        "name": "gpt",
        "frozen": None,
    }


def test_equal_trees_pass_every_assertion():
    a, b, c = make_tree(), make_tree(), make_tree()
    assert_trees_all_close(a, b, c)
    assert_trees_all_equal(a, b, c, strict=True)
    assert_trees_all_equal_structs(a, b)
    assert_trees_all_equal_shapes(a, b)
    assert_tree_all_finite(a)


def test_close_respects_tolerances_and_names_the_leaf():
    a, b = make_tree(), make_tree(1.0 + 1e-7)
    assert_trees_all_close(a, b)
    assert_trees_all_close(a, make_tree(1.001), rtol=1e-2)
    with pytest.raises(AssertionError) as err:
        assert_trees_all_close(a, make_tree(1.001))
    msg = str(err.value)
    assert "tree['layers'][0].weight: 5 of 6 elements differ (rtol=1e-06, atol=0)" in msg
    assert "max abs diff 0.00500011 at index (1, 2) (5 vs 5.00500011)" in msg
    assert "max rel diff 0.001" in msg
    assert "tree['layers'][0].bias" in msg and "tree['unit'][0]" in msg
    assert "tree['unit'][1]" not in msg  # zeros scale to zeros


def test_atol_covers_zeros():
    assert_trees_all_close(torch.zeros(3), torch.full((3,), 1e-9), atol=1e-8)
    with pytest.raises(AssertionError, match=r"max rel diff inf"):
        assert_trees_all_close(torch.zeros(3), torch.full((3,), 1e-9))


def test_nan_matches_nan_only():
    x = torch.tensor([1.0, float("nan")])
    assert_trees_all_close(x, x.clone())
    assert_trees_all_equal(x, x.clone())
    with pytest.raises(AssertionError, match="1 NaN in only one tree"):
        assert_trees_all_close(x, torch.tensor([1.0, 2.0]))


def test_equal_is_exact_and_strict_checks_dtype():
    a = {"w": torch.tensor([1.0, 2.0])}
    with pytest.raises(AssertionError, match=r"tree\['w'\]: 1 of 2 elements differ; max abs diff"):
        assert_trees_all_equal(a, {"w": torch.tensor([1.0, 2.0 + 1e-6])})
    assert_trees_all_equal(a, {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)})
    with pytest.raises(AssertionError, match=r"tree\['w'\]: dtype torch.float32 vs torch.float64"):
        assert_trees_all_equal(a, {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}, strict=True)
    with pytest.raises(AssertionError, match=r"tree 2 tree\['w'\]"):
        assert_trees_all_equal(a, a, {"w": torch.tensor([0.0, 2.0])})


def test_non_tensor_leaves_compare_by_value():
    a = make_tree()
    b = make_tree()
    b["name"] = "llama"
    with pytest.raises(AssertionError, match=r"tree\['name'\]: values differ: 'gpt' vs 'llama'"):
        assert_trees_all_close(a, b)
    b = make_tree()
    b["step"] = 4
    with pytest.raises(AssertionError, match=r"tree\['step'\]: 1 of 1 elements differ"):
        assert_trees_all_equal(a, b)


def test_shape_mismatch_is_reported_not_broadcast():
    with pytest.raises(AssertionError, match=r"tree\[0\]: shapes differ: \(3,\) vs \(1, 3\)"):
        assert_trees_all_close([torch.ones(3)], [torch.ones(1, 3)])
    with pytest.raises(AssertionError, match=r"tree\['b'\]: shape \(2,\), tree 0 has \(3,\)"):
        assert_trees_all_equal_shapes({"b": torch.ones(3)}, {"b": torch.zeros(2)})
    assert_trees_all_equal_shapes({"b": torch.ones(3)}, {"b": torch.zeros(3)})


@pytest.mark.parametrize(
    "other, expect",
    [
        ({"a": torch.ones(2)}, r"leaves only in tree 0: tree\['b'\]\[0\]"),
        ({"a": torch.ones(2), "b": [torch.ones(1), torch.ones(1)]}, r"leaves only in tree 1: tree\['b'\]\[1\]"),
        ({"a": torch.ones(2), "b": (torch.ones(1),)}, "different node types"),
    ],
)
def test_structure_mismatch_shows_both_structures(other, expect):
    a = {"a": torch.ones(2), "b": [torch.ones(1)]}
    for check in (assert_trees_all_close, assert_trees_all_equal, assert_trees_all_equal_structs,
                  assert_trees_all_equal_shapes):
        with pytest.raises(AssertionError, match=expect) as err:
            check(a, other)
        assert "tree 0: PyTreeSpec({'a': *, 'b': [*]})" in str(err.value)
        assert "tree 1: PyTreeSpec(" in str(err.value)


def test_needs_two_trees():
    with pytest.raises(ValueError, match="at least two trees"):
        assert_trees_all_close(torch.ones(1))


def test_all_finite_names_nan_and_inf_leaves():
    assert_tree_all_finite({"a": torch.ones(2), "i": torch.arange(3), "s": "x", "n": None, "f": 1.5})
    tree = make_tree()
    tree["layers"][0].bias[1] = float("inf")
    tree["unit"].x[0] = float("nan")
    tree["lr"] = float("nan")
    with pytest.raises(AssertionError) as err:
        assert_tree_all_finite(tree)
    msg = str(err.value)
    assert "3 leaves are not finite" in msg
    assert "tree['layers'][0].bias: 0 NaN and 1 Inf of 3 elements (shape (3,))" in msg
    assert "tree['unit'][0]: 1 NaN and 0 Inf of 2 elements" in msg
    assert "tree['lr']: nan" in msg


def test_long_reports_are_capped():
    a = [torch.zeros(1) for _ in range(25)]
    b = [torch.ones(1) for _ in range(25)]
    with pytest.raises(AssertionError, match=r"25 leaves differ[\s\S]*\.\.\. and 15 more"):
        assert_trees_all_close(a, b)


def test_assert_shape():
    x, y = torch.zeros(2, 3), torch.zeros(4)
    assert_shape(x, (2, 3))
    assert_shape(x, [2, 3])
    assert_shape(x, torch.Size([2, 3]))
    assert_shape([x, y], [(2, 3), (4,)])
    assert_shape([x, torch.zeros(2, 3)], (2, None))
    assert_shape(x, (..., 3))
    assert_shape(x, (2, 3, ...))
    assert_shape(x, (2, ..., 3))
    assert_shape(y, (...,))
    assert_shape(torch.zeros(()), ())
    assert_shape(1.5, ())
    assert_shape(x, ({1, 2}, 3))
    with pytest.raises(AssertionError, match=r"input has shape \(2, 3\), expected \(2, 4\)"):
        assert_shape(x, (2, 4))
    with pytest.raises(AssertionError, match=r"input 1 has shape \(4,\), expected \(None, 3\)"):
        assert_shape([x, y], (None, 3))
    with pytest.raises(AssertionError, match=r"expected \(\.\.\., 2\)"):
        assert_shape(x, (..., 2))
    with pytest.raises(AssertionError, match=r"expected \(2, 3, 1, \.\.\.\)"):
        assert_shape(x, (2, 3, 1, ...))
    with pytest.raises(AssertionError, match=r"expected \(\{4, 5\}, 3\)"):
        assert_shape(x, ({4, 5}, 3))
    with pytest.raises(AssertionError, match="2 inputs but 1 expected shapes"):
        assert_shape([x, y], [(2, 3)])
    with pytest.raises(ValueError, match="at most one"):
        assert_shape(x, (..., ...))
    with pytest.raises(ValueError, match="must be a shape"):
        assert_shape(x, "2x3")


def test_assert_tree_shape_prefix():
    tree = {"a": torch.zeros(4, 2), "b": [torch.zeros(4, 1, 5)]}
    assert_tree_shape_prefix(tree, (4,))
    assert_tree_shape_prefix(tree, ())
    with pytest.raises(AssertionError, match=r"prefix \(4, 2\)[\s\S]*tree\['b'\]\[0\]: shape \(4, 1, 5\)"):
        assert_tree_shape_prefix(tree, (4, 2))
