"""transformers' ``Trainer`` with ``--deepspeed`` on a tiny Llama, unchanged, under real DeepSpeed or
under zfunc: the script a test launches with torchrun (``run``), and what it saw.

``python tests/harness/hf_trainer.py --which zfunc|deepspeed --case JSON --out DIR`` (under
``torchrun --nproc_per_node W``) trains the model ``model_folder`` holds (built before the
``TrainingArguments``, so both runs start from the same weights) on a tiny random token data set,
with the case's DeepSpeed config, and writes ``DIR/rank{r}.json``: every micro-batch's loss as the
model computed it (a forward hook on the model: the Trainer itself is not touched), the Trainer's
logged ``grad_norm`` and ``learning_rate`` per step. ``save_steps``: checkpoints under
``DIR/run/checkpoint-N``; ``resume_from``: a checkpoint folder the Trainer resumes from (a run
of its own, as a resumed job is). ``save_model`` writes ``trainer.save_model`` to ``DIR/model``.

The switch: with ``--which zfunc``, ``zfunc.deepspeed.install()`` before transformers is imported.
"""
from __future__ import annotations

import argparse
import json
import os

import torchrun

HERE = os.path.dirname(os.path.abspath(__file__))

LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def ds_config(stage: int, *, offload: bool = False, bf16: bool = False, gather_on_save: bool = True,
              optimizer: bool = False, scheduler: bool = False) -> dict:
    """A DeepSpeed config as Trainer users write it ("auto" where the Trainer fills it)."""
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = gather_on_save
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "zero_optimization": zero, "bf16": {"enabled": "auto"}}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto", "torch_adam": True}}
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto", "total_num_steps": "auto"}}
    return cfg


def save_model_folder(folder: str) -> str:
    """A tiny random Llama written with ``save_pretrained`` (seed 0): what every run starts from."""
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model.save_pretrained(folder)
    return folder


class Tokens:
    """``n`` random sequences of ``length`` tokens (seed 1), labels the inputs: a causal LM data set."""

    def __init__(self, n: int = 64, length: int = 16, vocab: int = LLAMA["vocab_size"]):
        import torch
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def route(which: str) -> None:
    """Make ``import deepspeed`` give ``which`` ("deepspeed": the real one; "zfunc")."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if which == "zfunc":
        import zfunc.deepspeed
        zfunc.deepspeed.install()


def cpu_processes(bf16: bool) -> dict:
    """On a machine without GPUs accelerate does not take DeepSpeed's multi-process path by itself
    (it finds no device backend, so the Trainer would see one process): start its state with gloo
    first and have the Trainer use it (``accelerator_config``; returned, for ``TrainingArguments``),
    for both runs, as a GPU machine does with nccl by itself. bf16 on the CPU: ``use_cpu`` too
    (transformers refuses bf16 without a GPU otherwise)."""
    import torch
    if torch.cuda.is_available():
        return {}
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return {"use_cpu": True} if bf16 else {}
    from accelerate import PartialState
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return {"accelerator_config": {"use_configured_state": True}, **({"use_cpu": True} if bf16 else {})}


def _trainer(case: dict, out: str, model_folder: str, seen: dict, resume: str | None = None):
    import torch
    import transformers

    def arguments():
        return transformers.TrainingArguments(
            output_dir=out, deepspeed=case["config"], per_device_train_batch_size=2,
            gradient_accumulation_steps=case.get("gas", 1), max_steps=case.get("steps", 4), learning_rate=2e-3,
            warmup_steps=1, lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=1.0, logging_steps=1,
            save_strategy="steps" if case.get("save_steps") else "no", save_steps=case.get("save_steps") or 500,
            report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
            bf16=case.get("bf16", False), save_only_model=False, **cpu_processes(case.get("bf16", False)))

    # args_first: the TrainingArguments (a live ZeRO-3 config) before the model, so from_pretrained
    # takes transformers' ZeRO-3 path (zero.Init, GatheredParameters)
    args = arguments() if case.get("args_first") else None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    if case.get("lora"):
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0))

    def record(module, args, kwargs, output):
        if torch.is_grad_enabled() and getattr(output, "loss", None) is not None:
            seen["losses"].append(float(output.loss.detach().float()))
    model.register_forward_hook(record, with_kwargs=True)
    args = args or arguments()
    # evaluate: "only", the Trainer's evaluate() and no training (its engine made for inference: no
    # optimizer); "after", evaluate() after training (transformers' evaluate() before train() fails
    # under DeepSpeed itself: the training engine is then not made)
    evaluate = case.get("evaluate")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   eval_dataset=Tokens() if evaluate else None)
    if evaluate == "only":
        seen["eval_loss"] = trainer.evaluate()["eval_loss"]
        return trainer
    trainer.train(resume_from_checkpoint=resume)
    if evaluate == "after":
        seen["eval_loss"] = trainer.evaluate()["eval_loss"]
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    seen["grad_norms"] = [h["grad_norm"] for h in logs]
    seen["lrs"] = [h["learning_rate"] for h in logs]
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--which", required=True)
    parser.add_argument("--case", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    route(a.which)
    import torch
    torch.set_num_threads(1)
    case = json.loads(a.case)
    rank = int(os.environ.get("RANK", 0))
    seen: dict = {"losses": []}
    trainer = _trainer(case, os.path.join(a.out, "run"), case["model"], seen, resume=case.get("resume_from"))
    if case.get("save_model"):
        trainer.save_model(os.path.join(a.out, "model"))
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run(which: str, case: dict, out: str, world: int = 1, timeout: int = 600) -> list[dict]:
    """Launch the script under torchrun with ``world`` gloo ranks; each rank's record."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "ACCELERATE_USE_CPU": "false", "PYTHONPATH": os.pathsep.join(
               [os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")])}
    return torchrun.records(__file__, ["--which", which, "--case", json.dumps(case), "--out", out], out, world, env,
                            which, timeout)


if __name__ == "__main__":
    main()
