"""CPU Adam: zfunc's fused kernel against torch's, and against the memory wall.

    python benchmarks/cpu_adam.py                       # 50M and 200M, 1 and 2 threads (~3 min)
    python benchmarks/cpu_adam.py --foreach-max 1G      # torch foreach at every size (slow)
    python benchmarks/cpu_adam.py --sizes 20M --threads 1 --reps 3   # quick look

Each thread count runs in its own process (OMP_NUM_THREADS and
torch.set_num_threads both set). In every process, for each size and layout
(one flat tensor, or ~200 tensors of mixed sizes), the implementations are
timed interleaved, one update each per round, and the median over the rounds
is reported. Two single-pass kernels are timed in the same rounds as
memory-bandwidth yardsticks, read + write counted: a copy (``dst.copy_(src)``;
the CPU also reads ``dst`` before writing it, which is not counted) and an
in-place pass (``buf.mul_(1.0)``, whose traffic is all counted, like Adam's).

fp32 AdamW (lr 1e-3, wd 0.01):
  zfunc.optim.adamw   the public path: adamw(...).update(grads, state, params) on a dict
  adam_update_        zfunc.ops.cpu_adam.adam_update_ (the fused kernel) directly
  torch fused         torch.optim.AdamW(fused=True)
  torch foreach       torch.optim.AdamW(foreach=True)
Mixed-precision step (fp32 master weights and moments, bf16 model copy, loss
scale 1024, clip at global norm 1.0):
  zfunc fused         bf16 grads read once for the norm (nonfinite_and_sq_norm),
                      then one pass: unscale x clip folded into the update,
                      bf16 copy of the params written by the same kernel
  torch way           fp32 grads: grad.mul_(1/scale), clip_grad_norm_,
                      AdamW(fused=True).step(), bf16_param.copy_(param)
Bytes counted per parameter (reads + writes): fp32 AdamW 28 (p, g, m, v read;
p, m, v written); zfunc mixed step 30 (bf16 g read by the norm pass, 2; the
update reads g, p, m, v, 14, writes p, m, v, 12, and the bf16 copy, 2).
The torch way moves 54 (unscale 8, norm 4, clip 8, AdamW 28, copy 6).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8
LOSS_SCALE, MAX_NORM = 1024.0, 1.0
FP32_BYTES = 28  # per parameter: read p, g, m, v; write p, m, v
MIXED_BYTES = 2 + (2 + 12) + (12 + 2)  # norm pass; update reads g, p, m, v; writes p, m, v, bf16


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def mixed_sizes(total: int, count: int = 200, seed: int = 0) -> list[int]:
    """~count tensor sizes summing to total: a few large matrices, many mid-size
    ones and small vectors (biases, norms), as in a transformer."""
    import random

    rng = random.Random(seed)
    weights = [math.exp(rng.uniform(0.0, 7.0)) for _ in range(count)]
    scale = total / sum(weights)
    sizes = [max(1, int(w * scale)) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


# ----------------------------------------------------------------- the worker

def worker(args) -> list[dict]:
    import torch

    torch.set_num_threads(args.threads)
    import zfunc.optim as zoptim
    from zfunc.ops import builder, cpu_adam

    kernel = cpu_adam.load()
    rows = []
    copy_n = 64 * 2**20  # 256 MiB per buffer: far beyond the caches
    src = torch.rand(copy_n)
    dst = torch.empty_like(src)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for n in args.sizes:
        for layout in args.layouts:
            shapes = [n] if layout == "flat" else mixed_sizes(n)
            params = {f"p{i}": torch.empty(s).uniform_(-1, 1) for i, s in enumerate(shapes)}
            grads = {k: torch.empty_like(p).uniform_(-1e-2, 1e-2) for k, p in params.items()}
            plist, glist = list(params.values()), list(grads.values())

            # fp32 implementations ------------------------------------------------
            opt = zoptim.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD)
            state = [opt.init(params)]

            def public():
                _, state[0] = opt.update(grads, state[0], params)

            ms = list(state[0].mu.values()) if isinstance(state[0].mu, dict) else None
            vs = list(state[0].nu.values()) if isinstance(state[0].nu, dict) else None
            step = [0]

            def direct():
                step[0] += 1
                cpu_adam.adam_update_(plist, glist, ms, vs, step=step[0], lr=LR,
                                      beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                                      weight_decay=WD, decoupled=True)

            tparams = [p.clone() for p in plist]
            for p, g in zip(tparams, glist):
                p.grad = g
            topt = torch.optim.AdamW(tparams, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                     fused=True)
            group = topt.param_groups[0]

            def torch_fused():
                group["fused"], group["foreach"] = True, False
                topt.step()

            def torch_foreach():
                group["fused"], group["foreach"] = False, True
                topt.step()

            def copy():
                dst.copy_(src)

            def inplace():
                src.mul_(1.0)

            fp32 = {"zfunc.optim.adamw": public, "adam_update_": direct,
                    "torch fused": torch_fused, "torch foreach": torch_foreach, "copy": copy,
                    "in-place": inplace}
            if n > args.foreach_max:
                del fp32["torch foreach"]
            if ms is None:
                del fp32["adam_update_"]
            times = run_interleaved(fp32, args.reps, timed)
            rows.append(dict(kind="fp32", threads=args.threads, n=n, layout=layout,
                             tensors=len(shapes), times=times, copy_bytes=8 * copy_n,
                             kernel=kernel is not None))
            del topt, tparams, opt, state, ms, vs

            # mixed precision step ------------------------------------------------
            master = plist
            m32 = [torch.zeros_like(p) for p in master]
            v32 = [torch.zeros_like(p) for p in master]
            low = [p.to(torch.bfloat16) for p in master]
            g16 = [(g * LOSS_SCALE).to(torch.bfloat16) for g in glist]
            g32 = [g * LOSS_SCALE for g in glist]
            mstep = [0]

            def ours_mixed():
                mstep[0] += 1
                sumsq, finite = cpu_adam.nonfinite_and_sq_norm(g16)
                if not finite:
                    return
                norm = math.sqrt(sumsq) / LOSS_SCALE
                clip = min(1.0, MAX_NORM / (norm + 1e-6))
                cpu_adam.adam_update_(master, g16, m32, v32, step=mstep[0], lr=LR,
                                      beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                                      decoupled=True, grad_scale=clip / LOSS_SCALE,
                                      lowp_params=low)

            tmaster = [p.clone() for p in master]
            tlow = [p.to(torch.bfloat16) for p in tmaster]
            for p, g in zip(tmaster, g32):
                p.grad = g
            mopt = torch.optim.AdamW(tmaster, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                     fused=True)

            # g32: the fp32 grads of an autocast model, scaled by the loss scale.
            # The torch way scales them in place, so each round starts from a
            # pristine copy (restored outside the timed region).
            g32_src = [g.clone() for g in g32]

            def restore_g32():
                torch._foreach_copy_(g32, g32_src)

            def torch_mixed():
                torch._foreach_mul_(g32, 1.0 / LOSS_SCALE)
                torch.nn.utils.clip_grad_norm_(tmaster, MAX_NORM, foreach=True)
                mopt.step()
                torch._foreach_copy_(tlow, tmaster)

            mixed = {"zfunc fused": ours_mixed, "torch way": (restore_g32, torch_mixed),
                     "copy": copy, "in-place": inplace}
            times = run_interleaved(mixed, args.reps, timed)
            rows.append(dict(kind="mixed", threads=args.threads, n=n, layout=layout,
                             tensors=len(shapes), times=times, copy_bytes=8 * copy_n,
                             kernel=kernel is not None))
            del mopt, tmaster, tlow, m32, v32, low, g16, g32, g32_src, params, grads, plist, glist, master
    row = next((r for r in builder.report() if r["name"] == "cpu_adam"), {})
    for r in rows:
        r["kernel_reason"] = row.get("reason", "")
    return rows


def run_interleaved(fns: dict, reps: int, timed) -> dict[str, list[float]]:
    """One call of each per round, ``reps`` rounds after a warm-up round. A value
    may be ``(prepare, fn)``: ``prepare`` runs untimed before each ``fn``."""
    fns = {k: v if isinstance(v, tuple) else (None, v) for k, v in fns.items()}
    out: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps + 1):  # round 0 warms up: lazy state, page faults, first calls
        for name, (prepare, fn) in fns.items():
            if prepare is not None:
                prepare()
            t = timed(fn)
            if r:
                out[name].append(t)
    return out


# ----------------------------------------------------------------- the report

def fmt_rows(rows: list[dict]) -> str:
    med = statistics.median
    gbs = lambda r, k, nbytes: nbytes / med(r["times"][k]) / 1e9  # noqa: E731
    copy = lambda r: gbs(r, "copy", r["copy_bytes"])  # noqa: E731
    inplace = lambda r: gbs(r, "in-place", r["copy_bytes"])  # noqa: E731
    lines = []
    fp32 = [r for r in rows if r["kind"] == "fp32"]
    if fp32:
        impls = ["zfunc.optim.adamw", "adam_update_", "torch fused", "torch foreach"]
        head = (["threads", "params", "layout"] + impls
                + ["ours / fused", "ours GB/s", "copy GB/s", "in-place GB/s", "ours / copy",
                   "ours / in-place"])
        lines += ["fp32 AdamW: G param/s (median); ours = zfunc.optim.adamw; "
                  f"bandwidth counts {FP32_BYTES} B/param", ""]
        body = []
        for r in fp32:
            ours = gbs(r, "zfunc.optim.adamw", FP32_BYTES * r["n"])
            body.append([str(r["threads"]), _size(r["n"]), _layout(r)]
                        + [f"{r['n'] / med(r['times'][k]) / 1e9:.2f}" if k in r["times"] else "-"
                           for k in impls]
                        + [f"{med(r['times']['torch fused']) / med(r['times']['zfunc.optim.adamw']):.2f}x",
                           f"{ours:.1f}", f"{copy(r):.1f}", f"{inplace(r):.1f}",
                           f"{ours / copy(r):.2f}", f"{ours / inplace(r):.2f}"])
        lines.append(_md(head, body))
    mixed = [r for r in rows if r["kind"] == "mixed"]
    if mixed:
        lines += ["", "Mixed-precision step (unscale, clip, AdamW, bf16 copy): G param/s (median); "
                  f"zfunc bandwidth counts {MIXED_BYTES} B/param", ""]
        head = ["threads", "params", "layout", "zfunc fused", "torch way", "speed-up",
                "zfunc GB/s", "copy GB/s", "in-place GB/s", "zfunc / copy", "zfunc / in-place"]
        body = []
        for r in mixed:
            ours = gbs(r, "zfunc fused", MIXED_BYTES * r["n"])
            body.append([str(r["threads"]), _size(r["n"]), _layout(r),
                         f"{r['n'] / med(r['times']['zfunc fused']) / 1e9:.2f}",
                         f"{r['n'] / med(r['times']['torch way']) / 1e9:.2f}",
                         f"{med(r['times']['torch way']) / med(r['times']['zfunc fused']):.2f}x",
                         f"{ours:.1f}", f"{copy(r):.1f}", f"{inplace(r):.1f}",
                         f"{ours / copy(r):.2f}", f"{ours / inplace(r):.2f}"])
        lines.append(_md(head, body))
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else str(n)


def _layout(r: dict) -> str:
    return "flat" if r["layout"] == "flat" else f"{r['tensors']} tensors"


def _md(head: list[str], body: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50M,200M", help="comma list, e.g. 50M,200M")
    ap.add_argument("--layouts", default="flat,tensors", help="flat and/or tensors")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (median reported)")
    ap.add_argument("--foreach-max", default="50M",
                    help="time torch foreach only up to this size (it is slow; default 50M)")
    ap.add_argument("--json", help="also write the raw timings here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.layouts = [s.strip() for s in args.layouts.split(",")]
    args.foreach_max = parse_size(str(args.foreach_max))
    if args.worker:
        args.threads = int(args.threads)
        print(json.dumps(worker(args)))
        return

    rows = []
    for t in [int(x) for x in args.threads.split(",")]:
        env = dict(os.environ, OMP_NUM_THREADS=str(t), MKL_NUM_THREADS=str(t))
        cmd = [sys.executable, __file__, "--worker", "--threads", str(t),
               "--sizes", ",".join(str(s) for s in args.sizes),
               "--layouts", ",".join(args.layouts), "--reps", str(args.reps)]
        cmd += ["--foreach-max", str(args.foreach_max)]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"worker with {t} thread(s) failed:\n{out.stderr}")
        rows += json.loads(out.stdout.strip().splitlines()[-1])
        print(f"# {t} thread(s) done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    import torch

    print(f"torch {torch.__version__}; cpu_adam kernel: {rows[0]['kernel_reason'] if rows else '?'}")
    print()
    print(fmt_rows(rows))


if __name__ == "__main__":
    main()
