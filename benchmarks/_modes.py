"""The modes of zero_vs_fsdp.py and offload.py: the command line they share, the worker that trains
one mode on one rank (a fresh process) and measures it, and ``run_mode``, which runs one mode on W
fresh ranks and gathers what they measured.

The worker builds the GPT of examples/gpt.py, the same initial weights in every mode, has
benchmarks/_peers.py make the mode's peer of it, and trains it on the same synthetic batches. It measures
each step's time, the bytes all-gathered (``GatherCounter``) and moved to and from disk, and the
peak RSS per segment of the run (setup, the first step, the rest of the warm-up, the timed steps:
the high-water mark, reset at each segment's start; zfunc.testing.memory). Run by ``run_mode`` as
``python benchmarks/_modes.py --worker MODE ...``.
"""
import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import zfunc as zf
from zfunc.testing import memory

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from _launch import launch  # noqa: E402
from _peers import PEERS, Settings, build, init_distributed, lm_loss  # noqa: E402
from _worker import disk_io_bytes  # noqa: E402
from gpt import GPT, GPTConfig, num_params, rank_generator  # noqa: E402

MODES = ["local", "ddp", "fsdp2", "zero0", "zero1", "zero2", "zero3", "zero3_noprefetch", "ds1", "ds2", "ds3", "zero3_cpu",
         "zero3_cpu_overlap", "ds3_cpu", "zero3_nvme", "zero3_nvme_small", "zero3_nvme_noprefetch",
         "zero3_nvme_small_noprefetch", "ds3_nvme", "fsdp2-compile", "zero3-compile", "zero3-jit", "zero3-jit-regather"]
COMPILED = {m: PEERS[m].eager for m in MODES if PEERS[m].eager}  # compiled mode -> its eager mode
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
BF16_TOLERANCE, FP32_TOLERANCE = 2e-2, 1e-5
# Compiled modes in fp32: 10x the eager tolerance. Inductor fuses and reorders float
# reductions (layer norm's mean and variance, softmax's max and sum, the bias and weight
# gradients' sums over tokens, in its own vectorised loop order), so each such op rounds
# differently from eager's, at a few fp32 ulps (1e-7 relative); AdamW then carries the
# differences forward (where a gradient is small its update is about lr * sign(g), so a rounding
# difference there moves a weight by up to lr) and they compound over the steps. Measured
# (2 ranks, fp32, inductor, torch 2.13 CPU): at most 1.1e-7 relative after 15 steps at 4 layers
# of width 256 (zero3-compile against zero3), 7e-8 after 7 steps at --small (fsdp2-compile,
# zero3-compile, zero3-jit against fsdp2). 1e-4 leaves three orders of magnitude for longer runs
# and wider models, and stays tight because these losses hardly move (random tokens: 8.36-8.42
# over those 15 steps, near ln(vocab)), so a computation that is wrong (a gradient left
# unreduced or counted twice, a stale parameter) changes the updates themselves, not their
# rounding, and must not hide under a loose bound. In bf16 the bf16 tolerance already covers it.
COMPILE_FP32_TOLERANCE = 1e-4


def have_jit():
    return hasattr(zf, "jit")


def have_deepspeed():
    return importlib.util.find_spec("deepspeed") is not None


