"""What ``engine.optimizer`` and ``engine.lr_scheduler`` are: the objects ``deepspeed.initialize``
returns beside the engine, which scripts read (the current lr in ``param_groups``,
``get_last_lr()``, ``state_dict()``).

zfunc's optimizer is a pure function of the state and its schedule a function of the
optimizer's update count, so these are views of the engine: they say what the next update
will use and do not hold state of their own. The engine steps the schedule (each applied
update advances the count, as DeepSpeed's engine calls ``lr_scheduler.step()`` after one), so
a script's own ``lr_scheduler.step()`` or a write to ``param_groups[i]["lr"]`` is refused
rather than silently ignored.
"""
from __future__ import annotations

import types

from ..optim.reported_lr import update_count


class ParamGroup(dict):
    """One param group as DeepSpeed's optimizer shows it: its hyperparameters and ``lr``, the lr
    of the next update. Writing ``lr`` would not reach the update: refused."""

    def __setitem__(self, key, value):
        if key == "lr":
            raise NotImplementedError(
                "setting param_groups[i]['lr'] is not supported: zfunc's lr is a schedule of the update count; give "
                "it as the config's 'scheduler' section or as lr_scheduler= to initialize")
        super().__setitem__(key, value)


class LiveLr:
    """``step -> lr`` of live group ``k``: the value its ``lr`` holds when the update runs.

    Live groups are the script's torch optimizer's own ``param_groups`` when ``deepspeed.initialize``
    is given that optimizer and no scheduler: DeepSpeed's optimizer holds those same dicts, so a
    scheduler built afterwards on the script's optimizer (an Accelerate loop's) or on the returned
    one (transformers' Trainer's) sets the lr of the next update by writing there."""

    def __init__(self, groups: list[dict], k: int):
        self.groups, self.k = groups, k

    def __call__(self, step) -> float:
        return float(self.groups[self.k]["lr"])


class NoModuleHooks:
    """What TRL's ``unwrap_model_for_generation`` handles as DeepSpeed's ZeRO-3 parameter offload: it
    clears each parameter's active modules and removes the module hooks, then registers them again.
    zfunc's ZeRO-3 gathers inside its step, through no module hooks, so each of those finds nothing."""

    def __init__(self):
        self.module = _NoParameters()
        self.forward_hooks, self.backward_hooks = [], []

    def _register_deepspeed_module(self, module) -> None:
        pass


class _NoParameters:
    def named_parameters(self, recurse: bool = True):
        return iter(())

    def ds_external_parameters(self):
        return iter(())


