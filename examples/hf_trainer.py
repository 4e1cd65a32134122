"""Fine-tune a tiny Llama with the Hugging Face Trainer and a DeepSpeed config, on zfunc.

    torchrun --standalone --nproc_per_node 1 examples/hf_trainer.py       # ZeRO-3 on zfunc, one process
    torchrun --standalone --nproc_per_node 1 examples/hf_trainer.py --deepspeed my_ds.json --steps 100
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py       # on GPUs (nccl)

As under DeepSpeed, the Trainer with ``--deepspeed`` wants a launcher (torchrun, ``deepspeed``,
``accelerate launch``), whose environment starts the process group.

This is an ordinary Trainer script: a model, a data set, TrainingArguments(deepspeed=...). The one
line marked below makes ``import deepspeed`` (which transformers and accelerate do) give zfunc;
without editing a script, ``ZFUNC_AS_DEEPSPEED=1 python your_script.py --deepspeed ds.json`` does the
same (docs/deepspeed.md, "From the Hugging Face Trainer"). The model is built from a small config
(no download) and learns bytes of the Python standard library's source; the trained model is saved
with ``trainer.save_model`` and read back with ``from_pretrained``. Runs in well under a minute on a
CPU. Needs ``pip install transformers accelerate``.
"""
import argparse
import os
import sys

import zfunc.deepspeed

zfunc.deepspeed.install()  # the one line: from here on `import deepspeed` is zfunc.deepspeed

import torch  # noqa: E402
import transformers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpt import stdlib_corpus  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--deepspeed", default=os.path.join(HERE, "ds_config_trainer.json"))
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--out", default="hf_trainer_out")
parser.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it


class Windows(torch.utils.data.Dataset):
    """Windows of ``seq`` bytes; the Llama predicts each next byte (labels are the inputs: the model shifts them)."""

    def __init__(self, data: torch.Tensor, seq: int):
        self.data, self.seq = data, seq

    def __len__(self):
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i):
        ids = self.data[i * self.seq: (i + 1) * self.seq].long()
        return {"input_ids": ids, "labels": ids.clone()}


def main():
    a = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=a.seq)
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=a.out, deepspeed=a.deepspeed, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        max_steps=a.steps, learning_rate=3e-3, warmup_steps=3, lr_scheduler_type="cosine", logging_steps=5,
        save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Windows(stdlib_corpus(0.5), a.seq))
    result = trainer.train()
    trainer.save_model(a.out)  # under ZeRO-3: the gathered 16-bit weights (stage3_gather_16bit_weights_on_model_save)
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {result.global_step} steps")
        # the Trainer's ZeRO-3 config is still live, so from_pretrained loads under zero.Init as DeepSpeed's
        # does: each parameter partitioned, its size in ds_numel
        again = transformers.AutoModelForCausalLM.from_pretrained(a.out)
        count = sum(getattr(p, "ds_numel", p.numel()) for p in again.parameters())
        print(f"saved and read back: {count} parameters from {a.out}")


if __name__ == "__main__":
    main()
