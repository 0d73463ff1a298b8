"""Which micro-batches ``hier_pipeline`` times, and that the others cost no timing at all.

One stage in a one-process gloo group: the engine's own step with a real schedule, counting the
forwards each layer's timer saw against the counts the policy implies.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.pipeline.engine import FULLY_TIMED_MICRO_BATCHES, PipelineEngine
from lightning_hier.pipeline.graph import LayerGraph
from lightning_hier.pipeline.partition import StagePartition
from lightning_hier.pipeline.settings import PipelineSettings
from lightning_hier.pipeline.stage import LayerTimes, StageExecutor


@pytest.fixture()
def one_process_group(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _engine(**settings: object) -> PipelineEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    graph = LayerGraph(model)
    partition = StagePartition((0,), graph.num_clusters)
    return PipelineEngine(graph, partition, 0, torch.device("cpu"), settings=PipelineSettings(**settings))


def _train(engine: PipelineEngine, steps: int, micro: int) -> list[list[bool]]:
    """``steps`` steps of ``micro`` micro-batches; returns which micro-batches were timed."""
    timed: list[list[bool]] = []
    x = torch.randn(micro * 2, 4)
    for _ in range(steps):
        flags: list[bool] = []

        def forward(m: int, received: torch.Tensor | None, flags: list[bool] = flags) -> torch.Tensor:
            engine.executor.timing = engine.times_micro_batch(m, micro)
            flags.append(engine.executor.timing)
            return engine.executor.forward(x[2 * m : 2 * m + 2]).sum()

        engine.train_step(micro, forward)
        timed.append(flags)
    return timed


def _counted(engine: PipelineEngine) -> int:
    counts = {engine.executor.times.forward_count[i] for i in engine.executor.layer_range}
    backward = {engine.executor.times.backward_count[i] for i in engine.executor.layer_range}
    assert len(counts) == 1 and counts == backward, (counts, backward)  # every layer, both directions
    return counts.pop()


@pytest.mark.usefixtures("one_process_group")
def test_nothing_is_timed_when_no_decision_reads_the_times() -> None:
    engine = _engine(rebalance="never", partition="uniform")
    flags = _train(engine, steps=3, micro=4)
    assert not any(any(step) for step in flags)
    assert _counted(engine) == 0


@pytest.mark.usefixtures("one_process_group")
def test_rebalancing_times_the_first_micro_batches_then_one_per_step_rotating() -> None:
    engine = _engine(rebalance=16, partition="uniform")
    micro, steps = 4, 6
    flags = _train(engine, steps=steps, micro=micro)
    full_steps = FULLY_TIMED_MICRO_BATCHES // micro
    assert all(all(step) for step in flags[:full_steps])
    # afterwards exactly one per step, at position step % micro
    for step in range(full_steps, steps):
        assert flags[step] == [m == step % micro for m in range(micro)], (step, flags[step])
    assert _counted(engine) == FULLY_TIMED_MICRO_BATCHES + (steps - full_steps)
    engine.executor.reset_times()  # a check: the next micro-batches are all timed again
    assert all(_train(engine, steps=1, micro=micro)[0])


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize(("settings", "steps_per_check", "stride"), [
    ({"rebalance": 64}, None, 4),  # 64 // TIMED_STEPS_PER_CHECK
    ({"rebalance": 31}, None, 1),  # under 32 steps per check: every step
    ({"rebalance": "epoch"}, 48, 3),  # the epoch's length, set by the strategy
    ({"rebalance": "epoch"}, None, 1),  # an epoch of unknown length
    ({"rebalance": 64, "partition": "time", "profile_steps": 1000}, None, 1),  # a profile reads every step
])  # fmt: skip
def test_rebalancing_alone_times_one_step_in_every_few_on_long_check_intervals(
    settings: dict[str, Any], steps_per_check: int | None, stride: int
) -> None:
    """After the first micro-batches, about 16 steps per check interval carry one timed micro-batch each
    (rotating through the step's positions), instead of every step: rebalance="epoch" over hundreds of steps
    paid a timed micro-batch (0.64 ms on the benchmark's 48-layer stage) in every step."""
    engine = _engine(**{"partition": "uniform", **settings})
    engine.steps_per_check = steps_per_check
    micro, steps = 4, 16
    flags = _train(engine, steps=steps, micro=micro)
    full_steps = FULLY_TIMED_MICRO_BATCHES // micro
    for step in range(full_steps, steps):
        expected = [step % stride == 0 and m == (step // stride) % micro for m in range(micro)]
        assert flags[step] == expected, (step, flags[step])
    timed_steps = sum(1 for step in range(full_steps, steps) if step % stride == 0)
    assert _counted(engine) == FULLY_TIMED_MICRO_BATCHES + timed_steps


@pytest.mark.usefixtures("one_process_group")
def test_a_check_that_moves_nothing_keeps_the_times_at_half_weight_and_times_no_burst() -> None:
    engine = _engine(rebalance=16, partition="uniform")
    micro = 4
    _train(engine, steps=3, micro=micro)  # the burst of FULLY_TIMED_MICRO_BATCHES, then one
    before = _counted(engine)
    assert before == FULLY_TIMED_MICRO_BATCHES + 1
    layers = engine.executor.layer_range
    means = [t for i in layers for t in engine.executor.times.summary(layers)[i]]
    decision = engine.rebalance(threshold=0.1)
    assert decision.new is None  # one stage: nothing to move
    assert [t for i in layers for t in engine.executor.times.summary(layers)[i]] == pytest.approx(means)
    flags = _train(engine, steps=2, micro=micro)
    assert flags == [[m == step % micro for m in range(micro)] for step in (3, 4)]  # no new burst
    assert _counted(engine) == pytest.approx(before * 0.5 + 2)


@pytest.mark.usefixtures("one_process_group")
def test_a_check_that_moves_layers_times_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Times measured under the old split describe layers some of which left: they are dropped, and
    the next micro-batches are all timed again."""
    from lightning_hier.pipeline import engine as engine_module
    from lightning_hier.pipeline.rebalance import RebalanceDecision

    engine = _engine(rebalance=100, partition="uniform")
    micro = 4
    _train(engine, steps=3, micro=micro)

    def moved(graph: Any, partition: StagePartition, *args: Any, **kwargs: Any) -> RebalanceDecision:
        return RebalanceDecision(partition, StagePartition((0,), graph.num_clusters), (1.0,), (1.0,), "test")

    monkeypatch.setattr(engine_module, "decide_rebalance", moved)
    assert engine.rebalance(threshold=0.1).new is not None
    assert _counted(engine) == 0
    assert _train(engine, steps=2, micro=micro) == [[True] * micro] * 2
    assert _counted(engine) == 2 * micro


def test_aged_layer_times_weigh_each_new_sample_above_each_old_one() -> None:
    times = LayerTimes(num_layers=1, num_clusters=1)
    for _ in range(4):  # four samples of 1 s, then aged to half weight, then two of 3 s
        times.forward[0] += 1.0
        times.forward_count[0] += 1
    times.age(0.5)
    assert times.mean_forward(0) == pytest.approx(1.0)
    for _ in range(2):
        times.forward[0] += 3.0
        times.forward_count[0] += 1
    assert times.mean_forward(0) == pytest.approx((2 * 1.0 + 2 * 3.0) / 4)  # 2 old at half, 2 new
    single = LayerTimes(num_layers=1, num_clusters=1)  # one sample aged below one sample's weight
    single.forward[0], single.forward_count[0] = 1.0, 1
    single.age(0.5)
    assert single.mean_forward(0) == pytest.approx(1.0)
    for keep in (0.0, 1.5):
        with pytest.raises(ValueError, match="keep"):
            times.age(keep)


@pytest.mark.usefixtures("one_process_group")
def test_memory_limit_times_only_until_the_first_plan_and_modes_override() -> None:
    engine = _engine(rebalance="never", partition="uniform", memory_limit=10**12, profile_steps=2)
    flags = _train(engine, steps=4, micro=2)
    assert flags == [[True, True], [True, True], [False, False], [False, False]]
    engine.layer_timing = "all"
    assert _train(engine, steps=1, micro=2) == [[True, True]]
    engine.layer_timing = "off"
    assert _train(engine, steps=1, micro=2) == [[False, False]]
    engine.layer_timing = "bogus"
    with pytest.raises(ValueError, match="layer_timing"):
        engine.times_micro_batch(0, 2)


def test_validation_forwards_stay_out_of_the_training_layer_times(tmp_path: Path) -> None:
    """Forwards without a graph (validation) are faster than training ones; they must not enter the
    means a rebalance reads. One stage in one process under Lightning, rebalance never asked for but
    every micro-batch timed: the counts equal the training micro-batches exactly."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hier import HierPipelineStrategy

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self(batch[0]), batch[1])

        def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
            self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class TimeEverything(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            strategy.engine.layer_timing = "all"

    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    strategy = HierPipelineStrategy(micro_batches=2, partition="uniform", rebalance="never")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, limit_train_batches=3,
        limit_val_batches=2, num_sanity_val_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[TimeEverything()],
        default_root_dir=tmp_path,
    )  # fmt: skip
    try:
        trainer.fit(Net(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    finally:  # Lightning leaves its one-process group up; later tests start their own
        if dist.is_initialized():
            dist.destroy_process_group()
    assert _counted(strategy.engine) == 3 * 2  # 3 steps x 2 micro-batches; 4 validation forwards left out
    assert strategy.engine.steps_per_check == 3  # the epoch's steps, for rebalance="epoch"


def test_static_shapes_keys_and_a_broken_assumption_named() -> None:
    """The key every stage computes from its own copy of the micro-batch, and the sender's check."""
    from lightning_hier.pipeline.batching import input_signature, split_batch
    from lightning_hier.pipeline.schedule import StageLink

    batch = {"x": torch.randn(10, 3), "y": torch.zeros(10, dtype=torch.long), "scale": 2}
    micro, _ = split_batch(batch, 3)  # 4, 3, 3 rows
    keys = [input_signature(m) for m, _ in micro]
    assert keys[1] == keys[2] != keys[0]
    assert input_signature({**micro[1][0], "scale": 3}) != keys[1]  # a scalar can change shapes too
    with pytest.raises(ValueError, match="static_shapes"):
        PipelineSettings(static_shapes="yes")  # type: ignore[arg-type]

    link = StageLink(0, 2, lambda s: 1 - s, torch.device("cpu"))
    activation = torch.randn(4, 8, requires_grad=True)
    link._sent_specs["k"] = (0, 1, 2, 4, 8)  # as if sent before for key "k"
    assert link.send_header(activation, "k") is True and link.headers_sent == 0  # remembered: no message
    with pytest.raises(RuntimeError, match="static_shapes=False"):
        link.send_header(torch.randn(5, 8, requires_grad=True), "k")


class _SlowGrad(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds``: a layer of known backward time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class _Slow(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowGrad.apply(x, self.seconds)


class _Block(nn.Module):
    """``x + tanh(slow(fc(x)))``: the skip connection makes its four layers one cluster."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.slow = _Slow(seconds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.slow(self.fc(x)))


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = _Block(0.05), _Block(0.0), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)))


def test_backward_time_is_booked_to_the_cluster_that_spent_it_with_one_hook_per_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cluster ``a``'s backward sleeps 50 ms, ``b``'s nothing: ``a``'s layers are booked the 50 ms and
    ``b``'s almost none, though only one gradient hook per cluster (3) timed them, not one per layer (9)."""
    graph = LayerGraph(_TwoBlocks(), leaf_modules=["a.slow", "b.slow"])
    assert [(c.start, c.end) for c in graph.clusters] == [(0, 4), (4, 8), (8, 9)]
    executor = StageExecutor(graph, StagePartition((0,), graph.num_clusters), 0)
    hooks = 0
    register_hook = torch.Tensor.register_hook

    def counting(tensor: torch.Tensor, hook: Any) -> Any:
        nonlocal hooks
        hooks += 1
        return register_hook(tensor, hook)

    monkeypatch.setattr(torch.Tensor, "register_hook", counting)
    for _ in range(2):
        executor.forward(torch.randn(3, 4)).sum().backward()
        executor.finish_backward()
    assert hooks == 2 * graph.num_clusters
    times = executor.times
    booked = [sum(times.backward[i] for i in range(c.start, c.end)) / 2 for c in graph.clusters]
    assert booked[0] >= 0.05 and booked[1] < 0.025, booked  # b: microseconds of work (slack for a busy host)
    assert all(times.backward_count[i] == 2 for i in range(len(graph.layers)))


class _DeviceMark:
    """A stand-in for a recorded CUDA event: a time, and whether the device has reached it yet."""

    def __init__(self) -> None:
        self.at = time.perf_counter()
        self.reached = False

    def query(self) -> bool:
        return self.reached


class _DeviceClock:
    """StageClock as on a GPU, with marks the test releases (``device_reaches_all``) and a count of
    the synchronizes asked for."""

    cuda = True

    def __init__(self) -> None:
        self.marks: list[_DeviceMark] = []
        self.synchronizes = 0

    def mark(self) -> _DeviceMark:
        self.marks.append(_DeviceMark())
        return self.marks[-1]

    def seconds(self, start: _DeviceMark, end: _DeviceMark) -> float:
        return end.at - start.at

    def synchronize(self) -> None:
        self.synchronizes += 1
        self.device_reaches_all()

    def ready(self, mark: _DeviceMark) -> bool:
        return mark.query()

    def device_reaches_all(self) -> None:
        for mark in self.marks:
            mark.reached = True


@pytest.mark.usefixtures("one_process_group")
def test_on_a_gpu_a_step_reads_only_finished_marks_and_a_check_waits_for_the_rest() -> None:
    """On a GPU the end of a step never waits for the device: the timed micro-batches the device has
    finished are read, the rest stay pending; the rebalance check's reading of the times resolves the
    rest with one synchronize (a regression would show as a synchronize ending every step, a drained
    queue per step)."""
    engine = _engine(rebalance=100, partition="uniform")
    clock = _DeviceClock()
    engine.executor.clock = clock
    micro = 2
    _train(engine, steps=2, micro=micro)  # the device has reached none of the marks yet
    assert clock.synchronizes == 0
    assert _counted(engine) == 0
    clock.device_reaches_all()
    _train(engine, steps=1, micro=micro)  # the first two steps are read at this step's end, not the third
    assert clock.synchronizes == 0
    assert _counted(engine) == 2 * micro
    engine.local_times()  # what a rebalance check reads: everything, after one synchronize
    assert clock.synchronizes == 1
    assert _counted(engine) == 3 * micro
