"""Real DeepSpeed training scripts run unchanged, once under real DeepSpeed and once under zfunc
(``ZFUNC_AS_DEEPSPEED=1``: ``import deepspeed`` is zfunc.deepspeed), through torchrun and
ds_launch.py (DeepSpeed's launcher's ``--local_rank``, and each rank's losses recorded).

``launch(...)`` returns rank 0's printed lines and every rank's losses; ``tiny_opt(folder)`` writes
the local model and tokenizer DeepSpeed-Chat's step 1 loads with ``from_pretrained``.
"""
from __future__ import annotations

import os
import subprocess
import sys

HARNESS = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(HARNESS), "deepspeed", "scripts")


def launch(script: str, args: list[str], world: int, folder, *, zfunc: bool, pythonpath: str | None = None,
           timeout: int = 900) -> tuple[list[str], list[list[float]]]:
    """Run ``script`` on ``world`` ranks in ``folder`` (made here); ``zfunc``: with the switch on.
    Returns (rank 0's stdout lines, each rank's losses in order)."""
    os.makedirs(folder, exist_ok=True)
    losses = os.path.join(folder, "losses")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore",
               ZFUNC_AS_DEEPSPEED="1" if zfunc else "0")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           os.path.join(HARNESS, "ds_launch.py"), losses, script, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(folder))
    assert done.returncode == 0, f"{'zfunc' if zfunc else 'deepspeed'}: {done.stderr[-6000:]}"
    per_rank = []
    for rank in range(world):
        with open(f"{losses}.{rank}") as f:
            per_rank.append([float(line) for line in f if line.strip()])
    return done.stdout.splitlines(), per_rank


def tiny_opt(folder) -> str:
    """A 2-layer OPT (hidden 32, random init, seed 0) and a word-level tokenizer of the words
    DeepSpeed-Chat's local data (scripts/deepspeed_chat) is made of, saved in ``folder`` for
    ``from_pretrained``; returns ``folder``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast

    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "green", "quick", "seven", "light",
             "paper", "north", "music", "table", "apple", "Human:", "Assistant:"]
    vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<unk>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(str(folder))
    # DeepSpeed-Chat's save_hf_format copies the tokenizer's ``vocab_file``, which transformers 5's
    # tokenizers backend sets only where a ``tokenizer.model`` exists: the word list goes there (never
    # read while tokenizer.json is beside it)
    with open(os.path.join(str(folder), "tokenizer.model"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=24, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=0, bos_token_id=1,
                       eos_token_id=1)
    OPTForCausalLM(config).save_pretrained(str(folder))
    return str(folder)
