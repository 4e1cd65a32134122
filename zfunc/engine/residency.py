"""``engine.offload_states()`` and ``engine.reload_states()``, with DeepSpeed's arguments: the
engine's state moved off the device between phases and back (``zf.offload_states``,
``zf.reload_states``; docs/rl.md). The engine holds the offloaded value meanwhile, so a
``train_batch``, ``forward`` or ``save_checkpoint`` before the reload is refused, naming
``reload_states``."""
from __future__ import annotations

from ..residency import OffloadedState, offload_states, reload_states


def offload(engine, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False,
            path: str | None = None) -> None:
    """DeepSpeed's ``engine.offload_states(include, device, pin_memory, non_blocking)``: ``include``
    takes DeepSpeed's ``OffloadStateTypeEnum`` names (or zfunc's parts), ``device`` ``"cpu"`` or
    (zfunc only) ``"nvme"``, whose files go under ``path`` (default: the config's
    ``zero_optimization.offload_optimizer.nvme_path`` or ``offload_param.nvme_path``). Refused in
    the middle of an accumulation (backward since the last ``step()``), and on an engine offloaded
    already."""
    if isinstance(engine.state, OffloadedState):
        raise ValueError("engine.offload_states(): the engine's state is offloaded already; call "
                         "engine.reload_states() first")
    engine._no_step_in_progress("engine.offload_states()")
    device = getattr(device, "value", device)
    if device == "nvme" and path is None:
        path = _config_nvme_path(engine.config)
        if path is None:
            raise ValueError("engine.offload_states(device='nvme'): give path=, a folder on a fast disk (the config "
                             "names none: zero_optimization.offload_optimizer.nvme_path)")
    engine.state = offload_states(engine.state, device=device, path=path, include=include, pin_memory=pin_memory,
                                  non_blocking=non_blocking)


def reload(engine, non_blocking: bool = False) -> None:
    """DeepSpeed's ``engine.reload_states(non_blocking)``: the state back on the device; nothing to do
    on an engine whose state was not offloaded (as DeepSpeed's)."""
    if isinstance(engine.state, OffloadedState):
        engine.state = reload_states(engine.state, non_blocking=non_blocking)


def _config_nvme_path(cfg) -> str | None:
    z = cfg.zero
    for section in (z.offload_optimizer, z.offload_param):
        if section is not None and getattr(section, "nvme_path", None):
            return section.nvme_path
    return None
