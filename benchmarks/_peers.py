"""The peers the benchmarks train, each built here once: plain PyTorch, DDP, FSDP2, DeepSpeed's
ZeRO stages and offloads, zfunc's compositions; PEERS, one registry of the names a benchmark's
--modes or --peers accepts.

A worker process builds one peer with ``build`` and trains it with the ``train(micro_batches)``
it returns: one optimizer step over a list of micro-batches (one, unless accumulating), the mean
loss back. What the peers of one run share (learning rate, precision, the batch DeepSpeed is told
of) is a ``Settings``; how a micro-batch becomes a loss is the benchmark's ``loss(forward, batch)``,
``forward`` being the peer's model (for zfunc, ``zf.apply`` on the step's parameters).
"""
import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import zfunc as zf


@dataclasses.dataclass(frozen=True)
class Peer:
    """One peer: what its rows are labelled, and how ``build`` makes it."""

    label: str
    kind: str  # "torch", "ddp", "fsdp2", "deepspeed" or "zfunc"
    stage: int = 3  # ZeRO's stage (zfunc, DeepSpeed)
    offload: str | None = None  # zfunc: a key of ZFUNC_OFFLOADS; DeepSpeed: "cpu", "cpu_params", "nvme", "nvme_sized"
    compiled: str | None = None  # "blocks": each block compiled in place; "jit", "jit-regather": zf.jit
    eager: str | None = None  # a compiled peer's eager twin
    prefetch: bool = True  # zfunc zero3: the coordinator issues gathers ahead of use (off: on demand)
    moments: str = "fp32"  # zfunc: Adam's moments' dtype ("bf16": zf.optim.adamw(state_dtype=torch.bfloat16))
    recompute: bool = False  # each block's activations recomputed in backward (zfunc: zf.recompute; the others:
    # torch.utils.checkpoint around each block's forward, as DeepSpeed's and torchtitan's activation checkpointing)


