"""pipeline/warmup.py: 1F1B warm-up counts, the step they give, and when extra warm-up forwards pay."""

from __future__ import annotations

from functools import partial

import pytest

from lightning_hier.pipeline.warmup import choose_extra_warmup, fits_in_memory, simulate_step, warmup_counts


def test_warmup_counts_add_each_stages_extra_to_the_stages_before_it_and_cap_at_the_micro_batches() -> None:
    assert warmup_counts(2, 4) == [2, 1]  # 1F1B: S - s
    assert warmup_counts(4, 8) == [4, 3, 2, 1]
    assert warmup_counts(2, 4, [1]) == [3, 1]
    assert warmup_counts(4, 8, [0, 2, 0]) == [6, 5, 2, 1]  # stage 1's two extra reach stage 0 too
    assert warmup_counts(3, 2, [5, 0]) == [2, 2, 1]  # never more than the micro-batches
    assert warmup_counts(2, 4, [1, 7]) == [3, 1]  # the last stage's entry is not used
    with pytest.raises(ValueError, match=">= 0"):
        warmup_counts(2, 4, [-1])


@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (3, 6), (4, 8), (4, 3)])
def test_balanced_1f1b_takes_micro_plus_stages_minus_one_slots(stages: int, micro: int) -> None:
    forward, backward = 2.0, 3.0
    step = simulate_step([forward] * stages, [backward] * stages, micro, warmup_counts(stages, micro))
    assert step == pytest.approx((micro + stages - 1) * (forward + backward))


def test_one_extra_forward_on_a_slower_first_stage_reaches_the_bound() -> None:
    # a skewed 2-stage stack (9 narrow blocks, then 7 wide ones) as measured (ms per micro-batch): stage 0
    # 13.7, stage 1 11.9
    forward, backward = [5.3, 4.6], [8.4, 7.3]
    # 1F1B by hand: stage 0 waits after F1 for stage 1's F0 + B0 and again before its B3 for stage 1's F3
    # + B3, which stage 1 starts only after stage 0's F3 (sent after B1): 64.9
    assert simulate_step(forward, backward, 4, [2, 1]) == pytest.approx(64.9)
    # with F2 before B0, stage 1 never waits after its first forward: stage 0's F0, stage 1's four
    # micro-batches, stage 0's last backward, the least any order can take
    bound = forward[0] + 4 * (forward[1] + backward[1]) + backward[0]
    assert simulate_step(forward, backward, 4, [3, 1]) == pytest.approx(bound) == pytest.approx(61.3)
    assert choose_extra_warmup(forward, backward, 4) == [1, 0]


def test_no_extra_forwards_where_they_buy_nothing() -> None:
    assert choose_extra_warmup([1.0, 1.0], [2.0, 2.0], 4) == [0, 0]  # balanced
    assert choose_extra_warmup([1.0, 2.0], [2.0, 4.0], 4) == [0, 0]  # the last stage is the slow one
    assert choose_extra_warmup([9.0, 1.0], [18.0, 2.0], 4) == [0, 0]  # gradients return before needed
    assert choose_extra_warmup([1.0], [2.0], 4) == [0]  # one stage


def test_a_stage_running_ahead_of_what_it_was_sent_is_a_deadlock() -> None:
    with pytest.raises(ValueError, match="deadlock"):
        simulate_step([1.0, 1.0], [2.0, 2.0], 4, [1, 2])


def test_on_a_gpu_extra_forwards_stop_where_a_stage_would_outgrow_its_memory() -> None:
    forward, backward = [5.3, 4.6], [8.4, 7.3]  # one extra forward on stage 0 pays (above)
    # stage 0 peaked at 40 of 100 GB holding 2 micro-batches: 3 would need 60 GB, within 90 % of it
    assert fits_in_memory([40, 10], [100, 100], [2, 1], [3, 1])
    # at 70 GB with 2, 3 would need 105 GB: more than the device
    assert not fits_in_memory([70, 10], [100, 100], [2, 1], [3, 1])
    assert fits_in_memory([70, 10], [None, None], [2, 1], [3, 1])  # host memory: not limited here
    assert fits_in_memory([70, 95], [100, 100], [2, 1], [2, 1])  # no stage holds more than it did
    tight = partial(fits_in_memory, [70, 10], [100, 100], [2, 1])
    roomy = partial(fits_in_memory, [40, 10], [100, 100], [2, 1])
    assert choose_extra_warmup(forward, backward, 4, fits=tight) == [0, 0]
    assert choose_extra_warmup(forward, backward, 4, fits=roomy) == [1, 0]
