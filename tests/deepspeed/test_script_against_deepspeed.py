"""A DeepSpeed-style training script run twice on the same ranks, once with ``import deepspeed``
(real DeepSpeed 0.19, CPU accelerator, gloo) and once with ``import zfunc.deepspeed as deepspeed``:
the same losses (fp32, to 1e-5), the same lr in the returned optimizer's ``param_groups`` and
scheduler, the same engine methods' values, the same 16-bit model file, the same fp32 weights read
back through ``deepspeed.utils.zero_to_fp32`` (its state_dict, its sharded safetensors files and
index, a fresh model loaded from it), and after
``load_checkpoint`` into a fresh engine the same client state and the same next losses; under
ZeRO stages 1 to 3, with and without gradient accumulation, at W = 1 and 2."""
import argparse
import importlib
import json
import os

import pytest
import torch
import torch.nn.functional as F

from deepspeed_script import Net, dataset, ds_config
from workers import fresh_workers

TOL = dict(rtol=1e-5, atol=1e-5)


def _engine(deepspeed, args):
    torch.manual_seed(0)
    model = Net()
    out = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), training_data=dataset())
    if hasattr(out[2], "num_local_io_workers"):  # DeepSpeed's loader: read in this (daemonic) worker, same samples
        out[2].num_local_io_workers = 0
    return out