PEERS = {
    "local": Peer("one process, W threads, global batch", "torch"),
    "torch": Peer("plain PyTorch (autocast on CUDA, fused AdamW)", "torch"),
    "torch-compile": Peer("plain PyTorch, each decoder layer torch.compile'd", "torch", compiled="blocks", eager="torch"),
    "ddp": Peer("torch DDP", "ddp"),
    "fsdp2": Peer("torch FSDP2 (fully_shard per block + root)", "fsdp2"),
    "fsdp2-compile": Peer("torch FSDP2, torch.compile per block (torchtitan: compile each block, then fully_shard per "
                          "block + root)", "fsdp2", compiled="blocks", eager="fsdp2"),
    "ds1": Peer("DeepSpeed ZeRO-1", "deepspeed", stage=1),
    "ds2": Peer("DeepSpeed ZeRO-2", "deepspeed", stage=2),
    "ds3": Peer("DeepSpeed ZeRO-3", "deepspeed"),
    "ds3_cpu": Peer("DeepSpeed ZeRO-3, optimizer offloaded to CPU", "deepspeed", offload="cpu"),
    "ds3_nvme": Peer("DeepSpeed ZeRO-3, params and optimizer state on NVMe", "deepspeed", offload="nvme"),
    "ds_cpu": Peer("DeepSpeed ZeRO-Offload: stage 3, offload_optimizer cpu", "deepspeed", offload="cpu"),
    "ds_cpu_params": Peer("DeepSpeed ZeRO-Infinity: stage 3, offload_optimizer + offload_param cpu", "deepspeed",
                          offload="cpu_params"),
    "ds_nvme": Peer("DeepSpeed ZeRO-Infinity: offload_optimizer + offload_param nvme", "deepspeed", offload="nvme_sized"),
    "zero0": Peer("zfunc, no transform (replicated)", "zfunc", stage=0),
    "zero1": Peer("zfunc zero1", "zfunc", stage=1),
    "zero2": Peer("zfunc zero2", "zfunc", stage=2),
    "zero3": Peer("zfunc zero3", "zfunc"),
    "zero3_noprefetch": Peer("zfunc zero3, coordinator prefetch off (prefetch_bucket_size=0: on demand)", "zfunc",
                             prefetch=False),
    "zero3_cpu": Peer("zfunc zero3(offload_cpu(...))", "zfunc", offload="cpu"),
    "zero3_cpu_overlap": Peer("zfunc zero3(offload_cpu(..., overlap=True)): the host update behind the next forward",
                              "zfunc", offload="cpu_overlap"),
    "zero3_nvme": Peer("zfunc zero3(offload_nvme(...)): params, grads, optimizer state on disk", "zfunc", offload="nvme"),
    "zero3_nvme_small": Peer("zfunc zero3(offload_nvme(..., sub_group_size=1e6)): the update streams from disk", "zfunc",
                             offload="nvme_small"),
    "zero3_nvme_noprefetch": Peer("zfunc zero3(offload_nvme(...)), coordinator prefetch off (reads and gathers on demand)",
                                  "zfunc", offload="nvme", prefetch=False),
    "zero3_nvme_small_noprefetch": Peer("zfunc zero3(offload_nvme(..., sub_group_size=1e6)), coordinator prefetch off",
                                        "zfunc", offload="nvme_small", prefetch=False),
    "zero3-compile": Peer("zfunc zero3, zf.compile_units(model) (each block compiled in place)", "zfunc",
                          compiled="blocks", eager="zero3"),
    "zero3-jit": Peer("zfunc zf.jit(zero3(...)): forward and backward one compiled program", "zfunc", compiled="jit",
                      eager="zero3"),
    "zero3-jit-regather": Peer("zfunc zf.jit(zero3(...), regather=True): the same, units gathered again in backward",
                               "zfunc", compiled="jit-regather", eager="zero3"),
    "zfunc": Peer("zfunc zero3(train_step(adamw)), mixed_precision in bf16", "zfunc"),
    "zfunc-blocks": Peer("zfunc, zf.compile_units(model)", "zfunc", compiled="blocks", eager="zfunc"),
    "zfunc-jit": Peer("zfunc, zf.jit(zero3(...))", "zfunc", compiled="jit", eager="zfunc"),
    "zfunc_cpu": Peer("zfunc zero3(offload_cpu(mixed_precision(...))): the host update behind the next forward", "zfunc",
                      offload="cpu_overlap"),
    "zfunc_cpu_sync": Peer("zfunc zero3(offload_cpu(mixed_precision(...), overlap=False)): the update after backward",
                           "zfunc", offload="cpu_sync"),
    "zfunc_cpu_host_sums": Peer("zfunc zero3(offload_cpu(mixed_precision(...), accumulate_on='host')): fp32 sums in host "
                                "memory", "zfunc", offload="cpu_host_sums"),
    "zfunc_cpu_params": Peer("zfunc zero3(offload_cpu(mixed_precision(...), params=True))", "zfunc", offload="cpu_params"),
    "zfunc_cpu_plan": Peer("zfunc zero3(offload_cpu(mixed_precision(...), budget=--budget GiB)): planned split", "zfunc",
                           offload="cpu_plan"),
    "zfunc_cpu_ratio": Peer("zfunc zero3(offload_cpu(mixed_precision(...), ratio=--ratio)): hand-set split", "zfunc",
                            offload="cpu_ratio"),
    "zfunc_cpu_delay": Peer("zfunc zero3(offload_cpu(mixed_precision(...), delay=1)): each update one step late, "
                            "behind the next step's forward and backward", "zfunc", offload="cpu_delay"),
    "zfunc_cpu_blocks": Peer("zfunc zero3(offload_cpu(mixed_precision(...))), zf.compile_units(model): the same "
                             "compiled blocks as zfunc-blocks under offload", "zfunc", offload="cpu_overlap",
                             compiled="blocks", eager="zfunc_cpu"),
    "zfunc_cpu_delay_blocks": Peer("zfunc zero3(offload_cpu(mixed_precision(...), delay=1)), zf.compile_units(model)",
                                   "zfunc", offload="cpu_delay", compiled="blocks", eager="zfunc_cpu_delay"),
    "zfunc_cpu_delay_blocks_bf16": Peer("zfunc zero3(offload_cpu(mixed_precision(...), delay=1)), compiled blocks, "
                                        "Adam's moments in bf16", "zfunc", offload="cpu_delay", compiled="blocks",
                                        eager="zfunc_cpu_delay", moments="bf16"),
    "zfunc_nvme": Peer("zfunc zero3(offload_nvme(mixed_precision(...), path))", "zfunc", offload="nvme"),
    # one large micro-batch a step, each block recomputed in backward (issue 50)
    "zfunc_cpu_recompute": Peer("zfunc zero3(offload_cpu(mixed_precision(recompute(...)))): exact, blocks recomputed",
                                "zfunc", offload="cpu_overlap", recompute=True),
    "zfunc_cpu_params_recompute": Peer("zfunc zero3(offload_cpu(mixed_precision(recompute(...)), params=True)): exact, "
                                       "parameters streamed from the host", "zfunc", offload="cpu_params",
                                       recompute=True),
    "zfunc_cpu_delay_recompute": Peer("zfunc zero3(offload_cpu(mixed_precision(recompute(...)), delay=1)), blocks "
                                      "recomputed", "zfunc", offload="cpu_delay", recompute=True),
    "zfunc_cpu_delay_recompute_blocks": Peer("zfunc zero3(offload_cpu(mixed_precision(recompute(...)), delay=1)), "
                                             "blocks recomputed and compiled", "zfunc", offload="cpu_delay",
                                             recompute=True, compiled="blocks", eager="zfunc_cpu_delay_recompute"),
    "ds_cpu_recompute": Peer("DeepSpeed ZeRO-Offload: stage 3, offload_optimizer cpu, blocks checkpointed", "deepspeed",
                             offload="cpu", recompute=True),
}


