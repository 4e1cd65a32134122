"""examples/hf_lora.py: LoRA from a local folder under zero3, generation through zf.bind, the adapter
saved with save_hf and reloaded with peft, equal to the trained state."""
import importlib.util
import os
import subprocess
import sys
import tempfile

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_lora.py")
QUICK = ["--steps", "2", "--generate-every", "2", "--new-tokens", "3", "--mb", "0.1", "--seq", "16", "--batch", "2"]


def test_the_lora_example_trains_generates_saves_and_reloads(tmp_path, monkeypatch, capsys):
    """Run here, not in a new process (imports are most of its time): a random Llama written with
    save_pretrained, LoRA on the meta-built model, two zero3 steps generating after the second, the adapter
    and the merged model written and loaded back by peft and transformers, equal to the trained state."""
    spec = importlib.util.spec_from_file_location("hf_lora", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    verdict = example.main(example.parser.parse_args(QUICK + ["--out", str(tmp_path / "adapter"),
                                                              "--merged", str(tmp_path / "merged")]))
    err = capsys.readouterr().err
    assert "step 2: loss" in err and "'def main(' -> " in err
    assert "logits equal to the trained state's, greedy tokens equal" in verdict, verdict
    assert "the merged model: logits equal to 1e-4" in verdict, verdict
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.slow
def test_the_lora_example_under_torchrun_with_two_processes(tmp_path):
    """examples/hf_lora.py under torchrun --nproc_per_node 2: each rank reads its part of the base, both
    generate, rank 0 writes the adapter and checks it."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", EXAMPLE, *QUICK,
           "--out", str(tmp_path / "adapter")]
    done = subprocess.run(run, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on 2 rank(s)" in done.stderr and "step 2: loss" in done.stderr
    assert "logits equal to the trained state's, greedy tokens equal" in done.stderr, done.stderr[-3000:]
