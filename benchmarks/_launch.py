"""Run one script as W fresh processes on localhost with torchrun's environment variables.

``gpt_args``: the command line of the benchmarks that run examples/gpt.py's GPT in each of their
peers' fresh processes (muon.py, hybrid.py).

torchrun would do, but it adds an agent process and its own logging; benchmarks want
nothing but W workers whose peak RSS is theirs alone, and a clean failure when one dies.
A benchmark script is both: the driver, and, started again by it with --worker, each worker
(``driver_or_worker``).
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv, world_size, env=None, timeout=None, **popen_kw):
    """Start `python *argv` on ranks 0..W-1 and wait. If one rank fails or the timeout
    passes, the others are killed. Returns the exit codes, rank by rank. popen_kw go to
    subprocess.Popen (e.g. stdout=, stderr= to keep each rank's output in a file)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = dict(os.environ, **(env or {}), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, **popen_kw))
    deadline = None if timeout is None else time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = any(p.poll() not in (None, 0) for p in procs)
        late = deadline is not None and time.monotonic() > deadline
        if failed or late:
            if late:
                print(f"launch: timed out after {timeout} s, killing {argv}", file=sys.stderr)
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    return [p.wait() for p in procs]


def driver_or_worker(parse_args, main, worker):
    """A benchmark script's entry: parse its command line, then run as the driver (``main``), or as
    one of the processes the driver launched (``worker``: the command line has --worker)."""
    args = parse_args()
    (worker if args.worker else main)(args)


def each_in_fresh_processes(names, script: str, argv, world: int, env=None, timeout=None) -> dict:
    """Run ``script`` once per name in ``names`` on ``world`` fresh processes, with ``argv`` and
    ``--worker NAME,OUT``; rank 0 leaves its result as JSON in OUT. Returns ``{name: result}``;
    exits naming the one whose rank failed."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = os.path.join(tmp, f"{name}.json")
            codes = launch([os.path.abspath(script), *argv, "--worker", f"{name},{out}"], world, env=env,
                           timeout=timeout)
            if any(codes):
                sys.exit(f"{name}: a rank failed: exit codes {codes}")
            with open(out) as f:
                rows[name] = json.load(f)
    return rows


def gpt_args(p, peers, timeout: float, extra=()):
    """``p`` (an ``argparse`` parser) given the GPT's shape, the step counts, ``--peers`` (of
    ``peers``), ``--json``, ``--small`` (a tiny model, 2 steps after 1) and the workers' ``--worker``;
    ``extra``: ``(flag, kwargs)`` pairs added too. Returns the parsed arguments, ``peers`` a list."""
    import argparse
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256, help="d_model")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    for flag, kwargs in extra:
        p.add_argument(flag, **kwargs)
    p.add_argument("--peers", default=",".join(peers))
    p.add_argument("--timeout", type=float, default=timeout, help="seconds per peer before its processes are killed")
    p.add_argument("--json", default=None, help="also write every peer's raw result here")
    p.add_argument("--small", action="store_true", help="a tiny model and 2 steps, for smoke testing")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.layers, args.width, args.vocab, args.seq, args.steps, args.warmup = 2, 64, 256, 16, 2, 1
    args.peers = args.peers.split(",")
    for peer in args.peers:
        if peer not in peers and not args.worker:
            p.error(f"unknown peer {peer!r}; choose from {', '.join(peers)}")
    return args