@dataclasses.dataclass
class Settings:
    """What every peer of one run shares."""

    lr: float
    wd: float = 0.01
    adam: str = "fused"  # torch AdamW's implementation in the torch and DeepSpeed peers: a key of ADAM_IMPL
    bf16: bool = False  # bf16 compute, fp32 master weights (and fp32 gradient reduction but in DeepSpeed)
    device: str = "cpu"
    world: int = 1
    batch: int = 1  # sequences per rank per micro-batch (DeepSpeed is told it)
    accumulate: int = 1  # micro-batches per step
    nvme_path: str | None = None
    compile_backend: str = "inductor"
    coordinator: dict = dataclasses.field(default_factory=dict)  # zfunc zero3's prefetch settings
    budget: float = 2.0  # zfunc_cpu_plan: GiB of GPU memory for kept optimizer state
    ratio: float = 0.9  # zfunc_cpu_ratio: share of parameters updated on the host
    units: Callable | None = None  # zfunc's rule for units (train_step's units=); None: its default


class NotAvailable(Exception):
    """A peer this machine cannot run (a missing keyword, an op DeepSpeed cannot build here)."""


ADAM_IMPL = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}


def lm_loss(logits, y):
    """Next-token cross-entropy; bf16 logits are cast to fp32 first (a no-op in fp32), in every peer."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def torch_adamw(params, s: Settings):
    return torch.optim.AdamW(params, lr=s.lr, weight_decay=s.wd, **ADAM_IMPL[s.adam])


def init_distributed(name: str, backend: str) -> None:
    """The default process group, through DeepSpeed for its peers (its comm backend needs it)."""
    if PEERS[name].kind == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend=backend)
    else:
        dist.init_process_group(backend)


def compile_blocks(blocks: torch.nn.ModuleList, backend: str) -> None:
    """Each block ``torch.compile``d and registered back in its list (torchtitan's apply_compile)."""
    for name, block in blocks.named_children():
        blocks.register_module(name, torch.compile(block, backend=backend, fullgraph=True))


def checkpoint_blocks(blocks: torch.nn.ModuleList) -> None:
    """Each block's forward under ``torch.utils.checkpoint`` (non-reentrant): what a user of DeepSpeed
    or FSDP2 writes for activation checkpointing, and what ``zf.recompute`` does for zfunc's peers."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        inner = block.forward
        block.forward = lambda *a, _f=inner, **k: checkpoint(_f, *a, use_reentrant=False, **k)


def fsdp2(model, blocks, mesh, bf16: bool = False):
    """FSDP2 as torchtitan applies it: fully_shard per block, then the root; bf16: MixedPrecisionPolicy
    (bf16 parameters, fp32 gradient reduction)."""
    mp = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if bf16 else {}
    for block in blocks:
        fully_shard(block, mesh=mesh, **mp)
    fully_shard(model, mesh=mesh, **mp)
    return model


def ds_config(name: str, s: Settings) -> dict:
    """The DeepSpeed config of peer ``name``. Offloaded optimizer state is updated by torch AdamW on
    the CPU (DeepSpeedCPUAdam would need its op JIT-built), by DeepSpeedCPUAdam on CUDA, with pinned
    buffers; its NVMe peers keep ZeRO-Infinity's defaults (buffer_count 5 x buffer_size 1e8, aio)
    but "nvme_sized" (``infinity_param_buffers``)."""
    offload = PEERS[name].offload
    config = {
        "train_micro_batch_size_per_gpu": s.batch,
        "gradient_accumulation_steps": s.accumulate,
        "optimizer": {"type": "AdamW", "params": dict(lr=s.lr, weight_decay=s.wd, torch_adam=True, **ADAM_IMPL[s.adam])},
        "zero_optimization": {"stage": PEERS[name].stage},
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; the others do not clip
    }
    zero, pin = config["zero_optimization"], s.device == "cuda"
    if offload in ("cpu", "cpu_params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if offload == "cpu_params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if offload in ("nvme", "nvme_sized"):
        nvme = {"device": "nvme", "nvme_path": s.nvme_path, "pin_memory": pin}
        zero["offload_param"], zero["offload_optimizer"] = dict(nvme), dict(nvme)
    if "offload_optimizer" in zero:
        if pin:
            config["optimizer"]["params"] = dict(lr=s.lr, weight_decay=s.wd)
        else:
            config["zero_force_ds_cpu_optimizer"] = False
    if s.bf16:  # bf16 parameters, fp32 master weights; DeepSpeed's default reduces gradients in bf16
        config["bf16"] = {"enabled": True}
    return config


def infinity_param_buffers(blocks, model, zero: dict) -> dict:
    """ZeRO-Infinity's offload_param pool for ``model``: DeepSpeed swaps each parameter (not each
    block) into a buffer of its own, so its defaults (5 buffers of 1e8 elements) stop a 1.8B GPT
    with "Not enough buffers 0 for swapping 1" once a prefetch asks for more parameters than there
    are buffers. Every buffer holds the largest parameter (the head, 1.03e8); there are as many as
    a prefetch bucket and the parameters in use at once can ask for (two blocks' worth, plus the
    embeddings and head), and prefetching and the parameters kept live are capped so that count holds
    (on an H200 the pool alone still ran out: max_live_parameters kept 1e9 elements live)."""
    threshold = zero.setdefault("stage3_param_persistence_threshold", int(1e5))
    swapped = lambda m: [p for p in m.parameters() if p.numel() > threshold]  # noqa: E731  small ones stay on the GPU
    block = max((swapped(b) for b in blocks), key=lambda ps: sum(p.numel() for p in ps))
    zero["stage3_prefetch_bucket_size"] = sum(p.numel() for p in block)
    # parameters stay live (holding their buffers) up to max_live_parameters, 1e9 by default: about 20
    # of these blocks, far more than the pool; cap them at the two blocks the pool is sized for
    zero["stage3_max_live_parameters"] = 2 * zero["stage3_prefetch_bucket_size"]
    zero["stage3_max_reuse_distance"] = zero["stage3_prefetch_bucket_size"]
    return dict(buffer_size=max(int(1e8), max(p.numel() for p in model.parameters())),
                buffer_count=2 * len(block) + 4)


def deepspeed_engine(name: str, model, blocks, s: Settings, config: dict | None = None):
    """``deepspeed.initialize`` on ``model`` with peer ``name``'s config (or ``config``)."""
    import deepspeed

    config = config or ds_config(name, s)
    if PEERS[name].offload in ("nvme", "nvme_sized"):
        from deepspeed.accelerator import get_accelerator

        aio = get_accelerator().create_op_builder("AsyncIOBuilder")
        if aio is None or not aio.is_compatible(verbose=False):
            raise NotAvailable("DeepSpeed's async_io op cannot build here (libaio headers missing?)")
    if PEERS[name].offload == "nvme_sized":
        zero = config["zero_optimization"]
        zero["offload_param"].update(infinity_param_buffers(blocks, model, zero))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


