"""examples/rl_grpo.py: a GRPO-style loop, rollouts by a plain Hugging Face model refreshed through
zf.iter_weights every iteration while the trainer's state waits off the device; the mean reward
rises from chance, the same whether the state waits in a file, in host memory or stays."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "rl_grpo.py")


@pytest.mark.slow  # iter_weights and offload_states have their own fast tests
def test_the_rl_example_learns_here():
    """Run in this process at W = 1 (imports are most of a new process's time)."""
    spec = importlib.util.spec_from_file_location("rl_grpo", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    first, last = example.main(example.parser.parse_args(["--iterations", "40", "--offload", "nvme"]))
    assert first < 0.2 and last > first + 0.08, (first, last)  # chance is 1/8
    assert example.main(example.parser.parse_args(["--iterations", "40", "--offload", "none"])) == (first, last)


@pytest.mark.slow
def test_the_rl_example_under_torchrun_with_two_processes():
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", EXAMPLE,
           "--offload", "nvme"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"mean reward ([\d.]+) -> ([\d.]+) over 100 iterations .* W = 2", done.stdout)
    assert found, done.stdout[-2000:]
    first, last = map(float, found.groups())
    assert first < 0.2 and last > 0.5, (first, last)
