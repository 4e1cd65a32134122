"""Reading Hugging Face safetensors weights and writing them back: zfunc against DeepSpeed and FSDP2.

    python benchmarks/hf_weights_peers.py                                         # a 31.6M-parameter Llama
    python benchmarks/hf_weights_peers.py --layers 24 --width 1024 --vocab 32000  # 315.9M

A random Llama (``_llama.llama``: tied embeddings) is written once with ``save_pretrained``;
then each way, in a fresh process at W = 1 (gloo), loads that folder into a trainable ZeRO-3 state
with AdamW's moments made, and exports it back as safetensors. Each phase's time and peak RSS
above the process's baseline (VmHWM, reset just before) are printed, with a spot check that a few
tensors loaded and exported equal the file's:

* ``zfunc-nvme``: ``zero3(offload_nvme(train_step(adamw)))`` on a meta model,
  ``step.init(model, weights=FOLDER)``; export ``zf.checkpoint.save_hf(state, OUT)``;
* ``zfunc``: the same without ``offload_nvme``;
* ``deepspeed``: ``from_pretrained`` under ``deepspeed.zero.Init`` (a ZeRO-3 config registered with
  ``HfDeepSpeedConfig``), then ``deepspeed.initialize``; export ``engine.save_checkpoint`` and
  ``zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict`` (torch's format: with
  ``safe_serialization=True`` it refuses the tied embeddings); needs ``pip install accelerate``;
* ``fsdp2``: ``fully_shard`` per decoder layer and the root on a meta model, ``to_empty``,
  ``dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(FOLDER))``, AdamW's moments
  made by one step on zero gradients; export ``dcp.save`` with ``HuggingFaceStorageWriter``.

Each way first runs once on a one-layer model, so lazy imports and first-call costs stay out of
the figures. A way that fails gets its row with the error instead of figures.
"""
import argparse
import glob
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import driver_or_worker, launch  # noqa: E402
from _llama import llama  # noqa: E402
from _peers import Settings, deepspeed_engine, ds_config, fsdp2, init_distributed, torch_adamw, zfunc_step  # noqa: E402
from _worker import measured  # noqa: E402

WAYS = ("zfunc-nvme", "zfunc", "deepspeed", "fsdp2")
PEERS = ("deepspeed", "fsdp2")
PEER = {"zfunc-nvme": "zfunc_nvme", "zfunc": "zero3", "deepspeed": "ds3", "fsdp2": "fsdp2"}  # benchmarks/_peers.py's
SETTINGS = Settings(lr=1e-3, adam="for-loop")  # torch AdamW's default on the CPU


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--dir", default=None, help="where the checkpoints and swap files go (default: a temporary folder)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def checked_names(layers: int) -> list[str]:
    """A few tensors to compare with the file: the first and last layer's, the embedding, the final norm."""
    return ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            f"model.layers.{layers - 1}.mlp.down_proj.weight", "model.norm.weight"]


def read_folder(folder: str, names) -> dict[str, torch.Tensor]:
    """The named tensors of a folder's safetensors (or torch ``.bin``) files, whichever file holds them."""
    from safetensors import safe_open

    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in names if n in f.keys()})
    for path in sorted(glob.glob(os.path.join(folder, "*.bin"))):
        tensors = torch.load(path, mmap=True, weights_only=True)
        out.update({n: tensors[n] for n in names if n in tensors})
    return out


def read_folder_keys(folder: str) -> list[str]:
    """The names of a folder's safetensors tensors (their headers only)."""
    from safetensors import safe_open

    keys = []
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            keys.extend(f.keys())
    return keys


def equal_to_file(tensors: dict, reference: dict) -> bool:
    return tensors.keys() == reference.keys() and all(torch.equal(tensors[n].float(), reference[n].float())
                                                      for n in reference)


def meta_model(folder: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def zfunc_way(folder: str, out: str, scratch: str, names, nvme: bool) -> dict:
    import zfunc as zf

    s = Settings(lr=1e-3, nvme_path=os.path.join(scratch, "swap"))
    step = zfunc_step(PEER["zfunc-nvme" if nvme else "zfunc"], lambda p, x: 0, s)
    r = {}
    state, r["load_s"], r["load_peak"] = measured(lambda: step.init(meta_model(folder), weights=folder))
    _, r["export_s"], r["export_peak"] = measured(lambda: zf.checkpoint.save_hf(state, out, config=folder))
    params = zf.gather_params(state)
    r["loaded"] = {n: params[n] for n in names}
    state.close()
    return r


def deepspeed_way(folder: str, out: str, scratch: str, names) -> dict:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    config = ds_config(PEER["deepspeed"], SETTINGS)
    registered = HfDeepSpeedConfig(config)  # noqa: F841 - from_pretrained reads it while it lives: zero.Init

    def load():
        model = AutoModelForCausalLM.from_pretrained(folder)
        return deepspeed_engine(PEER["deepspeed"], model, model.model.layers, SETTINGS, config)

    r = {}
    engine, r["load_s"], r["load_peak"] = measured(load)
    ckpt = os.path.join(scratch, "ds-checkpoint")

    def export():
        start = time.perf_counter()
        engine.save_checkpoint(ckpt, tag="t")
        r["save_checkpoint_s"] = time.perf_counter() - start
        # safe_serialization=True fails on tied embeddings ("Some tensors share memory"): torch's format
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, tag="t")

    _, r["export_s"], r["export_peak"] = measured(export)
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([params[n] for n in names]):
        r["loaded"] = {n: params[n].detach().clone() for n in names}
    return r


