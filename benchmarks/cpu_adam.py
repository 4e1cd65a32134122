"""CPU Adam: zfunc's fused kernel against torch's, and against the memory wall.

    python benchmarks/cpu_adam.py                      # 50M and 200M, 1 and 2 threads (~3 min)
    python benchmarks/cpu_adam.py --sizes 20M --threads 1 --reps 3    # a quick look
    python benchmarks/cpu_adam.py --foreach-max 1G     # torch foreach at every size (slow)

For each size and layout (one flat tensor, or ~200 tensors of mixed sizes) the
buffers are made once; then every round runs each implementation once under
each thread count (torch.set_num_threads, which the zfunc kernel and torch's
kernels both follow), in an order that rotates from round to round, so all of
them see the same machine state. Medians over the rounds are reported. Two
single-pass kernels are timed in the same rounds as memory-bandwidth
yardsticks, read + write counted: a copy with streaming stores
(csrc/bench/stream_copy.cpp: the destination is written without first being
read into the cache, so the 8 bytes counted per element are all the bytes
moved; ``dst.copy_(src)`` also reads ``dst``, 12 bytes moved for 8 counted,
and stands in only where the kernel cannot be built) and an in-place pass
(``buf.mul_(1.0)``, read and write of the same lines, like Adam's).

fp32 AdamW (lr 1e-3, wd 0.01):
  zfunc.optim.adamw   the public path: adamw(...).update(grads, state, params) on a dict
  adam_update_        zfunc.ops.adam.adam_update_ (the fused kernel) directly
  torch fused         torch.optim.AdamW(fused=True)
  torch foreach       torch.optim.AdamW(foreach=True)
Mixed-precision step (fp32 master weights and moments, bf16 model copy, loss
scale 1024, clip at global norm 1.0):
  zfunc fused         bf16 grads read once for the norm (nonfinite_and_sq_norm),
                      then one pass: unscale x clip folded into the update, the
                      bf16 copy of the params written by the same kernel
  torch way           fp32 grads (autocast's): grad.mul_(1/scale),
                      clip_grad_norm_, AdamW(fused=True).step(), bf16 copy_
Bytes counted per parameter (reads + writes): fp32 AdamW 28 (p, g, m, v read;
p, m, v written); zfunc mixed step 30 (the norm pass reads the bf16 g, 2; the
update reads g, p, m, v, 14, writes p, m, v, 12, and the bf16 copy, 2). The
torch way moves 54 (unscale 8, norm 4, clip 8, AdamW 28, copy 6).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import zfunc.optim as zoptim  # noqa: E402
from _sizes import mixed_sizes, parse_size  # noqa: E402
from zfunc.ops import adam, builder, cpu_adam

LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8
LOSS_SCALE, MAX_NORM = 1024.0, 1.0
FP32_BYTES = 28
MIXED_BYTES = 2 + 14 + 14
COPY_N = 64 * 2**20  # elements per yardstick buffer (256 MiB): far beyond the caches


def bench_case(n: int, layout: str, threads: list[int], reps: int, foreach: bool,
               yard: dict) -> list[dict]:
    """Time every implementation on one size and layout; one row per (kind, threads)."""
    shapes = [n] if layout == "flat" else mixed_sizes(n)
    params = {f"p{i}": torch.empty(s).uniform_(-1, 1) for i, s in enumerate(shapes)}
    grads = {k: torch.empty_like(p).uniform_(-1e-2, 1e-2) for k, p in params.items()}
    plist, glist = list(params.values()), list(grads.values())
    g_src = [g * LOSS_SCALE for g in glist]  # the torch way starts each step from these

    opt = zoptim.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD)
    state = [opt.init(params)]
    mlist, vlist = list(state[0].mu.values()), list(state[0].nu.values())
    step = [0]

    def public():
        _, state[0] = opt.update(grads, state[0], params)

    def direct():
        step[0] += 1
        adam.adam_update_(plist, glist, mlist, vlist, step=step[0], lr=LR, beta1=BETAS[0],
                              beta2=BETAS[1], eps=EPS, weight_decay=WD, decoupled=True)

    tparams = [p.clone() for p in plist]
    for p, g in zip(tparams, glist):
        p.grad = g
    topt = torch.optim.AdamW(tparams, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    group = topt.param_groups[0]

    def torch_fused():
        group["fused"], group["foreach"] = True, False
        topt.step()

    def torch_foreach():
        group["fused"], group["foreach"] = False, True
        topt.step()

    # mixed precision: the zfunc side keeps master = plist and its moments, the
    # torch side tparams and topt's; both write a bf16 model copy
    g16 = [g.to(torch.bfloat16) for g in g_src]
    low, tlow = [p.to(torch.bfloat16) for p in plist], [p.to(torch.bfloat16) for p in tparams]

    def ours_mixed():
        step[0] += 1
        sumsq, finite = cpu_adam.nonfinite_and_sq_norm(g16)
        if not finite:
            return
        clip = min(1.0, MAX_NORM / (math.sqrt(sumsq) / LOSS_SCALE + 1e-6))
        adam.adam_update_(plist, g16, mlist, vlist, step=step[0], lr=LR, beta1=BETAS[0],
                              beta2=BETAS[1], eps=EPS, weight_decay=WD, decoupled=True,
                              grad_scale=clip / LOSS_SCALE, lowp_params=low)

    def restore_grads():  # untimed: the torch way scales the grads in place
        torch._foreach_copy_(glist, g_src)

    def torch_mixed():
        group["fused"], group["foreach"] = True, False
        torch._foreach_mul_(glist, 1.0 / LOSS_SCALE)
        torch.nn.utils.clip_grad_norm_(tparams, MAX_NORM, foreach=True)
        topt.step()
        torch._foreach_copy_(tlow, tparams)

    fns = {("fp32", "zfunc.optim.adamw"): public, ("fp32", "adam_update_"): direct,
           ("fp32", "torch fused"): torch_fused, ("fp32", "torch foreach"): torch_foreach,
           ("mixed", "zfunc fused"): ours_mixed, ("mixed", "torch way"): (restore_grads, torch_mixed),
           ("yard", "copy"): lambda: yard["copy"](yard["dst"], yard["src"]),
           ("yard", "in-place"): lambda: yard["src"].mul_(1.0)}
    if not foreach:
        del fns[("fp32", "torch foreach")]

    times = {(t, k): [] for t in threads for k in fns}
    saved = torch.get_num_threads()
    try:
        keys = list(fns)
        for r in range(reps + 1):  # round 0 warms up: lazy state, page faults, first calls
            for t in threads:
                torch.set_num_threads(t)
                # rotate the order each round: no implementation always runs
                # first after a thread-count switch or after the same neighbour
                for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                    fn = fns[key]
                    prepare, fn = fn if isinstance(fn, tuple) else (None, fn)
                    if prepare is not None:
                        prepare()
                    t0 = time.perf_counter()
                    fn()
                    if r:
                        times[(t, key)].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(saved)

    rows = []
    for t in threads:
        yard_t = {name: times[(t, ("yard", name))] for name in ("copy", "in-place")}
        for kind in ("fp32", "mixed"):
            rows.append(dict(kind=kind, threads=t, n=n, layout=layout, tensors=len(shapes),
                             yard_bytes=8 * COPY_N,
                             times={**{name: times[(t, (k, name))] for k, name in fns
                                       if k == kind}, **yard_t}))
    return rows


# ----------------------------------------------------------------- the report

def fmt_rows(rows: list[dict], stat: str = "median") -> str:
    med = statistics.median if stat == "median" else min
    gbs = lambda r, k, nbytes: nbytes / med(r["times"][k]) / 1e9  # noqa: E731
    gps = lambda r, k: f"{r['n'] / med(r['times'][k]) / 1e9:.2f}" if k in r["times"] else "-"  # noqa: E731
    out = []
    for kind, ours, other, nbytes, impls, title in (
        ("fp32", "zfunc.optim.adamw", "torch fused", FP32_BYTES,
         ["zfunc.optim.adamw", "adam_update_", "torch fused", "torch foreach"],
         f"fp32 AdamW: G param/s ({stat}); ours = zfunc.optim.adamw, {FP32_BYTES} B/param"),
        ("mixed", "zfunc fused", "torch way", MIXED_BYTES, ["zfunc fused", "torch way"],
         f"Mixed-precision step (unscale, clip, AdamW, bf16 copy): G param/s ({stat}); "
         f"ours = zfunc fused, {MIXED_BYTES} B/param"),
    ):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        head = (["threads", "params", "layout"] + impls
                + [f"ours / {other}", "ours GB/s", "copy GB/s", "in-place GB/s", "ours / copy",
                   "ours / in-place"])
        body = []
        for r in sel:
            bw = gbs(r, ours, nbytes * r["n"])
            copy, inplace = gbs(r, "copy", r["yard_bytes"]), gbs(r, "in-place", r["yard_bytes"])
            body.append([str(r["threads"]), _size(r["n"]), _layout(r)]
                        + [gps(r, k) for k in impls]
                        + [f"{med(r['times'][other]) / med(r['times'][ours]):.2f}x",
                           f"{bw:.1f}", f"{copy:.1f}", f"{inplace:.1f}",
                           f"{bw / copy:.2f}", f"{bw / inplace:.2f}"])
        out += ([""] if out else []) + [title, "", _md(head, body)]
    return "\n".join(out)


def _size(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else str(n)


def _layout(r: dict) -> str:
    return "flat" if r["layout"] == "flat" else f"{r['tensors']} tensors"


def _md(head: list[str], body: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(out + ["| " + " | ".join(row) + " |" for row in body])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50M,200M", help="comma list (default 50M,200M)")
    ap.add_argument("--layouts", default="flat,tensors", help="flat and/or tensors")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (median reported)")
    ap.add_argument("--foreach-max", default="50M",
                    help="time torch foreach only up to this size (it is slow; default 50M)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="statistic over the rounds (min: best round, steadier on a busy machine)")
    ap.add_argument("--json", help="also write the raw timings here")
    ap.add_argument("--from-json", help="print the tables of an earlier --json run and exit")
    args = ap.parse_args()
    if args.from_json:
        print(fmt_rows(json.loads(Path(args.from_json).read_text()), args.stat))
        return
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    foreach_max = parse_size(args.foreach_max)

    kernel = cpu_adam.load()
    row = next(r for r in builder.report() if r["name"] == cpu_adam.NAME)
    streaming = builder.load("bench_stream_copy", ["bench/stream_copy.cpp"])
    yard = {"src": torch.rand(COPY_N)}
    yard["dst"] = torch.empty_like(yard["src"])
    yard["copy"] = (streaming.stream_copy if streaming is not None
                    else lambda dst, src: dst.copy_(src))
    rows = []
    t0 = time.perf_counter()
    for n in sizes:
        for layout in [s.strip() for s in args.layouts.split(",")]:
            rows += bench_case(n, layout, threads, args.reps, n <= foreach_max, yard)
            print(f"# {_size(n)} {layout}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"torch {torch.__version__}; zfunc cpu_adam kernel: "
          f"{'built' if kernel is not None else 'NOT built (' + row['reason'] + ')'}; "
          f"copy yardstick: {'streaming stores' if streaming is not None else 'dst.copy_(src)'}; "
          f"{args.reps} rounds")
    print()
    print(fmt_rows(sorted(rows, key=lambda r: (r["kind"], r["threads"])), args.stat))


if __name__ == "__main__":
    main()
