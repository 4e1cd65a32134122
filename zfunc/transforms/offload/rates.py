"""What this machine does per second for offload: the host's Adam, the device's Adam, the copies
between them and the disk under the swap files. Measured once per machine and cached, so the offload planner
(``zfunc.transforms.offload.plan``) and each step's roofline work from this machine's figures, not guesses."""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

INF = float("inf")


@dataclass(frozen=True)
class Rates:
    """Per second: ``host_update`` and ``device_update`` parameters of the fused Adam under mixed
    precision (fp32 master and moments, bf16 gradient and copy) on the host and on the device
    (``inf`` where the device is the host), ``pcie`` bytes each way between pinned host memory and
    the device (``inf`` likewise); ``machine`` names where they were measured."""

    host_update: float
    device_update: float = INF
    pcie: float = INF
    machine: str = ""

    def to_dict(self) -> dict:
        return {k: (None if v == INF else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Rates":
        return cls(**{k: (INF if v is None else v) for k, v in d.items()})


def machine_key(device: torch.device) -> str:
    """The cache's key: the host, its cores, torch and the device measured against."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{platform.node()}|{os.cpu_count()}|torch {torch.__version__}|{name}"


def cache_path() -> Path:
    """``$ZFUNC_CACHE_DIR/rates.json`` (default ``~/.cache/zfunc``)."""
    root = os.environ.get("ZFUNC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "zfunc")
    return Path(root) / "rates.json"


def measure(device=None, *, numel: int = 1 << 24, cache: bool = True) -> Rates:
    """This machine's ``Rates`` against ``device`` (default: the current CUDA device, else the
    CPU), read from the cache when it holds them, else measured (a few seconds) and written there."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    key = machine_key(device)
    path = cache_path()
    known = _read(path) if cache else {}
    if key in known:
        return Rates.from_dict(known[key])
    host = _adam_rate(torch.device("cpu"), numel)
    rates = Rates(host, INF, INF, key) if device.type == "cpu" else Rates(
        host, _adam_rate(device, numel), _copy_rate(device, numel * 4), key)
    if cache:
        _remember(key, rates.to_dict())
    return rates


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _best_of(fn, rounds: int, sync) -> float:
    fn()  # warm up (kernel builds, first touches)
    sync()
    best = INF
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _adam_rate(device: torch.device, numel: int) -> float:
    from ...ops.adam import adam_update_

    p = torch.randn(numel, device=device)
    g = torch.randn(numel, device=device).to(torch.bfloat16)
    m, v, low = torch.zeros_like(p), torch.zeros_like(p), torch.empty(numel, dtype=torch.bfloat16, device=device)
    run = lambda: adam_update_([p], [g], [m], [v], step=1, lr=1e-3, beta1=0.9, beta2=0.999,  # noqa: E731
                               eps=1e-8, weight_decay=0.01, decoupled=True, lowp_params=[low])
    return numel / _best_of(run, 3, _sync(device))


def _copy_rate(device: torch.device, nbytes: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    both = lambda: (dev.copy_(host, non_blocking=True), host.copy_(dev, non_blocking=True))  # noqa: E731
    return 2 * nbytes / _best_of(both, 3, _sync(device))


def _sync(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def disk_key(path) -> str:
    """The cache's key for the disk holding ``path``: this machine and the file system's device."""
    return f"{machine_key(torch.device('cpu'))}|disk {os.stat(path).st_dev}"


def cached_disk(path) -> tuple[float, float] | None:
    """(read, write) bytes a second of the disk holding ``path`` if ``measure_disk`` cached them;
    never measures (a step must not write hundreds of MiB to learn it)."""
    d = _read(cache_path()).get(disk_key(path))
    return None if d is None else (d["read"], d["write"])


def measure_disk(path, *, nbytes: int = 256 << 20, cache: bool = True, refresh: bool = False) -> tuple[float, float]:
    """(read, write) bytes a second of the disk holding ``path``, through zfunc's own asynchronous
    I/O (O_DIRECT, the swap files' path): a file of ``nbytes`` written with fsync, then read; cached
    per machine and disk (``refresh``: measured again all the same), the file removed."""
    from ...ops.aio import AsyncIO, aligned_empty, check_free_space

    os.makedirs(path, exist_ok=True)
    key = disk_key(path)
    known = _read(cache_path()) if cache and not refresh else {}
    if key in known:
        return known[key]["read"], known[key]["write"]
    check_free_space(path, nbytes)
    buf = aligned_empty(nbytes)
    buf.fill_(1)
    io, name = AsyncIO(), os.path.join(path, f".zfunc_rates.{os.getpid()}")
    try:
        t0 = time.perf_counter()
        io.pwrite(buf, name, fsync=True)
        io.wait()
        write = nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        io.pread(buf, name)
        io.wait()
        read = nbytes / (time.perf_counter() - t0)
    finally:
        io.close()
        if os.path.exists(name):
            os.remove(name)
    if cache:
        _remember(key, {"read": read, "write": write})
    return read, write


def _remember(key: str, value: dict) -> None:
    """Add ``key`` to the cache beside what others wrote meanwhile, atomically: a reader never sees
    half a file."""
    known = _read(cache_path())
    known[key] = value
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, path)
