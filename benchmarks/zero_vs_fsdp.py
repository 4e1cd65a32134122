"""zfunc ZeRO-1/2/3 against torch DDP, torch FSDP2 and (if installed) DeepSpeed, side by side.

    python benchmarks/zero_vs_fsdp.py                  # the anchor's setup, W=2 gloo ranks, 1 thread each
    python benchmarks/zero_vs_fsdp.py --repeats 3      # modes interleaved 3 times, medians reported
    python benchmarks/zero_vs_fsdp.py --small          # smoke test, well under a minute
    python benchmarks/zero_vs_fsdp.py --precision bf16 # bf16 compute, fp32 master weights and gradient reduction
    python benchmarks/zero_vs_fsdp.py --plot out.png   # also draw step time and peak RSS per mode (matplotlib)
    python benchmarks/zero_vs_fsdp.py --modes fsdp2,fsdp2-compile,zero3,zero3-compile,zero3-jit --repeats 3
                                                       # torch.compile: each compiled mode beside its eager one

Every mode runs in its own fresh set of W processes (benchmarks/_modes.py's worker; each peer built
by benchmarks/_peers.py), so peak RSS per rank (the process's RSS high-water mark, VmHWM: see
zfunc.testing.memory) is that mode's alone. All modes train the same model from the
same initial weights on the same synthetic batches, so they must reach the same
loss: the table checks that, and says so loudly when they do not (to 1e-5 relative in
fp32; to 2e-2 under bf16, where each mode rounds in its own places).

--precision bf16: zfunc runs `zeroN(mixed_precision(train_step(...), torch.bfloat16))`
(bf16 parameters, fp32 master weights, gradients reduced in fp32); FSDP2 gets
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); DDP (and "local") run their
forward under torch.autocast("cpu", bf16) with fp32 weights and gradients; DeepSpeed gets
"bf16": {"enabled": true} and its defaults otherwise (so it reduces gradients in bf16, half
the bytes zfunc and FSDP2 reduce in fp32). Every mode casts the logits to fp32 before the cross-entropy.

Compiled modes (--compile-backend, default inductor):
  fsdp2-compile  torchtitan's recipe: each block `torch.compile(block, backend=..., fullgraph=True)` and
                 registered back in its ModuleList (apply_compile), then fully_shard per block + root
                 (apply_fsdp): FSDP2's hooks run on the wrapper, outside the compiled code
  zero3-compile  zfunc zero3 with `zf.compile_units(model, backend=..., fullgraph=True)` before step.init
                 (each block compiled in place; zfunc gathers each unit outside its compiled code)
  zero3-jit      `zf.jit(zf.zero3(...), backend=...)`: forward and backward traced as one program with
                 functional collectives (needs zf.jit: without it the mode says so and the script exits)
  zero3-jit-regather  the same with `regather=True`: each unit gathered again in backward
A compiled mode's first step is its compile: the script reports it apart (its time, and the
peak RSS per rank during it) from the steady state (the median timed step, and the peak RSS
per rank over the timed steps), with each compiled mode against its own eager mode and
zero3-compile against fsdp2-compile, all in the same run. The peaks are the kernel's
high-water mark (VmHWM), reset before the first step and before the first timed step
(/proc/self/clear_refs). Every rank compiles cold: its own empty inductor cache
(TORCHINDUCTOR_CACHE_DIR), so no repeat or rank reuses another's kernels; and in its own
process (--compile-threads 1, TORCHINDUCTOR_COMPILE_THREADS), so the first step's peak RSS
holds the compiler's memory too (inductor's worker pool, with more threads, would not be counted).

"all-gather MB per step" is measured, not computed: each worker wraps
torch.distributed's all_gather_single (which all_gather_into_tensor and _all_gather_base
call, and through which zfunc, FSDP2 and DeepSpeed gather) and all_gather, and sums the
bytes of their output tensors on rank 0, per timed step (median over the timed steps).
zero3-jit's gathers are functional collectives called from compiled code, which that Python
wrapper never sees: its column stays empty.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _modes import (BF16_TOLERANCE, COMPILE_FP32_TOLERANCE, COMPILED, FP32_TOLERANCE, have_deepspeed, parse_args,  # noqa: E402
                    parser, per_repeat_ratio, precision_text, run_mode)
from _peers import PEERS  # noqa: E402
from _plot import pyplot, save  # noqa: E402


def arguments():
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=1, help="run the whole set of modes this many times, interleaved")
    p.add_argument("--json", default=None, help="also write all raw results here")
    p.add_argument("--from-json", default=None, help="print the table of an earlier --json run and exit")
    p.add_argument("--plot", default=None, metavar="PATH", help="also draw step time and peak RSS per mode "
                   "into this image (needs matplotlib: the benchmark extra)")
    return parse_args(p=p)


def mode_label(mode, precision):
    """The mode's label, plus how that mode computes in bf16 where it differs from the header's."""
    if precision == "bf16" and mode in ("ddp", "local"):
        return PEERS[mode].label + " + autocast(cpu, bf16), fp32 weights"
    return PEERS[mode].label


def table(results, args):
    modes = [m for m in args.modes if results[m]]
    precision = getattr(args, "precision", "fp32")  # --from-json files written before --precision
    summary = {m: dict(step_s=statistics.median(r["median_step_s"] for r in results[m]),
                       rss=statistics.median(r["peak_rss_bytes"] for r in results[m]),
                       rss_above=statistics.median(r["peak_above_baseline_bytes"] for r in results[m]),
                       loss=results[m][0]["final_loss"], params=results[m][0]["params"],
                       all_step_s=[r["median_step_s"] for r in results[m]],
                       gather=(statistics.median(r["all_gather_bytes"] for r in results[m])
                               if all(r.get("all_gather_bytes") is not None for r in results[m]) else None)) for m in modes}
    base = "fsdp2" if "fsdp2" in summary else modes[0]
    ref = "local" if "local" in summary else ("ddp" if "ddp" in summary else modes[0])
    b, mismatches = summary[base], []

    def time_ratio(m, other):
        return per_repeat_ratio(results, m, other)

    ddp = "ddp" if "ddp" in summary and base != "ddp" else None
    lines = [f"| mode | median step s | time / {base} |" + (" time / ddp |" if ddp else "")
             + f" peak RSS per rank | RSS / {base} | peak above baseline | "
             f"above / {base} | above / Ψ | ZeRO formula / Ψ | all-gather MB per step | prefetch misses per step after the first | loss after {args.warmup + args.steps} steps | agrees with {ref} |",
             "| --- | ---: | ---: |" + (" ---: |" if ddp else "") + " ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for m in modes:
        s = summary[m]
        rel = abs(s["loss"] - summary[ref]["loss"]) / abs(summary[ref]["loss"])
        tolerance = loss_tolerance(m, args)
        ok = rel <= tolerance
        if not ok:
            mismatches.append(f"{mode_label(m, precision)} reached {s['loss']:.8f}, {ref} {summary[ref]['loss']:.8f}: "
                              f"relative difference {rel:.2e} > {tolerance:g}")
        spread = "" if len(s["all_step_s"]) == 1 else f" ({min(s['all_step_s']):.3f}-{max(s['all_step_s']):.3f})"
        gather = "" if s["gather"] is None else f"{s['gather'] / 1e6:.2f}"
        misses = [r.get("misses_after_first") for r in results[m]]
        misses = "" if None in misses else f"{max(misses)}"
        lines.append(f"| {mode_label(m, precision)} | {s['step_s']:.3f}{spread} | {time_ratio(m, base):.2f} |"
                     + (f" {time_ratio(m, ddp):.2f} |" if ddp else "") + f" {s['rss'] / 1e9:.2f} GB | "
                     f"{s['rss'] / b['rss']:.2f} | {s['rss_above'] / 1e9:.2f} GB | {s['rss_above'] / b['rss_above']:.2f} | "
                     f"{s['rss_above'] / s['params']:.1f} | {formula_per_param(m, precision, args.world)} | {gather} | {misses} | {s['loss']:.6f} | {'yes' if ok else '**NO**'} ({rel:.1e}) |")
    for m in modes:  # a rerun of the same mode must give the same loss too
        if len({r["final_loss"] for r in results[m]}) > 1:
            mismatches.append(f"{mode_label(m, precision)} gave different losses in different repeats: {[r['final_loss'] for r in results[m]]}")
    return "\n".join(lines), summary, mismatches


def loss_tolerance(mode, args):
    """The relative loss difference a mode may show against the reference: the compiled modes'
    is wider (COMPILE_FP32_TOLERANCE: inductor rounds its fused reductions in its own order)."""
    if mode in COMPILED:
        return getattr(args, "compile_tolerance", None) or max(args.tolerance, COMPILE_FP32_TOLERANCE)
    return args.tolerance


def compile_table(results, args):
    """The compiled modes' first step (their compile) apart from their steady state, beside their
    eager modes; ratios per repeat (medians over repeats), each compiled mode against its own eager
    mode and zero3-compile against fsdp2-compile. None when the run has no compiled mode."""
    present = [m for m in args.modes if results.get(m)]
    if not any(m in COMPILED for m in present):
        return None
    precision = getattr(args, "precision", "fp32")
    shown = [m for m in present if m in COMPILED or m in COMPILED.values()]
    keys = ("first_step_s", "first_step_peak_rss_bytes", "median_step_s", "steady_peak_rss_bytes")

    def med(m, key):
        vals = [r.get(key) for r in results[m]]
        return None if None in vals else statistics.median(vals)

    def cell(v, unit):
        if v is None:
            return "n/a"
        return f"{v / 1e9:.3f} GB" if unit == "GB" else f"{v:.3f}"

    def spread(m, key):
        vals = [r.get(key) for r in results[m]]
        return "" if len(vals) < 2 or None in vals else f" ({min(vals):.2f}-{max(vals):.2f})"

    lines = ["| mode | first step s (compile) | first-step peak RSS per rank | steady step s (median timed) "
             "| steady peak RSS per rank (timed steps) | peak RSS per rank, whole run |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for m in shown:
        lines.append(f"| {mode_label(m, precision)} | {cell(med(m, 'first_step_s'), 's')}{spread(m, 'first_step_s')} | "
                     f"{cell(med(m, 'first_step_peak_rss_bytes'), 'GB')} | {cell(med(m, 'median_step_s'), 's')}"
                     f"{spread(m, 'median_step_s')} | {cell(med(m, 'steady_peak_rss_bytes'), 'GB')} | "
                     f"{cell(med(m, 'peak_rss_bytes'), 'GB')} |")
    pairs = [(m, e) for m, e in COMPILED.items() if m in present and e in present]
    if "zero3-compile" in present and "fsdp2-compile" in present:
        pairs.append(("zero3-compile", "fsdp2-compile"))
    if pairs:
        lines += ["", "| ratio | first step (compile) | first-step peak RSS | steady step | steady peak RSS |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for m, other in pairs:
            ratios = [per_repeat_ratio(results, m, other, key) for key in keys]
            lines.append(f"| {m} / {other} | " + " | ".join("n/a" if r != r else f"{r:.2f}" for r in ratios) + " |")
    if not all(r.get("peaks_reset", True) for m in shown for r in results[m]):
        lines.append("\n(The kernel refused to reset the RSS high-water mark (/proc/self/clear_refs): the first-step "
                     "and steady peaks are peaks since the process started.)")
    return "\n".join(lines)


def plot(summary, args, path):
    """Two panels, one bar per mode: median step time (whiskers: the repeats' range) and peak
    RSS per rank; zfunc's modes in one colour, the peers (DDP, FSDP2, DeepSpeed) in another."""
    plt = pyplot()
    modes = list(summary)
    labels = [mode_label(m, args.precision) for m in modes]
    colours = ["tab:blue" if m.startswith("zero") else "tab:gray" for m in modes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.45 * len(modes) + 1.6), sharey=True)
    y = range(len(modes))
    step = [summary[m]["step_s"] for m in modes]
    spread = [[s - min(summary[m]["all_step_s"]) for s, m in zip(step, modes)],
              [max(summary[m]["all_step_s"]) - s for s, m in zip(step, modes)]]
    left.barh(y, step, xerr=spread, color=colours, capsize=3)
    left.set_xlabel("median step time, s (whiskers: range over repeats)")
    right.barh(y, [summary[m]["rss"] / 1e9 for m in modes], color=colours)
    right.set_xlabel("peak RSS per rank, GB")
    left.set_yticks(list(y), labels)
    left.invert_yaxis()
    fig.suptitle(f"{args.precision}, W={args.world}, {args.layers} layers, d_model {args.width}, "
                 f"median over {args.repeats} repeat(s); blue: zfunc, grey: peers", fontsize=10)
    save(fig, path)


