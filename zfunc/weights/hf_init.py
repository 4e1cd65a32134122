"""A Hugging Face model's own initialization, run over the modules of one unit at a time.

transformers builds a model, then ``post_init`` runs ``initialize_weights``: every module, children
before their parent (``smart_apply``), goes through the ``_init_weights`` of the nearest
``PreTrainedModel`` above it (itself included), under ``guard_torch_init_functions`` so that a tensor
flagged ``_is_hf_initialized`` is left as it is. ``from_pretrained`` builds on the meta device,
loads and flags what the files hold, then runs the same pass for the rest: transformers 5 computes
every buffer there too (rotary ``inv_freq``, Gemma's ``embed_scale``, BERT's ``position_ids``).

zfunc runs that pass over the modules that own a unit's tensors *and their ancestors*, since a
parent may initialize its children's weights (GPT-2's attention rescales its ``c_proj``), in the same
order; the other units' tensors are on the meta device then, so writes to them do nothing.
"""
from __future__ import annotations

import contextlib
import sys

from torch import nn


class HFInit:
    """``_init_weights`` dispatch over ``model``'s modules, as ``initialize_weights`` does it."""

    def __init__(self, model: nn.Module):
        self.hf_of: dict[int, nn.Module] = {}   # id(module) -> the PreTrainedModel whose _init_weights it takes
        self.order: dict[int, int] = {}         # id(module) -> its place in smart_apply's order
        self.parents: dict[int, list[nn.Module]] = {}
        self._walk(model, None, sys.modules["transformers.modeling_utils"].PreTrainedModel)
        root = model
        while hasattr(root, "_orig_mod"):  # a compiled wrapper: names are the model's own
            root = root._orig_mod
        # the names tied parameters take their value from ({target: source}, all submodels')
        self.tie_sources = set((getattr(root, "all_tied_weights_keys", None) or {}).values())

    def _walk(self, module: nn.Module, hf, cls) -> None:
        if isinstance(module, cls):
            hf = module
        if hf is not None:
            self.hf_of.setdefault(id(module), hf)
        for child in module.children():
            self.parents.setdefault(id(child), []).append(module)
            if id(child) not in self.order:
                self._walk(child, hf, cls)
        self.order.setdefault(id(module), len(self.order))

    def covers(self, module: nn.Module) -> bool:
        """Whether ``module`` is under a ``PreTrainedModel`` (its init is transformers')."""
        return id(module) in self.hf_of

    def run(self, modules: list[nn.Module]) -> None:
        """``_init_weights`` over ``modules`` and every module above them, children first."""
        everything = {id(m): m for m in modules}
        for m in modules:
            for p in self._ancestors(m):
                everything.setdefault(id(p), p)
        with _guarded():
            for m in sorted(everything.values(), key=lambda m: self.order[id(m)]):
                hf = self.hf_of.get(id(m))
                if hf is not None:
                    hf._init_weights(m)

    def _ancestors(self, module: nn.Module):
        todo, seen = list(self.parents.get(id(module), [])), set()
        while todo:
            m = todo.pop()
            if id(m) not in seen:
                seen.add(id(m))
                yield m
                todo += self.parents.get(id(m), [])


def hf_init(model: nn.Module) -> HFInit | None:
    """The dispatch for ``model``, or None where it holds no ``PreTrainedModel`` (transformers not imported,
    or a model of another kind): nothing is imported here."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or not any(isinstance(m, modeling.PreTrainedModel) for m in model.modules()):
        return None
    return HFInit(model)


def _guarded():
    """transformers' guard: torch.nn.init's functions skip tensors flagged ``_is_hf_initialized``."""
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:  # transformers 4: its _init_weights writes every tensor it is given
        return contextlib.nullcontext()
    return guard_torch_init_functions()


def mark_loaded(tensor) -> None:
    """Flag ``tensor`` as loaded, as ``from_pretrained`` does: transformers' init functions leave it."""
    tensor._is_hf_initialized = True


def constructor_init(module: nn.Module) -> bool:
    """Initialize ``module``'s tensors as its constructor did, before ``post_init`` (what a tensor that
    ``_init_weights`` does not write holds in the model built normally); False where that is not known:
    ``reset_parameters()``, or transformers' ``Conv1D``, which has none (OpenAI GPT's ``_init_weights``
    leaves it)."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
        return True
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    if pytorch_utils is not None and type(module) is getattr(pytorch_utils, "Conv1D", None):
        nn.init.normal_(module.weight, std=0.02)  # its __init__
        nn.init.zeros_(module.bias)
        return True
    return False
