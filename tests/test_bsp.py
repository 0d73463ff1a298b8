"""hier_bsp: settings, aggregation arithmetic and controller rules without processes; the engine on 4
plain-torch processes; the strategy against Lightning's ddp."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import init_gloo, run_spawned, run_torchrun
from scripts.bsp_equivalence import SCENARIOS
from torch.utils.data.distributed import DistributedSampler

from lightning_hier import TimeBuckets
from lightning_hier.bsp.aggregate import GradientAggregate
from lightning_hier.bsp.controller import (
    BLOCKED,
    BUSY_MS,
    DEADLINE,
    DRAIN,
    ELAPSED_MS,
    FOLDED,
    INFLIGHT,
    ROW,
    STEP_MS,
    STUCK,
    TickDecision,
    decide,
    safe_to_close,
    slowest_remaining_s,
)
from lightning_hier.bsp.settings import BSPSettings
from lightning_hier.strategies.hier_bsp import HierBSPStrategy


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("superstep", "steps", "seconds"),
    [
        (4, 4, None),
        (1, 1, None),
        ("500ms", None, 0.5),
        ("2s", None, 2.0),
        (" 1.5 min ", None, 90.0),
        ("1h", None, 3600.0),
        ("1e-1s", None, 0.1),
        (timedelta(milliseconds=250), None, 0.25),
    ],
)
def test_superstep_is_a_step_count_or_a_duration(
    superstep: object, steps: int | None, seconds: float | None
) -> None:
    settings = BSPSettings(superstep=superstep)  # type: ignore[arg-type]
    assert settings.superstep_steps == steps
    if seconds is None:
        assert settings.superstep_seconds is None
    else:
        assert settings.superstep_seconds == pytest.approx(seconds)
    assert HierBSPStrategy(superstep=superstep).settings == settings  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "superstep",
    [0, -3, True, 2.5, 1.0, None, "4", "2", "0s", "-1s", "2 seconds", "2sec", "nan s", "inf s", "ms",
     timedelta(0), timedelta(seconds=-1)],
)
def test_a_bad_superstep_is_refused_naming_the_setting_and_the_value(superstep: object) -> None:
    for build in (BSPSettings, HierBSPStrategy):  # the strategy refuses it at construction, before any group
        with pytest.raises(ValueError) as info:
            build(superstep=superstep)  # type: ignore[arg-type]
        message = str(info.value)
        assert message.startswith(f"superstep={superstep!r} is not valid"), message
        assert "positive int" in message and "'500ms'" in message, message


def test_a_float_superstep_says_how_to_write_seconds() -> None:
    with pytest.raises(ValueError, match=r"superstep=0\.5 is not valid \(a bare number is ambiguous: for "
                       r"seconds write '0\.5s'\)"):
        BSPSettings(superstep=0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (dict(max_staleness=-1), "max_staleness must be an integer >= 0, got -1"),
        (dict(max_staleness=1, fill_idle=1), "fill_idle needs max_staleness=0 and a superstep of a step"),
        (
            dict(superstep="1s", max_staleness=0, fill_idle=1),
            "fill_idle needs max_staleness=0 and a superstep of a step count",
        ),
        (dict(max_staleness=0, fill_idle=-1), "fill_idle must be an integer >= 0"),
        (dict(max_staleness=0, fill_idle=True), "fill_idle must be an integer >= 0"),
        (dict(gradient_average="sum"), "gradient_average must be one of"),
        (
            dict(superstep="1s", gradient_average="nominal"),
            "gradient_average='nominal' divides by the superstep's step count x world_size and needs a "
            "superstep of a step count, got superstep='1s'",
        ),
    ],
)
def test_bad_settings_name_the_setting(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=re.escape(names)):
        BSPSettings(**kwargs)
    with pytest.raises(ValueError, match=re.escape(names)):  # refused at construction, before any group
        HierBSPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (dict(bucketing="none"), "bucketing='none' is not one of ['size', 'time'] or a TimeBuckets(...)"),
        (dict(bucketing="time", max_staleness=1), "bucketing='time' times the early push of plain BSP"),
        (
            dict(bucketing=TimeBuckets(), superstep=1, max_staleness=0, fill_idle=1),
            "bucketing='time' times the early push of plain BSP",
        ),
        (dict(bucketing="time", superstep="1s", max_staleness=0), "bucketing='time' times the early push"),
    ],
)
def test_bad_bucketing_settings_name_the_setting(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=re.escape(names)):
        HierBSPStrategy(**kwargs)


def test_bucketing_takes_time_buckets() -> None:
    assert HierBSPStrategy(superstep=1, max_staleness=0, bucketing="time").time_buckets == TimeBuckets()
    custom = TimeBuckets(profile_steps=5, warmup_steps=0, min_bucket_mb=0.25)
    strategy = HierBSPStrategy(superstep=1, max_staleness=0, bucketing=custom)
    assert strategy.bucketing == "time" and strategy.time_buckets is custom


def test_all_gather_is_refused_while_workers_run_free_and_works_when_drained() -> None:
    """In a training step the workers are not in step (and with staleness take different step counts):
    a gather there would pair different steps, or wait forever for one a peer never takes."""
    from types import SimpleNamespace

    strategy = HierBSPStrategy(superstep=1, max_staleness=1)
    strategy.engine = SimpleNamespace(memory=SimpleNamespace(paused=False))  # between drains
    value = torch.tensor([1.0, 2.0])
    with pytest.raises(RuntimeError, match="all_gather while hier_bsp's workers run free"):
        strategy.all_gather(value)
    strategy.engine.memory.paused = True  # drained (validation, epoch end): Lightning's own gather
    assert torch.equal(strategy.all_gather(value), value)  # one process: Lightning returns it as is


def test_a_failure_of_the_bsp_thread_is_named_for_what_it_was() -> None:
    from lightning_hier.bsp.liveness import describe_loss

    assert describe_loss(KeyError("sum"), []).startswith("the BSP thread failed")  # not a collective
    assert "KeyError: 'sum'" in describe_loss(KeyError("sum"), [])
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert describe_loss(gloo, []).startswith("a collective failed")
    nccl = torch.distributed.DistBackendError("NCCL error: unhandled system error")
    assert describe_loss(nccl, []).startswith("a collective failed")
    assert describe_loss(KeyError("sum"), [2]).startswith("lost rank(s) [2]")


def test_the_servers_optimizer_copy_keeps_hooks_attributes_and_steps_where_torch_sees_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server steps a copy of the user's optimizer. ``copy.copy`` keeps only what
    ``Optimizer.__getstate__`` lists (defaults, state, param groups): the user's step hooks and own
    attributes would be gone, and with torch's ``_warned_capturable_if_run_uncaptured`` gone Adafactor's
    step on a CUDA machine fails (``KeyError: 'capturable'``, seen on an H200)."""
    import types

    from lightning_hier.bsp.server import server_copy

    # what torch's graph-capture health check reads on a CUDA machine, without one
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda")
    )
    stream = types.SimpleNamespace(is_capturing=lambda: False)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *args, **kwargs: stream)
    weight = torch.nn.Parameter(torch.ones(3, 2))
    user = torch.optim.Adafactor([weight], lr=0.1)
    user.tag = "user's own attribute"
    stepped: list[str] = []
    user.register_step_post_hook(lambda optimizer, args, kwargs: stepped.append(type(optimizer).__name__))
    copied = server_copy(user)
    weight.grad = torch.full_like(weight, 0.5)
    copied.step()  # a copy.copy would fail here: KeyError: 'capturable'
    assert stepped == ["Adafactor"] and copied.tag == "user's own attribute"
    assert copied.state[weight] and not user.state  # the copy's state is its own
    assert copied.param_groups[0] is not user.param_groups[0]
    reference = torch.nn.Parameter(torch.ones(3, 2))
    reference.grad = torch.full_like(reference, 0.5)
    torch.optim.Adafactor([reference], lr=0.1).step()
    assert torch.equal(weight, reference)


