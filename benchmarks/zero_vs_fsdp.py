"""zfunc ZeRO-1/2/3 against torch DDP, torch FSDP2 and (if installed) DeepSpeed, side by side.

    python benchmarks/zero_vs_fsdp.py                  # the anchor's setup, W=2 gloo ranks, 1 thread each
    python benchmarks/zero_vs_fsdp.py --repeats 3      # modes interleaved 3 times, medians reported
    python benchmarks/zero_vs_fsdp.py --small          # smoke test, well under a minute
    python benchmarks/zero_vs_fsdp.py --precision bf16 # bf16 compute, fp32 master weights and gradient reduction
    python benchmarks/zero_vs_fsdp.py --plot out.png   # also draw step time and peak RSS per mode (matplotlib)
    python benchmarks/zero_vs_fsdp.py --modes fsdp2,fsdp2-compile,zero3,zero3-compile,zero3-jit --repeats 3
                                                       # torch.compile: each compiled mode beside its eager one

Every mode runs in its own fresh set of W processes, so peak RSS per rank
(the process's RSS high-water mark, what getrusage's ru_maxrss reports) is that mode's alone. All modes train the same model from the
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
import importlib
import importlib.util
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import zfunc as zf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from _launch import launch  # noqa: E402
from _plot import pyplot, save  # noqa: E402
from gpt import GPT, GPTConfig, num_params, rank_generator  # noqa: E402

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

MODES = {  # key -> description
    "local": "one process, W threads, global batch",
    "ddp": "torch DDP",
    "fsdp2": "torch FSDP2 (fully_shard per block + root)",
    "zero0": "zfunc, no transform (replicated)",
    "zero1": "zfunc zero1",
    "zero2": "zfunc zero2",
    "zero3": "zfunc zero3",
    "zero3_noprefetch": "zfunc zero3, coordinator prefetch off (prefetch_bucket_size=0: on demand)",
    "ds1": "DeepSpeed ZeRO-1",
    "ds2": "DeepSpeed ZeRO-2",
    "ds3": "DeepSpeed ZeRO-3",
    "zero3_cpu": "zfunc zero3(offload_cpu(...))",
    "zero3_cpu_overlap": "zfunc zero3(offload_cpu(..., overlap=True)): the host update behind the next forward",
    "ds3_cpu": "DeepSpeed ZeRO-3, optimizer offloaded to CPU",
    "zero3_nvme": "zfunc zero3(offload_nvme(...)): params, grads, optimizer state on disk",
    "zero3_nvme_small": "zfunc zero3(offload_nvme(..., sub_group_size=1e6)): the update streams from disk",
    "zero3_nvme_noprefetch": "zfunc zero3(offload_nvme(...)), coordinator prefetch off (reads and gathers on demand)",
    "zero3_nvme_small_noprefetch": "zfunc zero3(offload_nvme(..., sub_group_size=1e6)), coordinator prefetch off",
    "ds3_nvme": "DeepSpeed ZeRO-3, params and optimizer state on NVMe",
    "fsdp2-compile": "torch FSDP2, torch.compile per block (torchtitan: compile each block, then fully_shard per block + root)",
    "zero3-compile": "zfunc zero3, zf.compile_units(model) (each block compiled in place)",
    "zero3-jit": "zfunc zf.jit(zero3(...)): forward and backward one compiled program",
    "zero3-jit-regather": "zfunc zf.jit(zero3(...), regather=True): the same, units gathered again in backward",
}
COMPILED = {"fsdp2-compile": "fsdp2", "zero3-compile": "zero3", "zero3-jit": "zero3", "zero3-jit-regather": "zero3"}  # compiled mode -> its eager mode


def mode_label(mode, precision):
    """MODES[mode], plus how that mode computes in bf16 where it differs from the header's."""
    if precision == "bf16" and mode in ("ddp", "local"):
        return MODES[mode] + " + autocast(cpu, bf16), fp32 weights"
    return MODES[mode]


def have_jit():
    return hasattr(zf, "jit")


def have_deepspeed():
    return importlib.util.find_spec("deepspeed") is not None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--repeats", type=int, default=1, help="run the whole set of modes this many times, interleaved")
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
    p.add_argument("--json", default=None, help="also write all raw results here")
    p.add_argument("--from-json", default=None, help="print the table of an earlier --json run and exit")
    p.add_argument("--plot", default=None, metavar="PATH", help="also draw step time and peak RSS per mode "
                   "into this image (needs matplotlib: the benchmark extra)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one mode on this rank
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
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


ADAM_IMPL = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}