def script(which: str, folder: str, stage: int, gas: int) -> dict:
    """The training script; ``which``: "deepspeed" or "zfunc.deepspeed". Returns what it saw."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    os.environ["LOCAL_RANK"] = str(rank)  # as the launcher sets it (DeepSpeed's engine requires it)
    deepspeed = importlib.import_module(which)
    folder = os.path.join(folder, which)
    os.makedirs(folder, exist_ok=True)
    config = os.path.join(folder, f"ds_config_{rank}.json")
    with open(config, "w") as f:
        json.dump(ds_config(stage, gas, world), f)
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", config])
    deepspeed.init_distributed(dist_backend="gloo")

    engine, optimizer, loader, scheduler = _engine(deepspeed, args)
    seen = {"losses": [], "lrs": [], "applied": [], "boundary": [], "norms": [], "last_lr": []}
    for x, y in loader:
        seen["boundary"].append(engine.is_gradient_accumulation_boundary())
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        seen["losses"].append(loss.item())
        seen["lrs"].append(optimizer.param_groups[0]["lr"])
        seen["last_lr"].append(scheduler.get_last_lr())
        seen["applied"].append(engine.was_step_applied())
        if engine.was_step_applied():
            seen["norms"].append(float(engine.get_global_grad_norm()))
    seen["methods"] = {
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "train_batch_size": engine.train_batch_size(),
        "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
        "zero_optimization_stage": engine.zero_optimization_stage(),
        "fp16_enabled": engine.fp16_enabled(), "bfloat16_enabled": engine.bfloat16_enabled(),
        "zero_offload_optimizer": engine.zero_offload_optimizer(),
        "global_rank": engine.global_rank, "local_rank": engine.local_rank, "world_size": engine.world_size,
        "dp_world_size": engine.dp_world_size, "device": str(engine.device),
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "get_lr": engine.get_lr(), "scheduler_state": scheduler.state_dict(), "loader_len": len(loader),
        "gradient_clipping": engine.gradient_clipping(),
    }
    checkpoints = os.path.join(folder, "checkpoints")
    engine.save_checkpoint(checkpoints, tag="t1", client_state={"epoch": 1, "note": "hello"})
    with open(os.path.join(checkpoints, "latest")) as f:
        seen["latest"] = f.read()
    seen["saved_16bit"] = engine.save_16bit_model(os.path.join(folder, "export"))
    if rank == 0:
        weights = torch.load(os.path.join(folder, "export", "pytorch_model.bin"))
        seen["weights"] = {k: v.clone() for k, v in weights.items()}
        seen.update(fp32_weights(importlib.import_module(f"{which}.utils.zero_to_fp32"), checkpoints, folder))
    torch.distributed.barrier()

    engine2, optimizer2, loader2, scheduler2 = _engine(deepspeed, args)
    path, client_state = engine2.load_checkpoint(checkpoints)
    seen["loaded"] = path is not None
    seen["client_state"] = {k: client_state[k] for k in ("epoch", "note")}
    seen["resumed"] = {"global_steps": engine2.global_steps, "lr": optimizer2.param_groups[0]["lr"],
                       "scheduler_state": scheduler2.state_dict()}
    seen["resumed_losses"] = []
    for i, (x, y) in enumerate(loader2):
        if i == 2 * gas:
            break
        loss = F.cross_entropy(engine2(x), y)
        engine2.backward(loss)
        engine2.step()
        seen["resumed_losses"].append(loss.item())
    return seen


def fp32_weights(zero_to_fp32, checkpoints: str, folder: str) -> dict:
    """What a script reads of a saved checkpoint through ``deepspeed.utils.zero_to_fp32``: the fp32
    state_dict, its files written in shards of 600 bytes as safetensors (names, index, tensors), and a
    fresh model loaded from it."""
    out = os.path.join(folder, "fp32")
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(checkpoints, out, max_shard_size=600,
                                                            safe_serialization=True)
    import safetensors.torch
    files = sorted(os.listdir(out))
    # cloned: a tensor safetensors maps from its file cannot go back through the workers' queue
    written = {k: v.clone() for name in files if name.endswith(".safetensors")
               for k, v in safetensors.torch.load_file(os.path.join(out, name)).items()}
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    torch.manual_seed(1)
    loaded = zero_to_fp32.load_state_dict_from_zero_checkpoint(Net(), checkpoints)
    fp32 = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoints)
    return {"fp32": {k: v.detach().clone() for k, v in fp32.items()}, "fp32_files": files,
            "fp32_written": written, "fp32_index": index, "fp32_loaded": {k: v.detach().clone()
                                                                           for k, v in loaded.state_dict().items()}}


def compare(ours: dict, theirs: dict) -> None:
    for key in ("losses", "lrs", "norms", "resumed_losses"):
        assert len(ours[key]) == len(theirs[key]), key
        torch.testing.assert_close(torch.tensor(ours[key]), torch.tensor(theirs[key]), **TOL, msg=key)
    torch.testing.assert_close(torch.tensor(ours["last_lr"]), torch.tensor(theirs["last_lr"]), **TOL)
    for key in ("applied", "boundary", "latest", "saved_16bit", "loaded", "client_state"):
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    m, t = dict(ours["methods"]), dict(theirs["methods"])
    assert (m.pop("zero_offload_optimizer") is None) == (t.pop("zero_offload_optimizer") is None)
    torch.testing.assert_close(torch.tensor(m.pop("get_lr")), torch.tensor(t.pop("get_lr")), **TOL)
    assert m == t
    r, s = dict(ours["resumed"]), dict(theirs["resumed"])
    assert r.pop("lr") == pytest.approx(s.pop("lr"), rel=1e-6)
    assert r == s
    if "fp32" in theirs:
        assert ours["fp32_files"] == theirs["fp32_files"] and ours["fp32_index"] == theirs["fp32_index"]
        for key in ("fp32", "fp32_written", "fp32_loaded"):
            assert list(ours[key]) == list(theirs[key]), key
            for k, t in theirs[key].items():
                assert ours[key][k].dtype == t.dtype == torch.float32, (key, k)
                torch.testing.assert_close(ours[key][k], t, **TOL, msg=f"{key} {k}")
    if "weights" in theirs:
        assert list(ours["weights"]) == list(theirs["weights"])
        for k in theirs["weights"]:
            assert ours["weights"][k].dtype == theirs["weights"][k].dtype, k
            torch.testing.assert_close(ours["weights"][k], theirs["weights"][k], **TOL, msg=k)


def run_both(world: int, stage: int, gas: int, tmp_path) -> None:
    # real DeepSpeed's ZeRO-3 patches torch globally (torch.nn.functional.linear) and leaves it so:
    # in fresh processes, closed after, so no later test of the shared workers runs on its patches
    with fresh_workers(world) as group:
        theirs = group.run(script, "deepspeed", str(tmp_path), stage, gas)
        ours = group.run(script, "zfunc.deepspeed", str(tmp_path), stage, gas)
    for rank in range(world):
        compare(ours[rank], theirs[rank])


# Real DeepSpeed's first engine in a process takes about 20 s (its import, its shm op's build): the
# slow tier; test_initialize.py's fast tests hold zfunc.deepspeed to zf.initialize's engine.
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage, gas", [(1, 1), (2, 2), (3, 1), (3, 2), (1, 3)])
def test_the_script_matches_deepspeed(world, stage, gas, tmp_path):
    run_both(world, stage, gas, tmp_path)


@pytest.mark.slow
def test_the_script_matches_deepspeed_on_three_ranks(tmp_path):
    run_both(3, 3, 2, tmp_path)
