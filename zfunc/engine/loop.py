"""What both engines share (zfunc.engine.engine, zfunc.pipeline.interpreter): pulling a step's micro-batches,
the step counters, the report every ``steps_per_print`` steps, the counters a checkpoint
keeps, and DeepSpeed's engine methods (zfunc.engine.deepspeed_methods)."""
from __future__ import annotations

import os
import resource
import sys
import time

import torch

from .. import dist
from .compose import current_lr
from .deepspeed_methods import DeepSpeedMethods
from ..optim.reported_lr import update_count
from ..state import gather_params


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Loop(DeepSpeedMethods):
    """The loop around a composed step. A subclass sets ``config``, ``state``, ``step_fn``,
    ``optimizer_fn`` (the zfunc optimizer) and ``lr_schedule`` (the lr schedule, or None) and
    calls ``_stepped`` after each update."""

    COUNTERS = ("global_steps", "global_samples")  # what a checkpoint's manifest keeps

    def _start_counting(self) -> None:
        self.global_steps = 0
        self.global_samples = 0
        self.last_metrics: dict = {}
        self._last_print = time.perf_counter()
        self._tokens_since_print = 0
        self._step_applied = False  # was_step_applied()

    def _next_micro_batches(self, data_iter) -> list:
        """The next ``gradient_accumulation_steps`` micro-batches of ``data_iter``."""
        n, out = self.gradient_accumulation_steps(), []
        for _ in range(n):
            try:
                out.append(next(data_iter))
            except StopIteration:
                raise StopIteration(f"data_iter ended after {len(out)} of the {n} micro-batches of a step; wrap "
                                    "the loader in zf.RepeatingLoader to cycle it") from None
        return out

    def _stepped(self, metrics: dict, tokens: int, seconds: float) -> None:
        """Count an update (``config.train_batch_size`` samples, ``tokens`` tokens) and report it."""
        self.last_metrics = metrics
        self._step_applied = not metrics.get("skipped", False)
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        self._tokens_since_print += tokens
        self._report(metrics, seconds)

    # ------------------------------------------------------------------ reading

    def params(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights keyed like the model's (a stage's module's) ``named_parameters()``, on
        every rank."""
        return gather_params(self.state)

    def get_lr(self) -> list[float]:
        """The lr of the next update, one per param group (DeepSpeed's): each group's schedule where
        the engine was given them (``group_schedules``: a script's optimizer with param groups),
        else the optimizer's."""
        schedules = getattr(self, "group_schedules", None)
        if schedules:
            count = update_count(self.state.opt_state)
            count = int(self.state.count) if count is None else count
            return [float(s(count)) for s in schedules]
        return current_lr(self.config, self.lr_schedule, self.state, getattr(self, "optimizer_fn", None))

    # ------------------------------------------------------------------ logging

    def _report_parts(self, metrics: dict, seconds: float) -> list[str]:
        """What an engine adds to the report line after step, loss and lr."""
        return []

    def _report(self, metrics: dict, seconds: float) -> None:
        every = self.config.steps_per_print
        if dist.rank() != 0 or not every:
            return
        if sys.stderr.isatty():
            total = (self.config.scheduler or {}).get("params", {}).get("total_num_steps")
            done = f"{self.global_steps}/{total}" if total else f"{self.global_steps}"
            bar = ""
            if total:
                filled = int(30 * min(self.global_steps, total) / total)
                bar = "[" + "#" * filled + "." * (30 - filled) + "] "
            sys.stderr.write(f"\r{bar}{done} loss {float(metrics['loss']):.4f}")
            sys.stderr.flush()
        if self.global_steps % every:
            return
        parts = [f"step {self.global_steps}", f"loss {float(metrics['loss']):.4f}"]
        lr = self.get_lr()
        if lr:
            parts.append(f"lr {lr[0]:.3e}")
        parts += self._report_parts(metrics, seconds)
        prefix = "\n" if sys.stderr.isatty() else ""
        print(prefix + " | ".join(parts), file=sys.stderr, flush=True)

    def _rate_and_memory(self) -> list[str]:
        """Tokens per second since the last report, and this process's RSS (and its peak)."""
        now = time.perf_counter()
        rate = self._tokens_since_print / max(now - self._last_print, 1e-9)
        self._last_print, self._tokens_since_print = now, 0
        return [f"{rate:,.0f} tokens/s",
                f"rss {_rss_bytes() / 1e9:.2f} GB (peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f})"]

    # -------------------------------------------------------------- checkpoints

    def _counters(self) -> dict:
        return {name: getattr(self, name) for name in self.COUNTERS}

    def _restore_counters(self, manifest: dict) -> None:
        counters = manifest.get("engine", {})
        for name in self.COUNTERS:
            setattr(self, name, counters.get(name, int(self.state.count) if name == "global_steps" else 0))

    def close(self) -> None:
        """Remove the state's swap files (offload to NVMe)."""
        self.state.close()
