"""The named compositions the tests run, in one table, so that "zero3-bf16" means the same everywhere.

``COMPOSITIONS``: name -> ``cases.run_composed``'s keywords (``stage``, ``precision``, ``micro``,
``clip``, ``offload``); ``without_stage(name)`` for tests that draw the stage themselves; an NVMe
entry gets its swap folder where it runs (``"path"``). ``compose(name, step, swap)``: the same names
applied to a ``zf.train_step`` a test built itself (the Hugging Face and peft tests)."""
import torch

import zfunc as zf

FP16_SCALE = 1024.0  # fixed, so a reference can scale the same way
BF16 = {"dtype": torch.bfloat16}
FP16 = {"dtype": torch.float16, "loss_scale": FP16_SCALE}

COMPOSITIONS = {
    "zero0": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero3-clip": {"stage": 3, "clip": 0.05},
    "zero2-accumulate": {"stage": 2, "micro": 2},
    "zero3-accumulate": {"stage": 3, "micro": 2},
    "zero3-bf16": {"stage": 3, "precision": BF16},
    "zero1-fp16": {"stage": 1, "precision": FP16},
    "zero3-fp16": {"stage": 3, "precision": FP16},
    "zero3-bf16-accumulate": {"stage": 3, "precision": BF16, "micro": 2},
    "zero2-offload_cpu": {"stage": 2, "offload": {"kind": "cpu"}},
    "zero3-offload_cpu": {"stage": 3, "offload": {"kind": "cpu"}},
    "zero3-bf16-offload_cpu": {"stage": 3, "precision": BF16, "offload": {"kind": "cpu"}},
    "zero3-offload_params_cpu": {"stage": 3, "offload": {"kind": "cpu", "params": True}},
    # half the units' updates on the GPU, half on the host, in one call (offload_cpu's ratio)
    "zero3-bf16-offload_cpu-split": {"stage": 3, "precision": BF16, "offload": {"kind": "cpu", "ratio": 0.5}},
    # the last micro-batch's sums leave the GPU in backward (GradSink), the update finds them home
    "zero3-bf16-accumulate-offload_cpu": {"stage": 3, "precision": BF16, "micro": 2, "offload": {"kind": "cpu"}},
    "zero2-accumulate-offload_cpu-split": {"stage": 2, "micro": 2, "offload": {"kind": "cpu", "ratio": 0.5}},
    # each micro-batch's reduced shard copied down and summed in pinned host memory
    "zero3-bf16-accumulate-offload_cpu-host_sums": {"stage": 3, "precision": BF16, "micro": 2,
                                                    "offload": {"kind": "cpu", "accumulate_on": "host"}},
    "zero3-bf16-offload_nvme": {"stage": 3, "precision": BF16, "offload": {"kind": "nvme"}},
    "zero3-offload_nvme": {"stage": 3, "offload": {"kind": "nvme"}},
}


def without_stage(name: str) -> dict:
    return {k: v for k, v in COMPOSITIONS[name].items() if k != "stage"}


# name -> the composition of a train step ``s`` (``swap``: the NVMe folder); zero3 unless named otherwise
_COMPOSE = {
    "zero1": lambda s, swap: zf.zero1(s),
    "zero2": lambda s, swap: zf.zero2(s),
    "zero3": lambda s, swap: zf.zero3(s),
    "bf16": lambda s, swap: zf.zero3(zf.mixed_precision(s, torch.bfloat16)),
    "offload_cpu": lambda s, swap: zf.zero3(zf.offload_cpu(s)),
    "offload_nvme": lambda s, swap: zf.zero3(zf.offload_nvme(s, swap)),
    "accumulate": lambda s, swap: zf.zero3(zf.accumulate(s, 2)),
}


def compose(name: str, step, swap: str | None = None):
    return _COMPOSE[name](step, swap)
