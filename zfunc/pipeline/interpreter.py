"""The pipeline engine: each rank runs its stage's schedule (zfunc.pipeline.schedules) on its own state.

A stage is an ordinary zfunc state over its ``StageModule`` (each layer a unit), built
by the step the config asks for, with the ZeRO stage inside the stage's
data-parallel group: ``zero1/zero2(mixed_precision(train_step(...)), group=data)``.
The interpreter runs the stage's instruction list inside one ``materialized``
set-up, sending and receiving through its ``Link``s (zfunc.pipeline.link): a
forward runs the stage on the received activations through the state's
parameters; a backward gives autograd the received output gradient,
and each unit's gradient goes to a ``GradSink`` (zfunc.transforms.sinks) that sums the
micro-batches in fp32 and reduces over the data-parallel group in the last one.
Then tied modules' gradients are summed over the stages that own them, one
all-reduce over the world agrees on the loss, non-finite gradients and the
global norm (a tied module counted once; zfunc.agreement), and the stage's step updates its part
with ``1/micro_batches`` folded into the scale, as ``accumulate`` does.
"""
from __future__ import annotations

import os
import time
from typing import Iterator

import torch

from .. import checkpoint, dist, lazy
from ..checkpoint import client_state as client_state_file
from ..agreement import Agreement, agreed_live, grad_stats, live_flags, summed
from . import schedules as S
from ..engine.compose import build_optimizer, compile_arguments, compile_blocks, compose, resolve_backend
from ..grad import GradOut, apply, grad_spec, materialized, scalar_loss
from ..engine.loop import Loop
from ..transforms.sinks import GradSink
from .link import ACT, GRAD, Link
from .module import PipelineModule, make_grid
from ..step import train_step
from ..tree import Params

def _input_grads(xs) -> tuple:
    """What ``SendGrad`` sends: each floating input's gradient (zeros where it had none)."""
    return tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in xs if x.is_floating_point())


def _split_batch(batch):
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(f"a pipeline micro-batch is a pair (inputs, labels), got {type(batch).__name__}")
    inputs, labels = batch
    return (inputs if isinstance(inputs, tuple) else (inputs,)), labels


