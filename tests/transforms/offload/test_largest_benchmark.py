"""benchmarks/gpu_largest.py (the largest Llama the machine holds, trained with its state on the host)
runs its whole code on the CPU with a tiny model: every update and tier, its table, its sizing."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_largest.py")


def run(*args):
    out = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", *args], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| 0.2M"))
    return [c.strip() for c in row.strip("|").split("|")]


@pytest.mark.slow
@pytest.mark.parametrize("args", [(), ("--update", "exact"), ("--tier", "nvme", "--update", "exact"), ("--compile",)],
                         ids=["delay", "exact", "nvme", "compiled"])
def test_the_largest_model_benchmark_trains_a_tiny_llama_on_the_cpu(args):
    row = run(*args)
    assert row[2] == ("exact" if "exact" in args else "delay")
    assert 5.0 < float(row[-1]) < 7.0  # ln(512) = 6.24: a random model's loss over the vocabulary


def test_the_largest_model_benchmark_refuses_delay_on_disk():
    out = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--tier", "nvme"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "give --update exact" in out.stderr
