"""Every process the tests launch (torchrun ranks, Accelerate's, spawned workers) starts with this
folder on PYTHONPATH (tests/conftest.py puts it there), so Python imports this at start-up.

It guards the reference runs (real DeepSpeed, Accelerate, Lightning) against a PyTorch race at exit
that zfunc's own processes already avoid (``zfunc.dist._settle_before_exit``): a gloo worker thread
drops its last reference to a finished collective's tensors after the caller's wait returned, which
takes the GIL; once the interpreter is finalizing, that thread exits through a noexcept destructor
and the process aborts ("terminate called without an active exception"). A collection and a pause
with the GIL free, at exit, let the worker finish first. Nothing here imports torch.
"""
import atexit
import gc
import importlib.machinery
import importlib.util
import os
import sys
import time


def _settle() -> None:
    gc.collect()
    if "torch.distributed" in sys.modules:  # its group may already be destroyed; its workers not done
        time.sleep(0.05)


def _chain() -> None:
    """Run the sitecustomize this one shadows, if the interpreter has one."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


atexit.register(_settle)
_chain()
