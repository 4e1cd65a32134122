"""Libraries that drive DeepSpeed themselves, run unchanged under real DeepSpeed or under zfunc: an
ordinary Accelerate training loop with its DeepSpeed plugin, TRL's ``SFTTrainer`` and Lightning's
``DeepSpeedStrategy``, each on the tiny Llama of tests/harness/hf_trainer.py.

``python tests/harness/ds_clients.py --client accelerate|trl|lightning --case JSON --out DIR``
(under ``torchrun --nproc_per_node W``) writes ``DIR/rank{r}.json``: every micro-batch's training
loss as the model computed it (a forward hook on the model: the library is not touched), and what
the client's case reads back (Accelerate: the losses of the steps after a ``load_state``, and
``get_state_dict``'s tensors in ``DIR/state_dict.pt`` on rank 0).

The switch is the environment only: ``run("zfunc", ...)`` starts the ranks with
``ZFUNC_AS_DEEPSPEED=1`` (the ``.pth`` hook makes ``import deepspeed`` zfunc's at interpreter
start), ``run("deepspeed", ...)`` with it off. Nothing in the script names zfunc.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import hf_trainer

HERE = os.path.dirname(os.path.abspath(__file__))
LR, WEIGHT_DECAY, BATCH = 2e-3, 0.01, 2


def _model(folder: str, seen: dict):
    """The saved tiny Llama in fp32, its training losses recorded by a forward hook."""
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def record(module, args, kwargs, output):
        if module.training and torch.is_grad_enabled() and getattr(output, "loss", None) is not None:
            seen["losses"].append(float(output.loss.detach().float()))
    model.register_forward_hook(record, with_kwargs=True)
    return model


# ----------------------------------------------------------------------------- Accelerate


def accelerate_loop(case: dict, out: str, seen: dict) -> None:
    """Accelerate's own loop: ``prepare(model, optimizer, dataloader, scheduler)``, ``accumulate``,
    ``backward``, ``optimizer.step()``, ``lr_scheduler.step()``, ``optimizer.zero_grad()``; then
    ``unwrap_model`` / ``get_state_dict``, and with ``resume_at``: ``save_state`` after that many
    updates, and at the end ``load_state`` and the following updates again."""
    import torch
    import transformers
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import DummyOptim, DummyScheduler, InitProcessGroupKwargs

    gas, steps = case.get("gas", 1), case.get("steps", 4)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=case["config"]),
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])  # gloo: on CPUs
    model = _model(case["model"], seen)
    if "optimizer" in case["config"]:
        optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        scheduler = DummyScheduler(optimizer, total_num_steps=steps * accelerator.num_processes, warmup_num_steps=1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 1, steps)
    loader = torch.utils.data.DataLoader(hf_trainer.Tokens(), batch_size=BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    batches = list(loader)[:steps * gas]

    def train(part):
        model.train()
        for batch in part:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    resume_at = case.get("resume_at")
    if resume_at:
        train(batches[:resume_at * gas])
        accelerator.save_state(os.path.join(out, "state"))
        train(batches[resume_at * gas:])
    else:
        train(batches)
    seen["lrs"] = [float(scheduler.get_last_lr()[0])]
    unwrapped = accelerator.unwrap_model(model)
    seen["unwrapped"] = type(unwrapped).__name__
    state = accelerator.get_state_dict(model)  # every rank calls it (ZeRO-3 gathers)
    if accelerator.is_main_process:
        torch.save({k: v.detach().float().clone() for k, v in state.items()}, os.path.join(out, "state_dict.pt"))
    if resume_at:
        accelerator.load_state(os.path.join(out, "state"))
        done = len(seen["losses"])
        train(batches[resume_at * gas:])
        seen["resumed"] = seen["losses"][done:]
        del seen["losses"][done:]
    accelerator.wait_for_everyone()


# ----------------------------------------------------------------------------- the launch

CLIENTS = {"accelerate": accelerate_loop}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--client", required=True, choices=sorted(CLIENTS))
    parser.add_argument("--case", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    import torch
    torch.set_num_threads(1)
    case = json.loads(a.case)
    seen: dict = {"losses": []}
    CLIENTS[a.client](case, a.out, seen)
    import deepspeed
    seen["deepspeed"] = deepspeed.__version__
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run(which: str, client: str, case: dict, out: str, world: int = 1, timeout: int = 600) -> list[dict]:
    """Launch ``client``'s script under torchrun with ``world`` gloo ranks, ``import deepspeed``
    being ``which`` ("zfunc": ``ZFUNC_AS_DEEPSPEED=1``; "deepspeed": the real one); each rank's record."""
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "ZFUNC_AS_DEEPSPEED": "1" if which == "zfunc" else "0", "PYTHONPATH": os.pathsep.join(
               [HERE, os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           os.path.abspath(__file__), "--client", client, "--case", json.dumps(case), "--out", out]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{client} on {which} at W = {world} failed ({p.returncode}):\n{p.stdout[-4000:]}\n"
                             f"{p.stderr[-8000:]}")
    records = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            records.append(json.load(f))
    return records


if __name__ == "__main__":
    main()
