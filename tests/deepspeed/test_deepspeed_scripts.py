"""DeepSpeed training scripts run with one import changed: each script in scripts/ is run as
written, under real DeepSpeed (CPU accelerator, gloo), and again with ``import deepspeed``
changed to ``import zfunc.deepspeed as deepspeed``; what rank 0 prints must agree: the same
lines, numbers equal to fp32 rounding (bf16: to its rounding). All in the slow tier (each run is
four fresh processes importing DeepSpeed); the fast tier's test_initialize and
test_engine_methods cover the same face in process."""
import os
import re
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]\d+)?|-?\d+")


def run_script(script: str, args: list[str], world: int, tmp_path, *, zfunc: bool) -> list[str]:
    """Rank 0's printed lines of ``script`` run on ``world`` processes by torchrun, in a folder of
    its own under ``tmp_path``."""
    path = os.path.join(SCRIPTS, script)
    if zfunc:
        with open(path) as f:
            text = f.read()
        assert text.count("\nimport deepspeed\n") == 1, "the script must import deepspeed on one line"
        path = str(tmp_path / f"zfunc_{script}")
        with open(path, "w") as f:
            f.write(text.replace("\nimport deepspeed\n", "\nimport zfunc.deepspeed as deepspeed\n"))
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), path, *args]
    cwd = tmp_path / ("zfunc" if zfunc else "deepspeed")  # each run's files apart
    cwd.mkdir(exist_ok=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(cwd))
    assert done.returncode == 0, f"{'zfunc' if zfunc else 'deepspeed'}: {done.stderr[-4000:]}"
    return [line for line in done.stdout.splitlines()  # not DeepSpeed's log lines nor its op builds
            if line and not line.startswith(("[20", "DeepSpeed "))]


def assert_same_output(ours: list[str], theirs: list[str], rtol: float, loose: dict | None = None) -> None:
    """The same lines; their numbers equal to ``rtol``, or on lines starting with a key of ``loose``
    to that absolute tolerance."""
    assert len(ours) == len(theirs), f"zfunc printed\n{ours}\nDeepSpeed printed\n{theirs}"
    for a, b in zip(ours, theirs):
        assert NUMBER.sub("#", a) == NUMBER.sub("#", b), f"zfunc: {a!r}, DeepSpeed: {b!r}"
        tol = next((t for start, t in (loose or {}).items() if a.startswith(start)), None)
        for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)):
            close = pytest.approx(float(y), abs=tol) if tol is not None else pytest.approx(float(y), rel=rtol, abs=rtol)
            assert float(x) == close, f"zfunc: {a!r}, DeepSpeed: {b!r}"


CIFAR_CASES = [
    pytest.param(["--stage", "3"], 2, 1e-5, id="zero3-W2", marks=pytest.mark.slow),
    pytest.param(["--stage", "0"], 1, 1e-5, id="zero0-W1", marks=pytest.mark.slow),
    pytest.param(["--stage", "1", "--gas", "2"], 2, 1e-5, id="zero1-gas2-W2", marks=pytest.mark.slow),
    pytest.param(["--stage", "2", "--batch", "12"], 3, 1e-5, id="zero2-W3", marks=pytest.mark.slow),
    pytest.param(["--stage", "3", "--dtype", "bf16"], 2, 2e-2, id="zero3-bf16-W2", marks=pytest.mark.slow),
]
# under bf16 DeepSpeed reduces gradients in bf16 and zfunc in fp32: the weights differ by rounding,
# and an evaluation's accuracy (whole test images of 32) may differ by an image or two
LOOSE = {"accuracy": 100 * 2 / 32}


@pytest.mark.parametrize("args,world,rtol", CIFAR_CASES)
def test_deepspeeds_cifar_example_runs_with_the_import_changed(args, world, rtol, tmp_path):
    """DeepSpeed's CIFAR-10 example loop: losses, the lr the returned optimizer shows, the
    evaluation's accuracy and the engine's counters, against real DeepSpeed's."""
    theirs = run_script("cifar_deepspeed.py", args, world, tmp_path, zfunc=False)
    ours = run_script("cifar_deepspeed.py", args, world, tmp_path, zfunc=True)
    assert any("loss" in line for line in theirs)
    assert_same_output(ours, theirs, rtol, LOOSE if "bf16" in args else None)


CAUSAL_LM_CASES = [
    pytest.param(["--family", "gpt2", "--stage", "3"], 2, id="gpt2-zero3-W2", marks=pytest.mark.slow),
    pytest.param(["--family", "llama", "--stage", "2"], 2, id="llama-zero2-W2", marks=pytest.mark.slow),
    pytest.param(["--family", "gpt2", "--stage", "1", "--gas", "1"], 1, id="gpt2-zero1-W1", marks=pytest.mark.slow),
    pytest.param(["--family", "llama", "--stage", "3", "--micro", "1"], 3, id="llama-zero3-W3", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("args,world", CAUSAL_LM_CASES)
def test_a_hugging_face_fine_tuning_script_runs_with_the_import_changed(args, world, tmp_path):
    """A causal LM fine-tuned with the client's AdamW over no-decay groups and transformers'
    warmup schedule: losses, both groups' lr and the scheduler's, the engine's sizes and counters,
    an evaluation, a gathered weight, the 16-bit model's file, and a checkpoint's client state and
    the step after loading it, against real DeepSpeed's."""
    theirs = run_script("causal_lm_deepspeed.py", args, world, tmp_path, zfunc=False)
    ours = run_script("causal_lm_deepspeed.py", args, world, tmp_path, zfunc=True)
    assert any(line.startswith("resumed loss") for line in theirs)
    assert_same_output(ours, theirs, 1e-5)
