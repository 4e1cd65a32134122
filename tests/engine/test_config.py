"""zfunc.engine.config: DeepSpeed's JSON config (the lr schedules it names: test_lr_schedules.py).

The written-out numbers here are DeepSpeed 0.19's; the tests at the end compare
them with the ``deepspeed`` package itself (in the test extra, so CI runs them too).
"""
import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_oracle import real_deepspeed
from zfunc.engine import config as zc
from zfunc.optim import lr as ls

TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"

# DeepSpeed's documented ZeRO-Infinity setup, as is: the zero_optimization block of
# docs/_tutorials/zero.md ("Offloading to CPU and NVMe with ZeRO-Infinity") with the
# NVMe offload_param / offload_optimizer and aio blocks, and the fp16, optimizer and
# scheduler examples, of docs/_pages/config-json.md.
DOCS_ZERO_INFINITY = """
{
  "train_micro_batch_size_per_gpu": 1,
  "gradient_accumulation_steps": 4,
  "gradient_clipping": 1.0,
  "steps_per_print": 10,
  "wall_clock_breakdown": false,
  "optimizer": {
    "type": "AdamW",
    "params": {
      "lr": 0.001,
      "betas": [0.8, 0.999],
      "eps": 1e-8,
      "weight_decay": 3e-7
    }
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {
      "warmup_min_lr": 0,
      "warmup_max_lr": 0.001,
      "warmup_num_steps": 1000
    }
  },
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "initial_scale_power": 32,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": true,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_prefetch_bucket_size": 1e7,
    "stage3_param_persistence_threshold": 1e5,
    "reduce_bucket_size": 1e7,
    "sub_group_size": 1e9,
    "offload_optimizer": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 4,
      "fast_init": false
    },
    "offload_param": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 5,
      "buffer_size": 1e8,
      "max_in_cpu": 1e9
    }
  },
  "aio": {
    "block_size": 1048576,
    "queue_depth": 8,
    "thread_count": 1,
    "single_submit": false,
    "overlap_events": true
  }
}
"""


def cfg(**sections):
    return {TBS: 8, **sections}


def error(config, world_size=1, exc=ValueError) -> str:
    with pytest.raises(exc) as e:
        zc.parse(config, world_size)
    return str(e.value)


# ------------------------------------------------------------------ batch arithmetic


def test_inconsistent_batch_shows_the_arithmetic():
    msg = error({TBS: 32, MBS: 4, GAS: 2}, world_size=2)
    assert msg == ("train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 "
                   "* world size 2 = 16")


@pytest.mark.parametrize("given_, world, expect", [
    ({TBS: 30, MBS: 4}, 2,
     "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 * world size 2 = 8"),
    ({TBS: 30, GAS: 4}, 2,
     "train_batch_size 30 is not divisible by gradient_accumulation_steps 4 * world size 2 = 8"),
    ({TBS: 30}, 4, "train_batch_size 30 is not divisible by world size 4"),
])
def test_non_divisible_batch_shows_the_arithmetic(given_, world, expect):
    assert expect in error(given_, world)


@pytest.mark.parametrize("given_", [{}, {GAS: 4}])
def test_no_batch_size_is_an_error(given_):
    msg = error(given_)
    assert TBS in msg and MBS in msg


@pytest.mark.parametrize("key", [TBS, MBS, GAS])
@pytest.mark.parametrize("value", ["32", -4, 0, 2.5, True, None])
def test_batch_sizes_are_positive_integers(key, value):
    config = {TBS: 8, MBS: 8, GAS: 1}
    config[key] = value
    msg = error(config)
    assert key in msg and "integer >= 1" in msg


def test_auto_batch_size_says_what_auto_is():
    assert "Hugging Face" in error({TBS: "auto"})


@pytest.mark.parametrize("world", [0, -1, 1.0, "2"])
def test_world_size_is_checked(world):
    assert "world_size" in error({TBS: 8}, world)


@settings(max_examples=300, deadline=None)
@given(world=st.integers(1, 16), micro=st.integers(1, 64), gas=st.integers(1, 16),
       which=st.sampled_from([(TBS, MBS, GAS), (TBS, MBS), (TBS, GAS), (MBS, GAS), (MBS,), (TBS,)]))
