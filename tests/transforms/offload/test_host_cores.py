"""offload_cpu(host_cores=): the update behind the next forward runs on cores of its own
(zfunc.transforms.offload.cores), leaving the rest to the thread that launches the device's work.

Checked: which cores each form of the knob picks, and its refusals; the worker thread (and the
OpenMP team its kernels start) pinned there with a thread a core while the caller keeps every core;
the pinned update bit for bit the unpinned one and the synchronous one, with the cores reported in
``metrics["offload"]``."""
import importlib
import os
import threading

import pytest
import torch

import zfunc as zf
from models import SeededNet

cores = importlib.import_module("zfunc.transforms.offload.cores")
linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning threads needs Linux")


def test_each_form_of_host_cores_picks_its_cores():
    sixteen = list(range(16))
    assert cores.resolve(None, sixteen) == list(range(15))  # all but the launcher's
    assert cores.resolve(None, [0, 1]) is None  # two cores: a pin would halve the update
    assert cores.resolve(4, sixteen) == [12, 13, 14, 15]
    assert cores.resolve([3, 1, 3], sixteen) == [1, 3]
    assert cores.resolve(1, [4, 9]) == [9]


@pytest.mark.parametrize("bad, match", [(0, "give 1 to 15"), (16, "give 1 to 15"), ([], "non-empty subset"),
                                        ([2, 40], r"\[40\] are not among them"), (True, "number of cores"),
                                        ("all", "number of cores"), (2.5, "number of cores")])
def test_host_cores_that_cannot_be_given_are_refused(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cores.resolve(bad, list(range(16)))


def test_host_cores_without_the_worker_is_refused():
    step = zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3))
    with pytest.raises(ValueError, match="host_cores pins the worker .* give overlap=True"):
        zf.offload_cpu(step, overlap=False, host_cores=1)


def _run(host_cores, overlap=True, steps=3):
    model = SeededNet()

    def loss_fn(params, b):
        return torch.nn.functional.mse_loss(zf.apply(model, params, b[0]), b[1])

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2), units=lambda name, m: isinstance(m, torch.nn.Sequential))
    step = zf.zero3(zf.offload_cpu(step, copy_grads_on_host=True, overlap=overlap, host_cores=host_cores))
    state = step.init(model)
    g = torch.Generator().manual_seed(0)
    losses, metrics = [], None
    for _ in range(steps):
        state, metrics = step(state, (torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)))
        losses.append(float(metrics["loss"]))
    params = [t.clone() for t in state.params.leaves]
    return step, losses, params, metrics


@linux
def test_the_worker_runs_pinned_with_a_thread_a_core_and_the_caller_keeps_every_core():
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("one core: nothing to split")
    threads = torch.get_num_threads()
    step, _, _, metrics = _run(host_cores=1)
    updates = next(t for t in step.transforms if t.name == "offload_cpu").overlap

    def seen():  # on the worker: its pin, its threads, and the pin of a thread it starts (OpenMP's are so made)
        child = {}
        t = threading.Thread(target=lambda: child.update(cores=sorted(os.sched_getaffinity(0))))
        t.start()
        t.join()
        return sorted(os.sched_getaffinity(0)), torch.get_num_threads(), child["cores"]

    assert updates.on_worker(seen) == ([mine[-1]], 1, [mine[-1]])
    assert sorted(os.sched_getaffinity(0)) == mine and torch.get_num_threads() == threads  # the caller's untouched
    assert metrics["offload"]["host_cores"] == [mine[-1]]


@linux
def test_the_pinned_update_is_bit_for_bit_the_unpinned_and_the_synchronous_one():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to split")
    _, pinned_losses, pinned, metrics = _run(host_cores=1)
    _, free_losses, free, _ = _run(host_cores=None)
    _, sync_losses, sync, _ = _run(host_cores=None, overlap=False)
    assert pinned_losses == free_losses == sync_losses
    for a, b, c in zip(pinned, free, sync):
        assert torch.equal(a, b) and torch.equal(a, c)