def torch_adamw(params, args):
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.wd, **ADAM_IMPL[args.torch_adam])


def lm_loss(logits, y):
    """Next-token cross-entropy; bf16 logits are cast to fp32 first (a no-op in fp32), in every mode."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


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


def fsdp2_shard(model, world, bf16, device="cpu"):
    """FSDP2 as torchtitan applies it: fully_shard per block, then the root; bf16: MixedPrecisionPolicy
    (bf16 parameters, fp32 gradient reduction)."""
    mesh = init_device_mesh(device, (world,))
    mp = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if bf16 else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **mp)
    fully_shard(model, mesh=mesh, **mp)
    return model


def ds_config(mode, args):
    """The DeepSpeed config dict of mode ds1/ds2/ds3, ds3_cpu, ds3_nvme."""
    bf16 = args.precision == "bf16"
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": dict(lr=args.lr, weight_decay=args.wd, torch_adam=True, **ADAM_IMPL[args.torch_adam])},
        "zero_optimization": {"stage": int(mode[2])},
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; the others do not clip
    }
    if mode.endswith("_cpu"):  # torch AdamW on the offloaded state (DeepSpeedCPUAdam would need its op JIT-built)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        config["zero_force_ds_cpu_optimizer"] = False
    if mode.endswith("_nvme"):  # ZeRO-Infinity with its defaults (buffer_count 5 x buffer_size 1e8, aio)
        nvme = {"device": "nvme", "nvme_path": args.nvme_path, "pin_memory": False}
        config["zero_optimization"]["offload_param"] = dict(nvme)
        config["zero_optimization"]["offload_optimizer"] = dict(nvme)
        config["zero_force_ds_cpu_optimizer"] = False
    if bf16:  # bf16 parameters, fp32 master weights; DeepSpeed's default reduces gradients in bf16
        config["bf16"] = {"enabled": True}
    return config


def build(mode, model, args, world):
    """Returns train(x, y) -> loss tensor, one optimizer step, and whether that loss is
    already the global mean (zfunc) or this rank's own (the others)."""

    bf16 = args.precision == "bf16"

    def torch_train(module, opt, autocast=False):
        def train(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = module(x)
            loss = lm_loss(logits, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        return train

    if mode == "local":
        return torch_train(model, torch_adamw(model.parameters(), args), autocast=bf16), True
    if mode == "ddp":
        ddp = DDP(model)
        return torch_train(ddp, torch_adamw(ddp.parameters(), args), autocast=bf16), False
    compile_kw = dict(backend=args.compile_backend, fullgraph=True)  # torchtitan's: one graph per block or an error
    if mode in ("fsdp2", "fsdp2-compile"):
        if mode == "fsdp2-compile":  # torchtitan's apply_compile, then its apply_fsdp on the wrapped blocks below
            for name, block in model.blocks.named_children():
                model.blocks.register_module(name, torch.compile(block, **compile_kw))
        fsdp2_shard(model, world, bf16)
        return torch_train(model, torch_adamw(model.parameters(), args)), False
    if mode.startswith("zero"):
        def loss_fn(params, batch):
            x, y = batch
            return lm_loss(zf.apply(model, params, x), y)

        eager_mode = COMPILED.get(mode, mode)
        on_demand = eager_mode.endswith("_noprefetch")  # the coordinator issues nothing ahead of use
        stage, _, offload = eager_mode.removesuffix("_noprefetch").partition("_")
        shard = {"zero0": lambda s: s, "zero1": zf.zero1, "zero2": zf.zero2,
                 "zero3": lambda s: zf.zero3(s, **coordinator_settings(args, on_demand))}[stage]
        step = zf.train_step(loss_fn, zf.optim.adamw(args.lr, weight_decay=args.wd))
        if bf16:
            step = zf.mixed_precision(step, torch.bfloat16)  # reduce_dtype: fp32 by default
        if offload == "cpu":
            step = zf.offload_cpu(step)
        if offload == "cpu_overlap":
            step = zf.offload_cpu(step, overlap=True)
        if offload.startswith("nvme"):  # "nvme_small": sub-groups of 1e6 elements, so most stream from disk
            step = zf.offload_nvme(step, args.nvme_path, **({"sub_group_size": 10**6} if offload == "nvme_small" else {}))
        step = shard(step)
        if mode.startswith("zero3-jit"):
            if not have_jit():
                raise SystemExit(f"mode {mode}: the zfunc at {os.path.dirname(zf.__file__)} has no zf.jit")
            step = zf.jit(step, backend=args.compile_backend, regather=mode.endswith("regather"))
        if mode == "zero3-compile":
            zf.compile_units(model, **compile_kw)
        state = step.init(model)

        def train(x, y):
            nonlocal state
            state, metrics = step(state, (x, y))
            PREFETCH_MISSES.append(metrics.get("prefetch", {}).get("misses"))
            return metrics["loss"]
        train.settle = lambda: state.params.leaves  # an update running behind the next forward is over
        return train, True
    if mode.startswith("ds"):
        import deepspeed
        config = ds_config(mode, args)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def train(x, y):
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss.detach()
        return train, False
    raise ValueError(mode)


PREFETCH_MISSES = []  # zfunc modes: the coordinator's misses, per step


def coordinator_settings(args, on_demand):
    out = {}
    if args.prefetch_bucket is not None:
        out["prefetch_bucket_size"] = int(args.prefetch_bucket)
    if args.reuse_distance is not None:
        out["max_reuse_distance"] = int(args.reuse_distance)
    if on_demand:
        out["prefetch_bucket_size"] = 0
    return out


def disk_io_bytes():
    """(read, written) bytes this process (all its threads) has moved to and from storage."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def current_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes():
    """This process's RSS high-water mark (VmHWM: what ru_maxrss reports), since the last reset_peak_rss."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss():
    """Lower the high-water mark to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(args):
    mode = args.worker
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # every rank compiles cold, into its own cache: no repeat, mode or rank reuses another's kernels
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{args.result}.rank{os.environ.get('RANK', '0')}.inductor"
    gathers = GatherCounter()  # before deepspeed's comm backend or any step is built
    if mode == "local":
        rank, world, batch = 0, 1, args.batch * args.world
    else:
        if mode.startswith("ds"):
            import deepspeed
            deepspeed.init_distributed(dist_backend="gloo")
        elif mode.startswith("zero"):
            zf.dist.init()
        else:
            dist.init_process_group("gloo")
        rank, world, batch = dist.get_rank(), dist.get_world_size(), args.batch

    if args.preload_compiler:  # the compiler's own code in every mode's baseline, so above it is the model's
        importlib.import_module("torch._inductor.compile_fx")
    baseline_rss = current_rss_bytes()  # libraries and process group, before the model exists
    torch.manual_seed(args.seed)  # the same initial weights in every mode and on every rank
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width, n_layers=args.layers,
                    n_heads=args.heads, tie_embeddings=False)
    model = GPT(cfg)
    n_params = num_params(model)
    train, loss_is_global = build(mode, model, args, world)

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
    for i, (x, y) in enumerate(batches):
        if i in ends:
            peaks[ends[i]] = peak_rss_bytes()
            resettable = reset_peak_rss() and resettable
        io0 = disk_io_bytes()
        t0 = time.perf_counter()
        losses.append(train(x, y).item())
        if i == len(batches) - 1 and hasattr(train, "settle"):
            train.settle()  # the last step pays for its own update, as every other one did for its predecessor's
        times.append(time.perf_counter() - t0)
        gathered.append(gathers.take())
        io.append([b - a for a, b in zip(io0, disk_io_bytes())])

    peaks["steady"] = peak_rss_bytes()  # the timed steps (after the last reset)
    if mode.startswith("zero3-jit"):  # functional collectives inside compiled code: the wrapper saw none of them
        gathered = [None] * len(gathered)
    losses = torch.tensor(losses, dtype=torch.float64)
    if not loss_is_global:
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
                  prefetch_misses=PREFETCH_MISSES)
    with open(f"{args.result}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():  # gloo may abort at interpreter exit otherwise
        dist.barrier()
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# driver: each mode in fresh processes, modes interleaved, a markdown table at the end


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


def per_repeat_ratio(results, m, other, key="median_step_s"):
    """Median over repeats of m's step time (or `key`) / other's in the same repeat (nan if none in
    common): the machine drifts between repeats more than modes differ within one."""
    t = {o: {r.get("repeat", i): r[key] for i, r in enumerate(results[o]) if r.get(key) is not None} for o in (m, other)}
    common = sorted(set(t[m]) & set(t[other]))
    return statistics.median(t[m][k] / t[other][k] for k in common) if common else float("nan")


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


def precision_text(precision):
    if precision == "bf16":
        return ("bf16 (zfunc: mixed_precision, bf16 params, fp32 master + fp32 grad reduce; FSDP2: MixedPrecisionPolicy "
                "bf16/fp32 reduce; DeepSpeed: bf16, its default bf16 gradient reduce; DDP: autocast bf16 over fp32 weights)")
    return "fp32"


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
    args = parse_args()
    if args.worker:
        worker(args)
    else:
        main(args)
