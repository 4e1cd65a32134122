"""examples/hf_trainer.py under torchrun: the Hugging Face Trainer with the example's DeepSpeed config
(ZeRO-3) trains on zfunc, its loss falls, and save_model's folder loads with from_pretrained (slow: the
Trainer's path is covered fast by test_hf_trainer's ZeRO-3 case)."""
import os
import subprocess
import sys

import pytest

import transformers  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)
import accelerate  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_trainer.py")


@pytest.mark.slow
def test_the_trainer_example_trains_on_zfunc_and_saves(tmp_path):
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", EXAMPLE,
           "--steps", "10", "--out", str(tmp_path / "out")]
    done = subprocess.run(run, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu"))
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("loss "))
    first, last = float(line.split()[1]), float(line.split()[3])
    assert last < first, line
    assert "saved and read back: 106816 parameters" in done.stdout, done.stdout[-2000:]
