"""What every benchmark worker (one peer in its own process) does alike: time its steps or a
phase (with the peak RSS it adds), count its disk traffic, and leave its result, with its peak
memory, where the driver reads it."""
import json
import os
import sys
import time

import torch

from zfunc.testing import memory


def timed_steps(train, batches, cuda: bool, warmup: int) -> tuple[list[float], list[float]]:
    """``train(batch)`` on each batch, timed to the device's end (synchronized on CUDA); a line
    a step. Returns the step times and the losses. A step whose update runs behind the next
    forward (zfunc's ``offload_cpu(overlap=True)``) is charged when the next one waits for it; the
    last step also waits for its own (``train.settle()``), so the times add up to the run's."""
    times, losses = [], []
    for i, batch in enumerate(batches):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train(batch)
        if i == len(batches) - 1:
            train.settle()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        print(f"step {i}{' (warm-up)' if i < warmup else ''}: {times[-1]:.3f} s, loss {losses[-1]:.5f}", flush=True)
    return times, losses


def disk_io_bytes() -> tuple[int, int]:
    """(read, written) bytes this process (all its threads) has moved to and from storage."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def measured(fn):
    """``fn()``, the seconds it took and the peak RSS it added to the process (the high-water mark,
    reset first, above the RSS before it)."""
    before = memory.rss()
    memory.reset_peak()
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start, memory.peak() - before


def finish(result_path: str, out: dict, cuda: bool) -> None:
    """Write ``out`` with the process's peak GPU memory and RSS (zfunc.testing.memory) to
    ``result_path`` and exit at once: no teardown, so a broken process group (DeepSpeed's,
    nccl's) cannot hang or crash the exit."""
    if cuda and torch.cuda.is_available():
        out["gpu_peak"] = memory.cuda_peak()
    out["rss_peak"] = memory.peak()
    with open(result_path, "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
