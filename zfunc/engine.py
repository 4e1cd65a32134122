"""The engine: a DeepSpeed-style config composed into one zfunc step, and the loop around it.

``zf.initialize(model, config)`` reads the config (zfunc.config), composes the
transforms a user would write by hand::

    zeroN(offload_*(mixed_precision(accumulate(train_step(loss, chain(clip, optimizer)), gas))))

and keeps the state. ``train_batch(data_iter)`` pulls the gradient accumulation
steps' micro-batches and makes one step; the imperative style of ported
DeepSpeed scripts (``loss = engine(batch); engine.backward(loss); engine.step()``)
gives the same steps. Checkpoints are zfunc.checkpoint's, with the engine's
counters, the config and the model's ``state_dict`` keys in the manifest.
"""
from __future__ import annotations

import os
import resource
import sys
import time
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from . import checkpoint, config as configuration, dist, lr_schedules, optim
from .config import OffloadParamConfig
from .accumulate import accumulate
from .grad import apply
from .loss_scale import LossScaler
from .offload import offload_cpu
from .offload_nvme import offload_nvme
from .precision import mixed_precision
from .state import gather_params
from .step import EvalStep, Step, eval_step, train_step
from .zero import zero1, zero2, zero3


class RepeatingLoader:
    """Iterates ``loader`` forever, starting it again when it ends (DeepSpeed's RepeatingLoader)."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)


def model_loss(model: nn.Module, loss_fn: Callable | None) -> Callable:
    """The step's ``loss_fn(params, batch)`` from a model and the user's ``loss_fn(model, batch)``.

    Without ``loss_fn`` the model computes its own loss from the batch: ``model(**batch)``
    for a mapping (Hugging Face models given ``labels``), ``model(*batch)`` for a tuple or
    list, ``model(batch)`` otherwise; its output is the loss, has ``.loss``, or starts
    with it. With ``loss_fn``, it gets the model as a function (run on the state's
    parameters) and the batch: ``loss_fn=lambda model, b: F.cross_entropy(model(b[0]), b[1])``.
    """

    def loss(params, batch):
        def run(*args, **kw):
            return apply(model, params, *args, **kw)

        if loss_fn is not None:
            return loss_fn(run, batch)
        if isinstance(batch, dict):
            out = run(**batch)
        elif isinstance(batch, (tuple, list)):
            out = run(*batch)
        else:
            out = run(batch)
        return _the_loss(out)

    return loss


def _the_loss(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        value = out
    elif getattr(out, "loss", None) is not None:
        value = out.loss
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        value = out[0]
    else:
        raise TypeError(
            f"the model returned {type(out).__name__}, not a loss: without loss_fn the model must compute its "
            "own loss (a tensor, an output with .loss, or a tuple starting with it); or pass "
            "loss_fn=lambda model, batch: ... to zf.initialize")
    if value.numel() != 1:
        raise ValueError(f"the loss must be a single number, got a tensor of shape {tuple(value.shape)}: if the "
                         "model returns outputs rather than its loss, pass loss_fn=lambda model, batch: ...")
    return value.reshape(())


def _optimizer(cfg, optimizer, lr_scheduler):
    """The optimizer the config (or the caller) asks for, with its schedule and clipping."""
    if optimizer is not None and cfg.optimizer is not None:
        raise ValueError("an optimizer is given both in the config ('optimizer') and to zf.initialize: keep one")
    if optimizer is not None and lr_scheduler is not None:
        raise ValueError("with your own optimizer, give it the schedule as its lr (zf.optim.adamw(schedule)) "
                         "instead of passing lr_scheduler")
    if optimizer is None and cfg.optimizer is None:
        raise ValueError("no optimizer: put an 'optimizer' section in the config or pass optimizer=zf.optim.adamw(...)")
    schedule = None
    if optimizer is None:
        o = cfg.optimizer
        base_lr = o.lr
        if lr_scheduler is not None and cfg.scheduler is not None:
            raise ValueError("a scheduler is given both in the config ('scheduler') and to zf.initialize: keep one")
        if lr_scheduler is not None:
            schedule = lr_scheduler
        elif cfg.scheduler is not None:
            schedule = lr_schedules.from_config(cfg.scheduler, base_lr)
        lr = schedule if schedule is not None else base_lr
        if o.type == "sgd":
            optimizer = optim.sgd(lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.nesterov,
                                  dampening=o.dampening)
        elif o.decoupled:
            optimizer = optim.adamw(lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        else:
            optimizer = optim.adam(lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if cfg.gradient_clipping > 0:
        optimizer = optim.chain(optim.clip_by_global_norm(cfg.gradient_clipping), optimizer)
    return optimizer, schedule


def current_lr(cfg, schedule, state) -> list[float]:
    """The learning rate of the next update (DeepSpeed's ``get_lr``: one per param group)."""
    if schedule is None:
        return [cfg.optimizer.lr] if cfg.optimizer is not None else []
    return [float(schedule(int(state.count)))]


def compose(cfg, base: Step, *, group=None, accumulate_micro: bool = True) -> Step:
    """``base`` wrapped as the config says, in the order zfunc's rules ask (README, docs/architecture.md).

    ``group``: the ZeRO stage's process group (a pipeline stage's data-parallel group);
    ``accumulate_micro``: wrap in ``accumulate`` (not for a pipeline stage, whose schedule
    takes the micro-batches one by one)."""
    step = base
    if cfg.gradient_accumulation_steps > 1 and accumulate_micro and not isinstance(base, EvalStep):
        step = accumulate(step, cfg.gradient_accumulation_steps)
    if cfg.compute_dtype == torch.bfloat16:
        step = mixed_precision(step, torch.bfloat16)
    elif cfg.compute_dtype == torch.float16:
        f = cfg.fp16
        scaler = (LossScaler(init_scale=2.0 ** f.initial_scale_power, window=f.loss_scale_window,
                             hysteresis=f.hysteresis, min_scale=f.min_loss_scale,
                             consecutive_hysteresis=f.consecutive_hysteresis)
                  if not f.loss_scale else LossScaler(init_scale=f.loss_scale, dynamic=False))
        step = mixed_precision(step, torch.float16, loss_scale=scaler)
    z = cfg.zero
    coordinator = dict(prefetch_bucket_size=z.stage3_prefetch_bucket_size, max_live_parameters=z.stage3_max_live_parameters,
                       max_reuse_distance=z.stage3_max_reuse_distance)
    param_dev = z.offload_param.device if z.offload_param is not None else "none"
    opt_dev = z.offload_optimizer.device if z.offload_optimizer is not None else "none"
    if param_dev == "nvme" or opt_dev == "nvme":
        if param_dev == "nvme" and opt_dev not in ("nvme", "none"):
            raise ValueError(f"zero_optimization.offload_param.device 'nvme' with offload_optimizer.device "
                             f"{opt_dev!r} is not supported yet: offload both to nvme, or only the optimizer")
        section = z.offload_param if param_dev == "nvme" else z.offload_optimizer
        if param_dev == opt_dev == "nvme" and z.offload_param.nvme_path != z.offload_optimizer.nvme_path:
            raise ValueError(
                "zero_optimization.offload_param.nvme_path and offload_optimizer.nvme_path differ "
                f"({z.offload_param.nvme_path!r}, {z.offload_optimizer.nvme_path!r}): one state's swap files live "
                "in one folder here; give both the same path")
        pool = z.offload_param if z.offload_param is not None else OffloadParamConfig()
        step = offload_nvme(step, section.nvme_path, params=param_dev == "nvme", optimizer=opt_dev == "nvme",
                            buffer_count=pool.buffer_count, buffer_size=pool.buffer_size,
                            sub_group_size=z.sub_group_size, aio=cfg.aio,
                            **(coordinator if z.stage == 3 else {}))
    elif opt_dev == "cpu":
        step = offload_cpu(step, pin_memory=z.offload_optimizer.pin_memory)
    if z.stage == 1:
        step = zero1(step, group=group)
    elif z.stage == 2:
        step = zero2(step, group=group)
    elif z.stage == 3:
        step = zero3(step, group=group, persistence_threshold=z.stage3_param_persistence_threshold, **coordinator)
    elif group is not None:
        step = zero1(step, group=group)  # a pipeline stage's replicas still average their gradients there
    return step


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tokens(batch) -> int:
    """Tokens (or samples) in a micro-batch: the elements of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, dict):
        first = batch.get("input_ids", next(iter(batch.values()), None))
        return _tokens(first) if first is not None else 0
    if isinstance(batch, (tuple, list)) and batch:
        return _tokens(batch[0])
    return 0


class Engine:
    """Owns the model's state and the composed step; see the module docstring."""

    def __init__(self, model: nn.Module, cfg, *, loss_fn=None, optimizer=None, lr_scheduler=None):
        self.config = cfg
        self.model = model
        self.group = None
        self.world = dist.world_size()
        self.rank = dist.rank()
        self.state_dict_keys = list(model.state_dict().keys())
        loss = model_loss(model, loss_fn)
        opt, self.schedule = _optimizer(cfg, optimizer, lr_scheduler)
        self.step_fn = compose(cfg, train_step(loss, opt))
        self.eval_fn = compose(cfg, eval_step(loss))
        self.state = self.step_fn.init(model)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._micro: list = []  # the imperative style's micro-batches of the step in progress
        self._losses: list = []  # and the losses engine(batch) returned for them
        self._backward_done = 0
        self._last_print = time.perf_counter()
        self._tokens_since_print = 0
        self.last_metrics: dict = {}

    # ------------------------------------------------------------------- batches

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def _pull(self, data_iter: Iterator) -> list:
        if data_iter is None:
            raise ValueError("train_batch needs data_iter: an iterator over micro-batches (e.g. iter(RepeatingLoader(loader)))")
        batches = []
        for _ in range(self.gradient_accumulation_steps):
            try:
                batches.append(next(data_iter))
            except StopIteration:
                raise StopIteration(
                    f"data_iter ended after {len(batches)} of the {self.gradient_accumulation_steps} micro-batches of "
                    "a step; wrap the loader in zf.RepeatingLoader to cycle it") from None
        return batches

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step on the next ``gradient_accumulation_steps`` micro-batches; the mean loss."""
        return self._train(self._pull(data_iter))

    def _train(self, micro: list) -> torch.Tensor:
        batch = micro if self.gradient_accumulation_steps > 1 else micro[0]
        start = time.perf_counter()
        self.state, metrics = self.step_fn(self.state, batch)
        self.last_metrics = metrics
        self.global_steps += 1
        self.micro_steps += len(micro)
        self.global_samples += self.config.train_batch_size
        self._tokens_since_print += sum(_tokens(b) for b in micro) * self.world
        self._report(metrics, time.perf_counter() - start)
        return metrics["loss"]

    def eval_batch(self, data_iter: Iterator) -> torch.Tensor:
        """The mean loss over the next ``gradient_accumulation_steps`` micro-batches; no update."""
        losses = [self.eval_fn(self.state, b)["loss"] for b in self._pull(data_iter)]
        return torch.stack(losses).mean()

    # ------------------------------------------------------- the imperative style

    def __call__(self, batch) -> torch.Tensor:
        """The loss on ``batch`` (a micro-batch), kept for the next ``step()``.

        The loss is what ``train_batch`` reports for this micro-batch; computing it here costs
        one forward more than ``train_batch``, whose step runs forward and backward together.
        """
        loss = self.eval_fn(self.state, batch)["loss"]
        self._micro.append(batch)
        self._losses.append(loss)
        return loss

    def forward(self, batch) -> torch.Tensor:
        return self(batch)

    def backward(self, loss: torch.Tensor) -> None:
        """Marks the micro-batch of ``loss`` for the step; its gradients are taken in ``step()``."""
        if not self._losses or loss is not self._losses[-1]:
            raise ValueError("engine.backward takes the loss the last engine(batch) returned")
        self._backward_done = len(self._losses)

    def step(self) -> None:
        """Makes the optimizer step once ``gradient_accumulation_steps`` micro-batches have been
        through ``engine(batch)`` and ``backward``; before that it does nothing (as DeepSpeed's)."""
        if self._backward_done != len(self._micro):
            raise ValueError("engine.step() before engine.backward(loss) of the last micro-batch")
        if len(self._micro) < self.gradient_accumulation_steps:
            return
        micro, self._micro, self._losses, self._backward_done = self._micro, [], [], 0
        self._train(micro)

    def is_gradient_accumulation_boundary(self) -> bool:
        return len(self._micro) + 1 >= self.gradient_accumulation_steps

    # ------------------------------------------------------------------ reading

    def params(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights keyed like ``model.named_parameters()``, on every rank."""
        return gather_params(self.state)

    def get_lr(self) -> list[float]:
        return current_lr(self.config, self.schedule, self.state)

    @property
    def loss_scale(self) -> float | None:
        return None if self.state.loss_scale is None else float(self.state.loss_scale.scale)

    # ------------------------------------------------------------------ logging

    def _report(self, metrics: dict, seconds: float) -> None:
        every = self.config.steps_per_print
        if self.rank != 0 or not every:
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
        now = time.perf_counter()
        rate = self._tokens_since_print / max(now - self._last_print, 1e-9)
        self._last_print, self._tokens_since_print = now, 0
        parts = [f"step {self.global_steps}", f"loss {float(metrics['loss']):.4f}"]
        lr = self.get_lr()
        if lr:
            parts.append(f"lr {lr[0]:.3e}")
        if "loss_scale" in metrics:
            parts.append(f"loss scale {metrics['loss_scale']:g}")
        parts.append(f"{rate:,.0f} tokens/s")
        parts.append(f"rss {_rss_bytes() / 1e9:.2f} GB (peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f})")
        if self.config.wall_clock_breakdown:
            parts.append(f"step {seconds * 1e3:.0f} ms")
        prefix = "\n" if sys.stderr.isatty() else ""
        print(prefix + " | ".join(parts), file=sys.stderr, flush=True)

    # -------------------------------------------------------------- checkpoints

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
        """Every rank calls it; returns the checkpoint's folder (zfunc.checkpoint)."""
        tag = tag if tag is not None else f"global_step{self.global_steps}"
        extra = {"engine": {"global_steps": self.global_steps, "global_samples": self.global_samples,
                            "micro_steps": self.micro_steps},
                 "scheduler": {"last_step": int(self.state.count)},
                 "config": self.config.raw, "state_dict_keys": self.state_dict_keys,
                 "client_state": client_state or {}}
        return checkpoint.save(self.state, save_dir, tag, extra=extra, group=self.group)

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> tuple[str, dict]:
        """Load a checkpoint saved at any world size; returns ``(its folder, client_state)``."""
        if self._micro:
            raise ValueError("load_checkpoint in the middle of a step (engine(batch) without step()): finish it first")
        folder = checkpoint.resolve(load_dir, tag)
        self.state, manifest = checkpoint.load(self.state, load_dir, tag, group=self.group)
        counters = manifest.get("engine", {})
        self.global_steps = counters.get("global_steps", int(self.state.count))
        self.global_samples = counters.get("global_samples", 0)
        self.micro_steps = counters.get("micro_steps", 0)
        return folder, manifest.get("client_state", {})

    def close(self) -> None:
        """Remove the state's swap files (offload to NVMe)."""
        self.state.close()


def initialize(model: nn.Module, config, *, loss_fn: Callable | None = None, optimizer=None,
               lr_scheduler: Callable | None = None, model_parameters=None) -> Engine:
    """An ``Engine`` for ``model`` from a DeepSpeed-style ``config`` (a dict or a JSON path).

    ``loss_fn(model, batch)``: see ``model_loss``. ``optimizer``: a zfunc optimizer
    (``zf.optim.adamw(...)``) instead of the config's ``optimizer`` section;
    ``lr_scheduler``: a schedule ``step -> lr`` for the config's optimizer.
    ``model_parameters`` is accepted for DeepSpeed's signature and ignored (every
    parameter that requires grad is trained). Keys that zfunc accepts but does not
    act on are listed in one warning.
    """
    from .pipeline import PipelineModule

    dist.init()
    dist.check_launch()
    if isinstance(model, PipelineModule):
        from .pipeline_engine import PipelineEngine

        if loss_fn is not None:
            raise ValueError("a PipelineModule has its own loss_fn: give it there, not to zf.initialize")
        # the batch keys count data-parallel replicas: W / stages of them
        cfg = configuration.parse(config, dist.world_size() // model.num_stages or 1)
        configuration.warn_ignored(cfg)
        return PipelineEngine(model, cfg, optimizer=optimizer, lr_scheduler=lr_scheduler)
    cfg = configuration.parse(config, dist.world_size())
    configuration.warn_ignored(cfg)
    return Engine(model, cfg, loss_fn=loss_fn, optimizer=optimizer, lr_scheduler=lr_scheduler)
