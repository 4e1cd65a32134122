"""The RL loop's device-side costs on one GPU (W = 1): the training state moved off the GPU and
back between phases, and the weights streamed to an inference engine in buckets on the GPU.

    python benchmarks/gpu_rl.py                      # a 1.3B Llama (24 x 2048), bf16 + fp32 master, AdamW
    python benchmarks/gpu_rl.py --device cpu --small # smoke test of the script itself

Cases, each in a fresh process after one training step (so the optimizer state exists):

* ``zfunc``: ``zf.offload_states(state, device="cpu")`` then ``zf.reload_states``, twice (the
  second cycle reuses the page-locked buffers), against a page-locked ``copy_`` of the same bytes
  each way; ``torch.cuda.memory_allocated`` before, while out and after; the parameters after
  the reload equal those before, and a step trains on. Then ``zf.iter_weights(dtype=bf16,
  device="cuda")`` at two bucket sizes: GB/s of the stream against a device-to-device copy of the
  same bytes, and its peak added memory against a bucket plus the largest unit; beside it
  ``zf.gather_params`` (the whole model at once).
* ``deepspeed``: DeepSpeed ZeRO-3, bf16, its FusedAdam (``offload_states`` refuses any other
  optimizer): ``engine.offload_states()`` / ``reload_states()``, the same two cycles and figures.

One JSON line a case, then a table.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _llama import llama  # noqa: E402

CASES = ("zfunc", "deepspeed")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    p.add_argument("--profile", action="store_true", help="zfunc: the first stream under cProfile, top functions printed")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.layers, args.width, args.vocab, args.seq = 2, 128, 256, 16
    return args


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def allocated(device) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def copy_gbps(nbytes: int, device: str, pinned_host: bool) -> tuple[float, float]:
    """GB/s of one ``copy_`` of ``nbytes`` device-to-host and back (``pinned_host``), else device to device."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda") if pinned_host else torch.empty_like(src)
    rates = []
    for a, b in ((dst, src), (src, dst)) if pinned_host else ((dst, src),):
        a.copy_(b)  # warm
        sync(device)
        t0 = time.perf_counter()
        a.copy_(b)
        sync(device)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    del src, dst
    return rates[0], rates[-1]


def zfunc_case(args) -> dict:
    import zfunc as zf

    device = args.device
    model = llama(args, "meta")  # made on the device a unit at a time by step.init

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = zf.zero3(zf.mixed_precision(zf.train_step(loss_fn, zf.optim.adamw(1e-4)), torch.bfloat16))
    state = step.init(model, device=device)
    x = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    state, _ = step(state, x)
    sync(device)
    params = sum(p.numel() for p in model.parameters())
    expected = {k: v.clone() for k, v in zf.gather_params(state).items()}
    before = allocated(device)
    cycles = []
    for _ in range(2):
        t0 = time.perf_counter()
        state = zf.offload_states(state, device="cpu")
        sync(device)
        out_s, out_alloc = time.perf_counter() - t0, allocated(device)
        moved = sum(state.moved_bytes.values())
        t0 = time.perf_counter()
        state = zf.reload_states(state)
        sync(device)
        cycles.append({"out_s": out_s, "back_s": time.perf_counter() - t0, "freed": before - out_alloc,
                       "moved": moved, "after": allocated(device) - before})
    got = zf.gather_params(state)
    equal = all(torch.equal(got[k], v) for k, v in expected.items())
    del got, expected
    state, metrics = step(state, x)
    assert torch.isfinite(metrics["loss"]), "no finite loss after the reload"
    d2h, h2d = copy_gbps(cycles[-1]["moved"], device, pinned_host=True)

    streams = []
    blocks = [*model.model.layers, model.model.embed_tokens]  # the units: a decoder layer, the (tied) embedding
    largest_unit = 2 * max(sum(p.numel() for p in b.parameters()) for b in blocks)  # bf16
    for bucket_mb in (64, 512):
        sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = allocated(device)
        profiler = None
        if args.profile and bucket_mb == 64:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        total, t0 = 0, time.perf_counter()
        for _, t in zf.iter_weights(state, dtype=torch.bfloat16, bucket_bytes=bucket_mb << 20, device=device):
            total += t.numel() * t.element_size()
        sync(device)
        seconds = time.perf_counter() - t0
        if profiler is not None:
            import pstats
            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(18)
        peak = (torch.cuda.max_memory_allocated() - base) if device == "cuda" else 0
        streams.append({"bucket_mb": bucket_mb, "bytes": total, "s": seconds, "gbps": total / seconds / 1e9,
                        "peak_added": peak})
    d2d, _ = copy_gbps(streams[0]["bytes"], device, pinned_host=False)
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base, t0 = allocated(device), time.perf_counter()
    whole = zf.gather_params(state)
    sync(device)
    gather = {"s": time.perf_counter() - t0,
              "peak_added": (torch.cuda.max_memory_allocated() - base) if device == "cuda" else 0,
              "on": str(next(iter(whole.values())).device)}
    del whole
    return {"case": "zfunc", "params": params, "cycles": cycles, "equal_after_reload": equal,
            "pinned_copy_gbps": [d2h, h2d], "streams": streams, "device_copy_gbps": d2d,
            "largest_unit_bytes": largest_unit, "gather_params": gather}