def test_any_two_batch_numbers_give_the_third(world, micro, gas, which):
    full = {TBS: micro * gas * world, MBS: micro, GAS: gas}
    c = zc.parse({k: full[k] for k in which}, world)
    if which == (MBS,):  # DeepSpeed: gas = 1
        expect = (micro * world, micro, 1)
    elif which == (TBS,):  # DeepSpeed: gas = 1, micro = tbs / world
        expect = (micro * gas * world, micro * gas, 1)
    else:
        expect = (micro * gas * world, micro, gas)
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == expect
    assert c.train_batch_size == c.micro_batch_size * c.gradient_accumulation_steps * world


@settings(max_examples=200, deadline=None)
@given(world=st.integers(1, 16), micro=st.integers(1, 64), gas=st.integers(1, 16), off=st.integers(1, 100))
def test_a_wrong_triple_or_remainder_is_an_error(world, micro, gas, off):
    tbs = micro * gas * world + off
    msg = error({TBS: tbs, MBS: micro, GAS: gas}, world)
    assert msg.endswith(f"* world size {world} = {micro * gas * world}")
    if tbs % (micro * world):
        assert "not divisible" in error({TBS: tbs, MBS: micro}, world)
    else:
        assert zc.parse({TBS: tbs, MBS: micro}, world).gradient_accumulation_steps == tbs // (micro * world)


# ------------------------------------------------------------------------- loading


def test_parse_reads_a_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(DOCS_ZERO_INFINITY)
    assert zc.parse(path, 2) == zc.parse(str(path), 2) == zc.parse(json.loads(DOCS_ZERO_INFINITY), 2)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.json"
    assert str(path) in error(path, exc=FileNotFoundError)


def test_invalid_json_names_the_path(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 8,}')
    msg = error(path)
    assert str(path) in msg and "not valid JSON" in msg