def test_quota_is_one_superstep_per_staleness_step() -> None:
    assert BSPSettings(superstep=3, max_staleness=0).quota == 3
    assert BSPSettings(superstep=3, max_staleness=2).quota == 9
    assert BSPSettings(superstep="0.5s").quota is None


# ---------------------------------------------------------------------- aggregation arithmetic
def test_aggregate_sums_counts_and_double_buffers() -> None:
    aggregate = GradientAggregate([torch.zeros(3), torch.zeros(2)])
    aggregate.fold([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 1.0])], version=0)
    aggregate.fold([torch.tensor([0.5, 0.0, -1.0]), torch.tensor([2.0, 0.0])], version=1)
    out = aggregate.read_out()
    assert out.count == 2 and out.versions == [0, 1]
    assert torch.equal(out.sums[0], torch.tensor([1.5, 2.0, 2.0]))
    assert torch.equal(out.sums[1], torch.tensor([3.0, 1.0]))
    # folding goes on into fresh buffers while the read-out is pushed
    aggregate.fold([torch.ones(3), torch.ones(2)], version=2)
    assert torch.equal(out.sums[0], torch.tensor([1.5, 2.0, 2.0]))
    aggregate.recycle(out)
    second = aggregate.read_out()
    assert second.count == 1 and torch.equal(second.sums[0], torch.ones(3))
    assert out.staleness(applied_at=2) == [1, 0]


def test_aggregate_knows_which_parameters_any_micro_step_used() -> None:
    aggregate = GradientAggregate([torch.zeros(2)], num_params=3)
    aggregate.fold([torch.ones(2)], version=0, used=[True, False, False])
    aggregate.fold([torch.ones(2)], version=0, used=[False, False, True])
    assert aggregate.read_out().used == [1, 0, 1]  # parameter 1: left untouched by the server's step
    assert aggregate.read_out().used == [0, 0, 0]  # a fresh superstep starts with none used


def test_buckets_folded_ahead_count_once_and_the_micro_step_once() -> None:
    aggregate = GradientAggregate([torch.zeros(2), torch.zeros(3)])
    aggregate.fold([torch.ones(2), torch.ones(3)], version=0)
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])
    aggregate.fold_bucket(0, first)  # the last micro-step's first bucket, pushed while backward runs
    assert torch.equal(aggregate.sums[0], torch.tensor([2.0, 3.0]))
    aggregate.fold([first, second], version=0, folded=1)
    out = aggregate.read_out()
    assert out.count == 2 and out.versions == [0, 0]
    assert torch.equal(out.sums[0], torch.tensor([2.0, 3.0])) and torch.equal(out.sums[1], second + 1)


def test_early_push_by_default_only_on_cuda_and_never_past_a_gradient_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning.pytorch as pl

    import lightning_hier.strategies.hier_bsp as module

    class Plain(pl.LightningModule):
        pass

    class ChangesGradients(pl.LightningModule):
        def on_after_backward(self) -> None:
            pass

    def wanted(model: pl.LightningModule, early_push: bool | None = None) -> bool:
        strategy = HierBSPStrategy(superstep=1, max_staleness=0)
        strategy._early_push = early_push
        strategy.parallel_devices = [torch.device("cpu")]
        strategy._lightning_module = model
        return strategy._early_push_wanted()

    assert not wanted(Plain())  # CPU: the pushes would take backward's cores
    assert wanted(Plain(), early_push=True)
    monkeypatch.setattr(module, "emulating_cuda", lambda: True)  # as on CUDA
    assert wanted(Plain())
    assert not wanted(ChangesGradients())
    assert not wanted(Plain(), early_push=False)


def test_weighted_mean_counts_micro_steps_not_workers() -> None:
    # worker A folded 3 micro-steps of gradient 1.0, worker B one of gradient 5.0: the mean gradient
    # per micro-step is (3 + 5) / 4 = 2, not the per-worker average (1 + 5) / 2 = 3
    sums = {"a": torch.tensor([3.0]), "b": torch.tensor([5.0])}
    scale = 1.0 / BSPSettings(superstep=1).gradient_divisor(3 + 1, world_size=2)
    assert torch.allclose(sums["a"] * scale + sums["b"] * scale, torch.tensor([2.0]))
    with pytest.raises(ValueError, match="at least one micro-step"):
        BSPSettings().gradient_divisor(0, world_size=2)


