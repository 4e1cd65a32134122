"""What torch.compile asks of zfunc, and what zfunc asks of it.

zfunc gathers a unit before its module runs and releases it after, in forward
hooks; the gathers, the coordinator's bookkeeping and the collectives are
Python that dynamo should never trace. So zfunc's own entry points run eagerly
(``eager``), and the compiled region is the module's computation, as FSDP2's
hooks stay outside torchtitan's compiled blocks:

* a block compiled in place (``block.compile()``, ``compile_units``) runs as one
  graph: zfunc puts the unit's tensors in its slots before calling the compiled
  code and takes them out after (zfunc.grad), so ``fullgraph=True`` holds;
* a block wrapped (``torch.compile(block)``) or a whole model wrapped
  (``torch.compile(model)``) adds ``_orig_mod.`` to its parameter names: zfunc
  names every parameter, buffer and module by its *plain* name, without it, so
  states, checkpoints and ``gather_params`` read the same whether a model is
  compiled or not;
* a compiled model breaks its graph at each unit's boundary, where zfunc
  gathers: allowed, and said once (``GraphBreakWarning``).

``zf.compile_units`` (zfunc.tree) compiles each unit's module in place.
"""
from __future__ import annotations

import warnings
from typing import Iterator

import torch
from torch import nn

_WRAPPED = "_orig_mod."


class CompileError(RuntimeError):
    """A model or step zfunc cannot run compiled, with why and what to compile instead."""


class CompileWarning(UserWarning):
    """How zfunc compiles what it was asked to (``torch.compile(step)`` runs ``zf.jit(step)``)."""


class GraphBreakWarning(CompileWarning):
    """A compiled model whose graph zfunc breaks at unit boundaries (said once per model)."""


def cannot_compile(what: str, error: Exception, hint: str = "") -> CompileError:
    """The error for ``what`` (a unit, the model) that dynamo could not compile: its reason, not
    dynamo's stack; ``hint``: what to do instead."""
    reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return CompileError(
        f"torch.compile could not compile {what} under zfunc: {reason}. "
        + (hint or "Make that code traceable (TORCH_LOGS=graph_breaks shows where), compile it without "
           "fullgraph=True, or leave it eager: zf.compile_units(model, units=[...]) compiles the blocks you name"))


def plain_name(name: str) -> str:
    """``name`` without torch.compile's ``_orig_mod.`` segments."""
    if _WRAPPED not in name and not name.endswith("_orig_mod"):
        return name
    parts = [p for p in name.split(".") if p != "_orig_mod"]
    return ".".join(parts)


def named_parameters(model: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
    for name, p in model.named_parameters(remove_duplicate=remove_duplicate):
        yield plain_name(name), p


def named_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, b in model.named_buffers():
        yield plain_name(name), b


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module with its plain path; a wrapper and the module it wraps share one path (wrapper first)."""
    for name, m in model.named_modules():
        yield plain_name(name), m


def modules_by_path(model: nn.Module) -> dict[str, nn.Module]:
    """Plain path -> the outermost module at it (a compiled wrapper rather than what it wraps),
    so zfunc's hooks on it run outside the compiled code."""
    out: dict[str, nn.Module] = {}
    for name, m in named_modules(model):
        out.setdefault(name, m)
    return out


def owner(model: nn.Module, path: str) -> nn.Module:
    """The module that holds the parameter slots at plain ``path`` (inside any compiled wrapper)."""
    module = model.get_submodule(path)
    while is_wrapped(module):
        module = module._orig_mod
    return module


def real_name(model: nn.Module, name: str) -> str:
    """Plain ``name`` as ``model`` spells it, ``_orig_mod.`` included where a compiled wrapper
    stands (what ``functional_call`` needs to reach a slot of a wrapped module)."""
    out, module = [], model
    parts = name.split(".")
    for i, part in enumerate(parts):
        while is_wrapped(module):
            out.append("_orig_mod")
            module = module._orig_mod
        out.append(part)
        if i < len(parts) - 1:
            module = module._modules[part]
    return ".".join(out)


def is_wrapped(model: nn.Module) -> bool:
    """Whether ``model`` is ``torch.compile(module)``'s wrapper."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled code: wrapped by ``torch.compile``, or compiled in place."""
    return is_wrapped(module) or getattr(module, "_compiled_call_impl", None) is not None


def compile_in_place(module: nn.Module, **compile_kwargs) -> None:
    """``module.compile(**compile_kwargs)``, for a module of torch.nn itself too (an
    ``nn.Sequential`` block): dynamo starts no frame inside torch.nn, so ``module.compile()``
    compiles nothing there; it starts here and follows the call in."""
    _compile(module, lambda run: torch.compile(run, **compile_kwargs))


def compile_like(wrapper: nn.Module, module: nn.Module) -> None:
    """``module`` compiled in place with the options ``torch.compile(model)`` gave ``wrapper``
    (its dynamo context). Dynamo gives up on a model's frame that breaks inside a loop (at
    each unit), and torch 2.11 gives up on the frames it calls with it, so zfunc compiles
    each unit itself rather than count on dynamo reaching it."""
    _compile(module, wrapper.dynamo_ctx)


def _compile(module: nn.Module, optimize) -> None:
    call = module._call_impl

    def run(*args, **kwargs):
        return call(*args, **kwargs)

    module._compiled_call_impl = optimize(run)


def eager(fn):
    """``fn`` is zfunc's own work (gathers, bookkeeping, collectives): never traced by dynamo."""
    return torch.compiler.disable(fn, recursive=True)


_warned: set[int] = set()


def warn_graph_breaks(model: nn.Module, unit_names: list[str]) -> None:
    """Say once per compiled model where zfunc breaks its graph."""
    if id(model) in _warned or not unit_names:
        return
    _warned.add(id(model))
    shown = ", ".join(unit_names[:4]) + (", ..." if len(unit_names) > 4 else "")
    warnings.warn(
        f"torch.compile(model) under zfunc: the compiled graph breaks at the {len(unit_names)} unit "
        f"boundar{'y' if len(unit_names) == 1 else 'ies'} ({shown}), where zfunc gathers each unit and releases it after; each unit "
        "compiles as its own graph. For one graph per block and no breaks, compile the blocks "
        "instead: zf.compile_units(model) (or block.compile() for each) before step.init",
        GraphBreakWarning, stacklevel=3)