def test_duplicate_json_keys_are_an_error(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    msg = error(path)
    assert str(path) in msg and "'train_batch_size' appears twice" in msg


def test_a_json_file_must_hold_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert "JSON object" in error(path)


def test_parse_copies_the_input_and_does_not_warn():
    raw = cfg(zero_optimization={"stage": 2, "overlap_comm": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = zc.parse(raw, 1)
    raw["zero_optimization"]["stage"] = 3
    assert c.raw["zero_optimization"]["stage"] == 2 and c.zero.stage == 2


# ---------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("config, path, near", [
    ({TBS: 8, "gradient_clippin": 1.0}, "gradient_clippin", "gradient_clipping"),
    (cfg(zero_optimization={"offload_optimzer": {}}), "zero_optimization.offload_optimzer", "offload_optimizer"),
    (cfg(zero_optimization={"stage3_prefetch_bucket_sizee": 1}), "zero_optimization.stage3_prefetch_bucket_sizee",
     "stage3_prefetch_bucket_size"),
    (cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x", "buffer_cout": 5}}),
     "zero_optimization.offload_param.buffer_cout", "buffer_count"),
    (cfg(fp16={"loss_scale_windw": 10}), "fp16.loss_scale_windw", "loss_scale_window"),
    (cfg(bf16={"enable": True}), "bf16.enable", "enabled"),
    (cfg(aio={"queue_dept": 8}), "aio.queue_dept", "queue_depth"),
    (cfg(optimizer={"type": "AdamW", "parms": {}}), "optimizer.parms", "params"),
    (cfg(optimizer={"type": "AdamW", "params": {"betaz": [0.9, 0.99]}}), "optimizer.params.betaz", "betas"),
    (cfg(optimizer={"type": "SGD", "params": {"momentun": 0.9}}), "optimizer.params.momentun", "momentum"),
    (cfg(scheduler={"type": "WarmupLR", "params": {"warmup_max_lrr": 0.1}}), "scheduler.params.warmup_max_lrr",
     "warmup_max_lr"),
    (cfg(scheduler={"type": "WarmupLR", "parameters": {}}), "scheduler.parameters", "params"),
])
def test_unknown_key_names_its_path_and_the_nearest_key(config, path, near):
    msg = error(config)
    assert f"unknown key {path!r}: did you mean {near!r}?" in msg


def test_the_brief_example_message():
    msg = error(cfg(zero_optimization={"offload_optimzer": {"device": "cpu"}}))
    assert msg == "unknown key 'zero_optimization.offload_optimzer': did you mean 'offload_optimizer'?"


def test_unknown_key_without_a_near_one_lists_the_valid_keys():
    msg = error(cfg(fp16={"zzz": 1}))
    assert "unknown key 'fp16.zzz'" in msg and "loss_scale_window" in msg and "initial_scale_power" in msg


# ------------------------------------------------------------------------- bad types


@pytest.mark.parametrize("config, key, expected", [
    (cfg(zero_optimization={"stage": "3"}), "zero_optimization.stage", "integer"),
    (cfg(zero_optimization={"stage": 4}), "zero_optimization.stage", "<= 3"),
    (cfg(zero_optimization={"stage": 3.5}), "zero_optimization.stage", "integer"),
    (cfg(zero_optimization={"sub_group_size": -1}), "zero_optimization.sub_group_size", ">= 1"),
    (cfg(zero_optimization={"stage3_max_live_parameters": "many"}), "zero_optimization.stage3_max_live_parameters",
     "integer"),
    (cfg(zero_optimization={"offload_optimizer": {"device": "gpu"}}), "zero_optimization.offload_optimizer.device",
     "'none', 'cpu', 'nvme'"),
    (cfg(zero_optimization={"offload_optimizer": {"device": "cpu", "pin_memory": "yes"}}),
     "zero_optimization.offload_optimizer.pin_memory", "true or false"),
    (cfg(fp16={"enabled": 1}), "fp16.enabled", "true or false"),
    (cfg(fp16={"enabled": True, "loss_scale": -1}), "fp16.loss_scale", ">= 0"),
    (cfg(fp16={"enabled": True, "loss_scale_window": 0}), "fp16.loss_scale_window", ">= 1"),
    (cfg(fp16={"enabled": True, "min_loss_scale": 0}), "fp16.min_loss_scale", ">= 1"),
    ({TBS: 8, "gradient_clipping": -1.0}, "gradient_clipping", ">= 0"),
    ({TBS: 8, "gradient_clipping": "1"}, "gradient_clipping", "a number"),
    ({TBS: 8, "steps_per_print": 0}, "steps_per_print", ">= 1"),
    ({TBS: 8, "wall_clock_breakdown": "false"}, "wall_clock_breakdown", "true or false"),
    (cfg(optimizer={"type": "Adam", "params": {"lr": "1e-3"}}), "optimizer.params.lr", "a number"),
    (cfg(optimizer={"type": "Adam", "params": {"betas": [0.9]}}), "optimizer.params.betas", "two numbers"),
    (cfg(optimizer={"type": "Adam", "params": {"betas": [0.9, 1.0]}}), "optimizer.params.betas", "[0, 1)"),
    (cfg(optimizer={"type": 3}), "optimizer.type", "a string"),
    (cfg(aio={"block_size": 0}), "aio.block_size", ">= 1"),
    (cfg(aio={"single_submit": 0}), "aio.single_submit", "true or false"),
    (cfg(zero_optimization=[1]), "zero_optimization", "dict"),
    (cfg(zero_optimization=True), "zero_optimization", "dict"),
])
def test_wrong_types_name_the_key_and_the_expected_type(config, key, expected):
    msg = error(config)
    assert key in msg and expected in msg


# ------------------------------------------------------------------ not supported yet


@pytest.mark.parametrize("key, value", [
    ("amp", {"enabled": True}), ("pipeline", {"stages": 2}), ("sparse_attention", {"mode": "fixed"}),
    ("elasticity", {"enabled": True}), ("compression_training", {}), ("autotuning", {"enabled": True}),
    ("quantize_training", {"enabled": True}), ("curriculum_learning", {"enabled": True}),
    ("data_efficiency", {"enabled": True}), ("moe", {"enabled": True}), ("hybrid_engine", {"enabled": True}),
    ("tensor_parallel", {"autotp_size": 2}), ("sequence_parallel_size", 2), ("torch_autocast", {"enabled": True}),
])
def test_features_zfunc_lacks_are_not_supported_yet(key, value):
    msg = error(cfg(**{key: value}))
    assert repr(key) in msg and "not supported yet" in msg


@pytest.mark.parametrize("key, value", [("amp", {"enabled": False}), ("hybrid_engine", {"enabled": False}),
                                        ("sequence_parallel_size", 1)])
def test_a_disabled_feature_section_is_accepted_and_listed(key, value):
    assert zc.parse(cfg(**{key: value}), 1).ignored == (key,)


def test_a_path_as_a_top_level_key_is_listed_not_applied():
    """TRL's ``prepare_deepspeed`` writes ``"zero_optimization.reduce_bucket_size"`` and the like at the
    top level (one a float); DeepSpeed reads only nested keys, so zfunc acts on none of them either."""
    keys = {"zero_optimization.stage3_prefetch_bucket_size": 921.6, "zero_optimization.stage": 1}
    c = zc.parse(cfg(zero_optimization={"stage": 3}, **keys), 1)
    assert c.zero.stage == 3 and c.ignored == tuple(keys)


@pytest.mark.parametrize("zero, key", [
    ({"stage": 3, "zero_quantized_weights": True}, "zero_optimization.zero_quantized_weights"),
    ({"stage": 3, "zero_quantized_gradients": True}, "zero_optimization.zero_quantized_gradients"),
    ({"stage": 2, "cpu_offload": True}, "zero_optimization.cpu_offload"),
    ({"stage": 3, "cpu_offload_param": True}, "zero_optimization.cpu_offload_param"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", "ratio": 0.5}},
     "zero_optimization.offload_optimizer.ratio"),
])
def test_zero_semantics_zfunc_lacks_are_not_supported_yet(zero, key):
    msg = error(cfg(zero_optimization=zero))
    assert key in msg and "not supported yet" in msg


def test_semantic_switches_at_deepspeeds_defaults_are_accepted():
    c = zc.parse(cfg(zero_optimization={"stage": 3, "zero_quantized_weights": False, "zero_hpz_partition_size": 1,
                                        "cpu_offload": False}, fp16={"fp16_master_weights_and_grads": False}), 1)
    assert c.zero.stage == 3 and c.ignored == ()


@pytest.mark.parametrize("section, key", [
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads"),
    ({"aio": {"use_gds": True}}, "aio.use_gds"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, "optimizer.params.bias_correction"),
])
def test_other_settings_zfunc_lacks_are_not_supported_yet(section, key):
    msg = error(cfg(**section))
    assert key in msg and "not supported yet" in msg


@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lamb", "Lion", "Adagrad",
                                  "RMSprop", "Adamax"])
