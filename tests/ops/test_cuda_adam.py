"""The multi-tensor CUDA Adam (zfunc.ops.cuda_adam) against Adam in float64 (tests/harness/adam_reference.py).

Every numerical test runs twice: on a GPU where torch sees one, and always on
the kernel's CPU emulation (``cuda_adam.emulated()``: the same kernel
source compiled by g++, its grid run block by block, thread by thread), so
machines without a GPU, CI among them, test the kernel's math, chunking and
tails. Where nvcc is installed, the device code is also compiled for sm_90.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

from adam_reference import adam_f64, assert_within
from zfunc.ops import adam, builder, cpu_adam, cuda_adam, torch_adam

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BACKENDS = [pytest.param("emulated", marks=pytest.mark.slow), pytest.param("cuda", marks=needs_cuda)]  # the emulation is a native build
LR, BETAS, EPS, STEPS = 1e-2, (0.9, 0.999), 1e-8, 10
CHUNK = 1 << 16  # kChunk in csrc/adam/cuda_adam_kernel.cuh: elements per block


def _row(name):
    return next(r for r in builder.report() if r["name"] == name)


def test_without_cuda_the_builder_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cuda_adam.load() is None
    row = _row(cuda_adam.NAME)
    assert not row["built"] and ("CUDA" in row["reason"] or "DISABLE" in row["reason"])


@needs_cuda
def test_kernel_builds_where_nvcc_exists():
    module = cuda_adam.load()
    reason = _row(cuda_adam.NAME)["reason"]
    if module is None and reason.startswith(("nvcc not found", "disabled")):
        pytest.skip(f"kernel not buildable here: {reason}")
    assert module is not None, reason


def _nvcc():
    from torch.utils.cpp_extension import CUDA_HOME

    found = shutil.which("nvcc")
    if found is None and CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        found = os.path.join(CUDA_HOME, "bin", "nvcc")
    return found


@pytest.mark.slow
def test_device_code_compiles_with_nvcc(tmp_path):
    """nvcc compiles cuda_adam.cu (every dtype instantiation) for sm_90, GPU or not,
    and the C++ compiler takes the op's binding."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not installed")
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), str(builder.CSRC)]
    generated = "c10/cuda/impl/cuda_cmake_macros.h"  # CMake writes it; CPU wheels lack it
    if not any(os.path.exists(os.path.join(d, generated)) for d in includes):
        (tmp_path / generated).parent.mkdir(parents=True)
        (tmp_path / generated).write_text("#pragma once\n")
        includes.append(str(tmp_path))
    obj = tmp_path / "cuda_adam.o"
    cmd = [nvcc, "-c", "-std=c++20", "-O3", "-arch=sm_90", "-Xcompiler", "-fPIC", "-w",
           *[f"-I{d}" for d in includes], str(builder.CSRC / "adam" / "cuda_adam.cu"),
           "-o", str(obj)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert obj.stat().st_size > 0
    # the op's other source, its Python binding, is plain C++
    cxx = [os.environ.get("CXX", "c++"), "-fsyntax-only", "-std=c++20", "-w",
           "-DTORCH_EXTENSION_NAME=zfunc_cuda_adam_check",
           *[f"-I{d}" for d in (*includes, sysconfig.get_paths()["include"])],
           str(builder.CSRC / "adam" / "cuda_adam.cpp")]
    out = subprocess.run(cxx, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]


class Backend:
    """Where the kernel runs: a GPU through the public entry point, or its CPU emulation."""

    def __init__(self, name):
        self.name = name
        if name == "cuda":
            self.device = torch.device("cuda")
            self.update = adam.adam_update_  # routes CUDA tensors to the kernel
            return
        module = cuda_adam.emulated()
        assert module is not None, _row(cuda_adam.NAME + "_emulated")["reason"]
        self.device = torch.device("cpu")

        def update(ps, gs, ms, vs, *, lowp_params=None, grad_scale=1.0, **kw):
            module.adam_update(ps, gs, ms, vs, [] if lowp_params is None else lowp_params,
                               grad_scale=grad_scale, **kw)

        self.update = update


@pytest.fixture(params=BACKENDS)
def backend(request):
    return Backend(request.param)


def _run(backend, shapes, *, decoupled, wd, param_dtype=torch.float32,
         grad_dtype=torch.float32, lowp_dtype=None, grad_scale=1.0, seed=0):
    dev = backend.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]
    ps = [p.to(dev, param_dtype, copy=True) for p in init]  # never init itself
    ms = [torch.zeros(s, device=dev) for s in shapes]
    vs = [torch.zeros(s, device=dev) for s in shapes]
    lows = None if lowp_dtype is None else [torch.empty(s, device=dev, dtype=lowp_dtype)
                                            for s in shapes]
    for t, gs in enumerate(grads, start=1):
        gd = [g.to(dev, grad_dtype) for g in gs]
        before = [g.clone() for g in gd]
        backend.update(ps, gd, ms, vs, step=t, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                       weight_decay=wd, decoupled=decoupled, grad_scale=grad_scale,
                       lowp_params=lows)
        assert all(torch.equal(a, b) for a, b in zip(gd, before)), "grads were modified"
    return init, grads, ps, ms, vs, lows


