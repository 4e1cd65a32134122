"""The training state: a pytree of sharded parameters, optimizer state and buffers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch

from . import dist, layout, swap
from .pytree import NAMESPACE, register_node, tree_leaves
from .tree import Fault, Params


@dataclass(frozen=True)
class State:
    """Everything a step reads and returns. An optree/torch pytree.

    ``params``: trainable parameters (one flat leaf per unit). ``opt_state``:
    the optimizer's state over this rank's part of ``params``. ``frozen``:
    parameters that get no gradient. ``buffers``: ``name -> Tensor``,
    unsharded. ``count``: steps taken (0-d int64, skipped steps included).
    ``plan``: the static record of the step that made it (its composition
    and world size), checked when the state is passed to a step.
    ``loss_scale``: the fp16 loss scaler's state (``LossScaleState``), or None.
    ``loading_info``: on the state ``step.init(..., weights=)`` returns, the model's tensors the
    files lacked and the files' tensors the model has not (``missing_keys``, ``unexpected_keys``,
    as ``load_state_dict`` returns them); None elsewhere. Not part of the pytree.
    """

    loading_info = None  # a class attribute, not a field: set on init's state only

    params: Params
    opt_state: Any
    frozen: Params
    buffers: dict
    count: torch.Tensor
    plan: Any = None
    loss_scale: Any = None

    def close(self) -> None:
        """Remove the swap files this state owns (``offload_nvme``); a no-op for other states.

        The state, and every state a step returned from it, is unusable afterwards.
        """
        store = swap.open_store(self)
        if store is not None:
            store.close()

    def __enter__(self) -> "State":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_FIELDS = ("params", "opt_state", "frozen", "buffers", "count", "loss_scale")


def _flatten(s: State):
    # no loss scaler: no child at all (torch's pytree would count a None as a leaf); the field
    # names are the children's path entries (checkpoints name parts by them)
    children = (s.params, s.opt_state, s.frozen, s.buffers, s.count)
    children = children + (s.loss_scale,) if s.loss_scale is not None else children
    return children, s.plan, _FIELDS[: len(children)]


register_node(State, _flatten, lambda plan, children: State(*children[:5], plan=plan, loss_scale=(
    children[5] if len(children) > 5 else None)))


def _nodes(state) -> list[Params]:
    """Every ``Params`` node of ``state`` (parameters, frozen, the optimizer's), its values not read."""
    return [n for n in optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, Params), namespace=NAMESPACE)
            if isinstance(n, Params)]


def fault_of(state, *, wait: bool = False) -> Fault | None:
    """The ``Fault`` of a failed update that ``state`` holds (zfunc.tree), or None. ``wait``: first
    wait for the updates still writing it (without raising), so their failures count."""
    nodes = _nodes(state)
    if wait:
        for node in nodes:
            for unit in list(node._filling):
                node._wait(unit, refused_later=True)
    return next((n.fault for n in nodes if n.fault is not None and n.fault.failed), None)


def mark_failed(state, fault: Fault) -> None:
    """From now on every ``Params`` of ``state`` refuses its values with ``fault``'s error."""
    for node in _nodes(state):
        if node.fault is None or not node.fault.failed:
            node.fault = fault


def share_fault(given, returned, fault: Fault | None) -> None:
    """The ``Fault`` of the update that made ``returned`` from ``given`` (``fault``: the update's
    own, if its units still run; else a new one), held by both: if that update fails on any rank,
    both refuse (``refused_on_every_rank``)."""
    fault = fault or Fault()
    mark_failed(returned, fault)
    mark_failed(given, fault)


def refused_on_every_rank(state, what: str) -> None:
    """Raise, on each rank, once a collective (``what``) said that some rank's state is refused: a
    rank whose own update went through takes that failure into the fault its state shares with
    the state its last update was given (or a new one). Every rank's ``Fault`` is then ``agreed``,
    so the next use refuses at once, with no collective."""
    fault = fault_of(state)
    if fault is None:  # another rank's failed: this rank's state no longer matches it
        fault = next((n.fault for n in _nodes(state) if n.fault is not None), None) or Fault()
        fault.record(RuntimeError(f"another rank's state is refused ({what}); that rank's error names the cause"),
                     "the optimizer update on another rank")
        mark_failed(state, fault)
    fault.agreed = True
    raise fault.error()


