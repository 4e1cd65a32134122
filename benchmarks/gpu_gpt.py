"""zfunc against FSDP2 and DeepSpeed on one GPU (W = 1): a GPT in bf16, each peer in a fresh process.

    python benchmarks/gpu_gpt.py fits       # 0.84B GPT on the GPU: zfunc zero3 / FSDP2 / DeepSpeed ZeRO-3
    python benchmarks/gpu_gpt.py offload    # 1.8B GPT, GPU capped at 20 GiB: optimizer (and parameters) on the CPU
    python benchmarks/gpu_gpt.py nvme       # the same 1.8B GPT, its state in swap files under /tmp
    python benchmarks/gpu_gpt.py large      # the same, one 16K-token micro-batch a step, blocks recomputed
    python benchmarks/gpu_gpt.py large --batch 32   # 64K tokens a step
    python benchmarks/gpu_gpt.py fits --device cpu --tiny   # the same code on the CPU (gloo), a tiny model: smoke test

The model is examples/gpt.py (pre-LN, untied head); every peer is built by benchmarks/_peers.py,
as in the CPU benchmarks (FSDP2 with MixedPrecisionPolicy bf16 and fp32 reduction; FSDP2 and
DeepSpeed update with torch's fused AdamW, DeepSpeed's offloaded state on CUDA with its
DeepSpeedCPUAdam). Every peer builds the same initial weights (same seed, built on the device) and
trains on the same synthetic batches, so their losses agree up to bf16 rounding. Each peer runs in
its own process (RANK 0, WORLD_SIZE 1, nccl on CUDA, gloo on the CPU) under a timeout; a peer that
fails (out of memory, an op that does not build, an exception, the timeout) becomes a row "failed:
<reason>" and the others go on. Its whole output is kept in a log, whose tail is printed when it
fails. The native ops (zfunc's, and DeepSpeed's cpu_adam / async_io for offload / nvme) are built
first, in parallel, outside every peer's time (at most 240 s; cached in TORCH_EXTENSIONS_DIR, so a
second run skips them).
Exit status 1 when a peer failed ("not available" is no failure).

Sizes (SIZES): fits 24 layers x 1536 (0.84B), 8 x 2048 tokens a step, 3 warm-up + 5 timed steps;
offload and nvme 32 x 2048 (1.82B) under a 20 GiB cap (16 B/param of master + Adam is 29 GB),
offload 16 micro-batches of 1 x 2048 tokens a step (gradient accumulation, the same in every
peer), 1 + 3 steps, nvme 1 micro-batch of 2 x 2048, 1 + 2 steps (its swap files: about 30 GB
per peer, removed after each). Expected on an H100: about 1 minute per peer; --steps, --warmup,
--accumulate, --peers and --timeout shorten or stretch a run.
"""
import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), HERE]  # zfunc from this checkout, installed or not
from _flops import PEAK_TFLOPS, embedding_params, flops_per_token  # noqa: E402
from _launch import driver_or_worker, launch  # noqa: E402
from _peers import PEERS, NotAvailable, Settings, build, init_distributed, lm_loss  # noqa: E402
from _worker import finish, timed_steps  # noqa: E402
from gpt import GPT, GPTConfig, num_params, rank_generator  # noqa: E402