def test_nominal_average_weighs_each_micro_step_as_one_ddp_step() -> None:
    # superstep=2 on 4 workers: ddp would average 8 steps; 11 folded (fast workers filled) make
    # an update 11/8 of a ddp step's, 5 (a drain) 5/8 of one
    nominal = BSPSettings(superstep=2, max_staleness=0, fill_idle=1, gradient_average="nominal")
    assert nominal.gradient_divisor(11, world_size=4) == 8
    assert nominal.gradient_divisor(5, world_size=4) == 8
    assert BSPSettings(superstep=2, max_staleness=0).gradient_divisor(11, world_size=4) == 11


# ---------------------------------------------------------------------- controller rules
def row(
    folded: int = 0,
    in_flight: int = -1,
    blocked: bool = False,
    drain: bool = False,
    stuck: bool | None = None,
) -> list[int]:
    """A status row; ``stuck`` (blocked with the newest model picked up) defaults to ``blocked``."""
    r = [0] * ROW
    r[FOLDED], r[INFLIGHT], r[BLOCKED], r[DRAIN] = folded, in_flight, int(blocked), int(drain)
    r[STUCK] = int(blocked if stuck is None else stuck)
    return r


def test_plain_bsp_closes_only_when_every_worker_folded_its_step() -> None:
    settings = BSPSettings(superstep=1, max_staleness=0)
    waiting = [row(1, blocked=True), row(1, blocked=True), row(0, in_flight=3)]
    assert decide(waiting, settings, version=3).close is False
    done = [row(1, blocked=True)] * 3
    assert decide(done, settings, version=3).close is True


def timed_row(folded: int, in_flight: int, step_ms: int, elapsed: int, busy_ms: int | None = None) -> list:
    r = row(folded, in_flight=in_flight)
    r[STEP_MS], r[BUSY_MS], r[ELAPSED_MS] = step_ms, step_ms if busy_ms is None else busy_ms, elapsed
    return r


def test_fill_idle_closes_when_every_worker_folded_its_share_and_fills_until_the_slowest_ends() -> None:
    settings = BSPSettings(superstep=1, max_staleness=0, fill_idle=2)
    # two fast workers filled (2 + 2 folded, more than superstep_steps x world = 3) but the slow one
    # has not folded its step yet: not due (without fill_idle the total alone would close it)
    rows = [timed_row(2, -1, 10, -1), timed_row(2, 7, 10, 4), timed_row(0, 7, 50, 20)]
    assert decide(rows, settings, version=7) == TickDecision()  # neither close nor closing
    assert decide(rows, BSPSettings(superstep=1, max_staleness=0), version=7).closing
    # the slow worker, which still owes its step, folds in 50 - 20 ms; a filling worker (already at
    # its share) does not extend the window
    window = partial(slowest_remaining_s, settings=settings, version=7, own_step_ms=10)
    assert window(rows) == pytest.approx(0.030)
    rows[1] = timed_row(2, 7, 90, 1)
    assert window(rows) == pytest.approx(0.030)
    # slow outside its step (50 ms cycles, 8 ms of them from start to fold), now between steps 30 ms
    # into its cycle: it starts again in 20 ms and folds 8 ms later
    assert window([timed_row(0, -1, 50, 30, busy_ms=8)]) == pytest.approx(0.028)
    # a worker less than 1.5x slower is jitter, not a straggler: nobody fills for it
    assert slowest_remaining_s(rows, settings, version=7, own_step_ms=34) == 0
    # unknown times, another model, blocked, or overdue: no window
    assert slowest_remaining_s(rows, settings, version=7, own_step_ms=0) == 0
    assert window([timed_row(0, 7, 0, 20)]) == 0
    assert window([timed_row(0, 7, 50, -1)]) == 0
    assert window([timed_row(0, 6, 50, 20)]) == 0
    assert window([timed_row(0, 7, 50, 80)]) == 0
    waiting = timed_row(0, -1, 50, 20)
    waiting[BLOCKED] = 1  # between steps, the newest model not picked up yet: it will start from it
    assert window([waiting]) == pytest.approx(0.080)
    waiting[STUCK] = 1  # it cannot start from the newest model either (drained)
    assert window([waiting]) == 0
    done = [timed_row(3, -1, 10, -1), timed_row(1, -1, 10, -1), timed_row(1, -1, 50, -1)]
    for r in done:
        r[BLOCKED] = r[STUCK] = 1
    assert decide(done, settings, version=7).close


def test_a_worker_fills_only_inside_the_window_and_up_to_fill_idle() -> None:
    import time

    from lightning_hier.bsp.shared_memory import SharedModelMemory

    settings = BSPSettings(superstep=1, max_staleness=0, fill_idle=1)
    memory = SharedModelMemory([torch.zeros(4)], settings)
    memory.paused = False
    # two micro-steps: 30 ms cycles, 10 ms of each from start to fold
    start = 100.0
    for k in range(2):
        memory.cycle_ends(start + 0.030 * k)
        memory.cycle_starts(start + 0.030 * k)
        memory.micro_step_folded(start + 0.030 * k + 0.010)
    assert memory.step_s == pytest.approx(0.030) and memory.busy_s == pytest.approx(0.010)
    memory.started_since_pickup = 1  # at its quota (superstep=1)
    memory.fill_version = memory.version
    memory.fill_until = time.monotonic() + 0.5  # a straggler folds in 0.5 s: room for a 10 ms step
    assert not memory.blocked()
    memory.fill_until = time.monotonic() + 0.005  # 5 ms left: the fill would hold up the close
    assert memory.blocked()
    memory.fill_until = time.monotonic() + 0.5
    memory.started_since_pickup = 2  # already filled once: fill_idle=1
    assert memory.blocked()
    memory.started_since_pickup = 1
    memory.fill_version = memory.version - 1  # a window heard for an older model
    assert memory.blocked()
    memory.fill_version, memory.closing = memory.version, True  # the close is due: nobody starts
    assert memory.blocked()
    # a pause (validation, a checkpoint) between two micro-steps is not part of a cycle
    memory.closing, memory.paused = False, True
    memory.cycle_ends(start + 60.0)
    assert memory.step_s == pytest.approx(0.030)


