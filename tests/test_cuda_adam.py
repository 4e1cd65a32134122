"""The multi-tensor CUDA Adam (zfunc.ops.cuda_adam) against torch.optim.AdamW(fused=True).

Skips without CUDA. Where torch sees a GPU but nvcc is missing, the kernel
cannot build and the tests check the torch fallback instead.
"""
from __future__ import annotations

import pytest
import torch

from zfunc.ops import builder, cpu_adam, cuda_adam

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LR, BETAS, EPS, STEPS = 1e-2, (0.9, 0.999), 1e-8, 10


def test_without_cuda_the_builder_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cuda_adam.load() is None
    row = next(r for r in builder.report() if r["name"] == cuda_adam.NAME)
    assert not row["built"] and ("CUDA" in row["reason"] or "DISABLE" in row["reason"])


def _kernel_or_reason():
    module = cuda_adam.load()
    row = next(r for r in builder.report() if r["name"] == cuda_adam.NAME)
    return module, row["reason"]


@needs_cuda
def test_kernel_builds_where_nvcc_exists():
    module, reason = _kernel_or_reason()
    if module is None and (reason.startswith(("nvcc not found", "disabled"))):
        pytest.skip(f"kernel not buildable here: {reason}")
    assert module is not None, reason


def _run(shapes, *, decoupled, wd, param_dtype=torch.float32, grad_dtype=torch.float32,
         lowp_dtype=None, grad_scale=1.0, seed=0):
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]
    ps = [p.to(dev, param_dtype) for p in init]
    ms = [torch.zeros(s, device=dev) for s in shapes]
    vs = [torch.zeros(s, device=dev) for s in shapes]
    lows = None if lowp_dtype is None else [torch.empty(s, device=dev, dtype=lowp_dtype)
                                            for s in shapes]
    for t, gs in enumerate(grads, start=1):
        gd = [g.to(dev, grad_dtype) for g in gs]
        before = [g.clone() for g in gd]
        cpu_adam.adam_update_(ps, gd, ms, vs, step=t, lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                              eps=EPS, weight_decay=wd, decoupled=decoupled,
                              grad_scale=grad_scale, lowp_params=lows)
        assert all(torch.equal(a, b) for a, b in zip(gd, before)), "grads were modified"
    return init, grads, ps, ms, vs, lows


def _torch_fused(init, grads, *, decoupled, wd, grad_scale=1.0, grad_dtype=torch.float32):
    ps = [p.cuda().requires_grad_() for p in init]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=wd, fused=True)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.cuda().to(grad_dtype).float() * grad_scale
        opt.step()
    return [p.detach() for p in ps]


@needs_cuda
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fp32_matches_torch_fused(decoupled, wd):
    shapes = [1, 7, 4097, 2_500_003, 3 * 65536 + 5, (33, 17)]
    init, grads, ps, _, _, _ = _run(shapes, decoupled=decoupled, wd=wd)
    ref = _torch_fused(init, grads, decoupled=decoupled, wd=wd)
    torch.testing.assert_close(ps, ref, rtol=1e-5, atol=1e-6)


@needs_cuda
def test_grad_scale_and_low_precision_grads():
    shapes = [4097, 70_000]
    for grad_dtype in (torch.float32, torch.bfloat16, torch.float16):
        init, grads, ps, _, _, _ = _run(shapes, decoupled=True, wd=0.1, grad_dtype=grad_dtype,
                                        grad_scale=0.3)
        ref = _torch_fused(init, grads, decoupled=True, wd=0.1, grad_scale=0.3,
                           grad_dtype=grad_dtype)
        torch.testing.assert_close(ps, ref, rtol=1e-5, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
def test_lowp_copy_is_param_cast(lowp_dtype):
    init, grads, ps, _, _, lows = _run([4097, 300_001], decoupled=True, wd=0.01,
                                       lowp_dtype=lowp_dtype)
    for p, low in zip(ps, lows):
        assert torch.equal(low, p.to(lowp_dtype))
    ref = _torch_fused(init, grads, decoupled=True, wd=0.01)
    torch.testing.assert_close(ps, ref, rtol=1e-5, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_with_fp32_state(param_dtype):
    """Params stored in bf16/fp16: fp32 math each step, then rounded (as the fallback does)."""
    shapes = [4097, 65537]
    init, grads, ps, ms, _, _ = _run(shapes, decoupled=True, wd=0.1, param_dtype=param_dtype)
    rp = [p.cuda().to(param_dtype) for p in init]
    rm = [torch.zeros(s, device="cuda") for s in shapes]
    rv = [torch.zeros(s, device="cuda") for s in shapes]
    for t, gs in enumerate(grads, start=1):
        cpu_adam.torch_adam_(rp, [g.cuda() for g in gs], rm, rv, step=t, lr=LR, beta1=BETAS[0],
                             beta2=BETAS[1], eps=EPS, weight_decay=0.1, decoupled=True)
    ulp = 2.0 ** -7 if param_dtype == torch.bfloat16 else 2.0 ** -10
    for p, r in zip(ps, rp):
        assert p.dtype == param_dtype
        torch.testing.assert_close(p.float(), r.float(), rtol=2 * ulp, atol=1e-6)
    torch.testing.assert_close(ms, rm, rtol=1e-3, atol=1e-5)


@needs_cuda
def test_cuda_tensors_route_to_the_cuda_kernel(monkeypatch):
    module, reason = _kernel_or_reason()
    if module is None:
        pytest.skip(f"kernel not built: {reason}")
    calls = []

    class Spy:
        def adam_update(self, *args, **kw):
            calls.append(len(args[0]))
            return module.adam_update(*args, **kw)

    monkeypatch.setattr(cuda_adam, "load", lambda: Spy())
    shapes = [5, 100, 70_000] * 20
    init, grads, ps, _, _, _ = _run(shapes, decoupled=True, wd=0.1)
    assert calls == [len(shapes)] * STEPS  # one call (one launch per dtype mix) per update
    ref = _torch_fused(init, grads, decoupled=True, wd=0.1)
    torch.testing.assert_close(ps, ref, rtol=1e-5, atol=1e-6)
