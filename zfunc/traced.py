"""The compiled step's gradient part (``zf.jit``, JAX's ``jit``): forward and backward traced as one program.

``zf.jit(step, **compile_kwargs)`` replaces the step's gradient part (zfunc.grad: units
gathered in forward hooks, a Python coordinator issuing the collectives) with one function
of the stored leaves that ``torch.compile`` traces whole, collectives included:

* each unit's all-gather is a functional collective (``torch.distributed._functional_collectives``)
  in the program, and its backward, the reduce-scatter or all-reduce (mean over ranks, in the
  placement's reduce dtype) that takes the gradient home, is in the traced backward:
  AOTAutograd traces forward and backward jointly and splits them (SimpleFSDP's design);
* the compiler sees every collective and every op, so it may reorder and fuse across units;
* what stays outside is what a program of tensors cannot express: the agreement all-reduce
  (non-finite, norm, which units ran), the loss scale's bookkeeping and the update, as the
  step has them.

What the program gives up against the eager step: it keeps each gathered unit from its
gather to its backward (the compiler frees what it can), unless ``regather``: then selective
activation checkpointing marks the all-gathers to be done again in backward and the program
keeps only the shards, as ZeRO-3's hooks do (SimpleFSDP's policy). There is
no coordinator (no prefetch metrics, no divergence report: every rank must trace the same
program). A unit the loss does not use gets no gradient (``None``) and no update, as eagerly; so
does a parameter of a used unit that the loss does not read: its view passes through ``_Seen``,
whose backward marks it in its unit's probe, an input of the program whose gradient says which
parameters got one (``GradOut.live``), as the eager step's ``None`` gradients do. Across a graph
break that is not exact: a compiled graph's backward gets zeros for outputs that got no gradient,
so it marks a parameter read only after the break. There a marked parameter whose gradient is
nonzero on some rank got one; one whose gradient is zero everywhere might not have, and the step
refuses to guess (``zfunc.agreement.sure_live``).
Parameters or gradients that leave RAM as the step runs (``offload_nvme``'s swap files) are not
tensors of a program: such a step raises ``CompileError``. A sink that copies each gradient home
(``offload_cpu``'s, where the parameters live on an accelerator) gets each one from the program,
reduced, through its ``take_home``, as ``accumulate``'s sums do.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Callable, NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from . import compiled, dist, layout, lazy
from .grad import GradOut, grad_spec, loss_and_aux
from .placement import compute_device, copies_in, gathers, grad_is_shard
from .transform import Transform
from .tree import Params


class _Layout(NamedTuple):
    """What the program needs of one unit: whether it is gathered, whether its gradient goes
    home as a shard, the reduction's dtype, its flat layout."""

    gather: bool
    scatter: bool
    reduce_dtype: torch.dtype | None
    segment: object


class _Unit(torch.autograd.Function):
    """A unit's stored leaf to its full flat buffer; backward takes the full gradient home."""

    @staticmethod
    def forward(anchor, leaf, gather: bool, scatter: bool, reduce_dtype, group: str, w: int):
        return funcol.all_gather_tensor(leaf, 0, group) if gather else leaf.view_as(leaf)

    @staticmethod
    def setup_context(ctx, inputs, output):
        anchor, _, _, ctx.scatter, ctx.reduce_dtype, ctx.group, ctx.w = inputs
        ctx.home_dtype = anchor.dtype

    @staticmethod
    def backward(ctx, g):
        if ctx.w > 1:
            g = g.to(ctx.reduce_dtype)
            g = (funcol.reduce_scatter_tensor(g, "sum", 0, ctx.group) if ctx.scatter
                 else funcol.all_reduce(g, "sum", ctx.group)) / ctx.w
        return g.to(ctx.home_dtype), None, None, None, None, None, None


class _Seen(torch.autograd.Function):
    """Identity on parameter ``k``'s view; its backward, traced only where the loss reads the view,
    puts a one at ``k`` in the gradient of its unit's probe (a program input of one zero per
    parameter), so the program says which parameters got a gradient without changing any."""

    @staticmethod
    def forward(view, probe, k: int):
        return view.view_as(view)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, probe, ctx.k = inputs
        ctx.n, ctx.dtype, ctx.device = probe.numel(), probe.dtype, probe.device

    @staticmethod
    def backward(ctx, g):
        seen = torch.zeros(ctx.n, dtype=ctx.dtype, device=ctx.device)
        seen[ctx.k] = 1
        return g, seen, None


class Views(Mapping):
    """``name -> Tensor`` for ``loss_fn`` inside the program: every unit's views (aliases of tied
    weights too) and the buffers; ``zf.apply`` casts floating inputs to ``input_dtype``."""

    def __init__(self, spec, tensors: dict, input_dtype):
        self.spec = spec
        self.tensors = tensors
        self.input_dtype = input_dtype

    def __getitem__(self, name):
        return self.tensors[self.spec.canonical_name(name)]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)


