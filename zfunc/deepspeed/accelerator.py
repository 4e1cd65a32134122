"""``from zfunc.deepspeed.accelerator import get_accelerator``: the device as DeepSpeed scripts ask
for it (``get_accelerator().device_name(local_rank)``, ``.set_device``, ``.synchronize``...).

zfunc runs where torch runs: on CUDA when a GPU is there, else on the CPU, so the accelerator
here is torch's device with DeepSpeed's method names. Methods of DeepSpeed's accelerator that
scripts rarely call (op builders, graphs, streams) are not offered: asking for one raises,
naming it.
"""
from __future__ import annotations

import os

import torch

__all__ = ["Accelerator", "get_accelerator"]


class Accelerator:
    """CUDA when ``torch.cuda.is_available()``, else the CPU (DeepSpeed's CUDA and CPU accelerators)."""

    def __init__(self):
        self._cuda = torch.cuda.is_available()
        self._name = "cuda" if self._cuda else "cpu"

    # ----------------------------------------------------------------- devices

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` / ``"cuda:i"``, or ``"cpu"`` (the CPU has no index, as in DeepSpeed)."""
        if device_index is None or not self._cuda:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        """The torch.distributed backend zfunc uses on this device: nccl, or gloo on the CPU."""
        return "nccl" if self._cuda else "gloo"

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ------------------------------------------------------------------ dtypes

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return self._cuda

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.bfloat16] if self.is_bf16_supported() else [torch.float32]
        return dtypes + ([torch.float16] if self.is_fp16_supported() else [])

    # ------------------------------------------------------------ random state

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    # ------------------------------------------------------------------ memory

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def __getattr__(self, name: str):
        raise AttributeError(
            f"get_accelerator().{name}: this part of DeepSpeed's accelerator is not offered by zfunc.deepspeed "
            "(it has the device, dtype, seed and memory methods scripts use); call torch directly "
            f"(torch.{self._name}...)")


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The one accelerator of this process (DeepSpeed's ``get_accelerator``)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR
