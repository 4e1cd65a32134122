"""One way to start a harness script under torchrun and collect what each rank wrote.

The script runs with ``world`` gloo ranks (``--standalone``) and writes ``OUT/rank{r}.json``; a
failed launch raises with the tail of its output, naming ``what`` ran.
"""
import json
import os
import subprocess
import sys


def records(script: str, args: list[str], out: str, world: int, env: dict, what: str,
            timeout: int = 600) -> list[dict]:
    """Run ``script args...`` under torchrun with ``world`` ranks in environment ``env``; each rank's
    ``OUT/rank{r}.json``."""
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           os.path.abspath(script), *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{what} at W = {world} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}")
    found = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            found.append(json.load(f))
    return found
