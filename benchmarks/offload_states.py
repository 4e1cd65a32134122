"""The training state moved off the device and back between phases (``zf.offload_states``,
``zf.reload_states``) against a checkpoint round trip, on a Llama at W = 1; each case in a fresh
process.

    python benchmarks/offload_states.py             # a 31.6M-parameter Llama (10 x 512, vocabulary 4096)
    python benchmarks/offload_states.py --small     # smoke test

Cases, each after one training step (AdamW, so the optimizer state exists):

* ``zero3 offload_states nvme``: ``zf.offload_states(state, device="nvme", path=)``, then
  ``zf.reload_states``;
* ``zero3 checkpoint``: what a user does without it: ``zf.checkpoint.save``, drop the state, then
  ``step.init`` a new one and ``zf.checkpoint.load`` it;
* ``zero3+offload_nvme offload_states nvme``: a state whose parts live in swap files already (only
  the optimizer's step counts are in memory).

Reported: seconds to move out and to bring back, and the RSS freed while out (RSS after a step,
then after the move out, each after ``zfunc.buffers.trim``). The disk is this machine's; the files
are on the page cache's way to it, as a real run's would be.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _llama import llama  # noqa: E402

CASES = ("zero3 offload_states nvme", "zero3 checkpoint", "zero3+offload_nvme offload_states nvme")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--small", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.layers, args.width, args.vocab, args.seq = 2, 128, 256, 16
    return args


def run_case(args) -> dict:
    import zfunc as zf
    from zfunc import buffers
    from zfunc.testing import memory

    case, directory = args.worker, args.dir
    torch.manual_seed(0)

    def build():
        model = llama(args, "cpu")

        def loss_fn(params, x):
            return zf.apply(model, params, input_ids=x, labels=x).loss

        step = zf.train_step(loss_fn, zf.optim.adamw(1e-4))
        if case.startswith("zero3+offload_nvme"):
            step = zf.offload_nvme(step, os.path.join(directory, "swap"))
        return model, zf.zero3(step)

    model, step = build()
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, args.vocab, (2, args.seq), generator=torch.Generator().manual_seed(0))
    state, _ = step.init(model), None
    state, _ = step(state, x)
    state_bytes = sum(v for k, v in zf.memory_report(state)["by_home"].items() if k != "disk")

    def settled_rss():
        gc.collect()
        buffers.trim()
        return memory.rss()

    before = settled_rss()
    t0 = time.perf_counter()
    if case.endswith("checkpoint"):
        zf.checkpoint.save(state, os.path.join(directory, "ckpt"), "t")
        del state
        out_s = time.perf_counter() - t0
        out_rss = settled_rss()
        t0 = time.perf_counter()
        model, step = build()
        state, _ = zf.checkpoint.load(step.init(model), os.path.join(directory, "ckpt"), "t")
        back_s = time.perf_counter() - t0
    else:
        state = zf.offload_states(state, device="nvme", path=directory)
        out_s = time.perf_counter() - t0
        out_rss = settled_rss()
        t0 = time.perf_counter()
        state = zf.reload_states(state)
        back_s = time.perf_counter() - t0
    state, metrics = step(state, x)  # it trains on
    assert torch.isfinite(metrics["loss"])
    state.close()
    return {"case": case, "params": n_params, "state_bytes": state_bytes, "out_s": out_s, "back_s": back_s,
            "rss_freed": before - out_rss}


def main():
    args = parse_args()
    if args.worker:
        print(json.dumps(run_case(args)))
        return
    rows = []
    for case in CASES:
        with tempfile.TemporaryDirectory() as d:
            cmd = [sys.executable, __file__, "--worker", case, "--dir", d, "--layers", str(args.layers), "--width",
                   str(args.width), "--vocab", str(args.vocab), "--seq", str(args.seq)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"Llama, {rows[0]['params'] / 1e6:.1f}M parameters, W = 1, AdamW\n")
    print("| case | state in memory (MB) | out (s) | back (s) | RSS freed while out (MB) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['state_bytes'] / 1e6:.1f} | {r['out_s']:.2f} | {r['back_s']:.2f} | "
              f"{r['rss_freed'] / 1e6:.1f} |")


if __name__ == "__main__":
    main()
