"""Libraries that drive DeepSpeed themselves, run unchanged under real DeepSpeed or under zfunc: an
ordinary Accelerate training loop with its DeepSpeed plugin, TRL's ``SFTTrainer`` and Lightning's
``DeepSpeedStrategy``, each on the tiny Llama of tests/harness/hf_trainer.py.

``python tests/harness/ds_clients.py --client accelerate|trl|trl_dpo|trl_grpo|trl_reward|lightning|fabric --case JSON --out DIR``
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
import copy
import json
import os

import hf_trainer
import torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
LR, WEIGHT_DECAY, BATCH = 2e-3, 0.01, 2


def _model(folder: str, seen: dict, weights: bool = True):
    """The saved tiny Llama in fp32 (``weights=False``: built from its config, seed 0, as a module's
    ``configure_model`` builds it under ZeRO-3's ``zero.Init``, where ``from_pretrained`` fails under
    DeepSpeed too), its training losses recorded by a forward hook."""
    import torch
    import transformers
    torch.manual_seed(0)
    if weights:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        config = transformers.AutoConfig.from_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    def record(module, args, kwargs, output):
        if torch.is_grad_enabled() and getattr(output, "loss", None) is not None:
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


# ----------------------------------------------------------------------------- TRL


def tokenizer():
    """A word-level tokenizer over ``w0`` ... ``w92`` and three specials (96 ids: the tiny Llama's
    vocabulary), built here: nothing is downloaded."""
    import tokenizers
    import transformers
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(hf_trainer.LLAMA["vocab_size"] - 3)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def texts(n: int = 64, length: int = 15) -> list[str]:
    """``n`` random sentences of ``length`` words (seed 1), as a text data set holds them."""
    import torch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, hf_trainer.LLAMA["vocab_size"] - 3, (n, length), generator=g)
    return [" ".join(f"w{i}" for i in row.tolist()) for row in ids]


def _trl_arguments(case: dict, out: str, steps: int, bf16: bool = False, **extra) -> dict:
    """The training arguments every TRL case here gives its trainer's config: DeepSpeed's config, a
    linear warmup of one step, a log line every step, nothing saved, on the CPU processes."""
    return dict(output_dir=os.path.join(out, "run"), deepspeed=case["config"], per_device_train_batch_size=BATCH,
                gradient_accumulation_steps=case.get("gas", 1), max_steps=case.get("steps", steps), learning_rate=LR,
                warmup_steps=1, lr_scheduler_type="linear", weight_decay=WEIGHT_DECAY, max_grad_norm=1.0,
                logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, dataloader_num_workers=0,
                disable_tqdm=True, bf16=bf16, dataset_num_proc=None, **hf_trainer.cpu_processes(bf16), **extra)


def trl_sft(case: dict, out: str, seen: dict) -> None:
    """TRL's ``SFTTrainer`` with ``SFTConfig(deepspeed=...)`` on a text data set
    (``datasets.Dataset.from_dict``) that TRL tokenizes itself; the Trainer's logged ``grad_norm``,
    ``learning_rate`` and TRL's ``mean_token_accuracy`` per step."""
    import datasets
    import trl

    model = _model(case["model"], seen)
    bf16 = case.get("bf16", False)
    args = trl.SFTConfig(**_trl_arguments(case, out, 4, bf16, max_length=32, packing=False))
    trainer = trl.SFTTrainer(model=model, args=args, processing_class=tokenizer(),
                             train_dataset=datasets.Dataset.from_dict({"text": texts()}))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    for key in ("grad_norm", "learning_rate", "mean_token_accuracy"):
        seen[key] = [h[key] for h in logs]


def trl_dpo(case: dict, out: str, seen: dict) -> None:
    """TRL's ``DPOTrainer`` with ``DPOConfig(deepspeed=...)``: the policy trained, a second copy of the
    model as the reference, which TRL gives ``deepspeed.initialize`` without an optimizer (its
    ``prepare_deepspeed``: ZeRO-3 sharded, else stage 0) and runs in eval; a preference data set of
    prompts with a chosen and a rejected answer. The Trainer's logged ``loss``, ``grad_norm``,
    rewards and log-probabilities per step."""
    import datasets
    import trl

    model, ref = _model(case["model"], seen), _model(case["model"], {"losses": []})
    rows = texts(48, 12)
    data = {"prompt": [" ".join(t.split()[:4]) for t in rows[:16]],
            "chosen": [" ".join(t.split()[4:]) for t in rows[:16]],
            "rejected": [" ".join(t.split()[4:]) for t in rows[16:32]]}
    args = trl.DPOConfig(**_trl_arguments(case, out, 3, max_length=24))
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args, processing_class=tokenizer(),
                             train_dataset=datasets.Dataset.from_dict(data))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        seen[key.replace("/", "_")] = [h[key] for h in logs]


