"""Checkpoint save and load: zfunc against torch.distributed.checkpoint (DCP) with FSDP2 and
DeepSpeed's save_checkpoint, side by side, on the anchor GPT at W = 2 (gloo, CPU).

    python benchmarks/checkpoint.py                 # 3 repeats of each, then loads at W = 1 and 3
    python benchmarks/checkpoint.py --small         # smoke test
    python benchmarks/checkpoint.py --tools zfunc   # zfunc alone, with its checksums' cost

Each tool trains one step (so the optimizer state exists), then saves its full
training state (weights and Adam moments) --repeats times and loads it back as
many times, in fresh processes per tool. The times are the slowest rank's, each
save ending with every file on disk (zfunc and DCP fsync; DeepSpeed's torch.save
does not, which favours it). Then each tool loads the W = 2 checkpoint at W = 1
and W = 3: zfunc and DCP reshard; DeepSpeed's ZeRO-3 checkpoint needs its
universal-checkpoint conversion first, so that load is attempted and its error
reported. zfunc's saves and loads alternate with ones whose checksums are switched off
in this benchmark only (no CRC computed on save, none verified on load), in the same
processes: the difference is the checksums' cost.
"""
import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from _launch import driver_or_worker, launch  # noqa: E402
from _peers import Settings, deepspeed_engine, fsdp2, init_distributed, lm_loss, torch_adamw, zfunc_step  # noqa: E402
from gpt import GPT, GPTConfig, num_params  # noqa: E402

import zfunc as zf  # noqa: E402

TOOLS = {"zfunc": "zfunc zero3, zf.checkpoint", "dcp": "torch FSDP2 + torch.distributed.checkpoint",
         "ds": "DeepSpeed ZeRO-3 save_checkpoint"}
PEER = {"zfunc": "zero3", "dcp": "fsdp2", "ds": "ds3"}  # each tool's peer (benchmarks/_peers.py)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default="zfunc,dcp,ds")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    p.add_argument("--small", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--action", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.layers, args.width, args.vocab, args.seq, args.repeats = 2, 64, 256, 32, 2
    return args