def test_other_optimizers_are_not_supported_yet(name):
    msg = error(cfg(optimizer={"type": name}))
    assert repr(name) in msg and "not supported yet" in msg


def test_unknown_optimizer_names_the_nearest():
    msg = error(cfg(optimizer={"type": "Adma"}))
    assert "unknown optimizer.type 'Adma': did you mean 'Adam'?" in msg and "SGD" in msg


def test_max_grad_norm_points_to_gradient_clipping():
    msg = error(cfg(optimizer={"type": "Adam", "params": {"max_grad_norm": 1.0}}))
    assert "optimizer.params.max_grad_norm" in msg and "gradient_clipping" in msg


@pytest.mark.parametrize("name", ["OneCycle", "LRRangeTest", "StepLR"])
def test_schedulers_zfunc_lacks_are_not_supported_yet(name):
    msg = error(cfg(scheduler={"type": name, "params": {}}))
    assert repr(name) in msg and "not supported yet" in msg


def test_unknown_scheduler_names_the_nearest_and_lists_the_valid():
    msg = error(cfg(scheduler={"type": "WarmupCosine"}))
    assert "did you mean 'WarmupCosineLR'?" in msg and "WarmupLR, WarmupDecayLR, WarmupCosineLR" in msg


# --------------------------------------------------------------------- contradictions


@pytest.mark.parametrize("config, words", [
    (cfg(fp16={"enabled": True}, bf16={"enabled": True}), ["fp16.enabled", "bf16.enabled"]),
    (cfg(bf16={"enabled": True}, bfloat16={"enabled": True}), ["'bf16'", "'bfloat16'"]),
    (cfg(aio={"thread_count": 2, "intra_op_parallelism": 2}), ["aio.thread_count", "aio.intra_op_parallelism"]),
    (cfg(zero_optimization={"stage": 3, "stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}),
     ["zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.prefetch_bucket_size"]),
    (cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}),
     ["zero_optimization.offload_param.nvme_path"]),
    (cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme"}}),
     ["zero_optimization.offload_optimizer.nvme_path"]),
    (cfg(optimizer={"type": "SGD", "params": {"nesterov": True}}), ["optimizer.params.nesterov", "momentum"]),
    (cfg(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 100}}),
     ["scheduler.params.total_num_steps", "warmup_num_steps"]),
])
def test_contradictions_name_both_sides(config, words):
    msg = error(config)
    assert all(w in msg for w in words), msg


@pytest.mark.parametrize("params, key", [
    ({"warmup_num_steps": -5}, "scheduler.params.warmup_num_steps"),
    ({"warmup_num_steps": 0}, "scheduler.params.warmup_num_steps"),
    ({"warmup_type": "cosine"}, "scheduler.params.warmup_type"),
    ({"warmup_min_lr": -1e-3}, "scheduler.params.warmup_min_lr"),
    ({"warmup_max_lr": [1e-3, 1e-4]}, "scheduler.params.warmup_max_lr"),
    ({"last_batch_iteration": 10}, "scheduler.params.last_batch_iteration"),
])
def test_bad_scheduler_values_name_the_key(params, key):
    assert key in error(cfg(scheduler={"type": "WarmupLR", "params": params}))


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
def test_total_num_steps_is_required_for_the_decaying_schedules(kind):
    assert "scheduler.params.total_num_steps is required" in error(cfg(scheduler={"type": kind}))