def trl_grpo(case: dict, out: str, seen: dict) -> None:
    """TRL's ``GRPOTrainer`` with ``GRPOConfig(deepspeed=...)``: each prompt's completions sampled by
    ``generate`` on the model the engine trains (TRL's ``unwrap_model_for_generation``), scored by a
    reward function, the policy stepped on the group-relative advantages; ``beta``: with a reference
    model (made by TRL's ``prepare_deepspeed``). The Trainer's logged loss, gradient norm and rewards."""
    import datasets
    import trl

    model = _model(case["model"], seen)
    prompts = [" ".join(t.split()[:4]) for t in texts(16, 4)]

    def reward(completions, **kwargs):  # more of the word w7 is better
        return [float(c.split().count("w7")) + 0.1 * len(c.split()) for c in completions]

    args = trl.GRPOConfig(
        output_dir=os.path.join(out, "run"), deepspeed=case["config"], per_device_train_batch_size=4,
        gradient_accumulation_steps=1, max_steps=case.get("steps", 3), learning_rate=LR, warmup_steps=0,
        lr_scheduler_type="constant", weight_decay=WEIGHT_DECAY, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        num_generations=4, max_completion_length=6, beta=case.get("beta", 0.0), bf16=False,
        **hf_trainer.cpu_processes(False))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tokenizer(),
                              train_dataset=datasets.Dataset.from_dict({"prompt": prompts}))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    for key in ("loss", "grad_norm", "reward"):
        seen[key] = [h[key] for h in logs]


def trl_reward(case: dict, out: str, seen: dict) -> None:
    """TRL's ``RewardTrainer``: the tiny Llama with a sequence-classification head (one score), trained
    on chosen and rejected answers; the Trainer's logged loss, gradient norm and accuracy."""
    import datasets
    import torch
    import transformers
    import trl

    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(case["model"], num_labels=1,
                                                                            dtype=torch.float32)
    model.config.pad_token_id = 0
    rows = texts(32, 8)
    data = {"chosen": rows[:16], "rejected": rows[16:]}
    args = trl.RewardConfig(**_trl_arguments(case, out, 3, max_length=16))
    trainer = trl.RewardTrainer(model=model, args=args, processing_class=tokenizer(),
                                train_dataset=datasets.Dataset.from_dict(data))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    for key in ("loss", "grad_norm", "accuracy"):
        seen[key] = [h[key] for h in logs if key in h]


# ----------------------------------------------------------------------------- Lightning


def _cpu_standing_in_for(cuda_accelerator):
    """``cuda_accelerator`` (Lightning's or Fabric's ``CUDAAccelerator`` class) placing everything on
    the CPU: each rank's device ``cpu`` (indexed: the strategy checks them), so the group is gloo."""
    import torch

    class CPUAsCUDA(cuda_accelerator):
        def setup_device(self, device):
            pass

        def setup(self, trainer):
            pass

        def get_device_stats(self, device):
            return {}

        def teardown(self):
            pass

        @staticmethod
        def parse_devices(devices):
            return int(devices)

        @staticmethod
        def get_parallel_devices(devices):
            return [torch.device("cpu", k) for k in range(int(devices))]

        @staticmethod
        def auto_device_count():
            return 1

        @staticmethod
        def is_available():
            return True

    return CPUAsCUDA()


def cpu_as_cuda():
    """Lightning's ``DeepSpeedStrategy`` refuses any accelerator that is not its ``CUDAAccelerator``
    ("The DeepSpeed strategy is only supported on CUDA GPUs", in ``setup_environment``), for real
    DeepSpeed and zfunc alike. On a machine without GPUs this accelerator passes that check and
    places everything on the CPU; the strategy, the precision plugin and the loop are Lightning's
    own, unchanged."""
    from lightning.pytorch.accelerators import CUDAAccelerator
    return _cpu_standing_in_for(CUDAAccelerator)


