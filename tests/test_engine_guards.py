"""DDP parity guards: parameter changes after setup that hier_sliced cannot follow raise, naming the
parameter, instead of training a stale copy or nothing (one process)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers import free_port
from torch import nn

from lightning_hier import GradientTimingProfiler, HierSlicedEngine, Topology


@pytest.fixture
def engine_parts():  # noqa: ANN201
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = HierSlicedEngine(model, optimizer, Topology(1, 0, 1).build_groups())
    yield model, optimizer, engine
    engine.close()
    dist.destroy_process_group()


def _step(model: nn.Module, engine: HierSlicedEngine) -> None:
    model(torch.randn(2, 4)).sum().backward()
    engine.finish_backward()


def test_an_unchanged_model_steps(engine_parts) -> None:  # noqa: ANN001
    model, optimizer, engine = engine_parts
    before = model[1].weight.detach().clone()
    _step(model, engine)
    optimizer.step()
    engine.after_step()
    assert not torch.equal(before, model[1].weight)


def test_replaced_data_is_taken_back_into_the_bucket_or_refused(engine_parts) -> None:  # noqa: ANN001
    model, optimizer, engine = engine_parts
    model[1].weight.data = torch.full((1, 4), 2.0)  # what ModelPruning's lottery-ticket reset does
    _step(model, engine)
    grad = model[1].weight.grad.clone()
    optimizer.step()
    engine.after_step()
    # the step started from the new values, and the parameter is a bucket view again
    torch.testing.assert_close(model[1].weight.detach(), torch.full((1, 4), 2.0) - 0.1 * grad)
    bucket, slot = engine._where[0][0], engine._where[0][1]
    assert model[1].weight.data_ptr() == engine.buckets[bucket].param_view(slot).data_ptr()
    model[1].weight.data = torch.zeros(2, 4)  # another shape: cannot live in the slot
    with pytest.raises(RuntimeError, match=r"'1.weight'.*\.data was replaced"):
        engine.finish_backward()  # where every synchronising step checks


def test_unfreezing_after_setup_is_refused(engine_parts) -> None:  # noqa: ANN001
    model, _, engine = engine_parts
    model[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"'0.weight' was frozen at setup"):
        _step(model, engine)


def test_add_param_group_after_setup_is_refused(engine_parts) -> None:  # noqa: ANN001
    model, optimizer, engine = engine_parts
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(RuntimeError, match="add_param_group"):
        _step(model, engine)


class CheckpointedTwice(nn.Module):
    """``shared`` runs inside a reentrant checkpoint and again outside it: two gradient arrivals."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=True)
        return self.head(self.shared(inner))


def _checkpointed_step(bucketing: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model, reference = CheckpointedTwice(), CheckpointedTwice()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = HierSlicedEngine(
        model, optimizer, Topology(1, 0, 1).build_groups(), bucket_cap_mb=1e-5, bucketing=bucketing
    )
    x = torch.randn(3, 4, requires_grad=True)
    try:
        model(x).sum().backward()
        engine.finish_backward()
        optimizer.step()
        engine.after_step()
    finally:
        engine.close()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x).sum().backward()
    reference_optimizer.step()
    return list(model.parameters()), list(reference.parameters())


def test_a_gradient_ready_twice_after_its_bucket_was_sent_raises(engine_parts) -> None:  # noqa: ANN001
    with pytest.raises(RuntimeError, match=r"'shared.(weight|bias)' received a gradient twice"):
        _checkpointed_step("size")


def test_sending_after_backward_handles_a_gradient_ready_twice_exactly(engine_parts) -> None:  # noqa: ANN001
    got, want = _checkpointed_step("none")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_gradient_ready_times_are_taken_only_where_something_reads_them(engine_parts) -> None:  # noqa: ANN001
    """Each parameter's ready time costs a clock mark per backward (a CUDA event on a GPU): taken under
    bucketing="time" (the planner reads them) or for a GradientTimingProfiler, not otherwise."""
    model, optimizer, engine = engine_parts
    assert engine.bucketing == "size" and not engine.record_ready_times
    for record in (False, True):
        engine.record_ready_times = record
        engine.begin_backward()
        model(torch.randn(2, 4)).sum().backward()
        engine.finish_backward()
        ready = engine.last_timeline.ready
        assert len(ready) == 2 and [t is not None for t in ready] == [record, record], (record, ready)
        assert len(engine.last_timeline.bucket_launch) == 1  # the bucket's own marks are always taken
        optimizer.step()
        engine.after_step()
    engine.record_ready_times = False
    trainer = SimpleNamespace(strategy=SimpleNamespace(engines=[engine]))
    GradientTimingProfiler().on_train_start(trainer, None)  # type: ignore[arg-type]
    assert engine.record_ready_times