# ------------------------------------------------------------------------- optimizer


@pytest.mark.parametrize("type_, params, expect", [
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false; "AdamW" always is.
    ("Adam", {}, ("adam", True, 0.0)),
    ("adam", {"adam_w_mode": False}, ("adam", False, 0.0)),
    ("AdamW", {}, ("adamw", True, 0.0)),
    ("ADAMW", {"adam_w_mode": False}, ("adamw", True, 0.0)),
    # torch_adam: torch.optim.AdamW (weight decay 0.01) or torch.optim.Adam (0).
    ("Adam", {"torch_adam": True}, ("adam", True, 0.01)),
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, ("adam", False, 0.0)),
    ("AdamW", {"torch_adam": True}, ("adamw", True, 0.01)),
    ("AdamW", {"torch_adam": True, "weight_decay": 0.1}, ("adamw", True, 0.1)),
    ("SGD", {}, ("sgd", False, 0.0)),
    ("sgd", {"weight_decay": 1e-4}, ("sgd", False, 1e-4)),
])
def test_optimizer_type_decoupling_and_weight_decay_follow_deepspeed(type_, params, expect):
    o = zc.parse(cfg(optimizer={"type": type_, "params": params}), 1).optimizer
    assert (o.type, o.decoupled, o.weight_decay) == expect


def test_optimizer_defaults_are_deepspeeds():
    o = zc.parse(cfg(optimizer={"type": "AdamW"}), 1).optimizer
    assert o == zc.OptimizerConfig("adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=True,
                                   torch_adam=False, fused=None)
    s = zc.parse(cfg(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}), 1).optimizer
    assert (s.lr, s.momentum, s.dampening, s.nesterov, s.weight_decay) == (0.1, 0.9, 0.0, True, 0.0)


def test_optimizer_params_are_read():
    o = zc.parse(cfg(optimizer={"type": "Adam", "params": {
        "lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, "fused": True, "foreach": False,
    }}), 1).optimizer
    assert (o.lr, o.betas, o.eps, o.weight_decay, o.fused) == (3e-4, (0.8, 0.95), 1e-6, 0.1, True)


def test_no_optimizer_section_is_none():
    assert zc.parse(cfg(), 1).optimizer is None


# -------------------------------------------------------------------------- defaults


def test_defaults_are_deepspeeds():
    c = zc.parse({MBS: 2}, 4)
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (8, 2, 1)
    assert c.gradient_clipping == 1.0  # GRADIENT_CLIPPING_DEFAULT: clipping is on unless turned off
    assert c.steps_per_print is None  # STEPS_PER_PRINT_DEFAULT in DeepSpeed 0.19
    assert c.wall_clock_breakdown is False
    assert (c.optimizer, c.scheduler, c.fp16, c.bf16, c.aio, c.ignored) == (None, None, None, None, None, ())
    assert c.zero == zc.ZeroConfig(stage=0, offload_param=None, offload_optimizer=None,
                                   stage3_prefetch_bucket_size=50_000_000, stage3_param_persistence_threshold=100_000,
                                   stage3_max_live_parameters=1_000_000_000, stage3_max_reuse_distance=1_000_000_000,
                                   sub_group_size=1_000_000_000)
    assert c.compute_dtype is None


def test_section_defaults_are_deepspeeds():
    c = zc.parse(cfg(fp16={"enabled": True}, zero_optimization={
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/p"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/o"}}), 1)
    assert c.fp16 == zc.FP16Config(enabled=True, loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000,
                                   hysteresis=2, min_loss_scale=1, consecutive_hysteresis=False)
    assert c.fp16.dynamic and c.compute_dtype is torch.float16
    assert c.zero.offload_param == zc.OffloadParamConfig(device="nvme", nvme_path="/p", buffer_count=5,
                                                         buffer_size=100_000_000, pin_memory=True,
                                                         max_in_cpu=1_000_000_000)
    assert c.zero.offload_optimizer == zc.OffloadOptimizerConfig(device="nvme", nvme_path="/o", buffer_count=4,
                                                                 pin_memory=True, pipeline_read=False,
                                                                 pipeline_write=False, fast_init=False, ratio=1.0)
    b = zc.parse(cfg(bfloat16={"enabled": True}), 1)  # the legacy name
    assert b.bf16 == zc.BF16Config(enabled=True, check_grad_overflow=True) and b.compute_dtype is torch.bfloat16


