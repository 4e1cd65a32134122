"""A DeepSpeed fine-tuning script for a Hugging Face causal LM, laid out as DeepSpeed users
write them (DeepSpeed-Chat's supervised step, the Hugging Face examples' no-trainer loops),
offline: a tiny GPT-2 or Llama from a config, on synthetic tokens.

Its parts: the model built (with ``--zero_init``) inside ``deepspeed.zero.Init``, the client's
``torch.optim.AdamW`` over "no decay" parameter groups and transformers' linear warmup schedule,
``initialize`` returning the four values, gradient accumulation with ``engine.backward`` /
``engine.step``, the lr read back through the optimizer, an evaluation in ``engine.eval()``,
``GatheredParameters`` to read a weight, ``save_checkpoint`` with ``client_state`` and
``load_checkpoint`` into a fresh engine, and ``save_16bit_model``. Runs unchanged under real
DeepSpeed; the tests run it again with ``import zfunc.deepspeed as deepspeed``. (DeepSpeed
0.19.8's ``zero.Init`` cannot build transformers 5's models: it fails in ``from_config`` and
leaves the weights of a model class built directly at their empty values, so ``--zero_init``
is compared with zfunc's own run without it.)
"""
import argparse
import os

import torch
import transformers

import deepspeed


def parse_args():
    parser = argparse.ArgumentParser(description="causal LM fine-tuning")
    parser.add_argument("--family", default="gpt2", choices=["gpt2", "llama"])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--micro", type=int, default=2, help="sequences per rank per micro-batch")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--out", default="out")
    parser.add_argument("--zero_init", action="store_true", help="build the model inside deepspeed.zero.Init")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def config_for(family: str):
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    return transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def parameter_groups(model, weight_decay: float) -> list[dict]:
    no_decay = ("bias", "norm", "ln_")
    decay, rest = [], []
    for name, p in model.named_parameters():
        (rest if any(k in name.lower() for k in no_decay) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def build(args, ds_config):
    config = config_for(args.family)
    model_class = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[args.family]
    with deepspeed.zero.Init(enabled=args.zero_init):
        torch.manual_seed(0)
        model = model_class(config)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=2e-3, betas=(0.9, 0.95))
    total = args.steps
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=total)
    engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                                           lr_scheduler=scheduler, config=ds_config)
    return model, engine, optimizer, scheduler


def batches(args, rank: int, n: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 128, (args.micro, args.seq), generator=g) for _ in range(n)]


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    ds_config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
                 "gradient_clipping": 1.0,
                 "zero_optimization": {"stage": args.stage, "stage3_gather_16bit_weights_on_model_save": True}}
    model, engine, optimizer, scheduler = build(args, ds_config)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"train_batch_size {engine.train_batch_size()} gas {engine.gradient_accumulation_steps()} "
        f"micro {engine.train_micro_batch_size_per_gpu()} stage {engine.zero_optimization_stage()} world {world}")

    engine.train()
    for i, ids in enumerate(batches(args, rank, args.steps * args.gas)):
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            say(f"step {engine.global_steps} loss {loss.item():.6f} lr {optimizer.param_groups[0]['lr']:.6e} "
                f"lr_no_decay {optimizer.param_groups[1]['lr']:.6e} last_lr {scheduler.get_last_lr()[0]:.6e} "
                f"applied {engine.was_step_applied()}", flush=True)

    engine.eval()
    with torch.no_grad():
        ids = batches(args, 0, 1)[0].to(engine.device)
        say(f"eval loss {engine(input_ids=ids, labels=ids).loss.item():.6f}", flush=True)

    first = next(p for n, p in model.named_parameters() if n.endswith("wte.weight") or n.endswith("embed_tokens.weight"))
    with deepspeed.zero.GatheredParameters([first], modifier_rank=None):
        say(f"embedding sum {first.detach().float().sum().item():.6f} shape {tuple(first.shape)}", flush=True)

    engine.train()
    ckpt = os.path.join(args.out, "ckpt")
    engine.save_checkpoint(ckpt, client_state={"epoch": 3, "note": "client"})
    engine.save_16bit_model(os.path.join(args.out, "fp16"))
    if rank == 0:
        saved = torch.load(os.path.join(args.out, "fp16", "pytorch_model.bin"), map_location="cpu")
        total = sum(t.double().sum().item() for t in saved.values())
        say(f"16-bit files {sorted(os.listdir(os.path.join(args.out, 'fp16')))} tensors {len(saved)} "
            f"dtype {next(iter(saved.values())).dtype} sum {total:.5f}", flush=True)

    _, fresh, _, _ = build(args, ds_config)
    path, client_state = fresh.load_checkpoint(ckpt)
    say(f"loaded {path is not None} client {client_state['epoch']} "
        f"{client_state['note']} steps {fresh.global_steps}", flush=True)
    ids = batches(args, 1000 + rank, 1)[0].to(fresh.device)
    loss = fresh(input_ids=ids, labels=ids).loss
    fresh.backward(loss)
    fresh.step()
    say(f"resumed loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