from zfunc.transforms.offload import rates  # noqa: E402
BIG = dict(layers=32, width=2048, heads=16, vocab=50304, seq=2048)  # 1.82B parameters
SIZES = {  # model, sequences per micro-batch, micro-batches per step, GPU cap (GiB), warm-up and timed steps, timeout (s)
    "fits": dict(layers=24, width=1536, heads=12, vocab=50304, seq=2048, batch=8, accumulate=1, cap=None,
                 warmup=3, steps=5, timeout=150),
    # 16 B/param of fp32 master + Adam (29 GB) cannot fit under the cap; bf16 params (3.6 GB), zfunc's fp32
    # gradient accumulators (7.3 GB) and one 2048-token micro-batch's activations (~5 GB) can
    "offload": dict(BIG, batch=1, accumulate=16, cap=20, warmup=1, steps=3, timeout=150),
    "nvme": dict(BIG, batch=2, accumulate=1, cap=20, warmup=1, steps=2, timeout=180),
    # one large micro-batch a step (16K tokens; --batch 32: 64K), each block recomputed in backward, the loss a
    # chunk of tokens at a time (zf.chunked_cross_entropy in every peer), the update on the host (issue 50)
    "large": dict(BIG, batch=8, accumulate=1, cap=20, warmup=1, steps=3, timeout=240),
}
CHUNK = 4096  # tokens a chunk of the "large" mode's loss
TINY = dict(layers=2, width=64, heads=4, vocab=256, seq=64, batch=2, cap=None, warmup=1, steps=2, timeout=150)
MODE_PEERS = {  # each mode's peers (benchmarks/_peers.py's PEERS)
    "fits": ["zfunc", "fsdp2", "ds3"],
    "offload": ["zfunc_cpu", "zfunc_cpu_sync", "zfunc_cpu_delay", "zfunc_cpu_host_sums", "zfunc_cpu_params",
                "zfunc_cpu_plan", "zfunc_cpu_ratio", "zfunc_cpu_blocks", "zfunc_cpu_delay_blocks",
                "zfunc_cpu_delay_blocks_bf16", "ds_cpu", "ds_cpu_params"],
    "nvme": ["zfunc_nvme", "ds_nvme"],
    "large": ["zfunc_cpu_delay_recompute", "zfunc_cpu_recompute", "zfunc_cpu_params_recompute",
              "zfunc_cpu_delay_recompute_blocks", "ds_cpu_recompute"],
}
PAIRS = {"fits": [("zfunc", "fsdp2"), ("zfunc", "ds3")],
         "offload": [("zfunc_cpu", "ds_cpu"), ("zfunc_cpu_params", "ds_cpu_params"), ("zfunc_cpu_params", "ds_cpu"),
                     ("zfunc_cpu_plan", "ds_cpu"), ("zfunc_cpu_plan", "zfunc_cpu_ratio"), ("zfunc_cpu", "zfunc_cpu_sync"),
                     ("zfunc_cpu_host_sums", "ds_cpu"), ("zfunc_cpu_delay", "zfunc_cpu"), ("zfunc_cpu_delay", "ds_cpu"),
                     ("zfunc_cpu_blocks", "zfunc_cpu"), ("zfunc_cpu_delay_blocks", "zfunc_cpu_delay"),
                     ("zfunc_cpu_delay_blocks_bf16", "ds_cpu")],
         "nvme": [("zfunc_nvme", "ds_nvme")],
         "large": [("zfunc_cpu_delay_recompute", "ds_cpu_recompute"), ("zfunc_cpu_recompute", "ds_cpu_recompute"),
                   ("zfunc_cpu_params_recompute", "ds_cpu_recompute"),
                   ("zfunc_cpu_delay_recompute_blocks", "zfunc_cpu_delay_recompute")]}
AIMS = {"offload": [("zfunc_cpu", "ds_cpu"), ("zfunc_cpu_params", "ds_cpu_params")], "nvme": [("zfunc_nvme", "ds_nvme")]}


def large_aims(tokens: int) -> list:
    """Issue 50's aims for the large micro-batch: (peer, peer it is compared with, least TFLOPS ratio,
    least fraction of peak): delay=1 at 30% of peak at 16K tokens a step and 40% at 64K; the exact
    update 3.5x ZeRO-Offload's TFLOPS."""
    return [("zfunc_cpu_delay_recompute", None, None, 0.40 if tokens >= 65536 else 0.30),
            ("zfunc_cpu_recompute", "ds_cpu_recompute", 3.5, None)]


class ChunkedLM(torch.nn.Module):
    """The GPT's mean next-token loss with the head's logits made ``chunk`` tokens at a time
    (zf.chunked_cross_entropy): at 64K tokens the full logits alone would take 6.6 GB in bf16."""

    def __init__(self, gpt, chunk: int):
        super().__init__()
        self.gpt, self.chunk = gpt, chunk

    def forward(self, idx, labels):
        import zfunc as zf

        g = self.gpt
        x = g.tok_emb(idx) + g.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in g.blocks:
            x = block(x)
        return zf.chunked_cross_entropy(g.ln_f(x), g.head.weight, labels, chunk_size=self.chunk)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=list(SIZES))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny model, few steps (smoke test)")
    for k in ("batch", "accumulate", "warmup", "steps", "layers", "width"):
        p.add_argument(f"--{k}", type=int, default=None, help="override the mode's default")
    p.add_argument("--cap", type=float, default=None, help="GPU memory cap in GiB (default: the mode's)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per peer (default: the mode's)")
    p.add_argument("--peers", default=None, help="comma-separated subset of the mode's peers")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=2.0, help="zfunc_cpu_plan: GiB of GPU memory for kept optimizer state")
    p.add_argument("--ratio", type=float, default=0.9, help="zfunc_cpu_ratio: share of parameters updated on the host")
    p.add_argument("--swap", default=None, help="nvme: folder for the swap files (default: a new one under /tmp)")
    p.add_argument("--no-prebuild", action="store_true", help="do not build the native ops before the peers")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    size = dict(SIZES[a.mode], **(TINY if a.tiny else {}))
    size["accumulate"] = SIZES[a.mode]["accumulate"] if not a.tiny else (1 if a.mode in ("fits", "large") else 2)
    for k, v in size.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.device == "cpu":
        a.cap = None
    a.peers = a.peers.split(",") if a.peers else list(MODE_PEERS[a.mode])
    return a


