"""What the ranks agree on in a step, each time in one small all-reduce.

A rank's step acts alone between collectives; before the update, every rank must know what the
others saw, or their states drift apart (one skips a non-finite step the others apply) or a rank
waits forever (one raised on its own). So:

* after backward (``agree``): the loss, which units some rank used and which of their parameters
  got a gradient on some rank (``live_flags``, read back by ``agreed_live``), whether any gradient
  is non-finite and the global squared norm (``grad_stats``: one read of each gradient), and a
  fingerprint of the order in which each rank materialized units (``same_order``);
* with every such all-reduce, whether some rank's state is refused (an update that failed):
  ``summed`` raises on every rank if so;
* at a step's entry, for a state on disk (``agree_at_entry``).

The step (zfunc.step) and the pipeline's stages (zfunc.pipeline.interpreter, over every stage)
both agree through this module.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import compiled, dist, swap
from .grad import GradOut
from .ops import cpu_adam
from .state import State, check_usable, fault_of, refused_on_every_rank
from .tree import Params


class Agreement(NamedTuple):
    """What every rank agreed on after backward (``Step.apply_gradients``)."""

    loss: torch.Tensor  # mean over ranks of each rank's loss
    nonfinite: list[str]  # where some rank has an inf/NaN gradient ("unit 'name'")
    sq_norm: float  # squared global norm of the gradients (as computed, before any scale)
    same_order: bool = True  # every rank materialized the same units in the same order
    # per unit, which parameters got a gradient on some rank (None: zf.jit cannot tell; ``agreed_live``)
    live: tuple[tuple[bool | None, ...], ...] | None = None


def agree(out: GradOut, order: int, state: State | None, group, transforms, *, replicate=None) -> Agreement:
    """One all-reduce over ``group`` for what every rank must agree on after backward.

    First, whether some rank's ``state`` is refused (an update that failed: ``fault_of``); if so,
    the step raises on every rank, and every rank's state refuses from then on.

    Which units some rank used (a unit no rank used gets no update, as
    ``torch.optim`` skips a parameter without ``.grad``) and which of their
    parameters some rank gave a gradient (``out.live``; one that none did gets
    no update either, though its unit's gradient holds zeros for it), whether
    any gradient is non-finite and the global squared norm (``grad_stats``), the
    loss, and whether every rank materialized units in the same order (``order``,
    the coordinator's fingerprint of it).

    Hybrid sharding: ``group`` spans every rank and ``replicate`` is the group holding the same
    shards as this rank (averaged over it already: zfunc.placement.replicate_mean), so the shards'
    norm is counted on its first rank only, once per shard, not once per replica.
    """
    loss, grads = out.loss, out.grads
    leaves = grads.leaves
    w, r = dist.world_size(group), dist.rank(group)
    used = [float(g is not None) for g in leaves]
    flags = live_flags(grads, out.live)
    shards_here = replicate is None or dist.rank(replicate) == 0
    bad, sq_shard, sq_whole = grad_stats(grads, transforms, whole_here=r == 0, shards_here=shards_here)
    vec = summed([float(loss), *used, *bad, float(order), float(order) ** 2, *flags, sq_shard, sq_whole],
                 state, group, "its step's agreement")
    k = len(leaves)
    if not same_order(vec[1 + 2 * k], vec[2 + 2 * k], w):  # the caller names where the orders differ
        return Agreement(torch.tensor(vec[0] / w, dtype=torch.float32), [], 0.0, False)
    names = [u.name or "<root>" for u in grads.spec.model.units]
    partial = [(n, int(c)) for n, c in zip(names, vec[1 : 1 + k]) if 0 < c < w]
    if partial:
        name, c = partial[0]
        raise RuntimeError(
            f"ranks ran different units this step: unit {name!r} was used on {c} of {w} ranks. Every rank "
            "must run the same units (control flow that skips a block must skip it on every rank)"
        )
    nonfinite = [f"unit {n!r}" for n, b in zip(names, vec[1 + k : 1 + 2 * k]) if b]
    return Agreement(torch.tensor(vec[0] / w, dtype=torch.float32), nonfinite, vec[-2] + vec[-1],
                     True, agreed_live(grads, vec[3 + 2 * k : 3 + 2 * k + len(flags)]))


def grad_stats(grads: Params, transforms, *, whole_here: bool, norm_elsewhere=(), shards_here: bool = True
               ) -> tuple[list[float], float, float]:
    """This rank's part of the non-finite flags and the squared norm, in one read of each gradient
    (``nonfinite_and_sq_norm``, unless a transform measured it: ``Transform.grad_stats``).

    Returns, per gradient, 1.0 where it holds an inf or NaN; then the squared norm of the
    shards, which count on every rank, and of the whole gradients, the same on every rank and so
    counted only where ``whole_here``, and the shards only where ``shards_here`` (hybrid sharding:
    on one replica). ``norm_elsewhere``: units whose norm another rank counts (the pipeline's tied
    modules, on their first stage)."""
    bad, sq_shard, sq_whole = [], 0.0, 0.0
    for i, (g, shard) in enumerate(zip(grads.leaves, grads.spec.sharded)):
        if g is None or g.numel() == 0:
            bad.append(0.0)
            continue
        stats = next((s for t in transforms if (s := t.grad_stats(g)) is not None), None)
        sq, finite = stats if stats is not None else cpu_adam.nonfinite_and_sq_norm([g])
        bad.append(float(not finite))
        if i in norm_elsewhere:
            continue
        if shard:
            sq_shard += sq if shards_here else 0.0
        elif whole_here:
            sq_whole += sq
    return bad, sq_shard, sq_whole


def summed(values: list[float], state: State | None, group, what: str) -> list[float]:
    """``values`` summed over ``group`` in one all-reduce that also carries whether this rank's
    ``state`` is refused: if any rank's is, every rank raises (``refused_on_every_rank``, naming
    the agreement, ``what``)."""
    failed = state is not None and fault_of(state) is not None
    vec = torch.tensor([*values, float(failed)], dtype=torch.float64, device=dist.device_of(group))
    dist.all_reduce_sum(vec, group, kind="agreement")
    sums = vec.tolist()
    if sums[-1]:
        refused_on_every_rank(state, what)
    return sums[:-1]


def same_order(h_sum: float, h2_sum: float, w: int) -> bool:
    """Whether every rank's order fingerprint h was the same, from the sums of h and h^2
    (Cauchy-Schwarz: equal iff W * sum(h^2) == sum(h)^2; exact in float64 for 20-bit h)."""
    return w * h2_sum == h_sum * h_sum


def agree_at_entry(state: State, group, timeout_s: float) -> None:
    """For a state on disk (``offload_nvme``) at W > 1: one all-reduce, before any other
    collective of the step, of whether this rank's state is refused; if any rank's is, the step
    raises on every rank. Elsewhere a rank whose update failed runs the forward on what the
    update left, to reach the step's own agreement (``agree``); a failed swap store reads and
    writes nothing more, so that rank could not, and the others would wait in the forward's
    gathers until the collective timeout. A rank that already agreed raises in ``Step._check``,
    as every rank then does, without a collective."""
    if state.params.spec.swap is None or dist.world_size(group) == 1:
        return
    fault = fault_of(state)
    if fault is not None and fault.agreed:
        return
    if swap.open_store(state) is None:
        swap.check_state(state)  # closed by the program (on every rank): says so
    with dist.deadline(timeout_s, group):
        check_usable(state, collective=True, group=group, wait=False)


def live_flags(grads: Params, live: dict | None) -> list[float]:
    """For each parameter of each unit (in order), 1.0 where it got a gradient on this rank: where
    ``live`` (``GradOut.live``) says True, or, where it is not known, every one of a unit with a
    gradient; then, for each, 1.0 where zf.jit cannot tell (``live`` says None). Summed over
    ranks, ``agreed_live`` reads them back."""
    got, unsure = [], []
    for i, g in enumerate(grads.leaves):
        n = len(grads.spec.segment(i).entries)
        flags = (False,) * n if g is None else (True,) * n if live is None or i not in live else live[i]
        got += [float(f is True) for f in flags]
        unsure += [float(f is None) for f in flags]
    return got + unsure


def agreed_live(grads: Params, sums: list[float]) -> tuple[tuple[bool | None, ...], ...]:
    """``live_flags`` summed over ranks, per unit: whether each parameter got a gradient on some
    rank (as under DDP, whose all-reduced gradient exists where any rank made one); None where
    none says it did and some rank cannot tell (``sure_live`` refuses to guess)."""
    half = len(sums) // 2
    out, at = [], 0
    for i in range(len(grads.spec.sharded)):
        n = len(grads.spec.segment(i).entries)
        out.append(tuple(True if g else None if u else False
                         for g, u in zip(sums[at : at + n], sums[half + at : half + at + n])))
        at += n
    return tuple(out)


def sure_live(live, spec) -> tuple[tuple[bool, ...], ...] | None:
    """``live`` (``agreed_live``), where no parameter is left unsure; else the error naming one."""
    for i, got in enumerate(live or ()):
        for entry, g in zip(spec.segment(i).entries, got):
            if g is None:
                raise compiled.CompileError(
                    f"zf.jit cannot tell whether parameter {entry.name!r} got a gradient this step: the step's "
                    "program has graph breaks, and a compiled graph's backward gets zeros, not None, for what it "
                    "output that got no gradient, so a parameter read only after a break, and not this step, "
                    "looks like one whose gradient is exactly zero (torch.optim skips the first and updates the "
                    "second). Remove the graph breaks (torch._dynamo.explain names them), or compile the blocks "
                    "instead of the step (zf.compile_units); the state was not updated")
    return live