def parser(description=None):
    """The options every mode's run needs (the model, the batch, the ranks, the precision); a
    benchmark adds its own."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=None, help=f"comma-separated, from {','.join(MODES)} "
                   "(default: ddp,fsdp2,zero0,zero1,zero2,zero3, plus ds1,ds2,ds3 when deepspeed is installed)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512, help="d_model")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--world", type=int, default=2, help="ranks")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--torch-adam", default="fused", choices=["fused", "foreach", "for-loop"],
                   help="implementation of torch.optim.AdamW for the torch and DeepSpeed modes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefetch-bucket", type=float, default=None,
                   help="zfunc zero3 modes: the coordinator's prefetch_bucket_size in elements (default: zfunc's)")
    p.add_argument("--reuse-distance", type=float, default=None,
                   help="zfunc zero3 modes: the coordinator's max_reuse_distance in elements (default: zfunc's)")
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="fp32, or bf16 compute with fp32 master weights and fp32 gradient reduction")
    p.add_argument("--tolerance", type=float, default=None,
                   help=f"relative loss difference flagged as a mismatch (default {FP32_TOLERANCE:g} in fp32, "
                   f"{BF16_TOLERANCE:g} in bf16)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled modes (fsdp2-compile, zero3-compile, zero3-jit); "
                   "aot_eager or eager to tell a compiler problem from a tracing one")
    p.add_argument("--compile-threads", type=int, default=1,
                   help="TORCHINDUCTOR_COMPILE_THREADS per rank: 1 compiles in the rank's own process, so the first "
                   "step's peak RSS counts the compiler; more starts inductor's worker pool, whose memory is not counted")
    p.add_argument("--compile-tolerance", type=float, default=None,
                   help=f"relative loss difference flagged as a mismatch for the compiled modes (default "
                   f"{COMPILE_FP32_TOLERANCE:g} in fp32, the bf16 tolerance in bf16; see COMPILE_FP32_TOLERANCE)")
    p.add_argument("--preload-compiler", action="store_true",
                   help="import torch's compiler (dynamo, inductor: about 120 MiB of code) in every mode before the "
                   "baseline RSS, so 'peak above baseline' compares the models' memory, compiled or not")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mode before its processes are killed")
    p.add_argument("--nvme-path", default=None, help="folder for the *_nvme modes' swap files (default: a temporary "
                   "folder under $TMPDIR, on whatever disk holds it)")
    p.add_argument("--small", action="store_true", help="tiny model and few steps, for smoke testing")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one mode on this rank
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None, p=None):
    """``p``'s (by default ``parser()``'s) options, with the defaults that depend on others filled in."""
    p = p or parser()
    args = p.parse_args(argv)
    if args.small:
        args.layers, args.width, args.heads, args.vocab, args.seq, args.steps, args.warmup = 2, 128, 4, 1024, 64, 5, 2
    if args.modes is None:
        args.modes = "ddp,fsdp2,zero0,zero1,zero2,zero3" + (",ds1,ds2,ds3" if have_deepspeed() else "")
    args.modes = args.modes.split(",")
    if args.tolerance is None:
        args.tolerance = BF16_TOLERANCE if args.precision == "bf16" else FP32_TOLERANCE
    if args.compile_tolerance is None:
        args.compile_tolerance = max(args.tolerance, BF16_TOLERANCE if args.precision == "bf16" else COMPILE_FP32_TOLERANCE)
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if "zero3-jit" in args.modes and not have_jit():
        p.error(f"mode zero3-jit needs zf.jit, which the zfunc at {os.path.dirname(zf.__file__)} does not have; "
                "leave zero3-jit out of --modes")
    if any(m in COMPILED for m in args.modes) and args.warmup < 1 and not args.worker:
        p.error("compiled modes need --warmup >= 1: the first step is their compile, reported apart from the timed steps")
    return args


# -----------------------------------------------------------------------------
# worker: one mode on one rank


class GatherCounter:
    """Sums the output bytes of every all-gather this process starts.

    Wraps torch.distributed.all_gather_single (in the package and in distributed_c10d,
    whose all_gather_into_tensor and _all_gather_base call it by its global name, so each
    gather is counted once) and the list-valued all_gather. Installed before any model or
    step exists; zfunc, FSDP2 and DeepSpeed look these up at call time."""

    def __init__(self):
        self.bytes = 0
        c10d = dist.distributed_c10d
        for name, size in (("all_gather_single", lambda a, kw: _nbytes(a[0] if a else kw["output_tensor"])),
                           ("all_gather", lambda a, kw: sum(_nbytes(t) for t in (a[0] if a else kw["tensor_list"])))):
            orig = getattr(c10d, name)
            wrapped = self._wrap(orig, size)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)

    def _wrap(self, orig, size):
        def wrapped(*a, **kw):
            self.bytes += size(a, kw)
            return orig(*a, **kw)
        wrapped.__wrapped__ = orig
        return wrapped

    def take(self):
        n, self.bytes = self.bytes, 0
        return n


def _nbytes(t):
    return t.numel() * t.element_size()


def settings(args, world):
    """The peers' shared settings from the command line."""
    coordinator = {}
    if args.prefetch_bucket is not None:
        coordinator["prefetch_bucket_size"] = int(args.prefetch_bucket)
    if args.reuse_distance is not None:
        coordinator["max_reuse_distance"] = int(args.reuse_distance)
    return Settings(lr=args.lr, wd=args.wd, adam=args.torch_adam, bf16=args.precision == "bf16", world=world,
                    batch=args.batch, nvme_path=args.nvme_path, compile_backend=args.compile_backend,
                    coordinator=coordinator)


