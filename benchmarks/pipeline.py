"""Pipeline parallelism: the bubble against the ideal, and step time beside DeepSpeed's PipelineModule.

    python benchmarks/pipeline.py                # P = 2 and 3, m = 1..8 micro-batches
    python benchmarks/pipeline.py --small        # smoke test
    python benchmarks/pipeline.py --plot out.png # also draw the bubble against m (matplotlib)

Two GPTs as pipeline layers (embedding and LM head tied across the first and last
stage), micro-batches of one sequence, gloo on CPU, one thread per stage:
"anchor", the anchor GPT (4 blocks, d_model 512, vocab 8192, seq 256), whose last
stage also runs the large head, and "balanced", only blocks (2 per stage, hidden
states in, an MSE loss on hidden states out), whose stages cost the same.

Bubble: 1 - (time in forwards and backwards, summed over stages) / (stages x the
pipeline's span, from the first stage starting its instruction list to the last one
finishing it; not the update after it). Two ideals: (p - 1) / (m + p - 1), which assumes
equal stages and free transfers, and the ideal for the partition: the same schedule
replayed with each stage's measured forward and backward times and free transfers
(zfunc.pipeline.schedules.ideal_bubble), which is what unequal stages cannot beat.
DeepSpeed's PipelineModule trains the same layers (its TiedLayerSpec, its own 1F1B
TrainSchedule) with the same batches; step time is the median over the timed steps.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from _launch import driver_or_worker, launch  # noqa: E402
from _peers import lm_loss  # noqa: E402
from _plot import pyplot, save  # noqa: E402
from gpt import Block, Embed, GPTConfig, lm_head  # noqa: E402

import zfunc as zf  # noqa: E402
from zfunc.pipeline import schedules


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="anchor,balanced")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--micro", default="1,2,3,4,5,6,7,8")
    p.add_argument("--tools", default="zfunc,ds")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=1, help="runs of each tool, alternating; medians, and the "
                   "median of the per-repeat step-time ratios")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--small", action="store_true")
    p.add_argument("--plot", default=None, metavar="PATH", help="also draw the bubble against m, one panel per "
                   "model and p, into this image (needs matplotlib: the benchmark extra)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default="anchor", help=argparse.SUPPRESS)
    p.add_argument("--m", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--p", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.layers, args.width, args.vocab, args.seq, args.steps, args.warmup = 4, 64, 256, 32, 3, 1
        args.micro = "1,4"
    return args


class TiedEmbed(Embed):
    """``weight``: the token table, which DeepSpeed's TiedLayerSpec synchronises by that name."""

    @property
    def weight(self):
        return self.tok_emb.weight


def layers_of(args, cfg, layer_spec, tied_spec):
    blocks = [layer_spec(Block, cfg) for _ in range(cfg.n_layers)]
    if args.model == "balanced":
        return blocks
    return [tied_spec("embed", TiedEmbed, cfg), *blocks, layer_spec(torch.nn.LayerNorm, cfg.d_model),
            tied_spec("embed", TiedEmbed, cfg, forward_fn=lm_head)]


def loss_of(args):
    return F.mse_loss if args.model == "balanced" else lm_loss


def batches(args, step):
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(args.m):
        if args.model == "balanced":  # hidden states in, hidden states as targets
            out.append((torch.randn(1, args.seq, args.width, generator=g), torch.randn(1, args.seq, args.width, generator=g)))
            continue
        x = torch.randint(args.vocab, (1, args.seq + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def run_zfunc(args, cfg):
    torch.manual_seed(0)
    pipe = zf.PipelineModule(layers_of(args, cfg, zf.LayerSpec, zf.TiedLayerSpec), args.p, loss_of(args),
                             partition_method="type:Block")
    engine = zf.initialize(pipe, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": args.m,
                                  "gradient_clipping": 0.0,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}})
    return time_steps(args, engine, lambda: (engine.last_metrics["forward_s"], engine.last_metrics["backward_s"],
                                             *engine.last_metrics["schedule_window"]))


