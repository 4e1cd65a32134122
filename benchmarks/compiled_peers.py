"""Compiled as users compile: a Hugging Face Llama built from a config (no download), W = 1, each
peer in a fresh process on the same batches; plain PyTorch eager and with each decoder layer
compiled, FSDP2 eager and compiled (torchtitan's order), DeepSpeed ZeRO-3, and zfunc eager, with
compiled blocks and the compiled step (zf.jit).

    python benchmarks/compiled_peers.py                     # on the GPU: about 1.1B parameters, bf16
    python benchmarks/compiled_peers.py --device cpu --small  # the same peers on the CPU, a small model, fp32
    python benchmarks/compiled_peers.py --peers torch-compile,zfunc-blocks,zfunc-jit

On CUDA every peer trains in bf16 with fp32 master weights and AdamW: plain PyTorch and its
compiled layers under autocast with fused AdamW, FSDP2 with MixedPrecisionPolicy (fp32 reduce),
DeepSpeed with bf16 and torch's fused AdamW, zfunc `zero3(mixed_precision(...))`. On the CPU
everything is fp32. The first step (the compile, for compiled peers) is reported apart; the step
time is the median of the timed steps. TFLOPS = (6 N + 12 L d s) x tokens / step time, N the
parameters less the embedding table; the peak is 989 TFLOP/s (H100 SXM dense bf16).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
from _flops import PEAK_TFLOPS, embedding_params, flops_per_token  # noqa: E402
from _launch import driver_or_worker, launch  # noqa: E402
from _peers import PEERS, Settings, build, init_distributed, lm_loss  # noqa: E402
from _worker import finish, timed_steps  # noqa: E402
SIZES = {  # the Llama: 22 layers of 2048 (about 1.1B parameters), 4 x 2048 tokens a step
    "gpu": dict(layers=22, width=2048, heads=32, kv_heads=4, ffn=5632, vocab=32000, seq=2048, batch=4, warmup=3, steps=8),
    "small": dict(layers=4, width=256, heads=8, kv_heads=4, ffn=704, vocab=4096, seq=256, batch=4, warmup=2, steps=5),
}
NAMES = ["torch", "torch-compile", "fsdp2", "fsdp2-compile", "ds3", "zfunc", "zfunc-blocks", "zfunc-jit"]  # of PEERS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="the small model (the CPU's default)")
    for k in ("layers", "width", "batch", "seq", "warmup", "steps"):
        p.add_argument(f"--{k}", type=int, default=None, help="override the size's default")
    p.add_argument("--peers", default=",".join(NAMES))
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per peer")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    size = SIZES["small" if a.small or a.device == "cpu" else "gpu"]
    for k, v in size.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    a.bf16 = a.device == "cuda"
    a.peers = a.peers.split(",")
    unknown = set(a.peers) - set(NAMES)
    if unknown:
        p.error(f"unknown peers {sorted(unknown)}; choose from {', '.join(NAMES)}")
    return a


def llama(a):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.width, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                      tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)  # training: no KV cache
    torch.manual_seed(0)
    with torch.device(a.device):
        return LlamaForCausalLM(cfg)


def loss(forward, ids):
    """The Llama's next-token loss on its own input: ``ids`` shifted by one."""
    return lm_loss(forward(ids).logits[:, :-1], ids[:, 1:])


def measure(a):
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    init_distributed(a.worker, "nccl" if cuda else "gloo")
    model = llama(a)
    params, embedding = sum(p.numel() for p in model.parameters()), embedding_params(model)
    s = Settings(lr=a.lr, adam="fused" if cuda else "for-loop", bf16=a.bf16, device=a.device, batch=a.batch,
                 units=lambda name, m: type(m).__name__ == "LlamaDecoderLayer")
    train = build(a.worker, model, model.model.layers, loss, s)
    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randint(a.vocab, (a.batch, a.seq), generator=gen).to(a.device)] for _ in range(a.warmup + a.steps)]
    times, losses = timed_steps(train, batches, cuda, a.warmup)
    return dict(status="ok", params=params, embedding_params=embedding, first_s=times[0],
                step_s=statistics.median(times[a.warmup:]), losses=losses)


