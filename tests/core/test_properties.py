"""Property-based equivalence: drawn shapes, world sizes, unit policies and stages."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from assertions import assert_close_to
from cases import is_linear, reference, run_zfunc
from workers import workers


@st.composite
def configs(draw):
    depth = draw(st.integers(0, 4))
    # width >= 2: LayerNorm over one feature outputs its bias alone, and its
    # weight's gradient is rounding noise, which Adam scales up to steps of
    # size lr whose sign depends on how the batch is split across ranks
    kw = {"d_in": draw(st.integers(1, 6)), "width": draw(st.integers(2, 9)), "depth": depth,
          "d_out": draw(st.integers(1, 4))}
    policy = draw(st.sampled_from(["default", "linears", "list"] if depth else ["default", "linears"]))
    if policy == "default":
        units = None
    elif policy == "linears":
        units = is_linear
    else:
        chosen = draw(st.sets(st.integers(0, depth - 1), min_size=1))
        units = [f"blocks.{i}" for i in sorted(chosen)] + draw(st.sampled_from([[], ["out"]]))
    stage = draw(st.integers(0, 3))
    # where the unit policy is given, and so the order of the transforms:
    # zero3(f, units=), zf.units(zeroN(f)), zeroN(zf.units(f)), train_step(units=)
    via = draw(st.sampled_from(["zero3", "outer", "inner", "base"] if stage == 3 else ["outer", "inner", "base"]))
    return {
        "kw": kw,
        "units_via": via,
        "world": draw(st.sampled_from([1, 2, 3])),
        "stage": stage,
        "units": units,
        "threshold": draw(st.sampled_from([0, 0, 12])),
        "per_rank": draw(st.integers(1, 3)),
        "clip": draw(st.sampled_from([None, None, 0.1])),
    }


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_any_composition_matches_pytorch(c):
    world = c["world"]
    expected = reference("deep_mlp", c["kw"], steps=3, batch_size=c["per_rank"] * world, clip=c["clip"])
    results = workers(world).run(run_zfunc, "deep_mlp", c["kw"], c["stage"], 3, c["per_rank"], 0,
                                 c["units"], c["threshold"], c["clip"], c["units_via"])
    for r in results:
        assert_close_to(r["params"], expected["params"])
