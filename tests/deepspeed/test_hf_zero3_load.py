"""transformers' ZeRO-3 loading path on zfunc: ``from_pretrained`` while a ZeRO-3 config is live
builds the model under ``deepspeed.zero.Init`` and writes each module's weights through
``GatheredParameters(params, modifier_rank=0)``; after ``deepspeed.initialize`` every tensor the
engine holds equals the file's, bit for bit, on every rank, and transformers reports nothing
missing (tests/harness/hf_zero3_load.py, W = 2 under torchrun)."""
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_trainer  # noqa: E402
import hf_zero3_load  # noqa: E402


def test_every_tensor_loads_bit_for_bit(tmp_path):
    folder = hf_trainer.save_model_folder(str(tmp_path / "model"))
    for rank, record in enumerate(hf_zero3_load.run("zfunc", folder, str(tmp_path / "out"), world=2)):
        assert record["missing"] == [], (rank, record["missing"])
        assert record["differ"] == [], (rank, record["differ"])
        assert sorted(record["compared"]) == record["files"], rank