# -----------------------------------------------------------------------------
# worker: one peer in this process


def measure(a):
    with open(a.result + ".pid", "w") as f:
        f.write(str(os.getpid()))
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        if a.cap:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap * 2**30 / total))
    init_distributed(a.worker, "nccl" if cuda else "gloo")
    torch.manual_seed(a.seed)
    cfg = GPTConfig(vocab_size=a.vocab, seq_len=a.seq, d_model=a.width, n_layers=a.layers, n_heads=a.heads,
                    tie_embeddings=False)
    with torch.device(a.device):
        model = GPT(cfg)
    params, embedding = num_params(model), embedding_params(model)
    blocks, loss = model.blocks, lambda forward, b: lm_loss(forward(b[0]), b[1])
    if a.mode == "large":
        model = ChunkedLM(model, CHUNK)
        loss = lambda forward, b: forward(b[0], b[1])  # noqa: E731
    rooflines = []  # the offloaded steps' metrics["offload"] (zfunc.transforms.offload.plan.roofline)
    s = Settings(lr=a.lr, wd=a.wd, bf16=True, device=a.device, batch=a.batch, accumulate=a.accumulate,
                 nvme_path=a.swap, budget=a.budget, ratio=a.ratio)
    t0 = time.perf_counter()
    train = build(a.worker, model, blocks, loss, s,
                  on_metrics=lambda m: "offload" in m and rooflines.append(m["offload"]))
    setup_s = time.perf_counter() - t0
    gen = rank_generator(a.seed, 0)
    batches = []
    for _ in range(a.warmup + a.steps):
        tokens = torch.randint(a.vocab, (a.accumulate, a.batch, a.seq + 1), generator=gen).to(a.device)
        batches.append([(t[:, :-1], t[:, 1:]) for t in tokens])
    times, losses = timed_steps(train, batches, cuda, a.warmup)
    return dict(status="ok", params=params, embedding_params=embedding, setup_s=setup_s,
                step_s=statistics.median(times[a.warmup:]), losses=losses, roofline=rooflines[-1] if rooflines else None)


def worker(a):
    out = {}
    try:
        out = measure(a)
    except NotAvailable as e:
        out = dict(status=f"not available: {e}")
    except BaseException as e:  # out of memory, an op that does not build, anything: this peer's row says so
        traceback.print_exc()
        msg = (str(e).strip().splitlines() or [""])[0]
        out = dict(status=f"failed: {type(e).__name__}: {msg[:240]}")
    finish(a.result, out, a.device == "cuda")


# -----------------------------------------------------------------------------
# driver


