"""fp16 dynamic loss scaling: DeepSpeed's rules, skipped steps on every rank, a clear stop."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zfunc as zf
from cases import run_composed
from workers import workers


def deepspeed_rules(overflows, init_scale, window, hysteresis, min_scale, consecutive, factor=2.0):
    """DeepSpeed's DynamicLossScaler.update_scale, written out: the scale each step uses."""
    scale, it, last, hyst, used = init_scale, 0, -1, hysteresis, []
    for overflow in overflows:
        used.append(scale)
        if overflow:
            if hysteresis == 1 or hyst == 1:
                scale = max(scale / factor, min_scale)
            else:
                hyst -= 1
            last = it
        else:
            if consecutive:
                hyst = hysteresis
            if (it - last) % window == 0:
                if not consecutive:
                    hyst = hysteresis
                scale *= factor
        it += 1
    return used, scale


def test_defaults_are_deepspeeds():
    s = zf.LossScaler()
    assert (s.init_scale, s.window, s.hysteresis, s.min_scale, s.consecutive_hysteresis) == (2 ** 16, 1000, 2, 1, False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=60), st.integers(1, 5), st.integers(1, 3), st.booleans(),
       st.sampled_from([1.0, 4.0]), st.integers(0, 12))
def test_scale_trajectory_follows_deepspeed(overflows, window, hysteresis, consecutive, min_scale, power):
    scaler = zf.LossScaler(init_scale=2.0 ** power * min_scale, window=window, hysteresis=hysteresis,
                           min_scale=min_scale, consecutive_hysteresis=consecutive, max_stuck_steps=10 ** 6)
    state, used = scaler.init(), []
    for overflow in overflows:
        used.append(float(state.scale))
        state = scaler.update(state, overflow)
    want, final = deepspeed_rules(overflows, 2.0 ** power * min_scale, window, hysteresis, min_scale, consecutive)
    assert used == want and float(state.scale) == final
    assert int(state.skipped) == sum(overflows)


SCRIPT = [set(), {1}, set(), {0}, {0, 1}, set(), set(), set(), set(), {1}]  # ranks that overflow, per step
SCALER = dict(init_scale=2.0 ** 10, window=3, hysteresis=2, min_scale=1.0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_inf_on_one_rank_skips_every_rank_and_follows_the_rules(stage):
    """Steps where some rank's gradient has an inf are skipped everywhere, the parameters,
    master weights and moments untouched bit for bit, and the scale moves as DeepSpeed's would."""
    prec = {"dtype": torch.float16, "loss_scale": zf.LossScaler(**SCALER)}
    results = workers(2).run(run_composed, "deep_mlp", {"d_in": 3, "width": 6, "depth": 2, "d_out": 2}, stage,
                             len(SCRIPT), 2, 0, prec, None, None, False, None, False, SCRIPT)
    want, _ = deepspeed_rules([bool(r) for r in SCRIPT], SCALER["init_scale"], 3, 2, 1.0, False)
    for r in results:
        h = r["history"]
        assert [x["loss_scale"] for x in h] == want
        assert [x["skipped"] for x in h] == [bool(s) for s in SCRIPT]
        assert [x["unchanged"] for x in h] == [bool(s) for s in SCRIPT]  # skipped: bit for bit
        assert h[-1]["skipped_steps"] == sum(bool(s) for s in SCRIPT)


def _stuck(limit: int) -> str:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))

    def loss_fn(params, x):
        return zf.apply(model, params, x).sum() * float("inf")

    step = zf.mixed_precision(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), torch.float16,
                              loss_scale=zf.LossScaler(init_scale=4.0, max_stuck_steps=limit))
    state = step.init(model)
    for i in range(20):
        try:
            state, m = step(state, torch.ones(2, 3))
        except FloatingPointError as e:
            return f"step {i}: {e}"
    return "trained on"


def test_a_scale_stuck_at_the_minimum_raises_saying_what_to_try():
    message = _stuck(5)
    # step 0 uses up the hysteresis at 4, step 1 halves to 2, step 2 to 1 (the minimum),
    # steps 3-7 overflow at the minimum: the fifth raises
    assert message.startswith("step 7: fp16 gradients have overflowed (inf or NaN) on 5 consecutive steps")
    assert "bf16" in message and "learning rate" in message
