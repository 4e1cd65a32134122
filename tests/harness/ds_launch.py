"""Run a DeepSpeed training script as DeepSpeed's own launcher runs it, recording its losses.

    torchrun --nproc_per_node W ds_launch.py LOSSES SCRIPT [ARGS...]

- ``--local_rank=$LOCAL_RANK`` is appended to the script's arguments, as the ``deepspeed``
  launcher passes it (torchrun sets only the environment variable; DeepSpeed-Chat's scripts start
  the process group only when the flag is given);
- ``deepspeed.initialize`` is wrapped so that every loss the engine is handed
  (``engine.backward(loss)``) or returns (``engine.train_batch()``) is appended, as a number, to
  ``LOSSES.<rank>`` (one per line), whichever ``deepspeed`` this process imports: real DeepSpeed,
  or zfunc's under ``ZFUNC_AS_DEEPSPEED=1``;
- torch's generator is seeded (0) first, for scripts that never seed (DeepSpeedExamples' CIFAR
  script builds its model from torch's random default seed); a script's own seeding overrides it;
- the script runs as ``__main__`` with its folder first on ``sys.path``, as ``python SCRIPT`` would,
  and the process ends as the script leaves it (a script that leaves its process group open, as
  DeepSpeedExamples' CIFAR script does, exits with it open: zfunc.deepspeed frees its engines
  before the interpreter's teardown, which used to abort about one such W = 2 run in five).

The script itself is not touched.
"""
import os
import runpy
import sys


def _record(path: str):
    def write(value) -> None:
        with open(path, "a") as f:
            f.write(f"{float(value.detach().float()) if hasattr(value, 'detach') else float(value)!r}\n")
    return write


def _wrap_initialize(deepspeed, write) -> None:
    initialize = deepspeed.initialize

    def recorded_initialize(*args, **kwargs):
        out = initialize(*args, **kwargs)
        engine = out[0]
        backward, train_batch = getattr(engine, "backward", None), getattr(engine, "train_batch", None)
        if backward is not None:
            def recorded_backward(loss, *a, **k):
                write(loss)
                return backward(loss, *a, **k)
            engine.backward = recorded_backward
        if train_batch is not None:
            def recorded_train_batch(*a, **k):
                loss = train_batch(*a, **k)
                write(loss)
                return loss
            engine.train_batch = recorded_train_batch
        return out

    deepspeed.initialize = recorded_initialize


def main() -> None:
    losses, script, *args = sys.argv[1:]
    rank = os.environ.get("RANK", "0")
    import deepspeed
    _wrap_initialize(deepspeed, _record(f"{losses}.{rank}"))
    import torch
    torch.manual_seed(0)
    sys.argv = [script, *args, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