ZFUNC_OFFLOADS = {
    None: lambda step, s: step,
    "cpu": lambda step, s: zf.offload_cpu(step),
    "cpu_overlap": lambda step, s: zf.offload_cpu(step, overlap=True),  # the default on CUDA; on the CPU too
    "cpu_sync": lambda step, s: zf.offload_cpu(step, overlap=False),
    "cpu_host_sums": lambda step, s: zf.offload_cpu(step, accumulate_on="host"),
    "cpu_delay": lambda step, s: zf.offload_cpu(step, delay=1),
    "cpu_params": lambda step, s: zf.offload_cpu(step, params=True),
    "cpu_plan": lambda step, s: zf.offload_cpu(step, budget=int(s.budget * 2**30)),
    "cpu_ratio": lambda step, s: zf.offload_cpu(step, ratio=s.ratio),
    "nvme": lambda step, s: zf.offload_nvme(step, s.nvme_path),
    "nvme_small": lambda step, s: zf.offload_nvme(step, s.nvme_path, sub_group_size=10**6),  # most sub-groups stream
}


def zfunc_step(name: str, loss_fn, s: Settings):
    """Peer ``name``'s zfunc step: ``zeroN([offload]([mixed_precision]([accumulate](train_step(loss_fn,
    adamw)))))``, compiled whole under zf.jit for the jit peers."""
    peer = PEERS[name]
    moments = {"state_dtype": torch.bfloat16} if peer.moments == "bf16" else {}
    step = zf.train_step(loss_fn, zf.optim.adamw(s.lr, weight_decay=s.wd, **moments),
                         **({"units": s.units} if s.units else {}))
    if peer.recompute:
        step = zf.recompute(step)
    if s.accumulate > 1:
        step = zf.accumulate(step, s.accumulate)
    if s.bf16:
        step = zf.mixed_precision(step, torch.bfloat16)  # reduce_dtype: fp32 by default
    try:
        step = ZFUNC_OFFLOADS[peer.offload](step, s)
    except TypeError as e:  # a keyword this zfunc does not have
        raise NotAvailable(f"{type(e).__name__}: {e}") from e
    coordinator = dict(s.coordinator, **({} if peer.prefetch else {"prefetch_bucket_size": 0}))
    step = {0: lambda st: st, 1: zf.zero1, 2: zf.zero2, 3: lambda st: zf.zero3(st, **coordinator)}[peer.stage](step)
    if peer.compiled in ("jit", "jit-regather"):
        step = zf.jit(step, backend=s.compile_backend, regather=peer.compiled == "jit-regather")
    return step


