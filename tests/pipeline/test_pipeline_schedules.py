"""Pipeline schedules as data (zfunc.pipeline.schedules): the lists themselves, checked without running a model."""
import pytest
from hypothesis import given, settings, strategies as st

from zfunc.pipeline import schedules as S

SIZES = dict(micro_batches=st.integers(1, 12), stages=st.integers(1, 6), name=st.sampled_from(["1f1b", "gpipe"]))


def _all(name, m, p):
    return [S.schedule(name, m, p, s) for s in range(p)]


@settings(max_examples=150, deadline=None)
@given(**SIZES)
def test_every_micro_batch_goes_forward_then_backward_once_per_stage(micro_batches, stages, name):
    for s, program in enumerate(_all(name, micro_batches, stages)):
        fwd = [i.micro_batch for i in program if isinstance(i, S.Forward)]
        bwd = [i.micro_batch for i in program if isinstance(i, S.Backward)]
        assert sorted(fwd) == sorted(bwd) == list(range(micro_batches))
        for m in range(micro_batches):
            assert program.index(S.Forward(m)) < program.index(S.Backward(m))
        assert program[-3:] == [S.ReduceTiedGrads(), S.ReduceGrads(), S.OptimizerStep()]


@settings(max_examples=150, deadline=None)
@given(**SIZES)
def test_sends_match_receives_across_stages_in_order(micro_batches, stages, name):
    programs = _all(name, micro_batches, stages)
    for s in range(stages - 1):
        sent = [i.micro_batch for i in programs[s] if isinstance(i, S.SendActivation)]
        received = [i.micro_batch for i in programs[s + 1] if isinstance(i, S.RecvActivation)]
        assert sent == received == list(range(micro_batches))
        grads_sent = [i.micro_batch for i in programs[s + 1] if isinstance(i, S.SendGrad)]
        grads_received = [i.micro_batch for i in programs[s] if isinstance(i, S.RecvGrad)]
        assert grads_sent == grads_received
    assert not any(isinstance(i, (S.RecvActivation, S.SendGrad)) for i in programs[0])
    assert not any(isinstance(i, (S.SendActivation, S.RecvGrad)) for i in programs[-1])


@settings(max_examples=150, deadline=None)
@given(micro_batches=st.integers(1, 12), stages=st.integers(1, 6))
def test_1f1b_keeps_at_most_p_minus_s_micro_batches_in_flight(micro_batches, stages):
    for s, program in enumerate(_all("1f1b", micro_batches, stages)):
        live = peak = 0
        for i in program:
            live += isinstance(i, S.Forward) - isinstance(i, S.Backward)
            peak = max(peak, live)
        assert peak == min(stages - s, micro_batches)
    # GPipe holds every micro-batch
    for program in _all("gpipe", micro_batches, stages):
        assert max(sum(isinstance(i, S.Forward) for i in program[:k]) for k in range(len(program) + 1)) == micro_batches


def _run(programs) -> list[list]:
    """Execute with non-blocking sends and blocking receives, one instruction at a time on
    whichever stage can move; returns the order of completed instructions per stage
    (raises if every stage is stuck: a deadlock)."""
    pc = [0] * len(programs)
    mailbox = set()
    done = [[] for _ in programs]
    while any(pc[s] < len(p) for s, p in enumerate(programs)):
        moved = False
        for s, p in enumerate(programs):
            if pc[s] == len(p):
                continue
            i = p[pc[s]]
            if isinstance(i, S.RecvActivation) and ("act", s - 1, i.micro_batch) not in mailbox:
                continue
            if isinstance(i, S.RecvGrad) and ("grad", s + 1, i.micro_batch) not in mailbox:
                continue
            if isinstance(i, S.SendActivation):
                mailbox.add(("act", s, i.micro_batch))
            if isinstance(i, S.SendGrad):
                mailbox.add(("grad", s, i.micro_batch))
            done[s].append(i)
            pc[s] += 1
            moved = True
        assert moved, f"deadlock at {[p[pc[s]] if pc[s] < len(p) else None for s, p in enumerate(programs)]}"
    return done


@settings(max_examples=100, deadline=None)
@given(**SIZES)
def test_schedules_never_deadlock(micro_batches, stages, name):
    _run(_all(name, micro_batches, stages))


def test_a_schedule_prints_as_its_instructions():
    assert S.one_f_one_b(2, 2, 0) == [S.LoadMicroBatch(0), S.Forward(0), S.SendActivation(0),
                                      S.LoadMicroBatch(1), S.Forward(1), S.SendActivation(1),
                                      S.RecvGrad(0), S.Backward(0), S.RecvGrad(1), S.Backward(1),
                                      S.ReduceTiedGrads(), S.ReduceGrads(), S.OptimizerStep()]
    assert repr(S.Forward(3)) == "Forward(3)"


def test_bad_schedules_are_named():
    import pytest

    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        S.schedule("pipedream", 2, 2, 0)
    with pytest.raises(ValueError, match="0 <= stage < stages"):
        S.schedule("1f1b", 2, 2, 2)


COSTS = st.floats(0.01, 10.0)


@settings(max_examples=100, deadline=None)
@given(**SIZES, forward=COSTS, backward=COSTS)
def test_the_timeline_of_equal_stages_has_the_textbook_bubble(micro_batches, stages, name, forward, backward):
    bubble = S.ideal_bubble(name, micro_batches, [forward] * stages, [backward] * stages)
    assert abs(bubble - (stages - 1) / (micro_batches + stages - 1)) < 1e-9


@settings(max_examples=100, deadline=None)
@given(micro_batches=st.integers(1, 10), name=st.sampled_from(["1f1b", "gpipe"]),
       costs=st.lists(st.tuples(COSTS, COSTS), min_size=1, max_size=5), link=st.floats(0.0, 1.0))
def test_the_timeline_of_unequal_stages_is_bounded_by_the_slowest_and_by_one_trip(micro_batches, name, costs, link):
    """The slowest stage is busy m times; one micro-batch's trip through every stage and back is
    sequential; transfers only add."""
    f, b = [c[0] for c in costs], [c[1] for c in costs]
    span = max(S.timeline(name, micro_batches, f, b, link))
    assert span >= max(micro_batches * (x + y) for x, y in costs) - 1e-9
    assert span >= sum(f) + sum(b) + 2 * (len(costs) - 1) * link - 1e-9
    assert span >= max(S.timeline(name, micro_batches, f, b)) - 1e-9


def test_the_old_name_zf_schedules_warns_and_is_the_pipelines():
    """``zf.schedules`` meant the pipeline's instruction lists beside the lr schedules; it is
    ``zf.pipeline.schedules`` now and the old name still works, with a FutureWarning."""
    import zfunc as zf

    with pytest.warns(FutureWarning, match="zf.pipeline.schedules"):
        old = zf.schedules
    assert old is zf.pipeline.schedules