def fsdp2_way(folder: str, out: str, scratch: str, names) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    in_file = set(read_folder_keys(folder))

    def load():
        model = meta_model(folder)
        fsdp2(model, model.model.layers, mesh)
        model.to_empty(device="cpu")
        model.tie_weights()
        dcp.load({k: v for k, v in model.state_dict().items() if k in in_file},
                 storage_reader=HuggingFaceStorageReader(folder))
        opt = torch_adamw(model.parameters(), Settings(lr=1e-3, wd=0.0, adam="for-loop"))
        for p in model.parameters():  # a step on zero gradients makes the moments and moves nothing
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return model, opt

    r = {}
    (model, opt), r["load_s"], r["load_peak"] = measured(load)
    writer = HuggingFaceStorageWriter(out, save_distributed=True, enable_consolidation=True)
    _, r["export_s"], r["export_peak"] = measured(
        lambda: dcp.save({k: v for k, v in model.state_dict().items() if k in in_file}, storage_writer=writer))
    sd = model.state_dict()
    r["loaded"] = {n: sd[n].full_tensor() for n in names}
    return r


def worker(args, way: str, folder: str, warm: str, scratch: str) -> dict:
    """``way`` on the tiny folder ``warm`` first (its code paths and lazy imports, out of the figures), then
    measured on ``folder``."""
    if way in PEERS:
        init_distributed(PEER[way], "gloo")
    run = {"deepspeed": deepspeed_way, "fsdp2": fsdp2_way,
           "zfunc": lambda *a: zfunc_way(*a, nvme=False), "zfunc-nvme": lambda *a: zfunc_way(*a, nvme=True)}[way]
    names = checked_names(args.layers)
    out = os.path.join(scratch, "export")
    try:
        run(warm, os.path.join(scratch, "warm-export"), os.path.join(scratch, "warm"), checked_names(1))
        r = run(folder, out, scratch, names)
    except Exception as e:  # noqa: BLE001 - the error is the row
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:240]}"}
    reference = read_folder(folder, names)
    r["load_equal"] = equal_to_file(r.pop("loaded"), reference)
    r["export_equal"] = equal_to_file(read_folder(out, names), reference)
    return r


def run_way(args) -> None:
    """This fresh process's part (``--worker WAY,FOLDER,WARM,SCRATCH,RESULT``): ``worker``'s figures to RESULT."""
    way, folder, warm, scratch, result = args.worker.split(",")
    with open(result, "w") as f:
        json.dump(worker(args, way, folder, warm, scratch), f)


def main(args):
    root = args.dir or tempfile.mkdtemp(prefix="hf_weights_peers-")
    folder, warm = os.path.join(root, "llama"), os.path.join(root, "warm")
    torch.manual_seed(0)
    llama(argparse.Namespace(layers=1, width=64, vocab=64), "cpu").save_pretrained(warm)
    model = llama(args, "cpu")
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    rows = {}
    for way in args.ways.split(","):
        scratch = os.path.join(root, way)
        os.makedirs(scratch, exist_ok=True)
        result = os.path.join(scratch, "result.json")
        argv = [os.path.abspath(__file__), "--layers", str(args.layers), "--width", str(args.width), "--vocab",
                str(args.vocab), "--worker", f"{way},{folder},{warm},{scratch},{result}"]
        rcs = launch(argv, 1, env={"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}, timeout=1800)
        if os.path.exists(result):
            with open(result) as f:
                rows[way] = json.load(f)
        else:
            rows[way] = {"error": f"the process died (exit code {rcs[0]})"}
        print(f"[{way}] {rows[way]}", file=sys.stderr)
    mib = 2**20
    print(f"\nLlama, {params / 1e6:.1f}M parameters ({4 * params / mib:.0f} MiB in fp32), one save_pretrained "
          f"folder, W = 1; torch {torch.__version__}\n")
    print("| way | load s | load peak MiB | export s | export peak MiB | loaded = file | exported = file |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for way, r in rows.items():
        if "error" in r:
            print(f"| {way} | did not run: `{r['error']}` | | | | | |")
        else:
            print(f"| {way} | {r['load_s']:.1f} | {r['load_peak'] / mib:.0f} | {r['export_s']:.1f} | "
                  f"{r['export_peak'] / mib:.0f} | {r['load_equal']} | {r['export_equal']} |")
    print("\n| zfunc / peer | load s | load peak | export s | export peak |")
    print("| --- | ---: | ---: | ---: | ---: |")
    keys = ("load_s", "load_peak", "export_s", "export_peak")
    for ours in (w for w in rows if w.startswith("zfunc") and "error" not in rows[w]):
        for peer in (w for w in PEERS if w in rows and "error" not in rows[w]):
            print(f"| {ours} / {peer} | " + " | ".join(f"{rows[ours][k] / rows[peer][k]:.2f}" for k in keys) + " |")


if __name__ == "__main__":
    driver_or_worker(parse_args, main, run_way)