def lightning_fit(case: dict, out: str, seen: dict) -> None:
    """Lightning's ``Trainer(strategy=DeepSpeedStrategy(config=...))`` fitting a ``LightningModule``
    around the tiny Llama: AdamW and transformers' linear warmup scheduler from
    ``configure_optimizers`` (stepped by Lightning every step), ``accumulate_grad_batches``,
    ``gradient_clip_val``. On the CPU through ``cpu_as_cuda()``; ``cpu_accelerator``: Lightning's own
    ``"cpu"`` accelerator (which its DeepSpeed strategy refuses); ``resume_at``: a first Trainer fits
    that many steps and ``save_checkpoint``s, a new one fits on with ``ckpt_path=`` (``resumed_from``:
    how many losses the first recorded); ``callback``: that checkpoint written by Lightning's
    ``ModelCheckpoint`` callback every ``resume_at`` steps instead (``checkpoints``: the files it wrote);
    ``configure_model``: the model built from its config in the module's ``configure_model`` hook, which
    Lightning runs inside the strategy's ``zero.Init`` at ZeRO-3, not in ``__init__``."""
    import lightning.pytorch as pl
    import torch
    import transformers
    from lightning.pytorch.strategies import DeepSpeedStrategy

    steps, world = case.get("steps", 4), int(os.environ.get("WORLD_SIZE", 1))

    class Lit(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def configure_model(self):
            if self.model is None:  # Lightning calls it again on a resume: build once
                self.model = _model(case["model"], seen, weights=False)

        def training_step(self, batch, index):
            return self.model(**batch).loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 1, steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def fit(max_steps, ckpt_path=None):
        pl.seed_everything(0)
        module = Lit(None if case.get("configure_model") else _model(case["model"], seen))
        loader = torch.utils.data.DataLoader(hf_trainer.Tokens(), batch_size=BATCH, shuffle=True,
                                             generator=torch.Generator().manual_seed(2))
        callbacks = []
        if case.get("callback") and ckpt_path is None:
            from lightning.pytorch.callbacks import ModelCheckpoint
            callbacks = [ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), every_n_train_steps=resume_at,
                                         save_top_k=-1)]
        accelerator = "gpu" if torch.cuda.is_available() else "cpu" if case.get("cpu_accelerator") else cpu_as_cuda()
        trainer = pl.Trainer(accelerator=accelerator, devices=world, num_nodes=1,
                             strategy=DeepSpeedStrategy(config=copy.deepcopy(case["config"])), precision="32-true",
                             max_steps=max_steps, accumulate_grad_batches=case.get("gas", 1), gradient_clip_val=1.0,
                             logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer

    resume_at = case.get("resume_at")  # a first job's checkpoint after that many steps, resumed by a new job
    if resume_at:
        path = os.path.join(out, "lightning.ckpt")
        first = fit(resume_at)
        if case.get("callback"):
            path = first.checkpoint_callback.best_model_path
            seen["checkpoints"] = sorted(os.listdir(os.path.dirname(path)))
        else:
            first.save_checkpoint(path)
        seen["resumed_from"] = len(seen["losses"])
        trainer = fit(steps, ckpt_path=path)
    else:
        trainer = fit(steps)
    seen["lrs"] = [float(trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0])]


def fabric_cpu_as_cuda():
    """``cpu_as_cuda()`` for Lightning Fabric, whose ``DeepSpeedStrategy`` refuses any accelerator but
    its own ``CUDAAccelerator`` in the same way."""
    from lightning.fabric.accelerators import CUDAAccelerator
    return _cpu_standing_in_for(CUDAAccelerator)


def fabric_loop(case: dict, out: str, seen: dict) -> None:
    """Lightning Fabric with ``DeepSpeedStrategy(config=...)``: ``fabric.setup(model, optimizer)``
    (a torch AdamW), ``fabric.backward``, ``optimizer.step()``; with ``resume_at``: ``fabric.save`` of
    the model, optimizer and a step count after that many steps, then a fresh model and optimizer set
    up again and ``fabric.load``-ed, going on to ``steps``."""
    import lightning.fabric as lf
    import torch
    from lightning.fabric.strategies import DeepSpeedStrategy

    steps, world, resume_at = case.get("steps", 4), int(os.environ.get("WORLD_SIZE", 1)), case.get("resume_at")
    fabric = lf.Fabric(accelerator=fabric_cpu_as_cuda(), devices=world, precision="32-true",
                       strategy=DeepSpeedStrategy(config=copy.deepcopy(case["config"])))
    fabric.launch()
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(hf_trainer.Tokens(), batch_size=BATCH))
    batches = list(loader)[:steps]  # each rank its own (Fabric's distributed sampler)

    def setup():
        fabric.seed_everything(0)
        model = _model(case["model"], seen)
        return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))

    model, optimizer = setup()
    path = os.path.join(out, "fabric.ckpt")
    for i, batch in enumerate(batches):
        if resume_at and i == resume_at:
            fabric.save(path, {"model": model, "optimizer": optimizer, "step": i})
            model, optimizer = setup()
            state = {"model": model, "optimizer": optimizer, "step": 0}
            fabric.load(path, state)
            seen["resumed_step"] = state["step"]
        loss = model(**batch).loss
        fabric.backward(loss, model=model)
        optimizer.step()
        optimizer.zero_grad()


# ----------------------------------------------------------------------------- the launch

CLIENTS = {"accelerate": accelerate_loop, "trl": trl_sft, "trl_dpo": trl_dpo, "trl_grpo": trl_grpo,
           "trl_reward": trl_reward, "lightning": lightning_fit, "fabric": fabric_loop}


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
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "ZFUNC_AS_DEEPSPEED": "1" if which == "zfunc" else "0", "PYTHONPATH": os.pathsep.join(
               [HERE, os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")])}
    return torchrun.records(__file__, ["--client", client, "--case", json.dumps(case), "--out", out], out, world, env,
                            f"{client} on {which}", timeout)


if __name__ == "__main__":
    main()
