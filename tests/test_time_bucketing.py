"""Time-bucketed gradient sync: clustering, the agreed plan, re-profiling on drift, no deadlock."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import init_gloo, run_spawned
from torch import nn

from lightning_hier import HierSlicedEngine, TimeBuckets, Topology
from lightning_hier.bucketing.size_plan import ParamInfo
from lightning_hier.bucketing.time_bucketing import StepTimeline, TimeBucketing
from lightning_hier.bucketing.time_plan import TimePlan, cluster_ready_times, plan_misfit, plan_time_buckets


def _infos(n: int, numel: int = 256, keys: list | None = None) -> list[ParamInfo]:
    return [ParamInfo(i, numel, 4, keys[i] if keys else "g") for i in range(n)]


def test_gap_clustering_finds_known_clusters() -> None:
    # three bursts of gradients: ~1 ms, ~10 ms, ~20 ms after backward started
    times = [1.0e-3, 1.2e-3, 1.1e-3, 10.0e-3, 10.2e-3, 20.0e-3]
    clusters = cluster_ready_times(times, [1024] * 6, gap_threshold=0.5e-3, min_bytes=0, cap_bytes=1 << 30)
    assert clusters == [[0, 2, 1], [3, 4], [5]]


def test_clusters_respect_min_bytes_and_cap() -> None:
    times = [1.0e-3, 1.2e-3, 10.0e-3, 20.0e-3, 20.1e-3, 20.2e-3]
    merged = cluster_ready_times(
        times, [1024] * 6, gap_threshold=0.5e-3, min_bytes=3 * 1024, cap_bytes=1 << 30
    )
    assert merged == [[0, 1, 2], [3, 4, 5]]  # the 2 KB and 1 KB bursts merge forward until >= 3 KB
    split = cluster_ready_times(times, [1024] * 6, gap_threshold=0.5e-3, min_bytes=0, cap_bytes=2 * 1024)
    assert split == [[0, 1], [2], [3, 4], [5]]  # the 3 KB burst is split by the 2 KB cap


def test_time_plan_points_unseen_params_and_group_keys() -> None:
    infos = _infos(5, keys=["a", "a", "b", "a", "a"])
    ready = [2e-3, 2.1e-3, 2.05e-3, 9e-3, None]
    plan = plan_time_buckets(infos, ready, backward_seconds=10e-3, cap_bytes=1 << 30, min_bytes=0)
    # burst 1 holds keys a and b -> two buckets; burst 2; never-ready parameter last
    assert plan.plan.buckets == ((0, 1), (2,), (3,), (4,))
    assert plan.time_points == pytest.approx((2.1e-3, 2.05e-3, 9e-3, 10e-3))
    assert plan.bucket_bytes == (2048, 1024, 1024, 1024)
    assert plan.plan.kind == "time"


@pytest.mark.parametrize(
    ("kwargs", "valid"),
    [
        ({"profile_steps": 0}, "an integer >= 1"),
        ({"profile_steps": 2.0}, "an integer >= 1"),
        ({"profile_steps": True}, "an integer >= 1"),
        ({"warmup_steps": -1}, "an integer >= 0"),
        ({"reprofile_threshold": 0.0}, "a number in (0, 1]"),
        ({"reprofile_threshold": 1.5}, "a number in (0, 1]"),
        ({"reprofile_threshold": float("nan")}, "a number in (0, 1]"),
        ({"reprofile_threshold": "0.5"}, "a number in (0, 1]"),
        ({"reprofile_check_every": 0}, "an integer >= 1"),
        ({"min_bucket_mb": -1.0}, "a number in [0, 8796093022208]"),
        ({"min_bucket_mb": float("inf")}, "a number in [0, 8796093022208]"),
    ],
)
def test_a_bad_time_buckets_field_is_refused_naming_field_value_and_range(kwargs: dict, valid: str) -> None:
    [(name, value)] = kwargs.items()
    with pytest.raises(ValueError) as info:
        TimeBuckets(**kwargs)
    assert str(info.value) == f"TimeBuckets({name}={value!r}): {name} must be {valid}."


def test_time_buckets_are_frozen_and_time_means_the_defaults() -> None:
    from dataclasses import FrozenInstanceError

    from lightning_hier import HierSlicedStrategy

    with pytest.raises(FrozenInstanceError):
        TimeBuckets().profile_steps = 5  # type: ignore[misc]
    assert HierSlicedStrategy(bucketing="time").time_config == TimeBuckets()
    custom = TimeBuckets(profile_steps=5, warmup_steps=0, reprofile_check_every=7, min_bucket_mb=0.5)
    strategy = HierSlicedStrategy(bucketing=custom)
    assert strategy.bucketing == "time" and strategy.time_config is custom
    assert HierSlicedStrategy(bucketing="none").bucketing == "none"


def test_the_time_buckets_drive_the_controller() -> None:
    custom = TimeBuckets(profile_steps=5, warmup_steps=2, reprofile_threshold=0.5, reprofile_check_every=7)
    controller = TimeBucketing(_infos(2), 1 << 30, custom)
    assert (controller.profile_steps, controller.warmup_steps) == (5, 2)
    assert (controller.reprofile_threshold, controller.check_every) == (0.5, 7)
    assert controller.min_bucket_bytes == 1 << 20


@pytest.mark.parametrize("bucketing", ["fast", "Time", None, 3])
def test_unknown_bucketing_is_refused(bucketing: object) -> None:
    from lightning_hier import HierSlicedStrategy

    with pytest.raises(ValueError) as info:
        HierSlicedStrategy(bucketing=bucketing)  # type: ignore[arg-type]
    message = str(info.value)
    assert f"bucketing={bucketing!r}" in message and "['size', 'time', 'none']" in message, message
    assert "TimeBuckets" in message, message


def _decide_with_noisy_times(rank: int, world: int, store: str) -> dict:
    init_gloo(rank, world, store)
    infos = _infos(6)
    controller = TimeBucketing(
        infos, cap_bytes=1 << 30, config=TimeBuckets(profile_steps=2, warmup_steps=0, min_bucket_mb=0)
    )
    generator = torch.Generator().manual_seed(rank)
    base = [1e-3, 1.01e-3, 5e-3, 5.01e-3, 9e-3, 9.01e-3]
    if rank == 0:  # rank 0 alone sees parameter 1 late: on its own times it would get a bucket of its own
        base[1] = 1.6e-3
    plan = None
    for _ in range(2):
        # every rank measures different times (up to 3% off, and a different backward duration)
        noisy = [t * (1 + 0.03 * float(torch.rand(1, generator=generator))) for t in base]
        controller.observe(StepTimeline(0.0, 10e-3 + rank * 1e-3, noisy), frozenset(range(6)))
        plan = controller.after_step(frozenset(range(6))) or plan
    return {"plan": plan.to_dict()}


def test_plan_is_identical_on_every_rank_despite_different_measurements(tmp_path: Path) -> None:
    results = run_spawned(_decide_with_noisy_times, 4, tmp_path)
    plans = [r["plan"] for r in results]
    assert all(p == plans[0] for p in plans)
    # the plan comes from the times averaged over all ranks, not from the deciding rank's own
    assert plans[0]["buckets"] == [[0, 1], [2, 3], [4, 5]]
    rank0_alone = plan_time_buckets(
        _infos(6), [1e-3, 1.6e-3, 5e-3, 5.01e-3, 9e-3, 9.01e-3], 10e-3, 1 << 30, 0, 0.02
    )
    assert [list(b) for b in rank0_alone.plan.buckets] == [[0], [1], [2, 3], [4, 5]]


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a layer whose gradient takes ``delay`` seconds."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, delay: float) -> torch.Tensor:  # noqa: ANN001
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        time.sleep(ctx.delay)
        return grad, None


class DelayedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.delays = [0.01] * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, delay in zip(self.layers, self.delays):
            x = torch.tanh(layer(SlowBackward.apply(x, delay)))
        return x


def _drift_run(rank: int, world: int, store: str, slow_down_at: int | None) -> dict:
    init_gloo(rank, world, store)
    torch.manual_seed(0)
    model = DelayedStack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = TimeBuckets(profile_steps=2, warmup_steps=1, reprofile_check_every=4, min_bucket_mb=0)
    engine = HierSlicedEngine(
        model, optimizer, Topology(world, rank, 1).build_groups(), bucketing="time", time_config=config,
        bucket_cap_mb=0.001,
    )  # fmt: skip
    plans = []
    for step in range(20):
        if step == slow_down_at:
            model.delays[1] = 0.08  # a layer becomes much slower mid-run
        x = torch.randn(8, 16)
        engine.begin_backward()
        model(x).pow(2).mean().backward()
        engine.finish_backward()
        optimizer.step()
        engine.after_step()
        plans.append(engine.time_bucketing.plans_made)
    engine.close()
    return {"plans": plans, "plan": engine.time_bucketing.plan.to_dict()}


def test_reprofiles_when_a_layer_becomes_slower(tmp_path: Path) -> None:
    results = run_spawned(_drift_run, 2, tmp_path, 8)
    for result in results:
        assert result is not None and "error" not in result, result
        assert result["plans"][3] == 1  # first plan after 1 warm-up + 2 profiled steps
        assert result["plans"][-1] == 2  # drift noticed at a check, profiled again, new plan
    assert results[0]["plan"] == results[1]["plan"]


def test_does_not_reprofile_when_timing_is_steady(tmp_path: Path) -> None:
    results = run_spawned(_drift_run, 2, tmp_path, None)
    for result in results:
        assert result is not None and "error" not in result, result
        assert result["plans"][-1] == 1


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.left = nn.Linear(8, 2)
        self.right = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        return getattr(self, branch)(torch.tanh(self.trunk(x)))


def _branch(rank: int, step: int) -> str:
    return "left" if (rank + step) % 2 == 0 else "right"


def _rank_dependent_graph(rank: int, world: int, store: str) -> dict:
    init_gloo(rank, world, store)
    torch.manual_seed(0)
    model = TwoBranches()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    config = TimeBuckets(profile_steps=1, warmup_steps=0, min_bucket_mb=0)
    engine = HierSlicedEngine(
        model, optimizer, Topology(world, rank, 2).build_groups(), bucketing="time", time_config=config,
        bucket_cap_mb=0.0001,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(5)
    for step in range(5):
        xs = torch.randn(world, 4, 8, generator=generator)
        model(xs[rank], _branch(rank, step)).pow(2).mean().backward()
        engine.finish_backward()
        optimizer.step()
        engine.after_step()
    engine.close()
    return {"params": [p.detach().clone() for p in model.parameters()]}


def test_rank_dependent_graph_neither_deadlocks_nor_changes_the_math(tmp_path: Path) -> None:
    results = run_spawned(_rank_dependent_graph, 4, tmp_path)
    torch.manual_seed(0)
    reference = TwoBranches()
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(5)
    for step in range(5):
        xs = torch.randn(4, 4, 8, generator=generator)
        optimizer.zero_grad()
        loss = sum(reference(xs[r], _branch(r, step)).pow(2).mean() for r in range(4)) / 4
        loss.backward()
        optimizer.step()
    for result in results:
        assert result is not None and "error" not in result, result
        for got, want in zip(result["params"], reference.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def _saved_plan(infos: list[ParamInfo]) -> TimePlan:
    ready = [1e-3, 1.01e-3, 5e-3, 5.01e-3, 9e-3, 9.01e-3][: len(infos)]
    return plan_time_buckets(infos, ready, 10e-3, 1 << 30, 0, 0.02)


def test_a_saved_plan_must_fit_sizes_dtypes_and_groups_not_only_indices() -> None:
    infos = _infos(6)
    plan = _saved_plan(infos)
    assert plan_misfit(plan, infos) is None
    assert "held" in plan_misfit(plan, _infos(6, numel=512))  # same count, other shapes
    other_dtype = [ParamInfo(i, 256, 2 if i == 1 else 4, "g") for i in range(6)]
    assert "bytes" in plan_misfit(plan, other_dtype)
    other_groups = _infos(6, keys=["g", "h", "g", "g", "g", "g"])  # 0 and 1 share a bucket
    assert "mix" in plan_misfit(plan, other_groups)
    assert "covers" in plan_misfit(plan, _infos(5))


def test_a_restored_plan_still_reprofiles_when_the_used_parameters_change() -> None:
    infos = _infos(6)
    controller = TimeBucketing(infos, 1 << 30, TimeBuckets(reprofile_check_every=2, min_bucket_mb=0))
    controller.restore(_saved_plan(infos))
    timeline = StepTimeline(0.0, 10e-3, [1e-3] * 6, bucket_launch=[1e-3, 5e-3, 9e-3])
    everything, fewer = frozenset(range(6)), frozenset(range(5))
    for used in (everything, everything, fewer, fewer):
        controller.observe(timeline, used)
        controller.after_step(used)
    assert controller.profiling, "parameter 5 stopped producing gradients: the restored plan is stale"


def test_with_timelines_one_step_late_the_cold_first_step_stays_out_of_the_plan() -> None:
    """On CUDA a step's timeline arrives at the next step's end (events are read one step late). The cold
    first step (lazy CUDA and NCCL set-up) must not be profiled, and the plan must wait for the last
    profiled step to arrive: the plan equals the one made from the steady steps alone."""
    infos = _infos(6)
    config = TimeBuckets(profile_steps=2, warmup_steps=1, min_bucket_mb=0)
    controller = TimeBucketing(infos, 1 << 30, config, resolves_late=True)
    steady_ready = [1e-3, 1.01e-3, 5e-3, 5.01e-3, 9e-3, 9.01e-3]
    cold = StepTimeline(0.0, 40e-3, [1e-3, 30e-3, 31e-3, 32e-3, 39e-3, 39.5e-3])
    steady = StepTimeline(0.0, 10e-3, steady_ready)
    used = frozenset(range(6))
    pending, decided = None, []
    for step in range(5):
        assert controller.step == step
        if pending is not None:  # what the clock resolves at this step's end: the previous step
            controller.observe(pending[1], used, step=pending[0])
        pending = (step, cold if step == 0 else steady)
        plan = controller.after_step(used)
        if plan is not None:
            decided.append((step, plan))
    expected = plan_time_buckets(infos, steady_ready, 10e-3, 1 << 30, 0, controller.gap_fraction)
    assert [step for step, _ in decided] == [3], "decided before the last profiled step had arrived"
    assert decided[0][1].plan == expected.plan
    assert decided[0][1].time_points == pytest.approx(expected.time_points)


def test_a_timeline_of_the_layout_before_a_rebuild_is_not_taken_for_drift() -> None:
    infos = _infos(6)
    controller = TimeBucketing(infos, 1 << 30, TimeBuckets(min_bucket_mb=0), resolves_late=True)
    controller.restore(_saved_plan(infos))
    shifted = StepTimeline(0.0, 10e-3, [1e-3] * 6, bucket_launch=[8e-3, 8.5e-3, 9e-3])
    controller.observe(shifted, frozenset(range(6)), step=5, same_layout=False)
    assert controller.drift == 0.0
    controller.observe(shifted, frozenset(range(6)), step=6, same_layout=True)
    assert controller.drift > 0.1  # the same timeline on the plan's own layout is drift