def worker(args):
    mode = args.worker
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # every rank compiles cold, into its own cache: no repeat, mode or rank reuses another's kernels
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{args.result}.rank{os.environ.get('RANK', '0')}.inductor"
    gathers = GatherCounter()  # before deepspeed's comm backend or any step is built
    if mode == "local":
        rank, world = 0, 1
    else:
        init_distributed(mode, "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()

    if args.preload_compiler:  # the compiler's own code in every mode's baseline, so above it is the model's
        importlib.import_module("torch._inductor.compile_fx")
    baseline_rss = memory.rss()  # libraries and process group, before the model exists
    torch.manual_seed(args.seed)  # the same initial weights in every mode and on every rank
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width, n_layers=args.layers,
                    n_heads=args.heads, tie_embeddings=False)
    model = GPT(cfg)
    n_params = num_params(model)
    misses = []  # zfunc modes: the coordinator's misses, per step
    train = build(mode, model, model.blocks, lambda forward, b: lm_loss(forward(b[0]), b[1]), settings(args, world),
                  on_metrics=lambda m: misses.append(m.get("prefetch", {}).get("misses")))

    # synthetic tokens, the same in every mode: rank r's batches, or all ranks' concatenated for "local"
    gens = [rank_generator(args.seed, r) for r in range(args.world)] if mode == "local" else [rank_generator(args.seed, rank)]
    batches = []
    for _ in range(args.warmup + args.steps):
        tokens = torch.cat([torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g) for g in gens])
        batches.append((tokens[:, :-1], tokens[:, 1:]))

    times, losses, gathered, io = [], [], [], []
    gathers.take()  # setup's gathers (FSDP2's init, zfunc's step.init) are not a step's
    # peak RSS in segments: setup, the first step (a compiled mode's compile), the rest of the
    # warm-up, the timed steps (the steady state); each segment's high-water mark apart
    # (step index -> the segment that ends before it)
    ends = {args.warmup: "warmup", 1: "first_step", 0: "setup"}
    peaks, resettable = {}, True
    for i, batch in enumerate(batches):
        if i in ends:
            peaks[ends[i]] = memory.peak()
            try:
                memory.reset_peak()
            except OSError:  # the kernel refuses: the peaks that follow are the process's so far
                resettable = False
        io0 = disk_io_bytes()
        t0 = time.perf_counter()
        losses.append(train([batch]).item())
        if i == len(batches) - 1:
            train.settle()  # the last step pays for its own update, as every other one did for its predecessor's
        times.append(time.perf_counter() - t0)
        gathered.append(gathers.take())
        io.append([b - a for a, b in zip(io0, disk_io_bytes())])

    peaks["steady"] = memory.peak()  # the timed steps (after the last reset)
    if mode.startswith("zero3-jit"):  # functional collectives inside compiled code: the wrapper saw none of them
        gathered = [None] * len(gathered)
    losses = torch.tensor(losses, dtype=torch.float64)
    if mode != "local" and PEERS[mode].kind != "zfunc":  # zfunc's loss is the ranks' mean already
        dist.all_reduce(losses)
        losses /= world
    result = dict(mode=mode, rank=rank, world=world, params=n_params, step_s=times[args.warmup:],
                  median_step_s=statistics.median(times[args.warmup:]), losses=losses.tolist(),
                  all_gather_bytes=gathered,
                  median_all_gather_bytes=None if None in gathered else statistics.median(gathered[args.warmup:]),
                  median_read_bytes=statistics.median(r for r, _ in io[args.warmup:]),
                  median_write_bytes=statistics.median(w for _, w in io[args.warmup:]),
                  peak_rss_bytes=max(peaks.values()), baseline_rss_bytes=baseline_rss,
                  first_step_s=times[0], first_step_peak_rss_bytes=peaks["first_step"],
                  steady_peak_rss_bytes=peaks["steady"], peaks_reset=resettable,
                  prefetch_misses=misses)
    with open(f"{args.result}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():  # gloo may abort at interpreter exit otherwise
        dist.barrier()
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# driver: one mode on W fresh ranks


def run_mode(mode, args, tmp, repeat):
    world = 1 if mode == "local" else args.world
    threads = args.threads * args.world if mode == "local" else args.threads
    result = os.path.join(tmp, f"{mode}.{repeat}")
    argv = [os.path.abspath(__file__), "--worker", mode, "--result", result] + [
        f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
        ("steps", "warmup", "layers", "width", "heads", "vocab", "seq", "batch", "world", "lr", "wd", "torch_adam", "seed",
          "precision", "nvme_path", "prefetch_bucket", "reuse_distance", "compile_backend") if getattr(args, k) is not None
    ] + (["--preload-compiler"] if args.preload_compiler else [])
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TORCHINDUCTOR_COMPILE_THREADS": str(args.compile_threads)}
    if mode.startswith("ds"):
        env["DS_ACCELERATOR"] = "cpu"
    t0 = time.perf_counter()
    rcs = launch(argv, world, env=env, timeout=args.timeout)
    if any(rcs):
        print(f"[{mode}] failed: exit codes {rcs}", file=sys.stderr)
        return None
    ranks = []
    for r in range(world):
        with open(f"{result}.rank{r}.json") as f:
            ranks.append(json.load(f))
    out = dict(mode=mode, repeat=repeat, params=ranks[0]["params"], median_step_s=ranks[0]["median_step_s"],
               peak_rss_bytes=max(r["peak_rss_bytes"] for r in ranks),
               peak_above_baseline_bytes=max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in ranks), losses=ranks[0]["losses"],
               final_loss=ranks[0]["losses"][-1], all_gather_bytes=ranks[0]["median_all_gather_bytes"],
               read_bytes=max(r["median_read_bytes"] for r in ranks), write_bytes=max(r["median_write_bytes"] for r in ranks),
               misses_after_first=max((m for rk in ranks for m in rk["prefetch_misses"][1:] if m is not None), default=None),
               first_step_s=ranks[0]["first_step_s"], first_step_peak_rss_bytes=max(r["first_step_peak_rss_bytes"] for r in ranks),
               steady_peak_rss_bytes=max(r["steady_peak_rss_bytes"] for r in ranks), peaks_reset=all(r["peaks_reset"] for r in ranks),
               ranks=ranks)
    gather = "" if out["all_gather_bytes"] is None else f"{out['all_gather_bytes'] / 1e6:.2f} MB all-gathered/step, "
    print(f"[{mode}] repeat {repeat}: {out['median_step_s']:.3f} s/step, {out['peak_rss_bytes'] / 1e9:.2f} GB peak RSS, "
          f"{gather}first step {out['first_step_s']:.2f} s at {out['first_step_peak_rss_bytes'] / 1e9:.2f} GB peak RSS, "
          f"loss {out['final_loss']:.6f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return out


def per_repeat_ratio(results, m, other, key="median_step_s"):
    """Median over repeats of m's step time (or `key`) / other's in the same repeat (nan if none in
    common): the machine drifts between repeats more than modes differ within one."""
    t = {o: {r.get("repeat", i): r[key] for i, r in enumerate(results[o]) if r.get(key) is not None} for o in (m, other)}
    common = sorted(set(t[m]) & set(t[other]))
    return statistics.median(t[m][k] / t[other][k] for k in common) if common else float("nan")


def precision_text(precision):
    if precision == "bf16":
        return ("bf16 (zfunc: mixed_precision, bf16 params, fp32 master + fp32 grad reduce; FSDP2: MixedPrecisionPolicy "
                "bf16/fp32 reduce; DeepSpeed: bf16, its default bf16 gradient reduce; DDP: autocast bf16 over fp32 weights)")
    return "fp32"


if __name__ == "__main__":
    worker(parse_args())