def test_staleness_bound_holds_the_close_for_a_slow_worker() -> None:
    # version 5 is out; a worker still computes from version 3: closing now would apply its gradient
    # at superstep 7, three supersteps after its model (> 2), so the close waits for it
    rows = [row(4), row(4), row(0, in_flight=3)]
    settings = BSPSettings(superstep=2, max_staleness=2)
    assert safe_to_close(rows, version=5, max_staleness=2) is False
    assert decide(rows, settings, version=5).closing is True
    assert safe_to_close(rows, version=4, max_staleness=2) is True
    # with max_staleness=0 an idle worker that is not blocked could still start from the old model
    assert safe_to_close([row(1), row(1, blocked=True)], version=0, max_staleness=0) is False


def test_superstep_seconds_follow_the_controllers_clock_and_drains_flush() -> None:
    settings = BSPSettings(superstep="0.5s", max_staleness=1)
    rows = [row(2), row(1)]
    assert decide(rows, settings, version=0).close is False
    rows[0][DEADLINE] = 1  # only rank 0's clock counts
    assert decide(rows, settings, version=0).close is True
    drained = [row(1, blocked=True, drain=True), row(0, blocked=True, drain=True)]
    decision = decide(drained, settings, version=0)
    assert decision.close and decision.pause
    assert decide([row(0, drain=True), row(0, drain=True)], settings, 0) == type(decision)(pause=True)


def test_a_drain_inside_an_accumulation_window_pauses_without_the_suspended_fold() -> None:
    """Validation in the middle of an accumulation window: every worker is in its drain with its micro-step
    in flight (it folds after the drain). The drain pauses at once (a regression would show as a wait for
    that fold, which only the draining worker itself could make, until the timeout) and closes only what
    keeps every gradient within max_staleness."""
    plain = BSPSettings(superstep=1, max_staleness=0)
    Decision = type(decide([row()], plain, 0))
    mid_window = [row(0, in_flight=3, drain=True), row(0, in_flight=3, drain=True)]
    assert decide(mid_window, plain, version=3) == Decision(pause=True)
    # a fold is waiting too: closing now would make the suspended micro-steps 1 superstep stale
    folded = [row(1, in_flight=3, drain=True), row(0, in_flight=3, drain=True)]
    assert decide(folded, plain, version=3) == Decision(pause=True)
    bounded = BSPSettings(superstep=1, max_staleness=1)
    assert decide(folded, bounded, version=3) == Decision(close=True, pause=True)
    # a worker not yet in its drain may still be computing: nobody pauses before it drains too
    assert decide([row(0, in_flight=3, drain=True), row(0, in_flight=3)], plain, version=3).pause is False


def test_a_superstep_that_cannot_fill_up_closes_with_what_it_has() -> None:
    # two workers ended their epoch (drained), the other two reached their quota of 2 with 3 folded in
    # all: 4 are due, nobody can fold another before a new model, so it closes rather than waits forever
    settings = BSPSettings(superstep=1, max_staleness=1)
    stuck = [
        row(0, blocked=True, drain=True),
        row(0, blocked=True, drain=True),
        row(2, blocked=True),
        row(1, blocked=True),
    ]
    assert decide(stuck, settings, version=2).close is True
    stuck[3][BLOCKED] = stuck[3][STUCK] = 0  # that worker can still fold one: the superstep waits for it
    assert decide(stuck, settings, version=2) == type(decide(stuck, settings, 2))()
    # plain BSP: three workers folded theirs and wait; the fourth reads as blocked only because it has not
    # yet picked up the newest model (its quota counts from its last pick-up). It will fold once it does,
    # so the superstep must not close without it (a race the CI run found).
    plain = BSPSettings(superstep=1, max_staleness=0)
    waiting = [
        row(1, blocked=True),
        row(1, blocked=True),
        row(0, blocked=True, stuck=False),
        row(1, blocked=True),
    ]
    assert decide(waiting, plain, version=2).close is False