class PipelineEngine(Loop):
    """``zf.initialize(PipelineModule(...), config)``: train_batch / eval_batch over the pipeline."""

    def __init__(self, pipe: PipelineModule, cfg, *, optimizer=None, lr_scheduler=None):
        self._check_config(cfg)
        self.config, self.pipe = cfg, pipe
        self.pipeline_schedule = pipe.schedule  # "1f1b" or "gpipe", see zfunc.pipeline.schedules
        self.grid = grid = make_grid(pipe)
        self.module = pipe.build(grid.stage)
        c = cfg.compile
        if c is not None and c.enabled:  # the stage's layers, each compiled in place (zf.compile_units)
            compile_blocks(self.module, {**c.kwargs, "backend": resolve_backend(c.backend, "compile.backend")})
        self._tie_initial_weights()
        opt, self.lr_schedule = build_optimizer(cfg, optimizer, lr_scheduler, self.module)
        self.optimizer_fn = opt

        def no_loss(params, batch):  # the interpreter drives forward and backward itself
            raise RuntimeError("a pipeline stage's step is driven by its schedule, not called")

        self.step_fn = compose(cfg, train_step(no_loss, opt), group=grid.data_group, accumulate_micro=False)
        self.state = self.step_fn.init(self.module)
        self.tied_units = self._tied_units()
        owners = pipe.tied_stages()
        # tied units whose gradient norm another stage counts (the first that holds the key)
        self.counted_elsewhere = {u for key, u in self.tied_units.items() if owners[key][0] != grid.stage}
        self._start_counting()
        self.fwd = Link(grid.next, ACT) if grid.stage < grid.stages - 1 else None  # activations out
        self.fwd_in = Link(grid.prev, ACT) if grid.stage > 0 else None
        self.bwd = Link(grid.prev, GRAD) if grid.stage > 0 else None  # input gradients out
        self.bwd_in = Link(grid.next, GRAD) if grid.stage < grid.stages - 1 else None

    def compile(self, backend="inductor", compile_kwargs: dict | None = None) -> None:
        """Compile this stage's layers, each in place (``zf.compile_units``) with
        ``torch.compile(backend=backend, **compile_kwargs)``, as ``Engine.compile`` compiles a
        model's blocks; zfunc gathers each layer's unit outside its compiled code."""
        compile_blocks(self.module, compile_arguments(compile_kwargs, backend, "compile_kwargs"))

    @staticmethod
    def _check_config(cfg) -> None:
        z = cfg.zero
        if z.stage == 3:
            raise ValueError("zero_optimization.stage 3 with pipeline parallelism is not supported (as in DeepSpeed): "
                             "use stage 1 or 2 inside each stage's data-parallel group")
        for name in ("offload_param", "offload_optimizer"):
            section = getattr(z, name)
            if section is not None and section.device != "none":
                raise ValueError(f"zero_optimization.{name} with pipeline parallelism is not supported yet")

    # ------------------------------------------------------------------ set-up

    def _tie_initial_weights(self) -> None:
        """Every copy of a tied module starts from the first owning stage's values."""
        for key, group in self.grid.tied_groups.items():
            if group is None:
                continue
            module = self.module.tied[self.module.tied_keys.index(key)]
            with torch.no_grad():
                for p in module.parameters():
                    dist.broadcast(p.data, 0, group)

    def _tied_units(self) -> dict[str, int]:
        """Tied key -> its unit index in this stage's state."""
        names = [u.name for u in self.state.params.spec.model.units]
        return {key: names.index(f"tied.{i}") for i, key in enumerate(self.module.tied_keys)}

    # ----------------------------------------------------------------- batches

    def _pull(self, data_iter) -> list:
        """The step's micro-batches (first and last stage only: the others need no data)."""
        if not (self.module.first or self.module.last):
            return [None] * self.gradient_accumulation_steps()
        if data_iter is not None:  # kept, as DeepSpeed's pipeline engine keeps it, for calls without one
            self.data_iterator = data_iter
        data_iter = getattr(self, "data_iterator", None)
        if data_iter is None:
            raise ValueError(f"stage {self.grid.stage} (the {'first' if self.module.first else 'last'}) needs "
                             "data_iter: an iterator over (inputs, labels) micro-batches (or the engine's "
                             "set_dataloader(loader), or training_data given to deepspeed.initialize)")
        return [_split_batch(b) for b in self._next_micro_batches(data_iter)]

    # ------------------------------------------------------------- interpreter

    def _run(self, program, micro: list, buffers: dict, train: bool, scale: float | None = None):
        """Execute ``program``; returns (this stage's losses per micro-batch, gradients or None, the
        peak bytes of units materialized at once, which parameters got a gradient: ``GradOut.live``).
        ``buffers``: the step's fresh buffers (``Step.begin``); ``scale``: fp16's loss scale, applied
        to the last stage's losses before backward."""
        state, module = self.state, self.module
        inputs, outputs, out_grads, labels, losses = {}, {}, {}, {}, {}
        grads_sent: set[int] = set()  # micro-batches whose input gradients went back inside their backward
        n = len(micro)
        grads = None
        grad_ctx = torch.enable_grad() if train else torch.no_grad()
        self.forward_s = self.backward_s = 0.0  # the rest of the schedule's time is bubble and transfers
        for link, kind in ((self.fwd_in, S.RecvActivation), (self.bwd_in, S.RecvGrad)):
            if link is not None:
                link.expect(sum(isinstance(i, kind) for i in program))
        with grad_ctx, materialized(state.params, state.frozen, buffers, differentiable=train) as (view, tracker, _):
            sink = GradSink(grad_spec(state.params.spec), self.step_fn.sum_home) if train else None
            tracker.sink = sink
            for ins in program:
                m = ins.micro_batch
                if isinstance(ins, S.LoadMicroBatch):
                    x, y = micro[m]
                    if module.first:
                        inputs[m] = x
                    if module.last:
                        labels[m] = y
                elif isinstance(ins, S.RecvActivation):
                    inputs[m] = tuple(t.requires_grad_() if train and t.is_floating_point() else t
                                      for t in self.fwd_in.recv())
                elif isinstance(ins, S.Forward):
                    t0 = time.perf_counter()
                    with lazy.resolving(view), tracker.hooks():
                        out = apply(module, view, *inputs[m])
                        if module.last:
                            losses[m] = self._loss(out, labels.pop(m))
                        else:
                            outputs[m] = out if isinstance(out, tuple) else (out,)
                    self.forward_s += time.perf_counter() - t0
                elif isinstance(ins, S.SendActivation):
                    self.fwd.send(outputs[m] if train else outputs.pop(m))
                elif isinstance(ins, S.RecvGrad):
                    out_grads[m] = self.bwd_in.recv()
                elif isinstance(ins, S.Backward):
                    sink.last = m == n - 1
                    early = self._send_grads_early(m, inputs[m], grads_sent) if self.bwd is not None else []
                    t0 = time.perf_counter()
                    with lazy.resolving(tracker):
                        if module.last:
                            torch.autograd.backward(losses[m] if scale is None else losses[m] * scale)
                        else:
                            pairs = [(o, g) for o, g in zip(outputs.pop(m), out_grads.pop(m)) if o.requires_grad]
                            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                    self.backward_s += time.perf_counter() - t0
                    for handle in early:
                        handle.remove()
                elif isinstance(ins, S.SendGrad):
                    xs = inputs.pop(m)
                    if m not in grads_sent:  # some input got no gradient: zeros for it, sent now
                        self.bwd.send(_input_grads(xs))
                elif isinstance(ins, (S.ReduceTiedGrads, S.ReduceGrads, S.OptimizerStep)):
                    pass  # after the set-up closes: see _update
            if train:
                tracker.finish()
                grads = sink.grads()
            peak = tracker.peak
        for link in (self.fwd, self.bwd):
            if link is not None:
                link.finish()
        return [losses[m].detach().float() for m in sorted(losses)], grads, peak, tracker.got

    def _send_grads_early(self, m: int, xs: tuple, sent: set) -> list:
        """Post a micro-batch's ``SendGrad`` from inside its ``Backward``, the moment autograd has
        accumulated every input's gradient: the previous stage waits on this transfer in 1F1B's
        steady state, and the rest of the backward (the first layer's weight gradients going into
        the accumulator) need not delay it. Returns the hooks, removed after the backward."""
        waiting = [x for x in xs if x.is_floating_point() and x.requires_grad]
        left = [len(waiting)]

        def arrived(_):
            left[0] -= 1
            if left[0] == 0:
                self.bwd.send(_input_grads(xs))
                sent.add(m)

        return [x.register_post_accumulate_grad_hook(arrived) for x in waiting]

    def _loss(self, out, y) -> torch.Tensor:
        return scalar_loss(self.pipe.loss_fn(out, y), "the pipeline's loss_fn must return")

    # ----------------------------------------------------------------- update

    def _agree(self, losses: list, grads: Params) -> Agreement:
        """One all-reduce over the world: the loss (last stage), the global squared norm (each
        shard once, each whole gradient once per stage, a tied module on its first stage only),
        whether any gradient is non-finite, and whether any stage's state is refused (an update
        that failed there: every stage raises, ``refused_on_every_rank``). The stage's step takes
        it as agreed (``Step.apply_gradients``)."""
        grid = self.grid
        bad, sq_shard, sq_whole = grad_stats(grads, self.step_fn.transforms, whole_here=grid.replica == 0,
                                             norm_elsewhere=self.counted_elsewhere)
        loss = float(torch.stack(losses).mean()) if losses else 0.0
        vec = summed([loss, sq_shard, sq_whole, sum(bad)], self.state, None, "the pipeline's agreement")
        nonfinite = [f"stage {grid.stage} or another"] if vec[3] else []
        return Agreement(torch.tensor(vec[0] / grid.replicas, dtype=torch.float32), nonfinite, vec[1] + vec[2])

    def _reduce_tied(self, grads: Params) -> None:
        for key, unit in self.tied_units.items():
            group = self.grid.tied_groups.get(key)
            g = grads.leaves[unit]
            if group is not None and g is not None:
                dist.all_reduce_sum(g, group)

    def _agree_live(self, grads: Params, live) -> tuple:
        """Per unit, which parameters got a gradient on some replica of this stage, or, for a tied
        module, on some stage holding it (whose gradients ``_reduce_tied`` summed): those the
        update leaves out get none (``GradInfo.live``)."""
        flags = torch.tensor(live_flags(grads, live), dtype=torch.float64,
                             device=dist.device_of(self.grid.data_group))
        dist.all_reduce_sum(flags, self.grid.data_group)
        starts = [0]
        for i in range(len(grads.spec.sharded)):
            starts.append(starts[-1] + len(grads.spec.segment(i).entries))
        for key, unit in self.tied_units.items():
            group = self.grid.tied_groups.get(key)
            if group is not None and grads.leaves[unit] is not None:  # as _reduce_tied's
                dist.all_reduce_sum(flags[starts[unit] : starts[unit + 1]], group)
        return agreed_live(grads, flags.tolist())

    def set_dataloader(self, loader) -> None:
        """Draw micro-batches from ``loader`` (e.g. a ``RepeatingLoader``) when ``train_batch`` /
        ``eval_batch`` get no ``data_iter`` (DeepSpeed's; the first and last stages only read it)."""
        if self.module.first or self.module.last:
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator) -> None:
        """Draw micro-batches from ``iterator`` when ``train_batch`` / ``eval_batch`` get none (DeepSpeed's)."""
        if self.module.first or self.module.last:
            self.training_dataloader = None
            self.data_iterator = iterator

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One step over ``gradient_accumulation_steps`` micro-batches (pulled by the first and last
        stages from ``data_iter``, else the iterator kept from the last one given or set); returns
        the mean loss on every rank."""
        micro = self._pull(data_iter)
        program = S.schedule(self.pipeline_schedule, len(micro), self.grid.stages, self.grid.stage)
        start = time.perf_counter()
        step, state = self.step_fn, self.state
        started = step.begin(state, agrees=True)  # a stage whose update failed runs to _agree, which refuses
        scaler = step.loss_scaler  # fp16: every stage scales by the same loss scale
        scale = None if scaler is None else float(state.loss_scale.scale)
        losses, grads, peak, live = self._run(program, micro, started.buffers, train=True, scale=scale)
        schedule_end = time.perf_counter()
        self._reduce_tied(grads)
        grad_scale = 1.0 / len(micro) / (1.0 if scale is None else scale)  # the true gradients: grads x this
        out = GradOut(torch.zeros(()), None, grads, peak, grad_scale)  # the loss: the agreement's
        agreement = self._agree(losses, grads)._replace(live=self._agree_live(grads, live))
        # the state keeps its buffers (the schedule's forwards ran on fresh copies)
        self.state, metrics = step.apply_gradients(state, out, agreement=agreement)
        metrics["step_s"] = time.perf_counter() - start
        # the instruction list's time, in Forward and Backward, and when it ran (perf_counter, a clock
        # every process on a machine shares on Linux: the stages' windows give the pipeline's span)
        metrics["forward_s"], metrics["backward_s"] = self.forward_s, self.backward_s
        metrics["busy_s"] = self.forward_s + self.backward_s
        metrics["schedule_s"] = schedule_end - start  # the rest of step_s is the update
        metrics["schedule_window"] = (start, schedule_end)
        self._stepped(metrics, 0, metrics["step_s"])
        return metrics["loss"]

    def eval_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """The mean loss over the next micro-batches, forward only; on every rank."""
        micro = self._pull(data_iter)
        program = [i for i in S.gpipe(len(micro), self.grid.stages, self.grid.stage)
                   if isinstance(i, (S.LoadMicroBatch, S.RecvActivation, S.Forward, S.SendActivation))]
        losses, *_ = self._run(program, micro, self.step_fn.begin(self.state, agrees=True).buffers, train=False)
        (loss,) = summed([float(torch.stack(losses).mean()) if losses else 0.0], self.state, None,
                         "the pipeline's eval agreement")
        return torch.tensor(loss / self.grid.replicas, dtype=torch.float32)

    def _report_parts(self, metrics: dict, seconds: float) -> list[str]:
        return [f"{seconds * 1e3:.0f} ms"]

    # -------------------------------------------------------------- checkpoints

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state=None) -> str:
        """Each stage's state under ``save_dir/stage{s}``; loadable at another data-parallel size
        and at another pipeline shape (``load_checkpoint``)."""
        tag = tag if tag is not None else f"global_step{self.global_steps}"
        client, files = client_state_file.pack(client_state)
        extra = {"engine": self._counters(),
                 "pipeline": {"stages": self.grid.stages, "parts": self.pipe.parts, "layers": len(self.pipe.layers)},
                 "config": self.config.raw, **client}
        folder = checkpoint.save(self.state, os.path.join(save_dir, f"stage{self.grid.stage}"), tag, extra=extra,
                                 group=self.grid.data_group, files=files)
        dist.barrier()
        return folder

    def load_checkpoint(self, load_dir: str, tag: str | None = None):
        folder = os.path.join(load_dir, f"stage{self.grid.stage}")
        first = checkpoint.Saved(checkpoint.resolve(os.path.join(load_dir, "stage0"), tag))
        saved = first.manifest.get("pipeline", {})
        if saved.get("layers", len(self.pipe.layers)) != len(self.pipe.layers):
            raise ValueError(f"this checkpoint was saved from a pipeline of {saved.get('layers')} layers; this one has "
                             f"{len(self.pipe.layers)}")
        if saved.get("stages") == self.grid.stages and saved.get("parts") == self.pipe.parts:
            self.state, manifest = checkpoint.load(self.state, folder, tag, group=self.grid.data_group)
        else:  # another pipeline shape: each unit (a layer, or a tied module) from the stage that saved it
            self.state, manifest = checkpoint.load(self.state, folder, tag, group=self.grid.data_group,
                                                   sources=self._reshaped(load_dir, tag, saved, first))
        self._restore_counters(manifest)
        return folder, client_state_file.unpack(first.folder, first.manifest)  # every stage saved the same

    def _reshaped(self, load_dir: str, tag, saved: dict, first):
        """``checkpoint.load``'s sources for a checkpoint cut into other stages."""
        if self.state.buffers:
            raise ValueError("loading a pipeline checkpoint at another pipeline shape with module buffers is not "
                             "supported yet")
        stages = [first] + [checkpoint.Saved(checkpoint.resolve(os.path.join(load_dir, f"stage{s}"), tag))
                            for s in range(1, saved["stages"])]
        where = {}
        for s, src in enumerate(stages):
            names = [u["name"] for u in src.manifest["model"]["units"]]
            for name, what in self.pipe.unit_names(s, saved["parts"]).items():
                if name in names:  # a layer without parameters has no unit
                    where.setdefault(what, (src, names.index(name)))
        ours = self.pipe.unit_names(self.grid.stage)
        names = [u.name for u in self.state.params.spec.model.units]

        def locate(i):
            if names[i] not in ours:  # the root unit, which holds nothing here
                return first, [u["name"] for u in first.manifest["model"]["units"]].index(names[i])
            return where[ours[names[i]]]

        return first, locate