class Program:
    """The traced forward of one state layout; its backward is the compiled joint graph's."""

    def __init__(self, loss_fn: Callable, has_aux: bool, params: Params, frozen: Params | None, kwargs: dict,
                 regather: bool = False):
        self.loss_fn, self.has_aux = loss_fn, has_aux
        self.regather = regather
        spec = params.spec
        group = spec.process_group
        self.w = dist.world_size(group)
        # functional collectives name their group; W = 1 issues none
        self.group = (group or torch.distributed.group.WORLD).group_name if self.w > 1 else ""

        self.units = [_Layout(gathers(p, group), grad_is_shard(p, s), p.reduce_dtype, spec.segment(i))
                      for i, (p, s) in enumerate(zip(spec.placements, spec.sharded))]
        self.frozen = None if frozen is None else [
            (gathers(p, group), frozen.spec.segment(i)) for i, p in enumerate(frozen.spec.placements)]
        self.model = spec.model
        self.input_dtype = next((p.param_dtype for p in spec.placements if p.param_dtype), None)
        # one zero per parameter of each unit: their gradients say which parameters got one (_Seen)
        self.probes = [torch.zeros(len(u.segment.entries), device=leaf.device, requires_grad=True)
                       for u, leaf in zip(self.units, params.leaves)]
        self.broken = False  # dynamo broke the program's graph (its marks are then a superset)
        self.compiled = torch.compile(self.forward, **kwargs)

    def __call__(self, anchors, leaves, frozen, buffers, batch):
        """The compiled forward; notes whether compiling it broke the graph."""
        breaks = _graph_breaks()
        out = self.compiled(anchors, self.probes, leaves, frozen, buffers, batch)
        self.broken |= _graph_breaks() > breaks
        return out

    def live(self, home: Params, marks) -> dict[int, tuple[bool | None, ...]]:
        """``GradOut.live`` from the probes' gradients ``marks`` (and, after a graph break, the home
        gradients: a marked parameter with a nonzero gradient here got one, one with none here cannot
        be told apart from one that got zeros)."""
        out = {}
        for i, (g, seen) in enumerate(zip(home.leaves, marks)):
            if g is None or seen is None:
                continue
            got = [s > 0 for s in seen.tolist()]
            if self.broken:
                ranges = home.parameter_ranges(i)
                nonzero = torch.stack([g[a:b].ne(0).any() for a, b in ranges]).tolist() if ranges else []
                got = [(True if nz else None) if on else False for on, nz in zip(got, nonzero)]
            out[i] = tuple(got)
        return out

    def forward(self, anchors, probes, leaves, frozen, buffers, batch):
        if not self.regather:
            return self.run(anchors, probes, leaves, frozen, buffers, batch)
        return checkpoint(self.run, anchors, probes, leaves, frozen, buffers, batch, use_reentrant=False,
                          context_fn=_REGATHER)

    def run(self, anchors, probes, leaves, frozen, buffers, batch):
        tensors = {}
        for (gather, scatter, reduce_dtype, segment), anchor, probe, leaf in zip(self.units, anchors, probes,
                                                                                  leaves):
            if segment.entries:
                full = _Unit.apply(anchor, leaf, gather, scatter, reduce_dtype or leaf.dtype, self.group, self.w)
                tensors.update((name, _Seen.apply(view, probe, k))
                               for k, (name, view) in enumerate(segment.unflatten(full).items()))
        for (gather, segment), leaf in zip(self.frozen or (), frozen):
            if segment.entries:
                tensors.update(segment.unflatten(funcol.all_gather_tensor(leaf, 0, self.group) if gather else leaf))
        tensors.update(buffers)
        return loss_and_aux(self.loss_fn(Views(self.model, tensors, self.input_dtype), batch), self.has_aux)


_GATHER_OPS = {torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.wait_tensor.default}