class CountingStore:
    """The ``add`` of torch's key-value store, in one process."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]


def test_shared_batches_cover_the_epoch_once_and_a_faster_worker_takes_more() -> None:
    from lightning_hier.bsp.batch_claims import ClaimingSampler

    store = CountingStore()
    n, batch = 103, 8  # 13 chunks, the last one of 7
    samplers = [ClaimingSampler(n, batch, False, "k", rank, 2, seed=5, store=store) for rank in range(2)]
    for epoch in range(2):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        streams = [iter(s) for s in samplers]
        taken: list[list[int]] = [[], []]
        speed = (3, 1)  # rank 0 reads three batches for every one of rank 1's
        while True:
            moved = False
            for rank, stream in enumerate(streams):
                for _ in range(speed[rank] * batch):
                    index = next(stream, None)
                    if index is not None:
                        taken[rank].append(index)
                        moved = True
            if not moved:
                break
        order = torch.randperm(n, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        assert sorted(taken[0] + taken[1]) == list(range(n))  # every sample exactly once, none padded
        assert taken[1][:batch] == order[batch : 2 * batch]  # rank r starts with chunk r, no round trip
        assert len(taken[0]) > 2 * len(taken[1])  # the fast worker took the larger share
    # drop_last leaves out the short chunk; the epoch needs a batch per worker
    assert ClaimingSampler(n, batch, True, "d", 0, 2, store=store).num_chunks == 12
    with pytest.raises(ValueError, match="cannot be shared by 4 workers"):
        ClaimingSampler(20, 8, False, "e", 0, 4, store=store)


def test_equally_fast_workers_fold_the_samples_of_ddps_steps() -> None:
    from lightning_hier.bsp.batch_claims import ClaimingSampler

    store, n, batch, world = CountingStore(), 1437, 32, 4  # the digits benchmark's epoch
    samplers = [ClaimingSampler(n, batch, False, "q", r, world, seed=42, store=store) for r in range(world)]
    streams = [iter(s) for s in samplers]
    ddp = []
    for rank in range(world):
        sampler = DistributedSampler(list(range(n)), num_replicas=world, rank=rank, shuffle=True, seed=42)
        ddp.append(list(sampler))
    # round j: every worker takes one batch (claims in whatever order); together they hold the samples
    # of ddp's step j on the four ranks, in all 11 steps whose batches are full, so a superstep of one
    # micro-step each sums what ddp's step sums (which worker trains on which of them may differ)
    for j in range(11):
        claimed = [next(stream) for stream in streams[::-1] for _ in range(batch)]
        step = [index for rank in range(world) for index in ddp[rank][j * batch : (j + 1) * batch]]
        assert sorted(claimed) == sorted(step), j
    rest = [index for stream in streams for index in stream]
    assert len(rest) == n - 11 * world * batch  # 29 samples, each once (ddp pads them to 4 x 8 with repeats)


def test_only_lightnings_own_distributed_sampler_is_taken_over() -> None:
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from lightning_hier.bsp.batch_claims import why_not_claimed

    data = TensorDataset(torch.arange(64.0))
    ours = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=4, rank=1))
    assert why_not_claimed(ours) is None
    assert "SequentialSampler" in str(why_not_claimed(DataLoader(data, batch_size=4)))
    tiny = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, num_replicas=4, rank=1))
    assert "fewer than the 4 workers" in str(why_not_claimed(tiny))


# ---------------------------------------------------------------------- engine on plain processes
@pytest.fixture(scope="module")
def engine_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bsp") / "engine.json"
    run_torchrun("bsp_checks.py", 4, str(out), timeout=300)
    return json.loads(out.read_text())


def test_plain_bsp_engine_equals_data_parallel_averaging(engine_results: dict) -> None:
    result = engine_results["plain"]
    assert result["reference_moved"] > 1e-2
    assert result["max_rel_diff"] < 1e-5, result
    assert result["supersteps"] == 6


def test_straggler_contributes_less_and_nothing_is_lost(engine_results: dict) -> None:
    result = engine_results["straggler"]
    computed, records = result["computed"], result["records"]
    applied = [sum(r["micro_steps"][w] for r in records) for w in range(4)]
    assert applied == computed  # every micro-step computed was applied, by worker
    fast = sum(computed[:3]) / 3
    assert computed[3] < 0.7 * fast, computed  # the slowed worker did fewer, the others did not wait
    assert max(r["max_staleness"] for r in records) <= 1
    assert any(r["max_staleness"] == 1 for r in records)  # the bound was reached, not just unused
    assert result["same_model_everywhere"]


@pytest.mark.parametrize("scenario", ["handoff_plain", "handoff_straggler"])
def test_every_access_the_two_threads_share_is_ordered_for_separate_streams(
    engine_results: dict, scenario: str
) -> None:
    """On CUDA the local BSP module queues on a stream of its own; the CPU run checks, with counters in
    place of the events, that each shared access waits for the other side's hand-over."""
    result = engine_results[scenario]
    assert result["unordered"] == [], result
    accesses = result["accesses"]
    assert accesses["push"] > 0 and accesses["announce"] > 0 and accesses["_pick_up"] > 0, accesses
    assert accesses["recycle"] > 0 and accesses["call"] == 1 and result["state_entries"] > 0, accesses
    if scenario == "handoff_plain":
        assert accesses["fold_bucket"] > 0 and result["early_or_ready_buckets"] > 0, result


def test_the_stream_checker_finds_a_missing_take_over(engine_results: dict) -> None:
    """Without the module's waits the same run reads folds, overwrites a model being copied and runs a
    task unordered: the checker above can fail."""
    found = engine_results["handoff_broken"]["unordered"]
    assert "push of bucket 0 before its fold was handed over" in found, found
    assert "task ran before the worker's hand-over" in found, found


def test_supersteps_by_the_controllers_clock(engine_results: dict) -> None:
    result = engine_results["timed"]
    computed, records = result["computed"], result["records"]
    assert [sum(r["micro_steps"][w] for r in records) for w in range(4)] == computed
    assert all(r["max_staleness"] == 0 for r in records)  # max_staleness=0: never a superstep late
    # a fast worker's ~0.03 s steps put several micro-steps into each 0.1 s superstep
    assert max(r["micro_steps"][0] for r in records) >= 2
    assert computed[3] < computed[0]
    assert result["same_model_everywhere"]


def test_fill_idle_keeps_gradients_fresh_and_each_micro_step_weighs_a_ddp_step(engine_results: dict) -> None:
    result = engine_results["fill"]
    computed, records = result["computed"], result["records"]
    assert [sum(r["micro_steps"][w] for r in records) for w in range(4)] == computed  # none lost
    assert all(r["max_staleness"] == 0 for r in records)
    # while the slow worker computed its step, fast ones filled: up to 1 + fill_idle micro-steps each
    assert any(r["micro_steps"][0] > r["micro_steps"][3] for r in records), records
    assert all(max(r["micro_steps"]) <= 3 for r in records), records
    assert computed[3] < 0.7 * min(computed[:3]), computed
    # hand-computed: plain SGD, lr 0.05, every gradient 1, each superstep divided by 1 x 4 workers
    expected = 0.05 * sum(computed) / 4
    assert result["moved_min"] == pytest.approx(expected, rel=1e-5)
    assert result["moved_max"] == pytest.approx(expected, rel=1e-5)
    # the mean over folded micro-steps would have moved lr x supersteps instead, visibly less here
    assert 0.05 * len(records) < 0.8 * expected