def time_steps(args, engine, stage_times):
    """Each timed step's time and (bubble, ideal for the partition); ``stage_times()`` gives this
    stage's (forward_s, backward_s, start, end) for the step just run."""
    times, bubbles = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        engine.train_batch(iter(batches(args, i)))
        dt = time.perf_counter() - t0
        bubble = measure(args, *stage_times())
        if i >= args.warmup:
            times.append(dt)
            bubbles.append(bubble)
    return times, bubbles


def measure(args, forward_s, backward_s, start, end):
    """(bubble, ideal for the partition) of one step from every stage's busy times and window."""
    row = torch.tensor([forward_s, backward_s, start, end], dtype=torch.float64)
    every = [torch.zeros_like(row) for _ in range(args.p)]
    dist.all_gather(every, row)
    fwd, bwd, start, end = torch.stack(every).unbind(1)
    span = (end.max() - start.min()).item()  # perf_counter is one clock for every process here
    return (1 - (fwd.sum() + bwd.sum()).item() / (args.p * span),
            schedules.ideal_bubble("1f1b", args.m, (fwd / args.m).tolist(), (bwd / args.m).tolist()))


def time_deepspeed_schedule(engine) -> dict:
    """DeepSpeed's instructions timed the way zfunc's engine times its own: forwards, backwards,
    and the window from the first instruction to the tied-gradient reduction that starts the
    update."""
    from deepspeed.runtime.pipe import schedule as ds

    marks = {}

    def timed(fn, kind):
        def run(self, **kw):
            t = time.perf_counter()
            marks.setdefault("start", t)
            if kind == "end":
                marks["end"] = t
            out = fn(self, **kw)
            if kind in ("forward", "backward"):
                marks[kind] = marks.get(kind, 0.0) + time.perf_counter() - t
            return out
        return run

    kinds = {ds.ForwardPass: "forward", ds.BackwardPass: "backward", ds.ReduceTiedGrads: "end"}
    engine._INSTRUCTION_MAP = {k: timed(v, kinds.get(k)) for k, v in type(engine)._INSTRUCTION_MAP.items()}
    return marks


def run_deepspeed(args, cfg):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    torch.manual_seed(0)
    model = PipelineModule(layers=layers_of(args, cfg, LayerSpec, TiedLayerSpec), num_stages=args.p, loss_fn=loss_of(args), partition_method="type:Block")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": args.m, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
              "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=config)
    marks = time_deepspeed_schedule(engine)  # read and emptied after each step
    return time_steps(args, engine, lambda: (marks.pop("forward", 0.0), marks.pop("backward", 0.0),
                                             marks.pop("start"), marks.pop("end")))


