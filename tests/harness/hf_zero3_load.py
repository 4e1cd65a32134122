"""transformers' ZeRO-3 loading path: ``from_pretrained`` while a ZeRO-3 DeepSpeed config is live
(``HfDeepSpeedConfig``, as ``TrainingArguments(deepspeed=...)`` makes one), then
``deepspeed.initialize``; each rank writes what the engine holds against the files.

``python tests/harness/hf_zero3_load.py --which zfunc|deepspeed --folder F --out DIR`` (under
torchrun) writes ``DIR/rank{r}.json``: transformers' missing keys, the names whose gathered
value differs from the file's tensor by any bit (``differ``), those compared (``compared``),
whether every parameter is, after ``from_pretrained``, as DeepSpeed leaves a partitioned one (0
elements on the real device, ``ds_shape`` and ``ds_numel``; zfunc: its values wait in the spill), the peak RSS growth in MiB of ``from_pretrained`` and of it with ``initialize``, and the
model's size in MiB. ``--wrap``: the loaded model held as ``inner`` by a module of the script's
that adds a value head after loading (DeepSpeed-Chat's reward model); the record then says
whether the head kept its value through ``initialize``, torch's generator's next draw after
``from_pretrained`` (``draw``, seeded just before), and the shapes ``engine.module.state_dict()``
gives when rank 0 alone calls it (``one_rank_state_dict``, as scripts save).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_trainer import route  # noqa: E402
import torchrun  # noqa: E402

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--which", required=True)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resize", type=int, default=None)
    parser.add_argument("--wrap", action="store_true")
    a = parser.parse_args()
    route(a.which)
    import deepspeed
    import safetensors.torch
    import torch
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = {**CONFIG, "train_batch_size": world}
    live = HfDeepSpeedConfig(config)  # noqa: F841  (kept alive: transformers reads it through a weak reference)
    before = _rss_mib()
    torch.manual_seed(7)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(a.folder, output_loading_info=True,
                                                                     dtype=torch.float32)
    loaded = _rss_mib() - before
    draw = torch.rand(1).item()
    # as DeepSpeed leaves partitioned parameters: 0 elements on the real device, the full shape in ds_shape
    held = all(p.numel() == 0 and not p.is_meta and p.ds_numel == torch.Size(p.ds_shape).numel() > 0
               for p in model.parameters())
    resized = {}
    if a.resize is not None:  # DeepSpeed-Chat's resize_token_embeddings: new modules built "like" the old weights
        model.resize_token_embeddings(a.resize, mean_resizing=False)
    prefix, head = "", None
    if a.wrap:
        model, prefix = _Wrapped(model), "inner."
        head = model.head.weight.detach().clone()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    grown = _rss_mib() - before
    files = safetensors.torch.load_file(os.path.join(a.folder, "model.safetensors"))
    differ, compared = [], []
    head_kept = None
    for name, p in model.named_parameters():
        if name == "head.weight":
            with deepspeed.zero.GatheredParameters([p]):
                head_kept = torch.equal(p.detach().cpu(), head)
        name = name.removeprefix(prefix)
        if name not in files:
            continue
        with deepspeed.zero.GatheredParameters([p]):
            value = p.detach().to("cpu", copy=True)
        compared.append(name)
        if a.resize is not None and value.shape[0] == a.resize != files[name].shape[0]:  # a resized vocabulary
            rows = files[name].shape[0]
            resized[name] = {"shape": list(value.shape), "added_sum": float(value[rows:].double().sum()),
                             "added_std": float(value[rows:].std())}
            value = value[:rows].contiguous()
        if value.dtype != files[name].dtype or not torch.equal(value.view(-1).view(torch.int32),
                                                                files[name].view(-1).view(torch.int32)):
            differ.append(name)
    out = {"missing": sorted(info.get("missing_keys", [])), "differ": differ, "compared": compared,
           "rss_growth_mib": grown, "loaded_growth_mib": loaded, "placeholders_after_load": held, "resized": resized,
           "model_mib": sum(t.numel() * t.element_size() for t in files.values()) / 2**20, "files": sorted(files),
           "draw": draw, "head_kept": head_kept}
    if a.wrap and rank == 0:
        out["one_rank_state_dict"] = {k: list(v.shape) for k, v in engine.module.state_dict().items()}
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _Wrapped(model):
    """``model`` as ``inner`` of a module with a value head built after loading, outside ``zero.Init``."""
    import torch

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.head = torch.nn.Linear(inner.config.hidden_size, 1, bias=False)

        def forward(self, input_ids):
            return self.head(self.inner.model(input_ids).last_hidden_state)

    return Wrapped(model)


def run(which: str, folder: str, out: str, world: int = 2, timeout: int = 600, resize: int | None = None,
        wrap: bool = False) -> list[dict]:
    """Launch the script under torchrun with ``world`` gloo ranks; each rank's record (``resize``: the
    vocabulary resized to it by ``resize_token_embeddings`` between ``from_pretrained`` and
    ``initialize``; the record's ``resized`` has each resized tensor's shape and its added rows' sum
    and std, the old rows being compared with the file's)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return torchrun.records(__file__, ["--which", which, "--folder", folder, "--out", out,
                                       *([] if resize is None else ["--resize", str(resize)]),
                                       *(["--wrap"] if wrap else [])], out, world, env,
                            which, timeout)


if __name__ == "__main__":
    main()
