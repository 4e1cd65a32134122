"""The fused CPU Adam (zfunc.ops.cpu_adam) against Adam in float64 (tests/harness/adam_reference.py).

The kernel must build on this machine (CI installs gcc and ninja) unless
ZFUNC_OPS_DISABLE is set, in which case these tests check the fallback.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from adam_reference import adam_f64, assert_within
from zfunc.ops import adam, builder, cpu_adam, torch_adam

DISABLED = builder._disabled(cpu_adam.NAME)
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8
STEPS = 10


def test_kernel_is_used_here():
    module = cpu_adam.load()
    row = next(r for r in builder.report() if r["name"] == cpu_adam.NAME)
    if DISABLED:
        assert module is None and not row["built"] and "ZFUNC_OPS_DISABLE" in row["reason"]
    else:
        assert module is not None, row["reason"]
        assert row["built"] and row["reason"] == "built"
        assert "-O3" in row["flags"] and "-fno-math-errno" in row["flags"]


def _grads(shapes, steps=STEPS, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * scale for s in shapes] for _ in range(steps)]


def _reference(params, grads, *, decoupled, wd):
    return adam_f64(params, grads, lr=LR, betas=BETAS, eps=EPS, wd=wd, decoupled=decoupled)


def _ours(params, grads, *, decoupled, wd, state_dtype=torch.float32, grad_scale=1.0,
          lowp_dtype=None, grad_dtype=None):
    ps = [p.clone() for p in params]
    ms = [torch.zeros_like(p, dtype=state_dtype) for p in ps]
    vs = [torch.zeros_like(p, dtype=state_dtype) for p in ps]
    lows = None if lowp_dtype is None else [torch.empty_like(p, dtype=lowp_dtype) for p in ps]
    for t, gs in enumerate(grads, start=1):
        if grad_dtype is not None:
            gs = [g.to(grad_dtype) for g in gs]
        before = [g.clone() for g in gs]
        adam.adam_update_(ps, gs, ms, vs, step=t, lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                              eps=EPS, weight_decay=wd, decoupled=decoupled,
                              grad_scale=grad_scale, lowp_params=lows)
        assert all(torch.equal(a, b) for a, b in zip(gs, before)), "grads were modified"
    return ps, ms, vs, lows


@pytest.mark.parametrize("n", [1, 7, 4097, pytest.param(2_500_003, marks=pytest.mark.slow)])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_float64_adam(n, decoupled, wd):
    params = [torch.randn(n, generator=torch.Generator().manual_seed(1))]
    grads = _grads([n])
    ours, ms, vs, _ = _ours(params, grads, decoupled=decoupled, wd=wd)
    ref = _reference(params, grads, decoupled=decoupled, wd=wd)
    assert_within(ours, ref.params, ref.tol_params)
    assert_within(ms, ref.exp_avgs, ref.tol_exp_avgs, "exp_avg")
    assert_within(vs, ref.exp_avg_sqs, ref.tol_exp_avg_sqs, "exp_avg_sq")


@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
def test_lowp_copy_is_param_cast(lowp_dtype):
    n = 70_001
    params = [torch.randn(n), torch.randn(33) * 1e-3]
    grads = _grads([n, 33], steps=3)
    ours, _, _, lows = _ours(params, grads, decoupled=True, wd=0.01, lowp_dtype=lowp_dtype)
    ref, _, _, _ = _ours(params, grads, decoupled=True, wd=0.01)
    for p, r, low in zip(ours, ref, lows):
        assert torch.equal(p, r)  # writing the copy changes nothing else
        assert low.dtype == lowp_dtype and torch.equal(low, p.to(lowp_dtype))


def test_lowp_rounding_edge_cases():
    # Values whose bf16/fp16 rounding is a tie, overflows or is subnormal.
    special = torch.tensor([1.00390625, 1.01171875, -1.00390625, 3.0e38, -3.0e38, 65520.0,
                            1e-40, -1e-40, 6e-8, 2.9e-8, 0.0, -0.0, float("inf"), float("-inf")])
    n = special.numel()
    for lowp_dtype in (torch.bfloat16, torch.float16):
        p = special.repeat(5)  # vector lanes and the masked tail
        low = torch.empty_like(p, dtype=lowp_dtype)
        g, m, v = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
        # lr = 0 and zero grads: the param stays, the copy is the cast of it
        adam.adam_update_([p], [g], [m], [v], step=1, lr=0.0, beta1=0.9, beta2=0.999,
                              eps=1e-8, weight_decay=0.0, decoupled=True, lowp_params=[low])
        assert torch.equal(p[:n], special)
        assert torch.equal(low, p.to(lowp_dtype)), lowp_dtype


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_grad_scale_folds_into_the_kernel(decoupled):
    shapes = [4097, 100]
    params = [torch.randn(s) for s in shapes]
    grads = _grads(shapes, scale=1024.0)
    scale = 0.37 / 1024.0  # unscale x clip factor
    ours, _, _, _ = _ours(params, grads, decoupled=decoupled, wd=0.1, grad_scale=scale)
    scaled = [[g * scale for g in gs] for gs in grads]
    ref = _reference(params, scaled, decoupled=decoupled, wd=0.1)
    assert_within(ours, ref.params, ref.tol_params)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_grads_are_read_directly(grad_dtype):
    shapes = [4097, 5]
    params = [torch.randn(s) for s in shapes]
    grads = [[g.to(grad_dtype) for g in gs] for gs in _grads(shapes)]
    ours, _, _, _ = _ours(params, grads, decoupled=True, wd=0.1, grad_dtype=grad_dtype)
    ref = _reference(params, grads, decoupled=True, wd=0.1)
    assert_within(ours, ref.params, ref.tol_params)


def test_bf16_state_within_bf16_tolerance():
    shapes = [100_003, 17]
    params = [torch.randn(s) for s in shapes]
    grads = _grads(shapes)
    ours, ms, vs, _ = _ours(params, grads, decoupled=True, wd=0.1, state_dtype=torch.bfloat16)
    ref, rms, rvs = _reference(params, grads, decoupled=True, wd=0.1)[:3]
    assert all(m.dtype == torch.bfloat16 and v.dtype == torch.bfloat16 for m, v in zip(ms, vs))
    # Each store of m and v rounds with a relative error of at most 2^-9 (half a
    # bf16 ulp) and older errors decay by beta each step, so after STEPS steps
    # m is off by at most STEPS * 2^-9 * max|m| (m, an average of signed grads,
    # may be near 0: an absolute bound) and v, a sum of squares, by STEPS * 2^-9
    # relative. The update m / sqrt(v) inherits ~2^-8 relative per step: at
    # most about lr * 2^-8 per step on the param.
    ulp = 2.0 ** -8
    for p, r in zip(ours, ref):
        assert (p - r).abs().max().item() <= STEPS * LR * 2 * ulp
    for m, rm in zip(ms, rms):
        assert (m.double() - rm).abs().max().item() <= STEPS * ulp * rm.abs().max().item()
    for v, rv in zip(vs, rvs):
        torch.testing.assert_close(v.double(), rv, rtol=STEPS * ulp, atol=1e-9)


def test_bf16_params_without_master_match_the_fallback():
    """bf16 params with fp32 state: the kernel equals fp32 math rounded each step."""
    shapes = [4097, 3]
    params = [torch.randn(s).bfloat16() for s in shapes]
    grads = _grads(shapes)
    ours, ms, vs, _ = _ours(params, grads, decoupled=True, wd=0.1)
    ps = [p.clone() for p in params]
    rms = [torch.zeros_like(p, dtype=torch.float32) for p in ps]
    rvs = [torch.zeros_like(p, dtype=torch.float32) for p in ps]
    for t, gs in enumerate(grads, start=1):
        torch_adam.torch_adam_(ps, gs, rms, rvs, step=t, lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                             eps=EPS, weight_decay=0.1, decoupled=True)
    for p, r in zip(ours, ps):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.float(), r.float(), rtol=2.0 ** -7, atol=0)
    torch.testing.assert_close(ms, rms, rtol=1e-4, atol=1e-6)


def test_many_tensors_in_one_call(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    shapes = [int(s) for s in torch.randint(1, 20_000, (60,), generator=gen)] + [(31, 7), (0,)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = _grads(shapes, steps=3)
    calls = []
    real = cpu_adam.load()
    if real is not None:
        class Spy:
            def adam_update(self, *args, **kw):
                calls.append(len(args[0]))
                return real.adam_update(*args, **kw)

        monkeypatch.setattr(cpu_adam, "load", lambda: Spy())
    ours, _, _, lows = _ours(params, grads, decoupled=True, wd=0.01, lowp_dtype=torch.bfloat16)
    ref = _reference(params, grads, decoupled=True, wd=0.01)
    assert_within(ours, ref.params, ref.tol_params)
    assert all(torch.equal(lo, p.bfloat16()) for lo, p in zip(lows, ours))
    if real is not None:
        assert calls == [len(shapes)] * 3  # one C++ call per update, whole list


def test_noncontiguous_and_odd_inputs_fall_back_correctly():
    base = torch.randn(64, 65)
    params = [base.t(), torch.randn(1000, dtype=torch.float64), torch.randn(300)]
    params = [p.clone() if p.dim() == 1 else p for p in params]
    grads = [[torch.randn(p.shape, dtype=p.dtype) for p in params] for _ in range(3)]
    ps = [p.clone() if p.is_contiguous() else p.clone().t().contiguous().t() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t, gs in enumerate(grads, start=1):
        adam.adam_update_(ps, gs, ms, vs, step=t, lr=LR, beta1=0.9, beta2=0.999, eps=EPS,
                              weight_decay=0.1, decoupled=True)
    assert not ps[0].is_contiguous()
    ref = _reference(params, grads, decoupled=True, wd=0.1)
    assert_within(ps, ref.params, ref.tol_params)


def test_thread_count_does_not_change_results():
    n = 600_000
    params = [torch.randn(n), torch.randn(n)]
    grads = _grads([n, n], steps=2)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _, _, _ = _ours(params, grads, decoupled=True, wd=0.1)
        s1 = cpu_adam.nonfinite_and_sq_norm(grads[0])
        torch.set_num_threads(max(2, saved))
        two, _, _, _ = _ours(params, grads, decoupled=True, wd=0.1)
        s2 = cpu_adam.nonfinite_and_sq_norm(grads[0])
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert s1 == s2


def test_nonfinite_and_sq_norm():
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(100_001, generator=gen), torch.randn(17, generator=gen).bfloat16(),
          torch.randn(3, 5, generator=gen).half(), torch.empty(0)]
    s, ok = cpu_adam.nonfinite_and_sq_norm(xs)
    expect = sum(float(x.double().square().sum()) for x in xs)
    assert ok and math.isclose(s, expect, rel_tol=1e-9)
    big = [torch.full((40,), 1e30)]  # squares overflow fp32, not the float64 sum
    s, ok = cpu_adam.nonfinite_and_sq_norm(big)
    assert ok and math.isclose(s, 40 * float(big[0][0]) ** 2, rel_tol=1e-12)
    for bad in (float("inf"), float("-inf"), float("nan")):
        for pos in (0, 16, 100_000):  # vector body and masked tail
            y = xs[0].clone()
            y[pos] = bad
            assert cpu_adam.nonfinite_and_sq_norm([xs[1], y])[1] is False
        z = xs[1].clone()
        z[-1] = bad
        assert cpu_adam.nonfinite_and_sq_norm([z])[1] is False
    assert cpu_adam.nonfinite_and_sq_norm([xs[0][:99_995].view(-1, 5)[:, :3]])[1]  # non-contiguous


def test_length_mismatch_is_a_clear_error():
    p = [torch.zeros(3)]
    with pytest.raises(ValueError, match="1 params but 0 grads"):
        adam.adam_update_(p, [], p, p, step=1, lr=1.0, beta1=0.9, beta2=0.9, eps=1e-8,
                              weight_decay=0.0, decoupled=True)


_FALLBACK_SCRIPT = textwrap.dedent("""
    import json, warnings
    import torch
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        from zfunc.ops import adam, builder, cpu_adam, torch_adam
        torch.manual_seed(0)
        p = torch.randn(5000)
        # Oracle: AdamW written out in float64 (torch.optim.AdamW's for-loop step
        # in a fresh process came out 2.9e-6 off at one element in about one run
        # in five, after the aio tests; the float64 formula has no such drift).
        ref, rm, rv = p.double(), torch.zeros(5000, dtype=torch.float64), 0
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        low = torch.empty_like(p, dtype=torch.bfloat16)
        for t in range(1, 4):
            g = torch.randn(5000)
            ref = ref * (1 - 1e-2 * 0.1)
            rm, rv = 0.9 * rm + 0.1 * g.double(), 0.999 * rv + 0.001 * g.double() ** 2
            ref = ref - 1e-2 / (1 - 0.9 ** t) * rm / ((rv / (1 - 0.999 ** t)).sqrt() + 1e-8)
            adam.adam_update_([p], [g * 4], [m], [v], step=t, lr=1e-2, beta1=0.9,
                                  beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
                                  grad_scale=0.25, lowp_params=[low])
            adam.adam_update_([p[:0]], [g[:0]], [m[:0]], [v[:0]], step=t, lr=1e-2,
                                  beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                  decoupled=True)
    rel = (p.double() - ref).abs() / ref.abs().clamp_min(1)  # fp32 rounding: ~1e-7
    i = int(rel.argmax())
    print(json.dumps({"row": [r for r in builder.report() if r["name"] == "cpu_adam"][0],
                      "err": rel.max().item(), "at": [i, p[i].item(), ref[i].item()],
                      "low_ok": bool(torch.equal(low, p.bfloat16())),
                      "warnings": [str(w.message) for w in caught
                                   if issubclass(w.category, builder.OpBuildWarning)]}))