def test_offload_param_to_cpu_is_zero_infinitys_cpu_tier():
    c = zc.parse(cfg(zero_optimization={"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}}), 1)
    assert c.zero.offload_param == zc.OffloadParamConfig(device="cpu", pin_memory=False)
    assert c.zero.offload_optimizer is None


def test_float_counts_become_ints():
    c = zc.parse(cfg(zero_optimization={"stage": 3.0, "stage3_max_live_parameters": 2e9, "sub_group_size": 1e8,
                                        "offload_param": {"device": "nvme", "nvme_path": "/p", "buffer_size": 1e8}},
                     aio={"block_size": 2.62144e5}), 1)
    for value in (c.zero.stage, c.zero.stage3_max_live_parameters, c.zero.sub_group_size,
                  c.zero.offload_param.buffer_size, c.aio["block_size"]):
        assert type(value) is int
    assert c.zero.stage3_max_live_parameters == 2_000_000_000 and c.aio == {"block_size": 262144}


def test_auto_in_deepspeeds_config_models_means_the_default():
    c = zc.parse(cfg(zero_optimization={"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                        "reduce_bucket_size": "auto"}, fp16={"enabled": "auto"}), 1)
    assert c.zero.stage3_prefetch_bucket_size == 50_000_000 and c.fp16.enabled is False


def test_deepspeeds_second_names_for_stage3_knobs():
    c = zc.parse(cfg(zero_optimization={"stage": 3, "prefetch_bucket_size": 7, "max_live_parameters": 8,
                                        "max_reuse_distance": 9, "param_persistence_threshold": 10}), 1)
    z = c.zero
    assert (z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters, z.stage3_max_reuse_distance,
            z.stage3_param_persistence_threshold) == (7, 8, 9, 10)


# --------------------------------------------------------------------------- ignored


def test_ignored_keys_are_listed_and_warned_once():
    c = zc.parse(cfg(
        zero_optimization={"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                           "round_robin_gradients": True, "stage3_gather_16bit_weights_on_model_save": True},
        tensorboard={"enabled": True}, wandb={"enabled": False}, zero_allow_untested_optimizer=True,
        prescale_gradients=False, activation_checkpointing={"partition_activations": True},
        fp16={"enabled": True, "auto_cast": False}), 1)
    expect = {"zero_optimization.overlap_comm", "zero_optimization.reduce_bucket_size",
              "zero_optimization.allgather_bucket_size", "zero_optimization.round_robin_gradients",
              "zero_optimization.stage3_gather_16bit_weights_on_model_save", "tensorboard", "wandb",
              "zero_allow_untested_optimizer", "prescale_gradients", "activation_checkpointing", "fp16.auto_cast"}
    assert set(c.ignored) == expect and len(c.ignored) == len(expect)
    with pytest.warns(UserWarning) as record:
        zc.warn_ignored(c)
    assert len(record) == 1
    assert all(key in str(record[0].message) for key in expect)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_zero3_is_ignored_as_deepspeed_ignores_it(stage):
    """DeepSpeed's stages 0-2 never read offload_param (DeepSpeed-Chat's configs set it at every stage)."""
    for device in ("cpu", "nvme"):
        c = zc.parse(cfg(zero_optimization={"stage": stage, "offload_param": {"device": device, "nvme_path": "/x"}}), 1)
        assert c.zero.offload_param is None
        assert len(c.ignored) == 1 and c.ignored[0].startswith("zero_optimization.offload_param")
        assert f"stage {stage}" in c.ignored[0]
        with pytest.warns(UserWarning, match="zero_optimization.offload_param"):
            zc.warn_ignored(c)


def test_nothing_ignored_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zc.warn_ignored(zc.parse(cfg(zero_optimization={"stage": 1}), 1))


@pytest.mark.parametrize("key", ["zero_force_ds_cpu_optimizer", "gradient_predivide_factor", "communication_data_type",
                                 "csv_monitor", "comms_logger", "flops_profiler", "dump_state", "memory_breakdown",
                                 "checkpoint", "data_types", "seed", "compile", "timers", "sparse_gradients"])
def test_deepspeed_tooling_keys_are_ignored(key):
    assert zc.parse(cfg(**{key: {}}), 1).ignored == (key,)


# ------------------------------------------------------------- DeepSpeed's docs config


def test_deepspeeds_zero_infinity_docs_config_parses_as_is():
    c = zc.parse(json.loads(DOCS_ZERO_INFINITY), 4)
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (16, 1, 4)
    assert c.optimizer == zc.OptimizerConfig("adamw", lr=0.001, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7,
                                             decoupled=True)
    assert c.scheduler == {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                          "warmup_num_steps": 1000}}
    assert c.fp16 == zc.FP16Config(enabled=True, initial_scale_power=32)
    z = c.zero
    assert (z.stage, z.stage3_max_live_parameters, z.stage3_max_reuse_distance, z.stage3_prefetch_bucket_size,
            z.stage3_param_persistence_threshold, z.sub_group_size) == (3, 10**9, 10**9, 10**7, 10**5, 10**9)
    assert z.offload_param == zc.OffloadParamConfig("nvme", "/local_nvme", 5, 10**8, True, 10**9)
    assert z.offload_optimizer == zc.OffloadOptimizerConfig("nvme", "/local_nvme", 4, True, fast_init=False)
    assert c.aio == {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                     "overlap_events": True}
    assert (c.gradient_clipping, c.steps_per_print, c.wall_clock_breakdown) == (1.0, 10, False)
    assert set(c.ignored) == {"zero_optimization.contiguous_gradients", "zero_optimization.reduce_bucket_size",
                              "zero_optimization.offload_optimizer.fast_init",
                              "zero_optimization.offload_param.max_in_cpu"}
    schedule = ls.from_config(c.scheduler, c.optimizer.lr)
    assert schedule(0) == 0.0 and schedule(5000) == 0.001


# ------------------------------------------------------- against DeepSpeed itself


def test_zero_and_precision_defaults_match_deepspeeds():
    real_deepspeed()
    from deepspeed.runtime import constants
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    z, ours = DeepSpeedZeroConfig(), zc.ZeroConfig()
    assert (ours.stage, ours.stage3_prefetch_bucket_size, ours.stage3_param_persistence_threshold,
            ours.stage3_max_live_parameters, ours.stage3_max_reuse_distance, ours.sub_group_size) == (
        z.stage, z.prefetch_bucket_size, z.param_persistence_threshold, z.max_live_parameters,
        z.max_reuse_distance, z.sub_group_size)
    p, op = DeepSpeedZeroOffloadParamConfig(), zc.OffloadParamConfig()
    assert (op.device, op.nvme_path, op.buffer_count, op.buffer_size, op.pin_memory, op.max_in_cpu) == (
        p.device, p.nvme_path, p.buffer_count, p.buffer_size, p.pin_memory, p.max_in_cpu)
    o, oo = DeepSpeedZeroOffloadOptimizerConfig(), zc.OffloadOptimizerConfig()
    assert (oo.device, oo.nvme_path, oo.buffer_count, oo.pin_memory, oo.pipeline_read, oo.pipeline_write,
            oo.fast_init, oo.ratio) == (o.device, o.nvme_path, o.buffer_count, o.pin_memory, o.pipeline_read,
                                        o.pipeline_write, o.fast_init, o.ratio)
    f, of = DeepSpeedFP16Config(), zc.FP16Config()
    assert (of.enabled, of.loss_scale, of.initial_scale_power, of.loss_scale_window, of.hysteresis,
            of.min_loss_scale, of.consecutive_hysteresis) == (
        f.enabled, f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale,
        f.consecutive_hysteresis)
    b, ob = DeepSpeedBF16Config(), zc.BF16Config()
    assert (ob.enabled, ob.check_grad_overflow) == (b.enabled, b.check_grad_overflow)
    c = zc.parse({TBS: 8}, 1)
    assert (c.gradient_clipping, c.steps_per_print, c.wall_clock_breakdown) == (
        constants.GRADIENT_CLIPPING_DEFAULT, constants.STEPS_PER_PRINT_DEFAULT, constants.WALL_CLOCK_BREAKDOWN_DEFAULT)


def test_optimizer_defaults_match_deepspeeds():
    real_deepspeed()
    import inspect

    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT

    o = zc.parse(cfg(optimizer={"type": "Adam"}), 1).optimizer
    assert o.decoupled is ADAM_W_MODE_DEFAULT
    for cls in (FusedAdam, DeepSpeedCPUAdam):
        d = {k: v.default for k, v in inspect.signature(cls.__init__).parameters.items()}
        assert (o.lr, o.betas, o.eps, o.weight_decay) == (d["lr"], d["betas"], d["eps"], d["weight_decay"])
    for torch_cls, type_ in ((torch.optim.AdamW, "AdamW"), (torch.optim.Adam, "Adam")):
        params = {"torch_adam": True, "adam_w_mode": type_ == "AdamW"}
        d = {k: v.default for k, v in inspect.signature(torch_cls.__init__).parameters.items()}
        assert zc.parse(cfg(optimizer={"type": type_, "params": params}), 1).optimizer.weight_decay == d["weight_decay"]
    s = zc.parse(cfg(optimizer={"type": "SGD"}), 1).optimizer
    d = {k: v.default for k, v in inspect.signature(torch.optim.SGD.__init__).parameters.items()}
    assert (s.lr, s.momentum, s.dampening, s.weight_decay, s.nesterov) == (
        d["lr"], d["momentum"], d["dampening"], d["weight_decay"], d["nesterov"])


def _json_default(value):
    if hasattr(value, "model_dump"):
        return None  # a nested section left at its default
    if hasattr(value, "value"):  # an enum
        return value.value
    return value


def test_every_deepspeed_zero_fp16_bf16_key_is_known():
    """No key DeepSpeed's config models define is 'unknown' here: each is used,
    ignored, or refused as not supported yet."""
    real_deepspeed()
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    def names(model):
        for name, field in model.model_fields.items():
            yield name, _json_default(field.get_default(call_default_factory=True))
            if field.alias:
                yield field.alias, _json_default(field.get_default(call_default_factory=True))

    def wrap(model, key, value):
        if model is DeepSpeedZeroConfig:
            return cfg(zero_optimization={"stage": 3, key: value})
        if model is DeepSpeedZeroOffloadParamConfig:
            return cfg(zero_optimization={"stage": 3, "offload_param": {key: value}})
        if model is DeepSpeedZeroOffloadOptimizerConfig:
            return cfg(zero_optimization={"stage": 3, "offload_optimizer": {key: value}})
        return cfg(**{"fp16" if model is DeepSpeedFP16Config else "bf16": {key: value}})

    for model in (DeepSpeedZeroConfig, DeepSpeedZeroOffloadParamConfig, DeepSpeedZeroOffloadOptimizerConfig,
                  DeepSpeedFP16Config, DeepSpeedBF16Config):
        for key, value in names(model):
            try:
                zc.parse(wrap(model, key, value), 1)
            except ValueError as e:
                assert "unknown key" not in str(e) and "not supported yet" in str(e), (model.__name__, key, str(e))


def test_deepspeed_accepts_the_docs_config_and_agrees():
    real_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = json.loads(DOCS_ZERO_INFINITY)
    theirs, ours = DeepSpeedConfig(json.loads(DOCS_ZERO_INFINITY)), zc.parse(raw, 1)
    assert (theirs.train_batch_size, theirs.train_micro_batch_size_per_gpu, theirs.gradient_accumulation_steps) == (
        ours.train_batch_size, ours.micro_batch_size, ours.gradient_accumulation_steps)
    z = theirs.zero_config
    assert (z.stage, z.prefetch_bucket_size, z.param_persistence_threshold, z.max_live_parameters,
            z.max_reuse_distance, z.sub_group_size, z.offload_param.buffer_size, z.offload_param.max_in_cpu) == (
        ours.zero.stage, ours.zero.stage3_prefetch_bucket_size, ours.zero.stage3_param_persistence_threshold,
        ours.zero.stage3_max_live_parameters, ours.zero.stage3_max_reuse_distance, ours.zero.sub_group_size,
        ours.zero.offload_param.buffer_size, ours.zero.offload_param.max_in_cpu)
    assert (theirs.gradient_clipping, theirs.steps_per_print, theirs.float16_config.initial_scale_power) == (
        ours.gradient_clipping, ours.steps_per_print, ours.fp16.initial_scale_power)


@pytest.mark.parametrize("given_", [{TBS: 12, GAS: 3}, {TBS: 12, MBS: 2}, {MBS: 3, GAS: 2}, {TBS: 5}, {MBS: 4}])
def test_batch_arithmetic_matches_deepspeed_at_world_size_one(given_):
    real_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    theirs, ours = DeepSpeedConfig(dict(given_)), zc.parse(given_, 1)
    assert (theirs.train_batch_size, theirs.train_micro_batch_size_per_gpu, theirs.gradient_accumulation_steps) == (
        ours.train_batch_size, ours.micro_batch_size, ours.gradient_accumulation_steps)