def _reference(init, grads, *, decoupled, wd, grad_scale=1.0, grad_dtype=torch.float32):
    """Adam in float64 on the gradients the kernel reads (rounded to ``grad_dtype``, scaled)."""
    seen = [[g.to(grad_dtype).double() * grad_scale for g in gs] for gs in grads]
    return adam_f64(init, seen, lr=LR, betas=BETAS, eps=EPS, wd=wd, decoupled=decoupled)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fp32_matches_float64_adam(backend, decoupled, wd):
    # one block, a partial block, block boundaries +-1, several blocks, 2-D
    shapes = [1, 7, 4097, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 5, 2_500_003, (33, 17)]
    init, grads, ps, _, _, _ = _run(backend, shapes, decoupled=decoupled, wd=wd)
    ref = _reference(init, grads, decoupled=decoupled, wd=wd)
    assert_within(ps, ref.params, ref.tol_params)


def test_grad_scale_and_low_precision_grads(backend):
    shapes = [4097, 70_000]
    for grad_dtype in (torch.float32, torch.bfloat16, torch.float16):
        init, grads, ps, _, _, _ = _run(backend, shapes, decoupled=True, wd=0.1,
                                        grad_dtype=grad_dtype, grad_scale=0.3)
        ref = _reference(init, grads, decoupled=True, wd=0.1, grad_scale=0.3, grad_dtype=grad_dtype)
        assert_within(ps, ref.params, ref.tol_params)


@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
def test_lowp_copy_is_param_cast(backend, lowp_dtype):
    init, grads, ps, _, _, lows = _run(backend, [4097, 300_001], decoupled=True, wd=0.01,
                                       lowp_dtype=lowp_dtype)
    for p, low in zip(ps, lows):
        assert torch.equal(low, p.to(lowp_dtype))
    ref = _reference(init, grads, decoupled=True, wd=0.01)
    assert_within(ps, ref.params, ref.tol_params)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_with_fp32_state(backend, param_dtype):
    """Params stored in bf16/fp16: fp32 math each step, then rounded (as the fallback does)."""
    shapes = [4097, 65537]
    init, grads, ps, ms, _, _ = _run(backend, shapes, decoupled=True, wd=0.1,
                                     param_dtype=param_dtype)
    dev = backend.device
    rp = [p.to(dev, param_dtype, copy=True) for p in init]
    rm = [torch.zeros(s, device=dev) for s in shapes]
    rv = [torch.zeros(s, device=dev) for s in shapes]
    for t, gs in enumerate(grads, start=1):
        torch_adam.torch_adam_(rp, [g.to(dev) for g in gs], rm, rv, step=t, lr=LR,
                             beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1,
                             decoupled=True)
    ulp = 2.0 ** -7 if param_dtype == torch.bfloat16 else 2.0 ** -10
    for p, r, p0 in zip(ps, rp, init):
        assert p.dtype == param_dtype
        # Rounded every step: where the two fp32 paths (nvcc's fused multiply-adds against
        # torch's ops) land on either side of a rounding tie, they part by one ulp of the
        # value at that step, which is at most |p0| + STEPS * LR, and stay apart after.
        bound = 2 * ulp * (p0.to(dev).abs() + STEPS * LR) + 1e-6
        err = (p.float() - r.float()).abs()
        assert (err <= bound).all(), f"off by {err.max().item():.3g} where the bound is {bound[err.argmax()].item():.3g}"
    torch.testing.assert_close(ms, rm, rtol=1e-3, atol=1e-5)


def test_mixed_dtypes_in_one_call(backend):
    """One call with several dtype combinations: one launch per combination, each right."""
    dev, shapes = backend.device, [5, 70_000, 4097, 33]
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in shapes]
    g32 = [torch.randn(s, generator=gen) for s in shapes]
    pdt = [torch.float32, torch.bfloat16, torch.float32, torch.float16]
    gdt = [torch.float32, torch.float32, torch.bfloat16, torch.float16]
    ps = [p.to(dev, d, copy=True) for p, d in zip(init, pdt)]
    gs = [g.to(dev, d) for g, d in zip(g32, gdt)]
    ms = [torch.zeros(s, device=dev) for s in shapes]
    vs = [torch.zeros(s, device=dev) for s in shapes]
    lows = [torch.empty(s, device=dev, dtype=torch.bfloat16) for s in shapes]
    kw = dict(step=1, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1,
              decoupled=True)
    backend.update(ps, gs, ms, vs, lowp_params=lows, **kw)
    for i in range(len(shapes)):  # each tensor alone through torch, in fp32, then rounded
        p = init[i].to(dev, pdt[i], copy=True).float()
        m, v = torch.zeros_like(ms[i]), torch.zeros_like(ms[i])
        torch_adam.torch_adam_([p], [gs[i].float()], [m], [v], **kw)
        assert torch.equal(ps[i], p.to(pdt[i])) or torch.allclose(
            ps[i].float(), p.to(pdt[i]).float(), rtol=2.0 ** -7, atol=1e-6), i
        torch.testing.assert_close(ms[i], m, rtol=1e-6, atol=1e-7)
        if pdt[i] in (torch.float32, torch.bfloat16):
            assert torch.equal(lows[i], ps[i].to(torch.bfloat16)), i
        else:  # the twin is rounded from the fp32 result, not from the fp16 param
            torch.testing.assert_close(lows[i].float(), p, rtol=2.0 ** -8, atol=1e-6)


