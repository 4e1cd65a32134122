"""Peak host memory of reading pretrained weights into an NVMe-offloaded state, three ways.

    python benchmarks/load_weights.py                        # a 31.6M-parameter Llama
    python benchmarks/load_weights.py --layers 24 --width 1024 --vocab 32000   # 315.9M

A Llama of the given size (random weights, one ``model.safetensors``, tied embeddings) is
read into ``zero3(offload_nvme(train_step(adamw)))`` at W = 1, each way in a fresh process,
and the peak RSS above the process's baseline (VmHWM, reset just before) is printed with
the time it took:

* ``weights``: built on the meta device, ``step.init(model, weights=PATH)``: each unit read
  from the file as it is initialized, then written to its swap file;
* ``init_fn``: built on the meta device, ``step.init(model, init_fn=fn)`` with the
  hand-written ``fn`` of before: every tensor copied from ``safetensors.torch.load_file``;
* ``model``: built on the CPU, ``model.load_state_dict(load_file(PATH))``, ``step.init(model)``.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import driver_or_worker  # noqa: E402
from _llama import llama  # noqa: E402
from _peers import Settings, zfunc_step  # noqa: E402
from _worker import measured  # noqa: E402

MODES = ("weights", "init_fn", "model")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dir", default=None, help="where the checkpoint and swap files go (default: a temporary folder)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def worker(args) -> None:
    """One way (``--worker MODE,PATH,SWAP,OUT``) in this fresh process: its seconds and peak RSS to OUT."""
    mode, path, swap, out = args.worker.split(",")
    step = zfunc_step("zfunc_nvme", lambda p, x: 0, Settings(lr=1e-3, nvme_path=swap))
    warm = llama(argparse.Namespace(layers=1, width=64, vocab=64), "meta")
    step.init(warm).close()  # the code paths and native ops, loaded before the baseline
    state, seconds, peak = measured(lambda: load(args, mode, path, step))
    params = sum(u.trainable.numel for u in state.params.spec.model.units)
    state.close()
    with open(out, "w") as f:
        json.dump({"peak": peak, "seconds": seconds, "params": params}, f)


def load(args, mode: str, path: str, step):
    from safetensors.torch import load_file

    if mode == "weights":
        return step.init(llama(args, "meta"), weights=path)
    if mode == "init_fn":
        tensors = load_file(path)
        model = llama(args, "meta")
        names = {id(m): n for n, m in model.named_modules()}

        def init_fn(module):  # rotary frequencies, in no file, zfunc computes from the module's config
            prefix = names[id(module)]
            with torch.no_grad():
                for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                    key = f"{prefix}.{n}" if prefix else n
                    if key in tensors:
                        t.copy_(tensors[key])

        state = step.init(model, init_fn=init_fn)
        del tensors
        return state
    model = llama(args, "cpu")
    model.load_state_dict(load_file(path), strict=False)
    return step.init(model)


def main(args):
    folder = args.dir or tempfile.mkdtemp(prefix="load_weights-")
    path = os.path.join(folder, "model.safetensors")
    from safetensors.torch import save_file

    with torch.device("meta"):
        shapes = llama(args, "meta").state_dict()
    g = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(v.shape, generator=g) * 0.02 for k, v in shapes.items() if k != "lm_head.weight"}, path)
    rows = []
    for mode in args.modes.split(","):
        out = os.path.join(folder, f"{mode}.json")
        swap = os.path.join(folder, f"swap-{mode}")
        cmd = [sys.executable, __file__, "--layers", str(args.layers), "--width", str(args.width), "--vocab",
               str(args.vocab), "--worker", f"{mode},{path},{swap},{out}"]
        subprocess.run(cmd, check=True)
        with open(out) as f:
            r = json.load(f)
        rows.append((mode, r))
    params = rows[0][1]["params"]
    print(f"Llama, {params / 1e6:.1f}M parameters ({4 * params / 2**20:.0f} MiB in fp32), "
          f"zero3(offload_nvme), W = 1")
    print("| way | peak RSS above baseline (MiB) | x fp32 size | seconds |")
    print("| --- | --- | --- | --- |")
    for mode, r in rows:
        print(f"| {mode} | {r['peak'] / 2**20:.0f} | {r['peak'] / (4 * params):.2f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
