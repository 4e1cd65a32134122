"""zfunc.old_paths: old import paths users wrote keep working, with a warning that names the new one.

``zfunc.estimate`` was the package and is now ``zfunc.estimator``: under the old name it stays
callable, because importing ``zfunc.estimate`` sets ``zf.estimate`` to the imported module, and
``zf.estimate(...)`` must still be the function.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {"zfunc.rates": "zfunc.transforms.offload.rates", "zfunc.offload_plan": "zfunc.transforms.offload.plan",
         "zfunc.estimate": "zfunc.estimator"}

# old attributes of ``zfunc``: the module now holding them, and what the warning says
MOVED_NAMES = {"schedules": ("zfunc.pipeline.schedules",
                             "zf.schedules is now zf.pipeline.schedules (zf.optim.lr holds the lr schedules)")}


def old_attribute(name: str):
    """``zfunc``'s ``__getattr__``: a moved attribute, with a warning; else AttributeError."""
    if name in MOVED_NAMES:
        module, message = MOVED_NAMES[name]
        warnings.warn(message + "; the old name will go", FutureWarning, stacklevel=2)
        return importlib.import_module(module)
    raise AttributeError(f"module 'zfunc' has no attribute {name!r}")


def new_name(name: str) -> str | None:
    """The new path of an old module path (a moved package's submodules move with it), or None."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _CallableEstimator(types.ModuleType):
    """``zfunc.estimate`` under its old name: the package's names, and called, ``zf.estimate``."""

    def __init__(self, package):
        super().__init__("zfunc.estimate", package.__doc__)
        self.__dict__["_package"] = package

    def __getattr__(self, name):
        return getattr(self._package, name)

    def __call__(self, *args, **kwargs):
        return self._package.estimate(*args, **kwargs)


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths in ``MOVED`` and loads each as the module at its new path, warning."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if new_name(name) else None

    def create_module(self, spec):
        new = new_name(spec.name)
        warnings.warn(f"{spec.name} is now {new}; the old path will go", FutureWarning, stacklevel=2)
        module = importlib.import_module(new)
        return _CallableEstimator(module) if spec.name == "zfunc.estimate" else module

    def exec_module(self, module):
        """Nothing to run: ``create_module`` returned the new module, already imported."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once, first: a moved package's submodules must not be
    found again by the path finder under their old names (a second copy of each)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