def build(name: str, model, blocks, loss, s: Settings, on_metrics=None):
    """``train(micro_batches) -> mean loss tensor``: one optimizer step of peer ``name`` on ``model``
    (whose ``blocks``, a ModuleList, FSDP2 shards and the compiled peers compile one by one).
    ``train.settle()`` waits for an update still running behind (zfunc's offload_cpu(overlap=True));
    ``train.close()`` lets go of zfunc's swap files. zfunc's loss is already the ranks' mean; the
    others' is this rank's. ``on_metrics``: called with each zfunc step's metrics."""
    peer = PEERS[name]
    if peer.kind == "zfunc":
        return _zfunc_train(name, model, loss, s, on_metrics)
    if peer.recompute and peer.kind != "zfunc":
        checkpoint_blocks(blocks)
    if peer.kind == "deepspeed":
        return _deepspeed_train(deepspeed_engine(name, model, blocks, s), loss)
    if peer.compiled == "blocks":  # before sharding: FSDP2's hooks run on the compiled wrappers (torchtitan's order)
        compile_blocks(blocks, s.compile_backend)
    if peer.kind == "fsdp2":
        fsdp2(model, blocks, init_device_mesh(s.device, (s.world,)), s.bf16)
    module = DDP(model) if peer.kind == "ddp" else model
    autocast = s.bf16 and peer.kind != "fsdp2"  # plain torch and DDP: bf16 compute over fp32 weights

    def forward(*a):
        with torch.autocast(s.device, dtype=torch.bfloat16, enabled=autocast):
            return module(*a)
    return _torch_train(forward, torch_adamw(module.parameters(), s), loss)


def _torch_train(forward, opt, loss):
    def train(micro):
        losses = []
        for batch in micro:
            value = loss(forward, batch)
            (value / len(micro) if len(micro) > 1 else value).backward()
            losses.append(value.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return _mean(losses)
    train.settle = train.close = lambda: None
    return train


def _deepspeed_train(engine, loss):
    def train(micro):
        losses = []
        for batch in micro:
            value = loss(engine, batch)
            engine.backward(value)  # scales by 1 / gradient_accumulation_steps
            engine.step()  # updates on the last micro-batch only
            losses.append(value.detach())
        return _mean(losses)
    train.settle = train.close = lambda: None
    return train


def _mean(losses):
    return losses[0] if len(losses) == 1 else torch.stack(losses).mean()


def _zfunc_train(name, model, loss, s, on_metrics):
    def loss_fn(params, batch):
        return loss(lambda *a: zf.apply(model, params, *a), batch)

    step = zfunc_step(name, loss_fn, s)
    if PEERS[name].compiled == "blocks":
        zf.compile_units(model, backend=s.compile_backend, fullgraph=True)
    if PEERS[name].offload == "cpu_plan":
        print(zf.plan_offload(step, model, budget=int(s.budget * 2**30)), flush=True)
    state = step.init(model)

    def train(micro):
        nonlocal state
        state, metrics = step(state, micro if s.accumulate > 1 else micro[0])
        if on_metrics is not None:
            on_metrics(metrics)
        return metrics["loss"]
    train.settle = lambda: state.params.leaves  # reading the parameters waits for an update running behind
    train.close = lambda: state.close()
    return train