def worker(a):
    try:
        out = measure(a)
    except BaseException as e:  # a peer that fails is a row that says why
        traceback.print_exc()
        out = dict(status=f"failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")
    finish(a.result, out, a.device == "cuda")


def main(a):
    print(f"compiled_peers.py on {a.device}: Llama {a.layers} x {a.width}, {a.batch} x {a.seq} tokens a step, "
          f"{'bf16 + fp32 master' if a.bf16 else 'fp32'}, {a.warmup} warm-up (the first is the compile) + {a.steps} "
          f"timed steps; each peer in a fresh process\n", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="compiled_peers.") as tmp:
        for peer in a.peers:
            result, log = os.path.join(tmp, f"{peer}.json"), os.path.join(tmp, f"{peer}.log")
            argv = [os.path.abspath(__file__), "--worker", peer, "--result", result, "--device", a.device] + [
                f"--{k}={getattr(a, k)}" for k in ("layers", "width", "batch", "seq", "warmup", "steps", "lr")]
            argv += ["--small"] if a.small or a.device == "cpu" else []
            with open(log, "w") as f:
                env = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                       "PYTHONUNBUFFERED": "1"} | ({"DS_ACCELERATOR": "cpu"} if a.device == "cpu" else {})
                launch(argv, 1, env=env, timeout=a.timeout, stdout=f, stderr=subprocess.STDOUT)
            try:
                with open(result) as f:
                    rows[peer] = json.load(f)
            except (OSError, ValueError):
                rows[peer] = dict(status="failed: no result (timed out or died); log tail: "
                                  + " / ".join(open(log).read().strip().splitlines()[-3:])[:300])
            r = rows[peer]
            print(f"[{peer}] " + (f"{r['step_s'] * 1e3:.0f} ms/step, first step {r['first_s']:.1f} s, loss "
                                  f"{r['losses'][-1]:.5f}" if r["status"] == "ok" else r["status"]), flush=True)
    report(a, rows)


def report(a, rows):
    ok = {k: r for k, r in rows.items() if r["status"] == "ok"}
    tokens = a.batch * a.seq
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    print("\n| peer | step ms | % bf16 peak | / its eager | / plain compiled | first step s | peak GPU GiB | peak RSS GiB | final loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = ok.get("torch-compile")
    for peer, r in rows.items():
        if r["status"] != "ok":
            print(f"| {PEERS[peer].label} | {r['status'].replace('|', '/')} | | | | | | | |")
            continue
        tflops = flops_per_token(r["params"], r["embedding_params"], a.layers, a.width, a.seq) * tokens / r["step_s"] / 1e12
        eager = ok.get(PEERS[peer].eager)
        print(f"| {PEERS[peer].label} | {r['step_s'] * 1e3:.0f} | {100 * tflops / PEAK_TFLOPS:.1f} | "
              + (f"{r['step_s'] / eager['step_s']:.2f}x" if eager else "") + " | "
              + (f"{r['step_s'] / base['step_s']:.2f}x" if base else "") + f" | {r['first_s']:.1f} | "
              f"{gib(r.get('gpu_peak'))} | {gib(r.get('rss_peak'))} | {r['losses'][-1]:.5f} |")
    if base:
        for peer, aim in (("zfunc-blocks", 1.05), ("zfunc-jit", 1.0)):
            if peer in ok:
                ratio = ok[peer]["step_s"] / base["step_s"]
                print(f"\naim {peer} <= {aim}x plain PyTorch's compiled layers: {ratio:.2f}x, "
                      f"{'PASS' if ratio <= aim else 'FAIL'}; first step {ok[peer]['first_s'] / base['first_s']:.2f}x "
                      f"its ({'PASS' if ok[peer]['first_s'] <= 1.5 * base['first_s'] else 'FAIL'}, aim <= 1.5x)")


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
