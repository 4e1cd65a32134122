"""One Hugging Face Trainer fine-tuning run, unchanged, under real DeepSpeed ZeRO-3 and under zfunc
(``zfunc.deepspeed.install()``), W = 2 gloo ranks under torchrun, one thread each: the step time,
the peak RSS of each rank, and the losses side by side.

    python benchmarks/hf_trainer.py                 # a 31.6M-parameter Llama (10 x 512, vocabulary 4096)
    python benchmarks/hf_trainer.py --small         # smoke test

Both runs train the same model (built with seed 0 before the ``TrainingArguments``, so both start
from the same weights) on the same random tokens, with the same config (ZeRO-3, the Trainer's
AdamW and linear schedule, "auto" batch keys), in fresh processes. Step time: the median over the
steps after the first two of the slowest rank's time from ``on_step_begin`` to ``on_step_end``
(a Trainer callback). Peak RSS: each rank's high-water mark over the whole run (imports, the
model, initialize, training), and its growth over the RSS just before the Trainer was made.
Losses: each micro-batch's as the model computed it (a forward hook), rank 0's.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.layers, a.width, a.vocab, a.seq, a.batch = (2, 64, 256, 32, 2) if a.small else (10, 512, 4096, 128, 4)
    a.steps = a.steps or (4 if a.small else 12)
    return a


def _rss_mib(peak: bool = False) -> float:
    if peak:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(a) -> None:
    """One rank of one run (under torchrun)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if a.worker == "zfunc":
        import zfunc.deepspeed
        zfunc.deepspeed.install()
    import torch
    import transformers
    from accelerate import PartialState

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # on CPUs accelerate takes DeepSpeed's multi-process path
    PartialState(backend="gloo")                     # only when started so (a GPU machine does it with nccl)
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.width, intermediate_size=a.width * 11 // 4,
                                   num_hidden_layers=a.layers, num_attention_heads=max(1, a.width // 64),
                                   num_key_value_heads=max(1, a.width // 128), max_position_embeddings=a.seq,
                                   tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch * a.world * a.steps, a.seq), generator=g)
    data = [{"input_ids": x, "labels": x.clone()} for x in ids]
    losses, times = [], []
    model.register_forward_hook(
        lambda m, args, kw, out: losses.append(float(out.loss.detach())) if torch.is_grad_enabled() else None,
        with_kwargs=True)

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - self.t)

    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    args = transformers.TrainingArguments(
        output_dir=a.out, deepspeed=config, per_device_train_batch_size=a.batch, max_steps=a.steps,
        learning_rate=1e-3, warmup_steps=2, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        seed=0, dataloader_num_workers=0, accelerator_config={"use_configured_state": True})
    before = _rss_mib()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()])
    trainer.train()
    record = {"times": times, "losses": losses, "peak_mib": _rss_mib(peak=True), "before_mib": before,
              "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())}
    with open(os.path.join(a.out, f"{a.worker}_rank{rank}.json"), "w") as f:
        json.dump(record, f)


def launch(which: str, a, out: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.world}",
           os.path.abspath(__file__), "--worker", which, "--out", out, "--world", str(a.world)]
    cmd += ["--small"] if a.small else []
    cmd += ["--steps", str(a.steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{which} failed:\n{done.stderr[-6000:]}")
    runs = []
    for r in range(a.world):
        with open(os.path.join(out, f"{which}_rank{r}.json")) as f:
            runs.append(json.load(f))
    return runs


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    out = tempfile.mkdtemp(prefix="hf_trainer_bench_")
    runs = {which: launch(which, a, out) for which in ("deepspeed", "zfunc")}
    params = runs["zfunc"][0]["params"]
    print(f"Llama {params / 1e6:.1f}M parameters ({a.layers} x {a.width}, vocab {a.vocab}), seq {a.seq}, "
          f"micro-batch {a.batch}, {a.steps} steps, ZeRO-3, W = {a.world} gloo, one thread a rank")
    rows = {}
    for which, ranks in runs.items():
        steps = [max(r["times"][k] for r in ranks) for k in range(len(ranks[0]["times"]))]
        rows[which] = {"step_s": statistics.median(steps[2:] if len(steps) > 3 else steps),
                       "peak": [r["peak_mib"] for r in ranks],
                       "grown": [r["peak_mib"] - r["before_mib"] for r in ranks]}
    d, z = rows["deepspeed"], rows["zfunc"]
    print("| run | step (s, median) | peak RSS per rank (MiB) | peak RSS growth from the Trainer on (MiB) |")
    print("| --- | --- | --- | --- |")
    for which, r in rows.items():
        print(f"| {which} | {r['step_s']:.3f} | {' / '.join(f'{x:.0f}' for x in r['peak'])} | "
              f"{' / '.join(f'{x:.0f}' for x in r['grown'])} |")
    print(f"| zfunc / DeepSpeed | {z['step_s'] / d['step_s']:.2f}x | "
          f"{' / '.join(f'{x / y:.2f}x' for x, y in zip(z['peak'], d['peak']))} | "
          f"{' / '.join(f'{x / y:.2f}x' for x, y in zip(z['grown'], d['grown']))} |")
    print("\nrank 0's losses, micro-batch by micro-batch:")
    print("| step | DeepSpeed | zfunc | relative difference |")
    print("| --- | --- | --- | --- |")
    for k, (x, y) in enumerate(zip(runs["deepspeed"][0]["losses"], runs["zfunc"][0]["losses"])):
        print(f"| {k + 1} | {x:.6f} | {y:.6f} | {abs(x - y) / abs(x):.1e} |")


if __name__ == "__main__":
    main()