class OptimizerHandle:
    """``engine.optimizer``: the engine's optimizer as scripts read it (see the module docstring).
    ``live``: the script's optimizer's groups, whose lr the script sets (``LiveLr``), returned as they are."""

    def __init__(self, engine, hyperparameters: list[dict] | None = None, live: list[dict] | None = None):
        self._engine = engine
        self._groups = hyperparameters
        self.live = live
        stand_in_of = getattr(engine, "_stand_in_of", None)
        if live is not None and stand_in_of:  # the groups' params: the stand-ins, so the model's own tensors
            for g in live:                     # are not kept alive (DeepSpeed's groups hold its empty partitions)
                if "params" in g:
                    g["params"] = [stand_in_of.get(id(p), p) for p in g["params"]]

    @property
    def parameter_offload(self):
        """DeepSpeed's ZeRO-3 module hooks, which TRL removes around generation and registers again:
        zfunc has none, so there is nothing to remove (``NoModuleHooks``)."""
        return NoModuleHooks()

    @property
    def state(self):
        """A torch optimizer's per-parameter state: empty and read-only here. zfunc's moments are the
        engine's state's shards (``engine.save_checkpoint`` writes them), in no per-parameter dict;
        Lightning's teardown walks this to move each tensor to the CPU, and finds nothing to move."""
        return types.MappingProxyType({})

    @property
    def overflow(self) -> bool:
        """Whether the last update was skipped (fp16's overflow, a non-finite gradient): DeepSpeed's
        optimizer's flag, which accelerate reads as ``step_was_skipped``."""
        return bool(self._engine.last_metrics.get("skipped", False))

    @property
    def param_groups(self) -> list[ParamGroup]:
        """One group per lr the engine reports, each with its hyperparameters and the next lr."""
        if self.live is not None:
            return self.live
        lrs = self._engine.get_lr()
        base = self._groups or [_config_hyperparameters(self._engine.config)]
        if not lrs:  # an optimizer that does not say its lr
            return [ParamGroup(hp) for hp in base]
        if len(base) != len(lrs):
            raise RuntimeError(f"the engine reports {len(lrs)} lrs for {len(base)} param groups")
        return [ParamGroup({**hp, "lr": lr}) for hp, lr in zip(base, lrs)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are the step's own and cleared by each update; between an update and the next
        ``engine.backward`` there are none. Zeroing the sums of an accumulation in progress (after
        ``engine.backward``, before the boundary's ``step()``) is not supported: raises."""
        window = getattr(self._engine, "_window", None)
        if window is not None and window.losses:
            raise NotImplementedError(
                "optimizer.zero_grad() in the middle of a gradient accumulation (engine.backward since the last "
                "update) is not supported: the gradients are summed until the boundary's engine.step()")

    def step(self, closure=None):
        """The engine's update, ``engine.step()``: what DeepSpeed's ZeRO optimizer's own ``step()`` does
        after ``engine.backward`` (Lightning Fabric calls it, never ``engine.step()``). A closure is
        refused: the loss comes from ``engine.backward``."""
        if closure is not None:
            raise NotImplementedError("optimizer.step(closure): zfunc's engine takes the loss from engine.backward; "
                                      "call optimizer.step() (or engine.step()) after it")
        self._engine.step()

    def state_dict(self) -> dict:
        """The update count and the param groups' hyperparameters (the moments are in the state:
        ``engine.save_checkpoint`` writes them)."""
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "state": {"step": update_count(self._engine.state.opt_state)}}

    def live_lrs(self) -> list[float] | None:
        """The live groups' lrs (what a checkpoint keeps, as DeepSpeed's keeps its optimizer's groups)."""
        return None if self.live is None else [float(g["lr"]) for g in self.live]

    def restore_live_lrs(self, lrs) -> None:
        if self.live is not None and lrs is not None and len(lrs) == len(self.live):
            for g, lr in zip(self.live, lrs):
                g["lr"] = lr

    def load_state_dict(self, state_dict: dict):
        raise NotImplementedError("optimizer.load_state_dict(): load the whole training state with "
                                  "engine.load_checkpoint(dir)")


class SchedulerHandle:
    """``engine.lr_scheduler``: the engine's lr schedule as scripts read it (see the module docstring).

    ``kind``: ``"deepspeed"`` for the config's ``scheduler`` section (DeepSpeed's schedulers count
    ``last_batch_iteration`` from -1), ``"torch"`` for a ``torch.optim.lr_scheduler`` object
    (``last_epoch`` from 0)."""

    def __init__(self, engine, kind: str = "deepspeed"):
        self._engine = engine
        self.kind = kind
        self._steps = 0  # step() calls made once the script took the scheduler from the engine

    @property
    def _updates(self) -> int:
        count = update_count(self._engine.state.opt_state)
        return int(self._engine.state.count) if count is None else count

    @property
    def last_batch_iteration(self) -> int:
        return self._updates - 1

    @property
    def last_epoch(self) -> int:
        return self._updates

    def get_lr(self) -> list[float]:
        """The lr the next update uses, one per param group."""
        return self._engine.get_lr()

    def get_last_lr(self) -> list[float]:
        return self._engine.get_lr()

    def step(self, *args, **kwargs):
        """Refused while the engine holds this scheduler (it advances with each update). A script that
        took it from the engine (``engine.lr_scheduler = None``, as Lightning's DeepSpeed strategy
        does) steps it itself: accepted when its n-th ``step()`` comes after the n-th update (once
        per update, Lightning's ``interval="step"``), which is the schedule zfunc already follows."""
        if self._engine.lr_scheduler is not self and not args and not kwargs:
            self._steps += 1
            if self._steps == self._updates:
                return
            raise NotImplementedError(
                f"lr_scheduler.step() number {self._steps} after {self._updates} optimizer updates: zfunc's lr "
                "follows the update count, so a scheduler taken from the engine must be stepped once after each "
                "update (Lightning: return the scheduler from configure_optimizers with interval='step' and "
                "frequency 1; an 'epoch' interval is not supported)")
        raise NotImplementedError(
            "lr_scheduler.step(): the engine steps the schedule at each update (as DeepSpeed's engine does for "
            "the scheduler it was given); stepping it again yourself is not supported")

    def state_dict(self) -> dict:
        if self.kind == "torch":
            return {"last_epoch": self.last_epoch, "_step_count": self.last_epoch + 1,
                    "_last_lr": self.get_last_lr()}
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict):
        """The schedule follows the update count, which ``engine.load_checkpoint(dir)`` restores: a
        state saved at the update the engine is at now is accepted (Lightning's resume loads the
        scheduler's state after the engine's checkpoint), and a scheduler the script steps itself
        counts the restored updates as stepped; a state of another update is refused."""
        key = "last_epoch" if self.kind == "torch" else "last_batch_iteration"
        saved, now = state_dict.get(key), getattr(self, key)
        if saved != now:
            raise NotImplementedError(
                f"lr_scheduler.load_state_dict(): a state saved at {key} {saved}, the engine is at {now}; the "
                "schedule follows the update count, which engine.load_checkpoint(dir) restores: load that first")
        self._steps = self._updates


def _config_hyperparameters(config) -> dict:
    o = config.optimizer
    if o is None:
        return {}
    if o.type == "sgd":
        return {"momentum": o.momentum, "dampening": o.dampening, "weight_decay": o.weight_decay,
                "nesterov": o.nesterov}
    return {"betas": o.betas, "eps": o.eps, "weight_decay": o.weight_decay}