def setup(tool, args):
    """The tool's trained state after one step, and its save and load functions."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width, n_layers=args.layers,
                          n_heads=8 if args.width % 8 == 0 else 4, tie_embeddings=False))
    n = num_params(model)
    x = torch.randint(args.vocab, (2, args.seq + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    x, y = x[:, :-1], x[:, 1:]
    if tool == "zfunc":
        def loss_fn(params, batch):
            return lm_loss(zf.apply(model, params, batch[0]), batch[1])

        step = zfunc_step(PEER[tool], loss_fn, Settings(lr=1e-3))
        box = {"state": step.init(model)}
        box["state"], _ = step(box["state"], (x, y))

        def save(path):
            zf.checkpoint.save(box["state"], os.path.dirname(path), os.path.basename(path))

        def load(path):
            box["state"], _ = zf.checkpoint.load(box["state"], os.path.dirname(path), os.path.basename(path))

        return n, save, load
    if tool == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        fsdp2(model, model.blocks, init_device_mesh("cpu", (dist.get_world_size(),)))
        opt = torch_adamw(model.parameters(), Settings(lr=1e-3))
        lm_loss(model(x), y).backward()
        opt.step()

        def save(path):
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

        def load(path):
            msd, osd = get_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

        return n, save, load
    engine = deepspeed_engine(PEER[tool], model, model.blocks, Settings(lr=1e-3, adam="for-loop", batch=2))
    loss = lm_loss(engine(x), y)
    engine.backward(loss)
    engine.step()

    def save(path):
        engine.save_checkpoint(os.path.dirname(path), tag=os.path.basename(path))

    def load(path):
        engine.load_checkpoint(os.path.dirname(path), tag=os.path.basename(path))

    return n, save, load


@contextlib.contextmanager
def without_checksums():
    """zfunc's checkpoints without their CRCs: none computed on save (zeros stored), none verified on load."""
    from zfunc.checkpoint import files as checkpoint_io

    kept = checkpoint_io.checksums, checkpoint_io.RankFile.verify
    checkpoint_io.checksums = lambda data: [0] * -(-data.numel() // checkpoint_io.CHUNK)
    checkpoint_io.RankFile.verify = lambda self, key, start=0, stop=None: None
    try:
        yield
    finally:
        checkpoint_io.checksums, checkpoint_io.RankFile.verify = kept


def unchecked(fn):
    def run(*args):
        with without_checksums():
            fn(*args)
    return run


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def worker(args):
    tool, action = args.worker, args.action
    init_distributed(PEER[tool], "gloo")
    n, save, load = setup(tool, args)
    root = os.path.join(args.dir, tool)
    out = {"tool": tool, "action": action, "world": dist.get_world_size(), "params": n}
    if action == "save_load":
        out["save_s"], out["load_s"] = [], []
        save_unchecked, load_unchecked = unchecked(save), unchecked(load)
        for i in range(args.repeats):  # zfunc: alternating with its checksums off, for their cost
            out["save_s"].append(timed(lambda: save(os.path.join(root, f"t{i}"))))
            if tool == "zfunc":
                out.setdefault("save_unchecked_s", []).append(timed(lambda: save_unchecked(f"{root}/u{i}")))
        for i in range(args.repeats):
            out["load_s"].append(timed(lambda: load(os.path.join(root, f"t{i}"))))
            if tool == "zfunc":
                out.setdefault("load_unchecked_s", []).append(timed(lambda: load_unchecked(f"{root}/u{i}")))
        out["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "t0"))
                           for f in fs)
    else:  # a resharded load of the W = 2 checkpoint
        try:
            out["load_s"] = [timed(lambda: load(os.path.join(root, "t0")))]
        except Exception as e:  # noqa: BLE001 - reported, it is the measurement
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def run(tool, action, world, args, tmp):
    result = os.path.join(tmp, f"{tool}.{action}.{world}.json")
    argv = [os.path.abspath(__file__), "--worker", tool, "--action", action, "--result", result, "--dir", args.dir] + [
        f"--{k}={getattr(args, k)}" for k in ("repeats", "layers", "width", "vocab", "seq")]
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    rcs = launch(argv, world, env=env, timeout=900)
    if any(rcs) or not os.path.exists(result):
        return {"tool": tool, "action": action, "world": world, "error": f"the processes died (exit codes {rcs})"}
    with open(result) as f:
        return json.load(f)


def main(args):
    tools = args.tools.split(",")
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="zfunc-ckpt-bench-")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tool in tools:
            results[(tool, 2)] = run(tool, "save_load", 2, args, tmp)
            for world in (1, 3):
                results[(tool, world)] = run(tool, "reshard", world, args, tmp)
            print(f"[{tool}] {results[(tool, 2)]}", file=sys.stderr)
    if own_dir:
        shutil.rmtree(args.dir, ignore_errors=True)
    base = results.get(("dcp", 2), {})
    med = lambda r, k: statistics.median(r[k]) if r.get(k) else None  # noqa: E731
    n = next((r["params"] for r in results.values() if "params" in r), 0)
    print(f"\nAnchor GPT, {n / 1e6:.1f}M parameters, fp32 weights + AdamW moments, W = 2 gloo ranks; "
          f"median of {args.repeats} saves and loads; torch {torch.__version__}\n")
    print("| tool | save s | save / DCP | load s (same W) | load / DCP | on disk MB | load at W = 1 | load at W = 3 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for tool in tools:
        r = results[(tool, 2)]
        if "error" in r:
            print(f"| {TOOLS[tool]} | failed: {r['error']} | | | | | | |")
            continue
        save_s, load_s = med(r, "save_s"), med(r, "load_s")

        def ratio(x, key):
            b = med(base, key)
            return f"{x / b:.2f}" if b else ""

        def reshard(world):
            o = results[(tool, world)]
            return f"fails: {o['error']}" if "error" in o else f"{o['load_s'][0]:.3f} s"

        print(f"| {TOOLS[tool]} | {save_s:.3f} | {ratio(save_s, 'save_s')} | {load_s:.3f} | {ratio(load_s, 'load_s')} | "
              f"{r['bytes'] / 1e6:.1f} | {reshard(1)} | {reshard(3)} |")
    r = results.get(("zfunc", 2), {})
    if r.get("save_unchecked_s"):
        costs = []
        for what in ("save", "load"):
            on, off = med(r, f"{what}_s"), med(r, f"{what}_unchecked_s")
            costs.append(f"{what} {on:.3f} s against {off:.3f} s without ({on / off - 1:+.0%})")
        print(f"\nzfunc's checksums (zlib CRC-32 per 1 MiB, computed on save, verified on load), "
              f"{r['bytes'] / 1e6:.1f} MB: " + ", ".join(costs))


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