def worker(args):
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= args.p:  # one core per stage: the stages' times do not depend on where the OS puts them
        os.sched_setaffinity(0, {cores[int(os.environ["RANK"]) % len(cores)]})
    if args.worker == "ds":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width, n_layers=args.layers,
                    n_heads=8 if args.width % 8 == 0 else 4)
    times, bubbles = (run_deepspeed if args.worker == "ds" else run_zfunc)(args, cfg)
    if dist.get_rank() == 0:
        out = {"step_s": statistics.median(times)}
        out["bubble"], out["partition_ideal"] = (statistics.median(b[k] for b in bubbles) for k in (0, 1))
        with open(args.result, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def model_args(args, model: str, p: int) -> dict:
    """anchor: the anchor GPT, whose last stage also holds the 8192-word head (unequal stages);
    balanced: only transformer blocks, 2 per stage, from hidden states to hidden states (an MSE
    loss), so every stage costs the same, as the textbook bubble (p-1)/(m+p-1) assumes."""
    if model == "balanced":
        return {"layers": 2 * p, "width": args.width, "vocab": args.vocab, "seq": args.seq}
    return {"layers": args.layers, "width": args.width, "vocab": args.vocab, "seq": args.seq}


def plot(rows, path):
    """The bubble against the number of micro-batches m, one panel per (model, p): the textbook
    ideal (p-1)/(m+p-1), the ideal for zfunc's partition, and the bubble each tool measured."""
    plt = pyplot()
    panels = list(dict.fromkeys((r["model"], r["p"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), sharey=True, squeeze=False)
    for ax, (model, p) in zip(axes[0], panels):
        mine = [r for r in rows if (r["model"], r["p"]) == (model, p)]
        ms = [r["m"] for r in mine]
        ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k:", label="ideal (p-1)/(m+p-1)")
        for key, style, label in (("partition_ideal", "k--", "ideal for zfunc's partition"),
                                  ("bubble", "o-", "zfunc")):
            pts = [(r["m"], r["zfunc"][key]) for r in mine if r.get("zfunc")]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        pts = [(r["m"], r["ds"]["bubble"]) for r in mine if r.get("ds")]
        if pts:
            ax.plot(*zip(*pts), "s-", color="tab:gray", label="DeepSpeed")
        ax.set_title(f"{model}, p = {p}", fontsize=10)
        ax.set_xlabel("micro-batches m")
        ax.set_xticks(ms)
    axes[0][0].set_ylabel("bubble (idle share of the span)")
    axes[0][0].legend(fontsize=8)
    save(fig, path)


def main(args):
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for p in map(int, args.stages.split(",")):
                for m in map(int, args.micro.split(",")):
                    row = {"model": model, "p": p, "m": m, **model_args(args, model, p)}
                    runs = {tool: [] for tool in args.tools.split(",")}
                    for repeat in range(args.repeats):  # the tools alternate: the machine drifts between runs
                        for tool in runs:
                            result = os.path.join(tmp, f"{tool}.{model}.{p}.{m}.{repeat}.json")
                            argv = [os.path.abspath(__file__), "--worker", tool, "--m", str(m), "--p", str(p),
                                    "--result", result, f"--steps={args.steps}", f"--warmup={args.warmup}",
                                    f"--model={model}"] + [f"--{k}={row[k]}" for k in ("layers", "width", "vocab", "seq")]
                            rcs = launch(argv, p, env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}, timeout=900)
                            if not any(rcs) and os.path.exists(result):
                                with open(result) as f:
                                    runs[tool].append(json.load(f))
                            else:
                                print(f"{tool} run {repeat} failed: exit codes {rcs}", file=sys.stderr)
                                runs[tool].append(None)
                    for tool, results in runs.items():
                        ok = [r for r in results if r]
                        row[tool] = None if not ok else {k: statistics.median(r[k] for r in ok) for k in ok[0]}
                    pairs = [(z["step_s"], d["step_s"]) for z, d in zip(runs.get("zfunc", []), runs.get("ds", [])) if z and d]
                    row["ratios"] = [round(a / b, 3) for a, b in pairs]  # per run: how much the machine drifts
                    row["ratio"] = statistics.median(row["ratios"]) if pairs else None
                    print(row, file=sys.stderr)
                    rows.append(row)
    print(f"\nGPT, d_model {args.width}, seq {args.seq}, micro-batches of 1 sequence, gloo CPU, one thread per stage; "
          f"median over {args.steps} steps after {args.warmup}, {args.repeats} alternating runs each. anchor: {args.layers} blocks, vocab {args.vocab}; "
          "balanced: 2 blocks per stage, hidden states in and out (MSE)\n")
    print("| model | stages p | micro-batches m | ideal bubble (p-1)/(m+p-1) | ideal for zfunc's partition | zfunc bubble "
          "| DeepSpeed bubble (its partition's ideal) | zfunc step s | DeepSpeed step s | zfunc / DeepSpeed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ideal = (r["p"] - 1) / (r["m"] + r["p"] - 1)
        z, d = r.get("zfunc"), r.get("ds")
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        bubble = "" if not z else f"{z['bubble']:.3f}"
        partition = "" if not z else f"{z['partition_ideal']:.3f}"
        ds_bubble = "" if not d else f"{d['bubble']:.3f} ({d['partition_ideal']:.3f})"
        print(f"| {r['model']} | {r['p']} | {r['m']} | {ideal:.3f} | {partition} | {bubble} | {ds_bubble} | "
              f"{'failed' if not z else format(z['step_s'], '.3f')} | {'failed' if not d else format(d['step_s'], '.3f')} "
              f"| {ratio} |")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