def formula_per_param(mode, precision, world):
    """Model-state bytes per parameter per rank by ZeRO's formulas (P, G, K bytes per parameter;
    fp32 AdamW: 4, 4, 8; bf16 with fp32 master: 2, 2, 12), for the modes they describe."""
    p, g, k = (2, 2, 12) if precision == "bf16" else (4, 4, 8)
    mode = COMPILED.get(mode, mode).removesuffix("_noprefetch")
    stage = {"ddp": 0, "local": 0, "zero0": 0, "zero1": 1, "ds1": 1, "zero2": 2, "ds2": 2, "zero3": 3, "ds3": 3,
             "fsdp2": 3}.get(mode)
    if stage is None:
        return ""
    return f"{[p + g + k, p + g + k / world, p + (g + k) / world, (p + g + k) / world][stage]:g}"


def main(args):
    failed = []
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        args = argparse.Namespace(**{"precision": "fp32", **saved["args"], "json": None, "plot": args.plot})
        results = saved["results"]
    else:
        results = {m: [] for m in args.modes}
        with tempfile.TemporaryDirectory(prefix="zero_vs_fsdp.") as tmp:
            if args.nvme_path is None:
                args.nvme_path = os.path.join(tmp, "swap")
            for repeat in range(args.repeats):
                for mode in args.modes:
                    out = run_mode(mode, args, tmp, repeat)
                    if out is None:
                        failed.append((mode, repeat))
                    else:
                        results[mode].append(out)
    if not any(results.values()):
        sys.exit("every mode failed")
    text, summary, mismatches = table(results, args)
    params = next(iter(summary.values()))["params"]
    print(f"\nGPT pre-LN, {args.layers} layers, d_model {args.width}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
          f"untied, {params / 1e6:.1f}M params, {precision_text(args.precision)}, AdamW (lr {args.lr}, wd {args.wd}; torch modes: {args.torch_adam}); "
          f"W={args.world} gloo ranks x {args.threads} thread(s), batch {args.world} x {args.batch}; "
          f"{args.warmup} warm-up + {args.steps} timed steps; median over {args.repeats} repeat(s); torch {torch.__version__}\n")
    print(text, flush=True)
    compiled = compile_table(results, args)
    if compiled:
        print(f"\ntorch.compile, backend {getattr(args, 'compile_backend', 'inductor')} (fullgraph=True per block for "
              f"fsdp2-compile and zero3-compile), each rank compiling cold in its own process "
              f"({getattr(args, 'compile_threads', 1)} compile thread(s)): the first step (the compile) and its peak RSS "
              "apart from the steady state; the eager modes' first steps beside them\n")
        print(compiled, flush=True)
    if args.plot:
        plot(summary, args, args.plot)
    print(f"\nLoss check: relative tolerance {args.tolerance:g} "
          f"({'bf16 default' if args.tolerance == BF16_TOLERANCE and args.precision == 'bf16' else 'fp32 default' if args.tolerance == FP32_TOLERANCE and args.precision == 'fp32' else 'set by --tolerance'}). "
          "All-gather MB: output bytes of every all-gather on rank 0 in one step, counted by wrapping "
          "torch.distributed.all_gather_single / all_gather in the worker."
          + (f" Compiled modes: relative tolerance {loss_tolerance(next(m for m in args.modes if m in COMPILED), args):g} "
             "(inductor rounds its fused reductions in its own order; see COMPILE_FP32_TOLERANCE); "
             "zero3-jit's all-gathers are functional collectives inside compiled code, not counted."
             if any(m in COMPILED for m in args.modes) else ""))
    if not have_deepspeed():
        print("\n(DeepSpeed modes skipped: `import deepspeed` fails here.)")
    if failed:
        print(f"\nFAILED runs (mode, repeat): {failed}")
    if mismatches:
        print("\n" + "!" * 72)
        for msg in mismatches:
            print(f"!!! LOSS MISMATCH: {msg}")
        print("!" * 72)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)
    sys.exit(1 if failed or mismatches else 0)


if __name__ == "__main__":
    main(arguments())
