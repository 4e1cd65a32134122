"""The assertions most tests share, so that every test compares the same way.

``assert_close_to``: fp32 equivalence with plain PyTorch (relative ``RTOL`` of the largest
expected value, docs/testing.md). ``assert_within_roundoff``: mixed precision against plain
PyTorch doing the same mixed precision, within bounds derived from the dtype's unit roundoff
(``UNIT_ROUNDOFF``; the reasoning is tests/transforms/test_precision.py's docstring).
``assert_same_run``: two runs bit for bit, parameters and every step's loss. ``assert_same_init``: a
random init compared with the same init built normally (where two seeds agree, exactly; elsewhere in
distribution; the reasoning is tests/weights/test_hf_meta_init.py's docstring).
"""
import math

import torch

from zfunc.testing import assert_trees_all_close

RTOL = 1e-5  # fp32 equivalence, docs/testing.md
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def assert_close_to(got: dict, expected: dict):
    scale = max(v.abs().max().item() for v in expected.values())
    assert list(got) == list(expected)
    assert_trees_all_close(got, expected, rtol=RTOL, atol=RTOL * scale)


def assert_within_roundoff(got: dict, ref: dict, init: dict, u: float, sgd: bool):
    """SGD: every parameter within 16 u of the largest distance any element of its tensor moved.
    Adam: no element further off than that largest step, and 90% of them within 4 u of it."""
    close, total = 0, 0
    for k, want in ref.items():
        err = (got[k] - want).abs()
        move = (want - init[k]).abs().max().item()
        if sgd:
            assert err.max().item() <= 16 * u * move, f"{k}: off by {err.max().item():.3g}, bound {16 * u * move:.3g}"
        else:
            assert err.max().item() <= move, f"{k}: off by {err.max().item():.3g}, more than its largest step {move:.3g}"
            close += int((err <= 4 * u * move).sum())
            total += err.numel()
    if not sgd:
        assert close >= 0.9 * total, f"only {close} of {total} elements within 4u of the reference"


def assert_same_run(a: dict, b: dict) -> None:
    """Bit for bit: parameters and the loss of every step."""
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]


def assert_same_init(got: dict, a: dict, b: dict, where: str = "") -> None:
    """``got`` holds what ``a`` holds: ``a`` and ``b`` are the same init under two seeds (tests/weights/test_hf_meta_init.py)."""
    assert set(got) == set(a), (where, set(got) ^ set(a))
    for k, want in a.items():
        g = got[k]
        assert g.shape == want.shape and g.dtype == want.dtype, (where, k, g.shape, want.shape, g.dtype, want.dtype)
        fixed = _fixed(want, b[k])
        assert torch.equal(g[fixed], want[fixed]), f"{where}{k}: deterministic values differ"
        if fixed.all():
            continue
        x, y = g[~fixed].double(), want[~fixed].double()
        n = x.numel()
        sx, sy = x.std() if n > 1 else x.abs(), y.std() if n > 1 else y.abs()
        tol_mean = 6 * math.sqrt((sx**2 + sy**2) / n) + 1e-7
        assert abs(x.mean() - y.mean()) <= tol_mean, f"{where}{k}: mean {x.mean():.4g}, want {y.mean():.4g}"
        if n > 8:
            assert abs(sx - sy) <= 6 * sy * math.sqrt(1 / n) + 1e-7, f"{where}{k}: std {sx:.4g}, want {sy:.4g}"


def _fixed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where the same init under two seeds agrees: the whole tensor, or whole rows of 4 or more (a
    padding row); single elements of a random bf16 tensor agree by chance."""
    if torch.equal(a, b):
        return torch.ones_like(a, dtype=torch.bool)
    if a.dim() < 2 or a[0].numel() < 4:
        return torch.zeros_like(a, dtype=torch.bool)
    rows = (a == b).reshape(a.shape[0], -1).all(1)
    return rows.reshape(-1, *[1] * (a.dim() - 1)).expand(a.shape)