BAD_LISTS = [  # (what is wrong, the message's pattern, a call's lists from params p and zeros z)
    ("grad length", r"grads\[0\] has 5 elements, the param 7",
     lambda p, z: ([p], [z[:5].clone()], [z.clone()], [z.clone()], None, 1)),
    ("moment dtype", r"exp_avgs\[0\] and exp_avg_sqs\[0\] must be",
     lambda p, z: ([p], [z], [z.long()], [z.clone()], None, 1)),
    ("twin dtype", "low-precision copy must be bf16 or fp16",
     lambda p, z: ([p], [z], [z.clone()], [z.clone()], [z.clone()], 1)),
    ("step", "step must be >= 1", lambda p, z: ([p], [z], [z.clone()], [z.clone()], None, 0)),
    ("list lengths", "1 params but 2 grads", lambda p, z: ([p], [z, z], [z.clone()], [z.clone()], None, 1)),
]
KW = dict(lr=LR, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.0, decoupled=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("entry", ["adam", "cuda_adam"])
def test_bad_lists_are_clear_errors(entry, device):
    """Every Adam entry point names the bad entry with a ValueError on every device, before any
    kernel runs (on the GPU machine a native op's own check crashed the test process)."""
    update = {"adam": adam.adam_update_, "cuda_adam": cuda_adam.adam_update_}[entry]
    for what, pattern, lists in BAD_LISTS:
        p, z = torch.zeros(7, device=device), torch.zeros(7, device=device)
        ps, gs, ms, vs, lows, step = lists(p, z)
        with pytest.raises(ValueError, match=pattern):
            update(ps, gs, ms, vs, lowp_params=lows, step=step, **KW)
        assert torch.equal(p, torch.zeros_like(p)), what  # nothing was written


_NATIVE_CHECKS = r"""
import torch
from zfunc.ops import cuda_adam
if torch.cuda.is_available():
    cuda_adam.load()  # both builds in one process, as on the GPU machine
module = cuda_adam.emulated()
p, z = torch.zeros(7), torch.zeros(7)
kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, grad_scale=1.0)
for args, extra, pattern in [
    (([p], [torch.zeros(5)], [z], [z.clone()], []), {}, "grads[0] has 5 elements, the param 7"),
    (([p], [z], [z.double()], [z.clone()], []), {}, "exp_avgs[0] and exp_avg_sqs[0] must be float32"),
    (([p], [z], [z.clone()], [z.clone()], [torch.zeros(7)]), {}, "low-precision copy must be bf16 or fp16"),
    (([p], [z], [z.clone()], [z.clone()], []), {"step": 0}, "step must be >= 1"),
]:
    try:
        module.adam_update(*args, **{**kw, **extra})
    except RuntimeError as e:
        assert pattern in str(e), (pattern, str(e))
    else:
        raise AssertionError("no error: " + pattern)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("beside_real_kernel", [False, True])
def test_native_checks_raise_in_a_process_of_their_own(beside_real_kernel):
    """The kernel's own checks (its last line, behind ``check_lists``) raise RuntimeError: run
    in a child process, alone and beside the real kernel where one is built, so a crash fails
    this test, naming its signal and (faulthandler) where, instead of the whole run. On an H200
    the child beside the real kernel died of SIGSEGV with nothing on stderr."""
    assert cuda_adam.emulated() is not None, _row(cuda_adam.NAME + "_emulated")["reason"]  # built here, once
    code = _NATIVE_CHECKS if beside_real_kernel else _NATIVE_CHECKS.replace("if torch.cuda.is_available():", "if False:")
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (
        f"exit status {proc.returncode} (negative: killed by that signal)\n{proc.stdout}\n{proc.stderr[-3000:]}")


@needs_cuda
def test_cuda_tensors_route_to_the_cuda_kernel(monkeypatch):
    module = cuda_adam.load()
    if module is None:
        pytest.skip(f"kernel not built: {_row(cuda_adam.NAME)['reason']}")
    calls = []

    class Spy:
        def adam_update(self, *args, **kw):
            calls.append(len(args[0]))
            return module.adam_update(*args, **kw)

    monkeypatch.setattr(cuda_adam, "load", lambda: Spy())
    shapes = [5, 100, 70_000] * 20
    init, grads, ps, _, _, _ = _run(Backend("cuda"), shapes, decoupled=True, wd=0.1)
    assert calls == [len(shapes)] * STEPS  # one call (one launch per dtype mix) per update
    ref = _reference(init, grads, decoupled=True, wd=0.1)
    assert_within(ps, ref.params, ref.tol_params)