def check_usable(state, *, collective: bool = False, group=None, wait: bool = True) -> None:
    """Raise if ``state`` is refused: an update that failed (``fault_of``, waiting for any still
    running unless not ``wait``) or swap files left half-updated or closed (``swap.check_state``).
    ``collective``: every rank of ``group`` (default: the state's) calls this before a collective,
    and all raise if any rank's is."""
    error = None
    fault = fault_of(state, wait=wait)
    if fault is not None:
        error = fault.error()
    else:
        try:
            swap.check_state(state)
        except RuntimeError as e:
            error = e
    group = state.params.spec.process_group if group is None else group
    if collective and dist.world_size(group) > 1:
        flag = torch.tensor([float(error is not None)], dtype=torch.float64, device=dist.device_of(group))
        dist.all_reduce_sum(flag, group, kind="agreement")
        if flag.item():
            if fault is None and error is not None:  # swap files: this rank's state refuses through its Params too
                fault = Fault()
                fault.record(error, "an update of this state's swap files")
                mark_failed(state, fault)
            refused_on_every_rank(state, "it refused a collective use")
    if error is not None:
        raise error


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def memory_report(state: State) -> dict:
    """Bytes this rank holds for each part of the model state (ZeRO memory: docs/records/benchmarks.md),
    and, under ``"by_home"``, the same bytes split by where they live: ``"device"``
    (accelerator memory; on a CPU-only machine, RAM), ``"pinned"`` (page-locked
    host memory), ``"host"`` (other host memory, when an accelerator holds the rest),
    ``"disk"`` (swap files of ``offload_nvme``). The value ``zf.offload_states`` returns reports
    itself: where its moved parts went, under ``"offloaded"``."""
    offloaded = getattr(state, "memory_report", None)  # zfunc.residency's OffloadedState
    if offloaded is not None:
        return offloaded()
    by_home = {"device": 0, "pinned": 0, "host": 0, "disk": 0}
    # on a GPU machine the CPU is the host even when every leaf lives there (the CPU parameter tier)
    accelerated = torch.cuda.is_available() or any(
        t.device.type not in ("cpu", "meta") for t in tree_leaves(state) if isinstance(t, torch.Tensor))
    for t in tree_leaves(state):
        if isinstance(t, torch.Tensor):
            if swap.on_disk(t):
                home = "disk"
            elif t.is_pinned():
                home = "pinned"
            else:
                home = "host" if accelerated and t.device.type == "cpu" else "device"
            by_home[home] += t.numel() * t.element_size()
    store = swap.open_store(state)
    return {
        "param_bytes": state.params.nbytes(),
        "optimizer_bytes": _nbytes(state.opt_state),
        "frozen_bytes": state.frozen.nbytes(),
        "buffer_bytes": _nbytes(state.buffers),
        "by_home": by_home,
        # offload_nvme: RAM its store keeps between steps (the read pool, the update's staging sets)
        "swap_buffer_bytes": 0 if store is None else store.resident_bytes(),
    }


INNER, MASTER = "inner", "master"


def wrapper_role(node_type: type, field: str) -> str | None:
    """What ``field`` of an optimizer-state node holds, found by structure.

    A transform that wraps the update part (mixed precision, offload) wraps the
    inner optimizer's state in a node with a field ``inner`` (``node_type._fields``
    names its children): that field is ``"inner"``; a field ``master`` holds the
    fp32 master weights (``"master"``); any other field another copy of the
    parameters (``"params"``), unless ``node_type.own_parts`` names it: a part of its own, known by
    its name (offload_cpu(delay=1)'s ``ahead``, the parameters with the pending update). None:
    ``node_type`` wraps nothing."""
    fields = getattr(node_type, "_fields", ())
    if INNER not in fields:
        return None
    if field in getattr(node_type, "own_parts", ()):
        return field
    return field if field in (INNER, MASTER) else "params"


def master_weights(opt_state) -> Any:
    """The fp32 master weights ``opt_state`` keeps (under the wrappers of ``wrapper_role``), or None."""
    node = opt_state
    while wrapper_role(type(node), INNER):
        for field in type(node)._fields:
            if wrapper_role(type(node), field) == MASTER:
                return getattr(node, field)
        node = node.inner
    return None


def master_params(state: State) -> Params:
    """The trainable parameters in full precision: the fp32 master weights under
    mixed precision (wherever offload keeps them), else the parameters."""
    master = master_weights(state.opt_state)
    return state.params if master is None else master


def gather_params(state: State) -> dict[str, torch.Tensor]:
    """Full fp32 parameters keyed like ``model.named_parameters()``, on every rank, on CPU.

    Under mixed precision these are the fp32 master weights (frozen parameters
    are their stored values, widened). A state whose update failed raises on every rank."""
    trainable = master_params(state)
    check_usable(state, collective=any(trainable.spec.sharded) or any(state.frozen.spec.sharded))
    return _by_name((trainable, state.frozen), torch.float32)


def _by_name(nodes, dtype) -> dict[str, torch.Tensor]:
    """The parameters of ``nodes`` (trainable, frozen) keyed and ordered like ``named_parameters()``,
    copied to the CPU in ``dtype`` (None: their own)."""
    out: dict[str, torch.Tensor] = {}
    for params in nodes:
        spec = params.spec
        for i in range(len(params.leaves)):
            for name, t in spec.segment(i).unflatten(unit_values(params, i)).items():
                out[name] = t.to(device="cpu", dtype=dtype, copy=True)
    order = [n for n, _ in spec.model.owner if spec.model.canonical_name(n) == n]
    return {name: out[name] for name in order}