# ---------------------------------------------------------------------- strategy against ddp
@pytest.fixture(scope="module")
def strategy_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bsp") / "strategy.json"
    run_torchrun("bsp_equivalence.py", 4, str(out), timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_plain_bsp_strategy_matches_ddp(strategy_results: dict, scenario: str) -> None:
    result = strategy_results[scenario]
    assert result["reference_moved"] > 1e-3
    assert result["max_rel_diff"] < 1e-5, result
    assert result["differs_across_ranks"] == 0.0, result  # parameters and buffers: one model everywhere
    assert result["micro_steps"] == [[1, 1, 1, 1]] * 6
    # torch's LR scheduler must see the optimizer as stepped (the server's copy steps for it)
    assert result["scheduler_before_optimizer_warnings"] == 0
    # each parameter's step count (and which have state at all) as in ddp's unsharded optimizer
    assert result["step_counts_bsp"] == result["step_counts"]
    # every superstep's buckets went out as the workers reported them folded in their last micro-step
    # (how many while a backward still ran depends on timing: this model's backward is shorter than a
    # tick), unless turned off
    expected = 0 if scenario.endswith("no_early_push") else result["buckets"]
    if scenario == "sgd_time_buckets":
        # one size bucket for the warmup and the 2 profiled micro-steps, then the time plan's buckets
        plan = result["time_plan"]
        assert result["supersteps_before_rebuild"] == 3
        assert sorted(i for bucket in plan["buckets"] for i in bucket) == list(range(6))
        assert len(plan["buckets"]) == result["buckets"] >= 2
        assert result["ready_buckets"] == [1] * 3 + [result["buckets"]] * 3
        return
    assert result["ready_buckets"] == [expected] * 6
    if result["validated_at"] is not None:  # at ddp's global steps
        ddp, ours = result["validated_at"]
        assert ours == ddp, result["validated_at"]
        if scenario == "sgd_max_steps_mid_epoch_validation":  # at step 4, none added at max_steps (step 6)
            assert ddp == [4]
        else:  # validated twice at some global step: once inside an accumulation window
            assert len(ddp) > len(set(ddp)), ddp
    if scenario == "adam_partly_used_one_bucket":  # used in steps 0 and 3 of 6: its own count
        assert sorted(set(result["step_counts"].values())) == [2.0, 6.0]


def test_skipped_training_steps_on_one_process_equal_the_single_device_run(tmp_path: Path) -> None:
    """training_step returning None on every other batch (allowed on one process): plain BSP takes the
    same steps and parameters as Lightning's single-device strategy (a regression would show as the next
    step waiting for a model that never comes, until the timeout)."""
    out = tmp_path / "skipped.json"
    run_torchrun("bsp_skipped_steps.py", 1, str(out), timeout=120)
    result = json.loads(out.read_text())
    assert result["steps"][0] == result["steps"][1] == 32  # 2 epochs x 16 batches, skipped ones counted
    assert result["max_rel_diff"] < 1e-5, result


def test_manual_optimization_is_refused_before_any_process_group(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from scripts.models import EquivModel, loader

    class Manual(EquivModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=HierBSPStrategy(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(ValueError, match="automatic optimization only"):
        trainer.fit(Manual(), train_dataloaders=loader())
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("settings", "trainer_kwargs", "message"),
    [
        (
            dict(superstep="0.1s", max_staleness=0),
            dict(max_epochs=1, val_check_interval=0.5),
            r"val_check_interval=0.5 with HierBSPStrategy\(superstep='0.1s'\)",
        ),
        (
            dict(max_staleness=2),
            dict(max_epochs=1, checkpoint_every_n_train_steps=2),
            r"every_n_train_steps.*max_staleness=2.*every_n_epochs",
        ),
    ],
)
def test_step_counted_settings_are_refused_when_workers_take_different_step_counts(
    tmp_path: Path, settings: dict, trainer_kwargs: dict, message: str
) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint
    from scripts.models import EquivModel, loader

    every = trainer_kwargs.pop("checkpoint_every_n_train_steps", None)
    callbacks = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every)] if every else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=HierBSPStrategy(**settings), logger=False,
        enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
        default_root_dir=tmp_path, **trainer_kwargs,
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        trainer.fit(EquivModel(), train_dataloaders=loader(), val_dataloaders=loader())
    assert not dist.is_initialized()


def test_only_step_counted_supersteps_without_staleness_run_workers_in_lockstep() -> None:
    assert BSPSettings(superstep=2, max_staleness=0).lockstep
    assert not BSPSettings(superstep=2, max_staleness=1).lockstep
    # by time, a faster worker folds more micro-steps into each superstep even without staleness
    assert not BSPSettings(superstep="0.5s", max_staleness=0).lockstep
    assert HierBSPStrategy(superstep="0.5s", max_staleness=0).share_batches
    assert not HierBSPStrategy(superstep=1, max_staleness=0).share_batches
    strategy = HierBSPStrategy(superstep=1, max_staleness=0)
    strategy._share_batches = True  # the tuning attribute overrides the lockstep default
    assert strategy.share_batches


# ---------------------------------------------------------------------- strategy: asynchronous, resumed
@pytest.fixture(scope="module")
def lightning_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bsp_lightning")
    run_torchrun("bsp_lightning_checks.py", 4, str(out), timeout=600)
    return json.loads((out / "results.json").read_text())


def logged_supersteps(result: dict) -> tuple[list[dict], list[int]]:
    """The per-superstep rows rank 0 logged to its CSV, and the micro-steps of each rank they applied."""
    import csv

    with open(result["metrics_csv"]) as f:
        rows = [r for r in csv.DictReader(f) if r.get("bsp/micro_steps")]
    return rows, [sum(int(float(r[f"bsp/micro_steps_rank{w}"])) for r in rows) for w in range(4)]


@pytest.mark.parametrize("scenario", ["straggler", "fixed_shards", "timed", "fill"])
def test_straggler_under_lightning_from_the_logged_supersteps(lightning_results: dict, scenario: str) -> None:
    result = lightning_results[scenario]
    rows, applied = logged_supersteps(result)
    assert applied == result["computed"]  # every optimizer step a worker took reached the server
    assert sum(int(float(r["bsp/micro_steps"])) for r in rows) == sum(result["computed"])
    worst = max(float(r["bsp/staleness_max"]) for r in rows)
    assert worst == 0 if scenario in ("timed", "fill") else worst <= 1
    fast, slow = result["computed"][:3], result["computed"][3]
    assert slow < 0.8 * min(fast), result["computed"]  # the others went on without it
    assert all(float(r["bsp/push_bytes"]) > 0 and float(r["bsp/pull_s"]) >= 0 for r in rows)
    assert result["same_model_everywhere"]
    if scenario != "straggler":  # validated at both epoch ends on every rank, however many steps each took
        assert result["validations"] == [2] * 4, result
    if scenario in ("timed", "fill"):  # a superstep where the fast workers folded more than the straggler
        assert any(float(r["bsp/micro_steps_rank0"]) > float(r["bsp/micro_steps_rank3"]) for r in rows)
    if scenario == "fill":  # fill_idle=1: at most one micro-step beyond superstep=1
        assert max(float(r[f"bsp/micro_steps_rank{w}"]) for r in rows for w in range(4)) <= 2
    if scenario != "fixed_shards":  # shared batches: the fast workers took the straggler's share
        assert result["each_sample_once_per_epoch"], result["samples"]
        assert sum(result["samples"]) == 2 * 512, result  # nobody idled at an epoch's end: no batch dropped
        assert min(fast) > 2 * 512 / 4 / 8, result  # each fast worker trained on more than a quarter


def test_a_schedule_sized_by_the_step_estimate_never_runs_past_its_end(lightning_results: dict) -> None:
    """``configure_optimizers`` sizes a OneCycleLR by ``trainer.estimated_stepping_batches`` (each worker's
    fixed share, 16 per epoch), with a straggler and the loader reloaded every epoch. Shared batches would let
    a fast worker take more steps than that, and OneCycleLR raises past its end; the workers keep fixed
    shares for the fit instead (a warning says so): the fast ones take exactly the estimate, the straggler
    fewer, and every step reaches the server."""
    result = lightning_results["one_cycle"]
    assert result["estimate"] == 2 * 512 // 4 // 8  # 2 epochs of a quarter of 512 samples in batches of 8
    fast, slow = result["computed"][:3], result["computed"][3]
    assert fast == [result["estimate"]] * 3 and slow < result["estimate"], result["computed"]
    _, applied = logged_supersteps(result)
    assert applied == result["computed"]
    assert result["same_model_everywhere"]


def assert_every_worker_stopped_together(result: dict) -> None:
    """Every step a worker took reached the server, and every worker validated once, at the shortened
    epoch's end, with the same model."""
    _, applied = logged_supersteps(result)
    assert applied == result["computed"]
    assert result["same_model_everywhere"]
    assert result["validations"] == [1] * 4, result


def test_max_steps_ends_every_worker_when_the_fastest_reaches_it(lightning_results: dict) -> None:
    """max_steps with free-running workers (accepted, not refused): the first worker to reach it ends the
    fit, the others stop after the step they are in; every step taken reached the server, and every worker
    validated once, at the shortened epoch's end, with the same model."""
    result = lightning_results["max_steps"]
    assert max(result["computed"]) == 11 and result["computed"][3] < 11, result["computed"]
    assert_every_worker_stopped_together(result)


def test_should_stop_set_by_one_worker_ends_every_workers_fit(lightning_results: dict) -> None:
    """One free-running worker sets ``trainer.should_stop`` in ``on_train_batch_end`` (its own ``Timer``, a
    user's own condition): the others stop after the step they are in, every worker validates once with
    the same model, and every step taken reached the server (a regression would show as the others
    training on while the stopped worker waits in its teardown, the fit hanging until the timeout)."""
    result = lightning_results["stop_one_rank"]
    assert result["computed"][0] == 6, result["computed"]  # stopped after its batch 5
    # nobody trained on into the rest of the epoch (64 batches shared by 4 workers) or a later one
    assert sum(result["computed"]) < 64 // 2, result["computed"]
    assert_every_worker_stopped_together(result)


def test_should_stop_set_by_one_worker_at_its_epochs_last_batch_ends_every_workers_fit(
    lightning_results: dict,
) -> None:
    """The same at the epoch's last batch of that worker (fixed shares, so it is batch 15 of 16), where every
    worker has already drained for the epoch's end: the workers agree at the epoch's end and none begins
    the next epoch (a regression would show as the others beginning it, the fit hanging until the
    timeout)."""
    result = lightning_results["stop_one_rank_at_epoch_end"]
    assert result["computed"][0] == 16 and max(result["computed"]) == 16, result["computed"]
    assert_every_worker_stopped_together(result)


def test_per_step_collectives_in_lockstep_pair_as_under_ddp(lightning_results: dict) -> None:
    """Lockstep workers (max_staleness=0) take the same steps: sync_dist, strategy.reduce and all_gather in
    training_step give ddp's values, hand-computed here (4 workers: the sum of (rank + 1) x (batch + 1))."""
    result = lightning_results["synced_in_lockstep"]
    steps = result["steps"]
    assert steps == 256 // 4 // 8
    assert result["reduced"] == [10.0 * (b + 1) for b in range(steps)]
    assert result["gathered"] == [[0, 1, 2, 3]] * steps
    assert result["logged_last"] == 10.0 * steps
    assert result["decisions"] == [[True, True, 0]] * steps  # rank 3's True reaches rank 0; rank 0's rank


def test_boolean_decisions_of_free_running_workers_stay_their_own(lightning_results: dict) -> None:
    """Workers not in lockstep (a straggler, so they take different numbers of steps): ``all=True`` of every
    worker's ``True`` is ``True`` (ddp's sum compared with the world size would give ``False``, and
    ``SpikeDetection`` would never update its statistics), ``all=False`` and a broadcast are the worker's
    own (a real broadcast would hang Lightning's learning-rate finder), and a barrier in ``training_step``
    returns (it cannot pair different steps)."""
    per_rank = lightning_results["decisions_running_free"]["decisions"]
    # the straggler takes fewer steps on an idle machine; on a loaded one the others may be slowed as much,
    # and the decisions below are each worker's own either way (ddp's would differ on every rank)
    assert len(per_rank[3]) <= min(len(d) for d in per_rank[:3])
    for rank, decisions in enumerate(per_rank):
        assert decisions == [[True, rank == 3, rank]] * len(decisions)


def test_fast_dev_run_trains_its_steps_on_every_worker(lightning_results: dict) -> None:
    """fast_dev_run sets max_steps, which non-lockstep settings refuse; its batches are as few, so every
    worker runs exactly that many steps (not a max_steps refusal)."""
    result = lightning_results["fast_dev_run"]
    assert result["computed"] == [3, 3, 3, 3]
    assert result["same_model_everywhere"]


@pytest.mark.parametrize(
    "scenario", ["resume", "resume_time_buckets", "resume_scheduler", "resume_replicated_server"]
)
def test_plain_bsp_resume_equals_an_uninterrupted_run(lightning_results: dict, scenario: str) -> None:
    result = lightning_results[scenario]
    assert result["halfway_moved"] > 5e-3  # (the scheduler's run decays its rates fast: 9.7e-3)
    # time buckets: the two runs sum in buckets of other layouts after their rebuilds (float order)
    assert result["max_rel_diff"] < (
        1e-5 if scenario in ("resume_time_buckets", "resume_scheduler") else 1e-6
    ), result
    assert result["rebuilt"] == [scenario == "resume_time_buckets"] * 3  # whole, first half, resumed
    assert result["bare_equals_halfway"] == 0.0  # the checkpoint loads into a module without the plugin


def run_separate_ranks(script: str, args: list[str], world: int, env: dict[str, str], log: Path) -> None:
    """One process per rank, started here as separate node agents would (Lightning's launcher and
    torchrun kill every process of the job as soon as one dies, so they cannot show what survivors do)."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    from helpers import SCRIPTS, free_port

    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world), **env}  # fmt: skip
    with open(log, "wb") as sink:
        procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / script), *args],
                env={
                    **base,
                    **(
                        {"NODE_RANK": "0", "LOCAL_RANK": str(rank)}
                        if "NODE_RANK" not in env
                        else {"NODE_RANK": str(rank), "LOCAL_RANK": "0"}
                    ),
                },
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            for rank in range(world)
        ]
        try:
            for proc in procs:
                proc.wait(timeout=180)
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)


def test_a_dead_worker_ends_the_others_with_its_rank_and_the_last_checkpoint_loads(tmp_path: Path) -> None:
    from scripts.models import EquivModel

    log = tmp_path / "log.txt"
    run_separate_ranks("bsp_dead_worker.py", [str(tmp_path)], 4, {}, log)
    results = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert (tmp_path / "died_at").exists(), (results, log.read_text()[-3000:])
    died = float((tmp_path / "died_at").read_text())
    assert sorted(results) == ["rank0", "rank1", "rank2"], (results, log.read_text()[-3000:])
    for result in results.values():
        assert result["error"] and result["error"].startswith("BSPStopped"), result
        assert result["ended"] - died < 60  # within the strategy's timeout, not a hang
    # ranks that still reach the job's store (hosted by rank 0's process) name the lost one
    assert "lost rank(s) [3]" in results["rank0"]["error"]
    rank2 = results["rank2"]["error"]
    assert "lost rank(s) [3]" in rank2 or "store is unreachable" in rank2
    checkpoint = torch.load(tmp_path / "ckpt" / "epoch=0-step=8.ckpt", weights_only=False)
    model = EquivModel(optimizer="sgd")
    model.load_state_dict(checkpoint["state_dict"])
    assert len(checkpoint["optimizer_states"][0]["state"]) == len(list(model.parameters()))


@pytest.mark.parametrize("who", ["every", "one"])
def test_an_error_in_training_step_ends_every_worker_promptly(tmp_path: Path, who: str) -> None:
    """A step that raises leaves its micro-step unfinished, whose gradients a drain in teardown would wait
    for until the strategy's timeout (here 120 s). The failing worker stops without a drain and the others
    stop with it, naming the rank."""
    log = tmp_path / "log.txt"
    run_separate_ranks("bsp_raising_step.py", [str(tmp_path), who], 2, {"NODE_RANK": "per rank"}, log)
    results = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == ["rank0", "rank1"], (results, log.read_text()[-3000:])
    raised = float((tmp_path / "raised_at").read_text())
    assert results["rank1"]["error"] == "ValueError: boom on rank 1", results
    if who == "every":
        assert results["rank0"]["error"] == "ValueError: boom on rank 0", results
    else:
        error = results["rank0"]["error"]
        assert error.startswith("BSPStopped") and "rank(s) [1] stopped" in error, results
    for result in results.values():
        assert result["ended"] - raised < 30, (results, log.read_text()[-3000:])  # not the 120 s timeout
    # ModelCheckpoint(save_on_exception=True) ran before the strategy heard of the error: it saved the
    # model every worker last picked up, without a drain (which would wait for the unfinished step: a hang)
    saved = results["rank0"]["checkpoint"]
    assert saved == {"keys_match": True, "equals_worker_model": True, "optimizer_groups": 1}, saved


# ---------------------------------------------------------------------- liveness
def _heartbeat_stopped(rank: int, world: int, store: str) -> dict:
    import threading
    import time

    from lightning_hier.bsp.liveness import Heartbeat

    init_gloo(rank, world, store)
    beat = Heartbeat("test", rank)
    beat.start()
    time.sleep(0.05)
    beat.stop()
    alive = beat.is_alive()
    beat.join()  # threading's own join calls Thread._stop, which the heartbeat must not shadow
    return {"alive_after_stop": alive, "threads": [t.name for t in threading.enumerate()]}


def test_a_stopped_heartbeat_has_ended_and_joins(tmp_path: Path) -> None:
    """Lightning's test suite stops leftover daemon threads through their ``stop()`` and asserts they ended:
    the heartbeat's stop must end the thread, not only set its flag, and ``join()`` must not raise
    ``'Event' object is not callable``."""
    (result,) = run_spawned(_heartbeat_stopped, 1, tmp_path)
    assert result is not None and "error" not in result, result
    assert result["alive_after_stop"] is False
    assert not any(name.startswith("hier-bsp-heartbeat") for name in result["threads"])


def _lost_among_stopped(rank: int, world: int, store: str) -> dict:
    from lightning_hier.bsp.liveness import Heartbeat, lost_ranks

    init_gloo(rank, world, store)
    beating = Heartbeat("lost", 0)  # this process: still beating
    beating.start()
    kv = torch.distributed.distributed_c10d._get_default_store()
    kv.add("lost/beat/1", 5)  # rank 1 beat, then tore down in order after seeing the failure itself
    Heartbeat("lost", 1).stop()  # never started: stop() only says it left
    kv.add("lost/beat/2", 5)  # rank 2 beat, then died without a word
    try:
        return {"lost": lost_ranks("lost", 3, watch_s=1.5)}
    finally:
        beating.stop()


def test_a_rank_that_left_in_order_is_not_named_lost(tmp_path: Path) -> None:
    """After a worker dies the survivors fail too and tear down; one whose teardown ends its heartbeat
    before rank 0 looks must not be named lost beside the dead one ('lost rank(s) [1, 2, 3]' for [3]): a
    rank that stops beating because its run ended says so in the store first."""
    (result,) = run_spawned(_lost_among_stopped, 1, tmp_path)
    assert result == {"lost": [2]}, result