def deepspeed_case(args) -> dict:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl")
    device = args.device
    model = llama(args, device)
    params = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},  # FusedAdam on CUDA
              "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    sync(device)
    before = allocated(device)
    cycles = []
    for _ in range(2):
        t0 = time.perf_counter()
        engine.offload_states()
        sync(device)
        out_s, out_alloc = time.perf_counter() - t0, allocated(device)
        t0 = time.perf_counter()
        engine.reload_states()
        sync(device)
        cycles.append({"out_s": out_s, "back_s": time.perf_counter() - t0, "freed": before - out_alloc,
                       "after": allocated(device) - before})
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss), "no finite loss after the reload"
    return {"case": "deepspeed", "params": params, "cycles": cycles}


def main():
    args = parse_args()
    if args.worker:
        out = (zfunc_case if args.worker == "zfunc" else deepspeed_case)(args)
        print("RESULT " + json.dumps(out), flush=True)
        return
    rows = []
    for case in args.cases.split(","):
        cmd = [sys.executable, __file__, "--worker", case, "--device", args.device, "--layers", str(args.layers),
               "--width", str(args.width), "--vocab", str(args.vocab), "--seq", str(args.seq)] + ["--profile"] * args.profile
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                print(f"== {case} failed (rc {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}", flush=True)
                continue
            rows.append(json.loads(lines[-1][7:]))
            print(lines[-1], flush=True)
            if args.profile:
                print(p.stderr[-6000:], flush=True)
        except subprocess.TimeoutExpired:
            print(f"== {case} timed out after {args.timeout} s", flush=True)
    gib = 2 ** 30
    for r in rows:
        print(f"\n{r['case']}: Llama {r['params'] / 1e6:.0f}M parameters")
        print("| cycle | out s | back s | GPU memory freed GiB | moved GiB | left after reload GiB |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for i, c in enumerate(r["cycles"]):
            print(f"| {i + 1} | {c['out_s']:.3f} | {c['back_s']:.3f} | {c['freed'] / gib:.2f} | "
                  f"{c.get('moved', 0) / gib:.2f} | {c['after'] / gib:.3f} |")
        if r["case"] == "zfunc":
            c = r["cycles"][-1]
            print(f"out {c['moved'] / c['out_s'] / 1e9:.1f} GB/s, back {c['moved'] / c['back_s'] / 1e9:.1f} GB/s; "
                  f"pinned copy_ {r['pinned_copy_gbps'][0]:.1f} / {r['pinned_copy_gbps'][1]:.1f} GB/s; "
                  f"equal after reload: {r['equal_after_reload']}")
            print("| bucket MiB | GB streamed | s | GB/s | of device copy | peak added GiB |")
            print("| ---: | ---: | ---: | ---: | ---: | ---: |")
            for s in r["streams"]:
                print(f"| {s['bucket_mb']} | {s['bytes'] / 1e9:.2f} | {s['s']:.3f} | {s['gbps']:.1f} | "
                      f"{s['gbps'] / r['device_copy_gbps']:.0%} | {s['peak_added'] / gib:.3f} |")
            g = r["gather_params"]
            print(f"device copy {r['device_copy_gbps']:.0f} GB/s; largest unit {r['largest_unit_bytes'] / gib:.3f} GiB; "
                  f"gather_params {g['s']:.3f} s, peak added {g['peak_added'] / gib:.2f} GiB, on {g['on']}")


if __name__ == "__main__":
    main()