def whole_here(state: State) -> bool:
    """Whether every unit of the parameters the step computes with (trainable and frozen) is whole
    on this rank (ZeRO 0-2, or a group of one), so ``compute_params`` needs no other rank."""
    return all(not any(p.spec.sharded) or dist.world_size(p.spec.process_group) == 1
               for p in (state.params, state.frozen))


def compute_params(state: State) -> dict[str, torch.Tensor]:
    """The parameters as the step computes with them (mixed precision's low-precision copy, which is
    its fp32 masters rounded), keyed like ``model.named_parameters()``, on CPU, read on this rank
    alone: only where ``whole_here``. A state whose update failed raises."""
    if not whole_here(state):
        raise ValueError("compute_params: a unit is sharded across ranks; gather_params(state) reads it (every "
                         "rank calls it)")
    check_usable(state)
    return _by_name((state.params, state.frozen), None)


def unit_values(params: Params, i: int) -> torch.Tensor:
    """Unit ``i``'s whole flat buffer (padded) on every rank: this rank's leaf, read in from its swap
    file if it lives in one, all-gathered if sharded (every rank of the group calls it)."""
    spec = params.spec
    leaf = swap.load(params.leaves[i]).detach()
    if not spec.sharded[i]:
        return leaf
    group = spec.process_group
    if dist.world_size(group) == 1:  # nothing to gather: the shard is the unit, where it lives
        return leaf
    # a host shard (swap file, offload_cpu's master) goes where nccl gathers; gloo gathers where it is
    on = dist.device_of(group)
    return dist.all_gather(leaf if on.type == "cpu" else leaf.to(on), group)


def write_params(state: State, values: dict[str, torch.Tensor]) -> None:
    """Write the full values of named parameters into ``state``, in place: every copy of them it
    keeps (the parameters or frozen parameters, mixed precision's fp32 master weights, offload's
    host copy), each rank its own part of each unit (its shard, or all of a replicated unit), cast
    to each copy's dtype, wherever it lives (device, host, swap file). The optimizer's moments and
    step counts are left as they are. ``values``: full tensors keyed by ``model.named_parameters()``
    names (a tied weight by any of its names), the same on every rank; no collective
    (``zfunc.deepspeed.zero.GatheredParameters`` broadcasts them first)."""
    spec = state.params.spec.model
    by_kind: dict[bool, dict[str, torch.Tensor]] = {True: {}, False: {}}
    for name, value in values.items():
        if name not in spec.parameter_names:
            raise KeyError(f"{name!r} is not a parameter of this state's model")
        by_kind[spec.owner_of(name)[1]][spec.canonical_name(name)] = value
    store = swap.open_store(state)
    if store is not None:
        store.drop_resident()  # the files are about to change under it
    copies = [state.params] + _parameter_copies(state.opt_state)
    for node in copies if by_kind[True] else []:
        _write_node(node, by_kind[True], store)
    if by_kind[False]:
        _write_node(state.frozen, by_kind[False], store)


def _parameter_copies(opt_state) -> list[Params]:
    """The ``Params`` nodes of ``opt_state`` that hold the parameters' values (``wrapper_role``: the
    master weights, offload's host copy), not the optimizer's own state."""
    accessors, nodes, _ = optree.tree_flatten_with_accessor(opt_state, is_leaf=lambda x: isinstance(x, Params),
                                                            namespace=NAMESPACE)
    out = []
    for accessor, node in zip(accessors, nodes):
        roles = [wrapper_role(e.type, getattr(e.type, "_fields", ())[e.entry]) for e in accessor
                 if isinstance(e.entry, int) and e.entry < len(getattr(e.type, "_fields", ()))]
        if isinstance(node, Params) and any(r is not None and r != INNER for r in roles):
            out.append(node)
    return out


def _write_node(node: Params, values: dict[str, torch.Tensor], store) -> None:
    """This rank's elements of ``values`` into ``node``'s leaves (``Params.parameter_ranges`` finds them)."""
    leaves = node.leaves  # waits for gathers and updates still writing them
    for i, leaf in enumerate(leaves):
        if leaf is None:
            continue
        entries = node.spec.segment(i).entries
        ranges = [(e, r) for e, r in zip(entries, node.parameter_ranges(i)) if e.name in values and r[0] < r[1]]
        if not ranges:
            continue
        target = swap.load(leaf) if swap.on_disk(leaf) else leaf
        for e, (lo, hi) in ranges:
            start = lo + _leaf_start(node, i) - e.offset  # where the leaf's piece starts within the parameter
            piece = values[e.name].detach().reshape(-1)[start:start + hi - lo]
            target.view(-1)[lo:hi].copy_(piece.to(device=target.device, dtype=target.dtype))
        if target is not leaf:
            store.write_now(target, leaf)


def _leaf_start(node: Params, i: int) -> int:
    """Where unit ``i``'s leaf starts within the unit's full flat buffer."""
    start = node._starts.get(i, 0)
    if node.spec.sharded[i]:
        home = layout.home_numel(node.spec.segment(i).padded, dist.world_size(node.spec.process_group), True)
        start += layout.shard_start(dist.rank(node.spec.process_group), home)
    return start