def env_for(a):
    env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    if a.device == "cpu":
        env.update(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", CUDA_VISIBLE_DEVICES="")
    elif os.environ.get("TORCH_CUDA_ARCH_LIST"):
        env["TORCH_CUDA_ARCH_LIST"] = plain_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    return env


def plain_arch_list(archs):
    """``TORCH_CUDA_ARCH_LIST`` without the architecture-specific suffixes ("9.0a" -> "9.0"):
    DeepSpeed's op builder reads each minor version as an integer and stops at "0a". The plain
    target builds the same sm_90 code for what these benchmarks compile."""
    out = []
    for arch in archs.replace(";", " ").split():
        ptx = arch.endswith("+PTX")
        major, _, minor = arch.removesuffix("+PTX").partition(".")
        out.append(f"{major}.{minor.rstrip('abcdefghijklmnopqrstuvwxyz')}" + ("+PTX" if ptx else ""))
    return ";".join(dict.fromkeys(out))


def end_group(pgid, since):
    """Kill what is left of a process group we started (its own session: a killed worker's JIT build,
    ninja, nvcc, g++), then remove the torch extension build locks it left behind (created after
    `since`), which would keep every later build of that op waiting. ninja keeps the objects it
    finished, so a later build goes on where this one stopped."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    from torch.utils.cpp_extension import get_default_build_root
    for lock in glob.glob(os.path.join(get_default_build_root(), "**", "lock"), recursive=True):
        try:
            if os.path.getmtime(lock) >= since - 1:
                os.remove(lock)
                print(f"removed the stale build lock {lock}", flush=True)
        except OSError:
            pass


def prebuild(a):
    """Build the native ops the peers JIT-build (zfunc's; DeepSpeed's cpu_adam, async_io), in parallel,
    so no peer's time or timeout holds a compile. Builds are cached (TORCH_EXTENSIONS_DIR)."""
    ds_ops = {"offload": ["CPUAdamBuilder"], "nvme": ["CPUAdamBuilder", "AsyncIOBuilder"]}.get(a.mode, [])
    if a.device == "cpu":  # DeepSpeed's CPU peers update with torch AdamW (_peers.ds_config): no cpu_adam
        ds_ops = [n for n in ds_ops if n != "CPUAdamBuilder"]
    ds = ("import deepspeed; from deepspeed.accelerator import get_accelerator as g\n"
          f"for n in {ds_ops!r}:\n b = g().create_op_builder(n)\n"
          " ok = b is not None and b.is_compatible(verbose=False)\n"
          " ok and b.load(verbose=False); print('DeepSpeed', n, 'built' if ok else 'not compatible here')")
    cmds = {"zfunc ops": [sys.executable, "-m", "zfunc.ops"]} | ({"DeepSpeed ops": [sys.executable, "-c", ds]} if ds_ops else {})
    t0 = time.perf_counter()
    procs = {k: subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=dict(os.environ, **env_for(a)), start_new_session=True) for k, c in cmds.items()}
    for k, p in procs.items():
        try:
            out = p.communicate(timeout=max(1.0, 240 - (time.perf_counter() - t0)))[0]
            lines = [ln for ln in out.splitlines() if ln.startswith(("|", "DeepSpeed "))]
            print(f"{k} (exit {p.returncode}):\n" + "\n".join(lines[-12:]), flush=True)
        except subprocess.TimeoutExpired:
            end_group(p.pid, t0)
            p.wait()
            print(f"{k}: still building after 240 s, stopped; left to the peers", flush=True)
    print(f"op builds: {time.perf_counter() - t0:.0f} s (outside every peer's time)\n", flush=True)


def run_peer(peer, a, tmp):
    result, log = os.path.join(tmp, f"{peer}.json"), os.path.join(tmp, f"{peer}.log")
    argv = [os.path.abspath(__file__), a.mode, "--worker", peer, "--result", result, "--device", a.device] + [
        f"--{k}={getattr(a, k)}" for k in ("batch", "accumulate", "warmup", "steps", "layers", "width", "lr", "wd", "seed", "budget", "ratio")]
    argv += (["--tiny"] if a.tiny else []) + ([f"--cap={a.cap}"] if a.cap else [])
    swap = None
    if peer.endswith("nvme"):
        swap = os.path.join(a.swap_root, peer)
        os.makedirs(swap, exist_ok=True)
        argv.append(f"--swap={swap}")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = launch(argv, 1, env=env_for(a), timeout=a.timeout, stdout=f, stderr=subprocess.STDOUT,
                    start_new_session=True)[0]
    wall = time.perf_counter() - t0
    try:
        with open(result + ".pid") as f:
            end_group(int(f.read()), t0)
    except (OSError, ValueError):
        pass
    if swap is not None:
        shutil.rmtree(swap, ignore_errors=True)
    tail = open(log, errors="replace").read().strip().splitlines()
    if os.path.exists(result):
        with open(result) as f:
            out = json.load(f)
    else:
        steps = [ln for ln in tail if ln.startswith("step ")]
        why = f"timed out after {a.timeout:.0f} s" if wall >= a.timeout else f"exit code {rc}"
        out = dict(status=f"failed: {why}" + (f" (last: {steps[-1]})" if steps else f" ({tail[-1][:160] if tail else 'no output'})"))
    out.update(peer=peer, wall_s=wall)
    if out["status"] == "ok":
        print(f"[{peer}] {out['step_s'] * 1e3:.0f} ms/step, loss {out['losses'][-1]:.5f}, setup {out['setup_s']:.0f} s, "
              f"{wall:.0f} s in all", flush=True)
    else:
        print(f"[{peer}] {out['status']} ({wall:.0f} s); log tail:\n    " + "\n    ".join(tail[-15:]), flush=True)
    return out


