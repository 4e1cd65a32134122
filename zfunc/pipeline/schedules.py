"""Pipeline schedules as data: one list of instructions per stage, which a small
interpreter (zfunc.pipeline.interpreter) executes. A schedule can be printed, tested and swapped.

Micro-batch ``m`` enters stage 0, goes forward through stages ``0..P-1`` and comes
back through ``P-1..0``. Per stage and micro-batch a forward is
``[LoadMicroBatch | RecvActivation] Forward [SendActivation]`` (the first stage
loads the inputs, the last loads the targets too and computes the loss), and a
backward is ``[RecvGrad] Backward [SendGrad]``. Every schedule ends with
``ReduceTiedGrads`` (a weight shared by stages), ``ReduceGrads`` (the stage's
data-parallel group) and ``OptimizerStep``.

* ``gpipe``: all forwards, then all backwards: every micro-batch's activations
  are alive at once.
* ``one_f_one_b`` (PipeDream-Flush, DeepSpeed's TrainSchedule): stage ``s`` runs
  ``P - s - 1`` forwards to fill the pipeline, then alternates one forward and one
  backward, then drains the backwards; at most ``P - s`` micro-batches are in
  flight on stage ``s``. Both give the same gradients; 1F1B holds fewer activations.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Instruction:
    micro_batch: int = -1  # -1: not about one micro-batch

    def __repr__(self) -> str:
        mb = f"({self.micro_batch})" if self.micro_batch >= 0 else "()"
        return type(self).__name__ + mb


class LoadMicroBatch(Instruction):
    """Take micro-batch ``m`` from the data (first stage: inputs; last stage: targets)."""


class RecvActivation(Instruction):
    """Receive micro-batch ``m``'s activations from the previous stage."""


class Forward(Instruction):
    """Run this stage's layers on micro-batch ``m`` (the last stage: and its loss)."""


class SendActivation(Instruction):
    """Send micro-batch ``m``'s outputs to the next stage."""


class RecvGrad(Instruction):
    """Receive the gradient of micro-batch ``m``'s outputs from the next stage."""


class Backward(Instruction):
    """Backpropagate micro-batch ``m`` through this stage (frees its activations)."""


class SendGrad(Instruction):
    """Send the gradient of micro-batch ``m``'s inputs to the previous stage."""


class ReduceTiedGrads(Instruction):
    """Sum the gradients of weights tied across stages over the stages that own them."""


class ReduceGrads(Instruction):
    """Average gradients over the stage's data-parallel replicas."""


class OptimizerStep(Instruction):
    """Update this stage's parameters."""


def _forward(m: int, stage: int, stages: int) -> list[Instruction]:
    first, last = stage == 0, stage == stages - 1
    out: list[Instruction] = []
    out.append(LoadMicroBatch(m) if first else RecvActivation(m))
    if last and not first:
        out.append(LoadMicroBatch(m))  # the targets
    out.append(Forward(m))
    if not last:
        out.append(SendActivation(m))
    return out


def _backward(m: int, stage: int, stages: int) -> list[Instruction]:
    out: list[Instruction] = []
    if stage < stages - 1:
        out.append(RecvGrad(m))
    out.append(Backward(m))
    if stage > 0:
        out.append(SendGrad(m))
    return out


def _end() -> list[Instruction]:
    return [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def _check(micro_batches: int, stages: int, stage: int) -> None:
    if micro_batches < 1 or stages < 1 or not 0 <= stage < stages:
        raise ValueError(f"a schedule needs micro_batches >= 1, stages >= 1 and 0 <= stage < stages; "
                         f"got {micro_batches}, {stages}, {stage}")


def gpipe(micro_batches: int, stages: int, stage: int) -> list[Instruction]:
    """All forwards, then all backwards (in reverse order, so each stage's sends meet receives)."""
    _check(micro_batches, stages, stage)
    out: list[Instruction] = []
    for m in range(micro_batches):
        out += _forward(m, stage, stages)
    for m in range(micro_batches):
        out += _backward(m, stage, stages)
    return out + _end()


def one_f_one_b(micro_batches: int, stages: int, stage: int) -> list[Instruction]:
    """Warm-up forwards, then one forward and one backward at a time, then the last backwards."""
    _check(micro_batches, stages, stage)
    warmup = min(stages - stage - 1, micro_batches)
    out: list[Instruction] = []
    for m in range(warmup):
        out += _forward(m, stage, stages)
    for i in range(micro_batches - warmup):
        out += _forward(warmup + i, stage, stages)
        out += _backward(i, stage, stages)
    for m in range(micro_batches - warmup, micro_batches):
        out += _backward(m, stage, stages)
    return out + _end()


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def schedule(name: str, micro_batches: int, stages: int, stage: int) -> list[Instruction]:
    """Stage ``stage``'s instructions under schedule ``name`` ("1f1b" or "gpipe")."""
    try:
        make = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}: choose from {', '.join(SCHEDULES)}") from None
    return make(micro_batches, stages, stage)


def timeline(name: str, micro_batches: int, forward_s, backward_s, link_s: float = 0.0) -> list[float]:
    """When each stage would finish its list, given what a Forward and a Backward of one
    micro-batch cost on each stage (``forward_s[s]``, ``backward_s[s]``) and what a transfer
    between neighbours costs (``link_s``): sends do not block, a receive waits for its send.

    The ideal of a real pipeline: ``1 - Σ busy / (stages x max(timeline))`` is the bubble
    its partition cannot avoid. With equal stages and free transfers it is (p-1)/(m+p-1)
    for both schedules.
    """
    stages = len(forward_s)
    if len(backward_s) != stages:
        raise ValueError(f"forward_s has {stages} stages, backward_s {len(backward_s)}")
    programs = [schedule(name, micro_batches, stages, s) for s in range(stages)]
    clock = [0.0] * stages
    pc = [0] * stages
    sent: dict[tuple, float] = {}  # (kind, stage, micro-batch) -> when its transfer arrives
    while any(pc[s] < len(p) for s, p in enumerate(programs)):
        moved = False
        for s, program in enumerate(programs):
            while pc[s] < len(program):
                i, m = program[pc[s]], program[pc[s]].micro_batch
                wait = (("act", s - 1, m) if isinstance(i, RecvActivation) else
                        ("grad", s + 1, m) if isinstance(i, RecvGrad) else None)
                if wait is not None:
                    if wait not in sent:
                        break  # its sender has not got there yet
                    clock[s] = max(clock[s], sent[wait])
                elif isinstance(i, Forward):
                    clock[s] += forward_s[s]
                elif isinstance(i, Backward):
                    clock[s] += backward_s[s]
                elif isinstance(i, SendActivation):
                    sent[("act", s, m)] = clock[s] + link_s
                elif isinstance(i, SendGrad):
                    sent[("grad", s, m)] = clock[s] + link_s
                pc[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"schedule {name!r} deadlocks at {[p[k] if k < len(p) else None for p, k in zip(programs, pc)]}")
    return clock


def ideal_bubble(name: str, micro_batches: int, forward_s, backward_s, link_s: float = 0.0) -> float:
    """The share of the stages' time a pipeline with these costs spends idle (``timeline``)."""
    span = max(timeline(name, micro_batches, forward_s, backward_s, link_s))
    busy = micro_batches * (sum(forward_s) + sum(backward_s))
    return 1.0 - busy / (len(forward_s) * span)
