"""``import deepspeed`` answered by zfunc's DeepSpeed face, where the user asks for it.

``install()`` (``zfunc.deepspeed.install()`` re-exports it) puts one finder first on
``sys.meta_path``:

- imports: ``deepspeed`` is ``zfunc.deepspeed`` and ``deepspeed.X`` is ``zfunc.deepspeed.X``, the
  same module objects entered in ``sys.modules`` under both names (so ``deepspeed.ops.adam.FusedAdam
  is zfunc.deepspeed.ops.adam.FusedAdam``). A ``deepspeed.X`` that zfunc has no module for raises
  ``ModuleNotFoundError`` naming the DeepSpeed feature and what zfunc offers;
- metadata: ``importlib.metadata`` finds a distribution named ``deepspeed`` whose version,
  ``0.19.8+zfunc.<zfunc's version>``, says that it is zfunc standing in for DeepSpeed 0.19.8's API
  (transformers and Accelerate check ``find_spec("deepspeed")`` and this metadata, and gate
  features on the version).

Nothing is installed by default: real DeepSpeed stays importable in the same environment. Two
ways on: ``zfunc.deepspeed.install()`` in a script before anything imports ``deepspeed``, or the
environment variable ``ZFUNC_AS_DEEPSPEED=1``, read at interpreter start by the
``zfunc-as-deepspeed.pth`` hook that zfunc's installation puts in site-packages, for launchers that
run code the user does not edit (``accelerate launch``, ``torchrun``, the Hugging Face Trainer).

This package is import-light on purpose (the standard library only): the hook runs in every
interpreter that starts with the variable set, and imports nothing of zfunc or torch until
``deepspeed`` itself is imported. It is a top-level package (as setuptools' ``_distutils_hack`` is
for its ``.pth``) because importing anything under ``zfunc`` runs ``zfunc/__init__.py``, which
imports torch.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys

__all__ = ["ENV", "install", "installed", "uninstall"]

ENV = "ZFUNC_AS_DEEPSPEED"
DEEPSPEED_VERSION = "0.19.8"  # the DeepSpeed release whose API zfunc.deepspeed follows
TARGET = "zfunc.deepspeed"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def install() -> None:
    """Make ``import deepspeed`` import ``zfunc.deepspeed`` in this process (see the module
    docstring). Idempotent. Refused when real DeepSpeed was already imported here: modules bound to
    it would stay DeepSpeed's while later imports got zfunc's."""
    if installed():
        return
    real = sorted(name for name, m in list(sys.modules.items())
                  if (name == "deepspeed" or name.startswith("deepspeed.")) and m is not None
                  and not getattr(m, "__name__", "").startswith(TARGET))
    if real:
        where = getattr(sys.modules.get(real[0]), "__file__", None)
        raise RuntimeError(
            f"zfunc.deepspeed.install(): real DeepSpeed is already imported in this process ({real[0]} from "
            f"{where}; {len(real)} deepspeed module(s)), so `import deepspeed` cannot become zfunc now. Call "
            f"install() before anything imports deepspeed (transformers and accelerate import it lazily, but "
            f"may have done so), or start the process with {ENV}=1 so zfunc is installed at interpreter start")
    sys.meta_path.insert(0, _Finder())
    importlib.invalidate_caches()


def installed() -> bool:
    """Whether ``import deepspeed`` is zfunc's in this process."""
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def uninstall() -> None:
    """Undo :func:`install`: the finder removed and the ``deepspeed`` / ``deepspeed.*`` names dropped
    from ``sys.modules`` (modules already bound to them keep what they hold). Real DeepSpeed, if
    installed, is what ``import deepspeed`` finds afterwards."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        if getattr(sys.modules[name], "__name__", "").startswith(TARGET):
            del sys.modules[name]
    importlib.invalidate_caches()


def switched_on(value: str | None) -> bool:
    """``ZFUNC_AS_DEEPSPEED``'s value read: on for 1 / true / yes / on, off for unset, empty, 0 /
    false / no / off (any case); anything else is an error, so a typo never silently leaves real
    DeepSpeed in place."""
    v = (value or "").strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ValueError(f"{ENV}={value!r}: set it to 1 to make `import deepspeed` zfunc's, or 0 / unset it for real "
                     "DeepSpeed")


def install_if_switched_on() -> None:
    """What the ``.pth`` hook calls at interpreter start: :func:`install` when ``ZFUNC_AS_DEEPSPEED``
    is on."""
    if switched_on(os.environ.get(ENV)):
        install()


def version() -> str:
    """``0.19.8+zfunc.<zfunc's version>``: DeepSpeed's API release, and that this is zfunc."""
    try:
        own = importlib.metadata.version("zfunc")
    except importlib.metadata.PackageNotFoundError:
        own = "0"
    return f"{DEEPSPEED_VERSION}+zfunc.{re.sub(r'[^A-Za-z0-9.]+', '.', own).strip('.')}"


# ------------------------------------------------------------------------- imports


class _Finder(importlib.abc.MetaPathFinder):
    """``deepspeed`` -> ``zfunc.deepspeed``, ``deepspeed.X`` -> ``zfunc.deepspeed.X``, and the
    ``deepspeed`` distribution's metadata."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        target_name = TARGET + fullname[len("deepspeed"):]
        if fullname == "deepspeed":
            # not imported here: transformers asks for this spec while it is itself being imported
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(target_name), is_package=True)
        try:
            found = importlib.util.find_spec(target_name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            raise ModuleNotFoundError(_missing(fullname), name=fullname)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(target_name),
                                              is_package=found.submodule_search_locations is not None)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name is None or re.sub(r"[-_.]+", "-", name).lower() == "deepspeed":
            yield _Distribution()


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deepspeed...`` as the zfunc module itself (the same object under both names)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        # the import system set __spec__ to the alias's; the module stays zfunc's under its own name
        own = getattr(module, "__loader__", None)
        module.__spec__ = importlib.util.spec_from_loader(self.target, own, origin=getattr(module, "__file__", None),
                                                          is_package=hasattr(module, "__path__"))
        if hasattr(module, "__path__") and module.__spec__ is not None:
            module.__spec__.submodule_search_locations = list(module.__path__)
            module.__spec__.has_location = getattr(module, "__file__", None) is not None


def _missing(fullname: str) -> str:
    return (f"No module named {fullname!r}: `import deepspeed` is zfunc's DeepSpeed face here ({ENV} or "
            f"zfunc.deepspeed.install()), which has no {TARGET}{fullname[len('deepspeed'):]}; DeepSpeed's "
            f"{fullname} is not supported by zfunc. docs/deepspeed.md lists the modules it offers; unset {ENV} "
            "to use real DeepSpeed")


# ------------------------------------------------------------------------ metadata


class _Distribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution as zfunc stands in for it (``importlib.metadata.version
    ("deepspeed")`` is :func:`version`)."""

    def read_text(self, filename):
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version()}\n"
                    "Summary: zfunc's DeepSpeed face (zfunc.deepspeed) standing in for DeepSpeed "
                    f"{DEEPSPEED_VERSION}'s API, switched on by zfunc.deepspeed.install() or {ENV}=1\n"
                    "Author: zfunc\nLicense: see zfunc\nRequires-Dist: zfunc\n")
        if filename == "top_level.txt":
            return "deepspeed\n"
        if filename == "INSTALLER":
            return "zfunc\n"
        return None

    def locate_file(self, path):
        spec = importlib.util.find_spec("zfunc")
        base = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else "."
        return pathlib.Path(base, "deepspeed", str(path))