""")



def _run_fallback(tmp_path, **env):
    full = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), **env)
    full.pop("ZFUNC_OPS_DISABLE", None) if "ZFUNC_OPS_DISABLE" not in env else None
    out = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], env=full, capture_output=True,
                         text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_missing_compiler_falls_back_and_says_so(tmp_path):
    res = _run_fallback(tmp_path, CXX="/nonexistent/g++")
    assert res["row"]["built"] is False
    assert "/nonexistent/g++" in res["row"]["reason"] and "compiler" in res["row"]["reason"]
    assert len(res["warnings"]) == 1 and "/nonexistent/g++" in res["warnings"][0]
    assert res["err"] < 1e-6 and res["low_ok"], res
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.so"))


@pytest.mark.slow
def test_disable_env_falls_back_quietly(tmp_path):
    res = _run_fallback(tmp_path, ZFUNC_OPS_DISABLE="aio,cpu_adam")
    assert res["row"]["built"] is False and "ZFUNC_OPS_DISABLE" in res["row"]["reason"]
    assert res["warnings"] == []
    assert res["err"] < 1e-6 and res["low_ok"], res


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "none"])
def test_portable_builds_match(isa):
    """The auto-vectorised (AVX2) and plain builds give the AVX-512 build's numbers."""
    script = textwrap.dedent("""
        import json, torch
        from zfunc.ops import adam, builder, cpu_adam, torch_adam
        gen = torch.Generator().manual_seed(0)
        shapes = [4099, 33]
        ps = [torch.randn(s, generator=gen) for s in shapes]
        ms = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
        vs = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
        lows = [torch.empty(s, dtype=torch.float16) for s in shapes]
        for t in range(1, 4):
            gs = [torch.randn(s, generator=gen).half() for s in shapes]
            adam.adam_update_(ps, gs, ms, vs, step=t, lr=1e-2, beta1=0.9, beta2=0.999,
                                  eps=1e-8, weight_decay=0.1, decoupled=t % 2 == 0,
                                  grad_scale=0.5, lowp_params=lows)
        s = cpu_adam.nonfinite_and_sq_norm(gs + lows)
        # every fp16 value (as fp32 params/grads) and float->bf16/fp16 edge cases
        half = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
        edge = torch.tensor([1.00390625, 1.01171875, 3.0e38, 65520.0, 65519.0, 1e-40, 6e-8,
                             2.9e-8, 2.98e-8, 5.96e-8, -0.0, float("inf"), float("nan")])
        casts_ok = True
        for x in (half.float(), edge, torch.randn(10007) * 1e-5):
            for dt in (torch.bfloat16, torch.float16):
                p, low = x.clone(), torch.empty_like(x, dtype=dt)
                z = torch.zeros_like(x)
                adam.adam_update_([p], [z], [z.clone()], [z.clone()], step=1, lr=0.0,
                                      beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                      decoupled=True, lowp_params=[low])
                casts_ok &= torch.equal(low.view(torch.int16), x.to(dt).view(torch.int16)) or (
                    torch.equal(low[~x.isnan()], x[~x.isnan()].to(dt)) and bool(low[x.isnan()].isnan().all()))
        hg = half[~half.isinf() & ~half.isnan()].reshape(-1)
        norm_ok = cpu_adam.nonfinite_and_sq_norm([half])[1] is False and abs(cpu_adam.nonfinite_and_sq_norm([hg])[0] - float(hg.double().square().sum())) < 1e-6 * float(hg.double().square().sum())
        print(json.dumps({"simd": cpu_adam.load().simd(), "sumsq": s[0], "casts_ok": bool(casts_ok),
                          "norm_ok": bool(norm_ok), "out": [x.float().tolist() for x in ps + ms + vs + lows]}))
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run(**env):
        full = dict(os.environ, **env)
        full.pop("ZFUNC_OPS_DISABLE", None)
        out = subprocess.run([sys.executable, "-c", script], env=full, capture_output=True,
                             text=True, timeout=600, cwd=root)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    native = run()
    other = run(ZFUNC_OPS_ISA=isa)  # its own cached build: the module name hashes the flags
    assert "avx512" not in other["simd"]
    assert native["casts_ok"] and other["casts_ok"] and native["norm_ok"] and other["norm_ok"]
    assert math.isclose(native["sumsq"], other["sumsq"], rel_tol=1e-12)
    for a, b in zip(native["out"], other["out"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
