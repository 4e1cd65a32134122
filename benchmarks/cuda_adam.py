"""CUDA Adam: zfunc's multi-tensor kernel against torch's fused AdamW, on one GPU.

    python benchmarks/cuda_adam.py                     # 50M and 200M, flat and 200 tensors
    python benchmarks/cuda_adam.py --sizes 1G --reps 50

Needs CUDA (exits with a message otherwise). Every round runs each
implementation once, in a rotating order, timed with CUDA events; medians are
reported as G param/s and as effective bandwidth (bytes read + written per
parameter over time) next to a device-to-device copy measured in the same
rounds (``dst.copy_(src)``, 8 bytes per element).

fp32 AdamW (lr 1e-3, wd 0.01), 28 B/param:
  zfunc               zfunc.ops.cuda_adam.adam_update_ (one launch for all tensors)
  torch fused         torch.optim.AdamW(fused=True)
Mixed precision, bf16 grads, fp32 master weights and state, bf16 model copy,
grad scale folded in (30 B/param for zfunc: g 2 + p, m, v read 12 + written 12
+ copy 2):
  zfunc mixed         one pass: unscale, update, bf16 copy
  torch way           grads to fp32 and unscaled (_foreach), fused AdamW,
                      _foreach_copy_ into the bf16 copy
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from _sizes import mixed_sizes, parse_size  # noqa: E402
from zfunc.ops import builder, cuda_adam

LR, WD, BETAS, EPS, SCALE = 1e-3, 0.01, (0.9, 0.999), 1e-8, 1.0 / 1024


def bench_case(n: int, layout: str, reps: int) -> dict:
    dev = torch.device("cuda")
    shapes = [n] if layout == "flat" else mixed_sizes(n)
    ps = [torch.empty(s, device=dev).uniform_(-1, 1) for s in shapes]
    gs = [torch.empty_like(p).uniform_(-1e-2, 1e-2) for p in ps]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    g16 = [g.to(torch.bfloat16) for g in gs]
    low = [p.to(torch.bfloat16) for p in ps]
    step = [0]

    def ours(grads=gs, lowp=None, scale=1.0):
        step[0] += 1
        cuda_adam.adam_update_(ps, grads, ms, vs, step=step[0], lr=LR, beta1=BETAS[0],
                               beta2=BETAS[1], eps=EPS, weight_decay=WD, decoupled=True,
                               grad_scale=scale, lowp_params=lowp)

    tps = [p.clone() for p in ps]
    for p, g in zip(tps, gs):
        p.grad = g
    topt = torch.optim.AdamW(tps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    tlow = [p.to(torch.bfloat16) for p in tps]

    def torch_mixed():
        grads = [g.float() for g in g16]
        torch._foreach_mul_(grads, SCALE)
        for p, g in zip(tps, grads):
            p.grad = g
        topt.step()
        torch._foreach_copy_(tlow, tps)

    src = torch.rand(64 * 2**20, device=dev)
    dst = torch.empty_like(src)
    fns = {"zfunc": ours, "torch fused": topt.step,
           "zfunc mixed": lambda: ours(g16, low, SCALE), "torch way": torch_mixed,
           "copy": lambda: dst.copy_(src)}
    times = {k: [] for k in fns}
    keys = list(fns)
    for r in range(reps + 1):  # round 0 warms up (lazy state, the build, the allocator)
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[k]()
            end.record()
            end.synchronize()
            if r:
                times[k].append(start.elapsed_time(end) / 1e3)
    return dict(n=n, layout=layout, tensors=len(shapes), copy_bytes=8 * src.numel(),
                times={k: statistics.median(v) for k, v in times.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50M,200M")
    ap.add_argument("--layouts", default="flat,tensors")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/cuda_adam.py needs CUDA (torch.cuda.is_available() is False)")
    if cuda_adam.load() is None:
        row = next(r for r in builder.report() if r["name"] == cuda_adam.NAME)
        sys.exit(f"the CUDA Adam kernel did not build: {row['reason']}")
    rows = [bench_case(parse_size(s), layout.strip(), args.reps)
            for s in args.sizes.split(",") for layout in args.layouts.split(",")]
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"medians of {args.reps} rounds\n")
    print("| params | layout | zfunc G/s | torch fused G/s | zfunc / torch | zfunc GB/s "
          "| mixed G/s | torch way G/s | mixed / torch way | mixed GB/s | copy GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, n = r["times"], r["n"]
        layout = "flat" if r["layout"] == "flat" else f"{r['tensors']} tensors"
        print(f"| {n / 1e6:g}M | {layout} | {n / t['zfunc'] / 1e9:.1f} | "
              f"{n / t['torch fused'] / 1e9:.1f} | {t['torch fused'] / t['zfunc']:.2f}x | "
              f"{28 * n / t['zfunc'] / 1e9:.0f} | {n / t['zfunc mixed'] / 1e9:.1f} | "
              f"{n / t['torch way'] / 1e9:.1f} | {t['torch way'] / t['zfunc mixed']:.2f}x | "
              f"{30 * n / t['zfunc mixed'] / 1e9:.0f} | {r['copy_bytes'] / t['copy'] / 1e9:.0f} |")


if __name__ == "__main__":
    main()