def report(a, rows):
    ok = {r["peer"]: r for r in rows if r["status"] == "ok"}
    tokens = a.batch * a.accumulate * a.seq
    params = next((r["params"] for r in ok.values()), None)
    first = next(iter(ok.values()), None)
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    name = torch.cuda.get_device_name() if a.device == "cuda" and torch.cuda.is_available() else a.device
    import importlib.metadata as md
    try:
        ds_version = md.version("deepspeed")
    except md.PackageNotFoundError:
        ds_version = "not installed"
    print(f"\n### {a.mode}: GPT {a.layers} layers, d_model {a.width}, {a.heads} heads, vocab {a.vocab}, seq {a.seq}, "
          f"{'?' if params is None else f'{params / 1e6:,.1f}M'} params, bf16 (fp32 master + AdamW, lr {a.lr}), "
          f"{a.batch} x {a.seq} tokens x {a.accumulate} micro-batch(es) = {tokens} tokens/step; "
          f"{a.warmup} warm-up + {a.steps} timed steps (median); W = 1 on {name}"
          + (f", GPU capped at {a.cap:g} GiB (set_per_process_memory_fraction)" if a.cap else "")
          + f"; torch {torch.__version__}, DeepSpeed {ds_version}; FSDP2: MixedPrecisionPolicy bf16, fp32 reduce; "
          "FSDP2 and DeepSpeed: torch AdamW fused (DeepSpeedCPUAdam on offloaded state)\n")
    print("TFLOPS = (6 N + 12 L d s) x tokens / step time, N: the "
          "parameters less the embedding tables; % peak against 989 TFLOP/s (H100 SXM dense bf16"
          + (", meaningless on the CPU" if a.device == "cpu" else "") + "). Peak GPU memory: "
          "torch.cuda.max_memory_allocated over the whole run; peak host RSS: the process's high-water mark (VmHWM).\n")
    print("| peer | step ms | tokens/s | TFLOPS | % bf16 peak | peak GPU GiB | peak host RSS GiB | final loss | loss vs first row |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        label = PEERS[r["peer"]].label
        if r["status"] != "ok":
            print(f"| {label} | {r['status'].replace('|', '/')} | | | | {gib(r.get('gpu_peak'))} | {gib(r.get('rss_peak'))} | | |")
            continue
        r["tflops"] = flops_per_token(params, r["embedding_params"], a.layers, a.width, a.seq) * tokens / r["step_s"] / 1e12
        rel = (r["losses"][-1] - first["losses"][-1]) / first["losses"][-1]
        print(f"| {label} | {r['step_s'] * 1e3:.0f} | {tokens / r['step_s']:,.0f} | {r['tflops']:.3g} | "
              f"{100 * r['tflops'] / PEAK_TFLOPS:.3g} | {gib(r.get('gpu_peak'))} | {gib(r['rss_peak'])} | "
              f"{r['losses'][-1]:.5f} | {rel:+.1e} |")
    roofs = [(r["peer"], r["roofline"]) for r in rows if r["status"] == "ok" and r.get("roofline")]
    if roofs:
        print("\nRoofline of the last step (metrics['offload']): compute = forward and backward measured, plus the "
              "serial part exactness forces (the first unit's update and upload, or the host update the next step's "
              "first forward cannot cover, whichever is larger); host update and copies at this "
              "machine's measured rates; waited = the forward's wait for the previous update running behind it (a "
              "part of compute); achieved = bound / step time.\n")
        print("| peer | compute s | update s (measured) | waited s | host update s | copies s | PCIe GB | bound s | binds "
              "| achieved |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
        for peer, f in roofs:
            if "disk_s" in f:  # offload_nvme's: the disk at its measured rates (disk busy = disk_fraction)
                print(f"| {peer} | {f['compute_s']:.3f} | {f['update_s']:.3f} | - | disk {f['disk_s']:.3f} | "
                      f"disk busy {100 * f['disk_fraction']:.0f}% | {f['disk_bytes'] / 1e9:.2f} (disk) | {f['bound_s']:.3f} | "
                      f"{f['binds']} | {100 * f['achieved']:.0f}% |")
                continue
            waited = "-" if f.get("waited_s") is None else f"{f['waited_s']:.3f}"
            print(f"| {peer} | {f['compute_s']:.3f} | {f['update_s']:.3f} | {waited} | {f['host_update_s']:.3f} | {f['copies_s']:.3f} | "
                  f"{f['pcie_bytes'] / 1e9:.2f} | {f['bound_s']:.3f} | {f['binds']} | {100 * f['achieved']:.0f}% |")
    pairs = [(z, p) for z, p in PAIRS[a.mode] if z in ok and p in ok]
    if pairs:
        print("\n| zfunc / peer | step time | TFLOPS | peak GPU memory | peak host RSS |\n| --- | ---: | ---: | ---: | ---: |")
        for z, p in pairs:
            zr, pr = ok[z], ok[p]
            gpu = f"{zr['gpu_peak'] / pr['gpu_peak']:.2f}x" if zr.get("gpu_peak") and pr.get("gpu_peak") else "n/a"
            print(f"| {z} / {p} | {zr['step_s'] / pr['step_s']:.2f}x | {zr['tflops'] / pr['tflops']:.2f}x | {gpu} | "
                  f"{zr['rss_peak'] / pr['rss_peak']:.2f}x |")
    for z, p, ratio, frac in large_aims(tokens) if a.mode == "large" else []:
        if z not in ok:
            print(f"\naim for {z}: no result" + ("" if z in a.peers else " (not run)"))
            continue
        got = ok[z]["tflops"]
        if ratio is not None:
            print(f"\naim for {z}: " + (f"{got / ok[p]['tflops']:.2f}x {p}'s TFLOPS: "
                  f"{'PASS' if got >= ratio * ok[p]['tflops'] else 'FAIL'} (aim >= {ratio}x)" if p in ok else
                  f"{p} has no result, no ratio"))
        if frac is not None:
            print(f"\naim for {z}: {100 * got / PEAK_TFLOPS:.1f}% of bf16 peak at {tokens} tokens a step: "
                  f"{'PASS' if got / PEAK_TFLOPS >= frac else 'FAIL'} (aim >= {100 * frac:.0f}%)")
    for z, p in AIMS.get(a.mode, []):
        if z not in a.peers:
            continue
        if z not in ok:
            print(f"\naim for {z}: no result ({next(r['status'] for r in rows if r['peer'] == z)})")
            continue
        frac = ok[z]["tflops"] / PEAK_TFLOPS
        vs = f"{ok[z]['tflops'] / ok[p]['tflops']:.2f}x {p}'s TFLOPS: {'PASS' if ok[z]['tflops'] >= 1.5 * ok[p]['tflops'] else 'FAIL'} (aim >= 1.5x)" \
            if p in ok else f"{p} has no result, no ratio"
        print(f"\naim for {z}: {vs}; {100 * frac:.1f}% of bf16 peak: {'PASS' if frac >= 0.30 else 'FAIL'} (aim >= 30%)")


def main(a):
    print(f"gpu_gpt.py {a.mode} on {a.device}{' (tiny)' if a.tiny else ''}: peers {', '.join(a.peers)}; "
          f"each in a fresh process, timeout {a.timeout:.0f} s each\n", flush=True)
    if not a.no_prebuild:
        prebuild(a)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_gpt.") as tmp:
        a.swap_root = a.swap or (tempfile.mkdtemp(prefix="gpu_gpt_swap.", dir="/tmp") if a.mode == "nvme" else None)
        try:
            if a.mode == "nvme":
                print(f"swap files under {a.swap_root}: {shutil.disk_usage(a.swap_root).free / 2**30:.0f} GiB free", flush=True)
                read, write = rates.measure_disk(a.swap_root, refresh=True)  # cached: the peers' roofline reads it
                print(f"the disk under them (zfunc.transforms.offload.rates.measure_disk, 256 MiB, O_DIRECT): read {read / 1e9:.2f} GB/s, "
                      f"write {write / 1e9:.2f} GB/s", flush=True)
            for peer in a.peers:
                rows.append(run_peer(peer, a, tmp))
        finally:
            if a.swap is None and a.swap_root:
                shutil.rmtree(a.swap_root, ignore_errors=True)
    report(a, rows)
    sys.exit(1 if any(r["status"].startswith("failed") for r in rows) else 0)


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
