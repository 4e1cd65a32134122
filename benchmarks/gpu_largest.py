"""The largest Llama this machine holds, trained on its one GPU with the state in host memory (or on disk).

    python benchmarks/gpu_largest.py                      # the largest Llama of 14B's dimensions that fits, delay=1
    python benchmarks/gpu_largest.py --update exact       # the same, each update exact
    python benchmarks/gpu_largest.py --layers 48          # 14B (Qwen2.5-14B's shape), if the host holds it
    python benchmarks/gpu_largest.py --tier nvme --swap /mnt/swap   # parameters and state in swap files
    python benchmarks/gpu_largest.py --device cpu --tiny  # the same code on the CPU, a tiny model: smoke test

The model: transformers' LlamaForCausalLM of 14B's dimensions (d 5120, FFN 13824, 40 heads of 128,
8 key-value heads, vocabulary 152,064, untied head), built on the meta device, so no weights exist
until zfunc makes each unit where it lives. ``--layers auto`` (the default) takes as many layers as
the host's free memory holds at ``--ram-fraction`` of it, at the bytes a parameter the composition
keeps there (counted from the model itself: one layer's parameters are the difference of a 2- and
a 1-layer build on meta).

The step: ``zero3(offload_cpu(mixed_precision(recompute(train_step(loss, adamw))), delay=1))``: bf16 parameters on the GPU (delay=1 keeps its own host copy, which the next step's
update writes; exact: ``params=True``, in pinned host memory, streamed to the GPU ahead of each
unit's use by the coordinator's prefetch, forward and the backward's recompute alike), fp32 master and AdamW moments
(bf16 with ``--moments bf16``, the default: 14B's fp32 moments alone would fill the host) updated by
the CPU Adam on cores of its own behind the next step (``delay=1``; ``--update exact``: behind the
next forward), every block recomputed in backward (``zf.recompute``), and the loss over the 152K
vocabulary by ``zf.chunked_cross_entropy`` (no full logits). One micro-batch of ``--batch`` x
``--seq`` tokens a step (64K by default). ``--compile``: each block compiled (``zf.compile_units``).

Reported: TFLOPS = (6 N + 12 L d s) x tokens / step time (N: parameters less the token table; the
recompute's extra forward is not counted, as MFU does not count it), % of bf16 peak (989 TFLOP/s,
H100 SXM dense; the H200's is the same), peak GPU memory, the host's peak RSS against the bytes the
composition was sized for, and the disk's use under ``--tier nvme``. Aims (issue 50): >= 30% of peak
at 64K tokens a step with ``delay=1``, >= 25% exact.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # zfunc from this checkout, installed or not
import zfunc as zf  # noqa: E402
from _flops import PEAK_TFLOPS, embedding_params, flops_per_token  # noqa: E402
from zfunc.testing import memory  # noqa: E402

LLAMA_14B = dict(width=5120, ffn=13824, heads=40, kv_heads=8, vocab=152064)
TINY = dict(width=64, ffn=176, heads=4, kv_heads=2, vocab=512, seq=64, batch=2, layers=2, chunk=128, warmup=1, steps=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a tiny model, two steps (smoke test)")
    p.add_argument("--layers", default="auto", help="a number, or auto: as many as the host holds")
    for k, v in LLAMA_14B.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16, help="sequences in the step's one micro-batch")
    p.add_argument("--chunk", type=int, default=8192, help="tokens a chunk of the chunked cross-entropy")
    p.add_argument("--update", default="delay", choices=["delay", "exact"])
    p.add_argument("--moments", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--tier", default="cpu", choices=["cpu", "nvme"])
    p.add_argument("--swap", default=None, help="--tier nvme: a folder for the swap files (default: under /tmp)")
    p.add_argument("--ram-fraction", type=float, default=0.8, help="of the host's available memory, for auto")
    p.add_argument("--compile", action="store_true", help="each block torch.compiled (zf.compile_units)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    a = p.parse_args(argv)
    if a.tiny:
        for k, v in TINY.items():
            setattr(a, k, v)
    if a.tier == "nvme" and a.update == "delay":
        p.error("--tier nvme runs offload_nvme's exact update (delay=1 is offload_cpu's): give --update exact")
    return a


def build(a, layers: int, device="meta"):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.width, intermediate_size=a.ffn,
                                   num_hidden_layers=layers, num_attention_heads=a.heads,
                                   num_key_value_heads=a.kv_heads, max_position_embeddings=max(a.seq, 128),
                                   tie_word_embeddings=False)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg)


class CausalLMLoss(torch.nn.Module):
    """The Llama's mean next-token loss, the head's logits made a chunk at a time."""

    def __init__(self, llama, chunk: int):
        super().__init__()
        self.llama, self.chunk = llama, chunk

    def forward(self, ids, labels):
        hidden = self.llama.model(input_ids=ids, use_cache=False).last_hidden_state
        return zf.chunked_cross_entropy(hidden, self.llama.lm_head.weight, labels, chunk_size=self.chunk)


def host_bytes_per_param(a) -> int:
    """What the composition keeps in host memory a parameter: bf16 parameters (exact: the stored
    ones, params=True; delay=1: the host copy with the pending update, ``ahead``, while the forward's
    stay on the GPU), the fp32 master, the two moments and the fp32 gradient sent home. Under
    --tier nvme only the gradient stays in host memory."""
    moments = 2 * (2 if a.moments == "bf16" else 4)
    return 4 + (0 if a.tier == "nvme" else 2 + 4 + moments)


def disk_bytes_per_param(a) -> int:
    return 2 + 4 + 2 * (2 if a.moments == "bf16" else 4) if a.tier == "nvme" else 0


def available_ram() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def size_model(a):
    """``(layers, parameters)``: ``--layers``, or the most the host (and disk) hold."""
    one, two = (sum(p.numel() for p in build(a, n).parameters()) for n in (1, 2))
    per_layer, rest = two - one, 2 * one - two
    if a.layers != "auto":
        layers = int(a.layers)
    else:
        room = [a.ram_fraction * available_ram() / host_bytes_per_param(a)]
        if a.tier == "nvme":
            room.append(0.9 * shutil.disk_usage(a.swap or tempfile.gettempdir()).free / disk_bytes_per_param(a))
        layers = int((min(room) - rest) // per_layer)
        if layers < 1:
            raise SystemExit(f"not even one layer of d {a.width} fits: {min(room) / 1e9:.1f}B parameters of room")
    return layers, rest + layers * per_layer


def make_step(a, model, swap):
    opt = zf.optim.adamw(a.lr, weight_decay=0.0, **({"state_dtype": torch.bfloat16} if a.moments == "bf16" else {}))
    step = zf.recompute(zf.train_step(lambda params, b: zf.apply(model, params, *b), opt))
    step = zf.mixed_precision(step, torch.bfloat16)
    if a.tier == "nvme":
        step = zf.offload_nvme(step, swap)  # parameters, gradients and state
    else:
        delay = a.update == "delay"  # its forward reads the GPU's copy while the host updates its own
        step = zf.offload_cpu(step, params=not delay, delay=int(delay))
    return zf.zero3(step)


def main(a):
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    dist.init_process_group("nccl" if cuda else "gloo")
    layers, params = size_model(a)
    swap = tempfile.mkdtemp(prefix="gpu_largest.", dir=a.swap) if a.tier == "nvme" else None
    host_bound = params * host_bytes_per_param(a)
    print(f"Llama: {layers} layers, d {a.width}, FFN {a.ffn}, {a.heads} heads ({a.kv_heads} kv), vocabulary {a.vocab}: "
          f"{params / 1e6:,.1f}M parameters; {a.batch} x {a.seq} = {a.batch * a.seq} tokens a step, update {a.update}, "
          f"moments {a.moments}, state on {a.tier}; host sized for {host_bound / 2**30:.1f} GiB "
          f"({host_bytes_per_param(a)} B a parameter) of {available_ram() / 2**30:.1f} GiB available", flush=True)
    torch.manual_seed(0)
    llama = build(a, layers)
    model = CausalLMLoss(llama, a.chunk)
    if a.compile:
        zf.compile_units(model, fullgraph=True)
    step = make_step(a, model, swap)
    memory.reset_peak()
    t0 = time.perf_counter()
    state = step.init(model, device=a.device)  # unit by unit, each where it lives
    init_s = time.perf_counter() - t0
    report = zf.memory_report(state)["by_home"]
    print(f"init: {init_s:.0f} s; state by home (GiB): " + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in report.items()),
          flush=True)
    gen = torch.Generator().manual_seed(1)
    times, losses, metrics = [], [], {}
    try:
        for i in range(a.warmup + a.steps):
            tokens = torch.randint(a.vocab, (a.batch, a.seq + 1), generator=gen).to(a.device)
            if cuda:
                torch.cuda.synchronize()
            began = time.perf_counter()
            state, metrics = step(state, (tokens[:, :-1], tokens[:, 1:]))
            loss = float(metrics["loss"])
            if i == a.warmup + a.steps - 1:
                state.params.leaves  # the last update, running behind, is charged to the run
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
            losses.append(loss)
            print(f"step {i}{' (warm-up)' if i < a.warmup else ''}: {times[-1]:.2f} s, loss {loss:.4f}", flush=True)
    finally:
        rss_peak = memory.peak()
        disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(swap) for f in fs) if swap else 0
        state.close() if hasattr(state, "close") else None
        if swap:
            shutil.rmtree(swap, ignore_errors=True)
    step_s = statistics.median(times[a.warmup:])
    tflops = flops_per_token(params, embedding_params(llama), layers, a.width, a.seq) * a.batch * a.seq / step_s / 1e12
    gpu = f"{memory.cuda_peak() / 2**30:.1f} GiB" if cuda else "n/a"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"\n| model | tokens/step | update | step s | TFLOPS | % bf16 peak | peak GPU | peak host RSS | host sized for "
          f"| disk | final loss |\n| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
          f"| {params / 1e6:,.1f}M ({layers} layers) | {a.batch * a.seq} | {a.update} | {step_s:.2f} | {tflops:.1f} | "
          f"{100 * tflops / PEAK_TFLOPS:.1f} | {gpu} | {rss_peak / 2**30:.1f} GiB | {host_bound / 2**30:.1f} GiB | "
          f"{disk / 2**30:.1f} GiB | {losses[-1]:.4f} |\n\non {device}, torch {torch.__version__}; roofline of the last step: "
          f"{metrics.get('offload')}")
    aim = 0.30 if a.update == "delay" else 0.25
    if cuda:
        print(f"aim: >= {100 * aim:.0f}% of bf16 peak: {'PASS' if tflops / PEAK_TFLOPS >= aim else 'FAIL'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