def _gathers_recomputed(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective activation checkpointing's policy for ``regather``: all-gathers are done again in
    backward, everything else is kept as the compiler prefers (SimpleFSDP's policy)."""
    if op in _GATHER_OPS or getattr(op, "is_view", False):  # a view of a gathered unit keeps all of it
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


_REGATHER = functools.partial(create_selective_checkpoint_contexts, _gathers_recomputed)


class Jit(Transform):
    """Marks a step whose gradient part is one compiled program (``compile_kwargs``: torch.compile's;
    ``regather``: units gathered again in backward instead of kept from forward)."""

    family = "jit"
    shapes_state = False

    def __init__(self, compile_kwargs: dict, regather: bool = False):
        self.compile_kwargs = compile_kwargs
        self.regather = regather
        self.programs: dict = {}  # the state layout's spec -> its Program

    def describe(self, inner: str) -> str:
        return f"jit({inner})"

    def check(self, inner) -> None:
        Transform.check(self, inner)
        if any(t.replicate is not None for t in inner):
            raise ValueError("zf.jit of a hybrid-sharded step (zero's mesh=) is not supported yet: the compiled "
                             "program reduces gradients in the shard group only, not over the replicas; leave the "
                             "step eager and compile the blocks (zf.compile_units(model) before step.init)")

    def grad_part(self, loss_fn: Callable, has_aux: bool):
        """The gradient part as ``zfunc.grad.value_and_grad_with_stats`` gives it, traced."""

        def run(params, batch, *, frozen=None, buffers=None, scale=None, sink=None):
            if params.spec.swap is not None or (sink is not None and not hasattr(sink, "take_home")):
                raise compiled.CompileError(
                    "zf.jit cannot trace this step: its parameters or gradients leave RAM as it runs "
                    "(offload_nvme's swap files), which are no tensors of a program. Compile the blocks instead "
                    "(zf.compile_units(model) before step.init) and leave the step eager")
            _refuse_copied_in(params)
            key = (params.spec, None if frozen is None else frozen.spec)
            program = self.programs.get(key)
            if program is None:
                program = self.programs[key] = Program(loss_fn, has_aux, params, frozen, self.compile_kwargs,
                                                       self.regather)
            anchors = _anchors(params)
            leaves = params.leaves
            frozen_leaves = [] if frozen is None else list(frozen.leaves)
            loss, aux = program(anchors, list(leaves), frozen_leaves, dict(buffers or {}), batch)
            with lazy.resolving(_NoWeightsOutside(self.regather)):
                grads = torch.autograd.grad(loss if scale is None else loss * scale, anchors + program.probes,
                                            allow_unused=True)
            grads, marks = grads[: len(anchors)], grads[len(anchors) :]
            home = Params(grad_spec(params.spec), grads)
            live = program.live(home, marks)
            w = dist.world_size(params.spec.process_group)  # every unit is gathered at once
            peak = sum(t.numel() * t.element_size() * (w if u.gather else 1) for t, u in zip(leaves, program.units))
            if sink is not None:  # accumulate: this micro-batch's home gradients into its sums
                for i, g in enumerate(grads):
                    if g is not None:
                        sink.take_home(i, g)
            return GradOut(loss.detach(), aux, home, peak, 1.0 if scale is None else 1.0 / scale, live=live)

        return run


def _refuse_copied_in(params: Params) -> None:
    """Units whose shards live in host memory and are copied to the accelerator as they are used
    (``offload_cpu(params=True)``): the copies are zfunc's, outside any program, so the program
    would read host tensors beside device ones. On a CPU group the copy is a plain one: traced."""
    group = params.spec.process_group
    for leaf, place in zip(params.leaves_in_flight, params.spec.placements):
        if leaf is not None and copies_in(place) and compute_device(place, leaf, group) != leaf.device:
            raise compiled.CompileError(
                f"zf.jit cannot trace offload_cpu(params=True) on {compute_device(place, leaf, group)}: its parameter "
                "shards live in host memory and are copied in unit by unit as they are used, outside any program. "
                "Compile the blocks instead (zf.compile_units(model) before step.init) and leave the step eager, "
                "or keep the parameters on the device (offload_cpu without params=True)")


def _graph_breaks() -> int:
    """Graph breaks dynamo has made in this process so far (its own statistics)."""
    return sum(counters["graph_break"].values())


class _NoWeightsOutside:
    """The resolver while the program's backward runs: a weight read there comes from code that
    recomputes outside the program (an activation checkpoint the compiler left to eager
    autograd), where the units are not gathered."""

    def __init__(self, regather: bool):
        self.regather = regather

    def resolve(self, name: str):
        hint = ("zf.jit(..., regather=True) checkpoints the forward itself, and a checkpoint inside it "
                "(Hugging Face's gradient_checkpointing_enable, say) " if self.regather else
                "an activation checkpoint of the model ")
        raise compiled.CompileError(
            f"zf.jit: parameter {name!r} was read in backward outside the compiled program: {hint}recomputes "
            "outside it, where zfunc holds no gathered unit. Turn that checkpointing off (the program "
            "keeps or re-gathers what backward needs), or compile the blocks instead (zf.compile_units)")


def _anchors(params: Params) -> list[torch.Tensor]:
    """What autograd differentiates per unit: the leaf, or for a full leaf whose gradient goes
    home as a shard (zero2), a shard-shaped stand-in (a gradient has its input's shape)."""
    spec = params.spec
    w = dist.world_size(spec.process_group)
    out = []
    for leaf, place, sharded in zip(params.leaves, spec.placements, spec.sharded):
        if grad_is_shard(place, sharded) and not sharded and w > 1:
            anchor = torch.empty_strided((layout.shard_numel(leaf.numel(), w),), (0,), dtype=leaf.dtype,
                                         device=leaf.device)
        else:
            anchor = leaf.detach()
        out.append(anchor.requires_grad_())
    return out
