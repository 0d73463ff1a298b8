"""A value the user logs ``on_step`` under ``hier_pipeline`` is the batch's, not its last micro-batch's.

The last stage runs ``training_step`` once per micro-batch, so each ``self.log`` call reaches Lightning's
result collection once per micro-batch, and Lightning keeps the last call's value as the step's. While
the step's micro-batches run, :func:`step_values_over_micro_batches` notes every tensor value logged with
``on_step=True``; afterwards each such metric's step value becomes what its ``reduce_fx`` makes of the
micro-batches' values (the mean weighted as Lightning weighs the epoch's mean, the max, min or sum), as
one process logging the whole batch would see. Values logged ``on_epoch`` accumulate per call as before,
so the epoch's value does not change. torchmetrics objects keep their own step value (their ``forward``
on the last micro-batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def step_values_over_micro_batches(results: Any) -> Iterator[None]:
    """Around one training step's micro-batches on the stage that runs the user's step (``results``: the
    trainer's result collection; ``None`` leaves logging alone)."""
    if results is None or not hasattr(results, "update_metrics"):
        yield
        return
    original = results.update_metrics
    logged: dict[str, list[tuple[torch.Tensor, int]]] = {}

    def noting(key: str, value: Any, batch_size: int) -> None:
        original(key, value, batch_size)
        metric = results[key]
        if metric.is_tensor and metric.meta.on_step:
            logged.setdefault(key, []).append((metric._forward_cache, batch_size))

    results.update_metrics = noting
    try:
        yield
    finally:
        del results.update_metrics  # back to the class's method
    for key, values in logged.items():
        if len(values) > 1:
            _set_step_value(results[key], values)


def _set_step_value(metric: Any, values: list[tuple[torch.Tensor, int]]) -> None:
    stacked = torch.stack([value for value, _ in values])
    meta = metric.meta
    if meta.is_mean_reduction:
        weights = torch.tensor([size for _, size in values], dtype=stacked.dtype, device=stacked.device)
        weights = weights.reshape(-1, *([1] * (stacked.dim() - 1)))
        step = (stacked * weights).sum(0) / weights.sum()
    elif meta.is_max_reduction:
        step = stacked.max(0).values
    elif meta.is_min_reduction:
        step = stacked.min(0).values
    elif meta.is_sum_reduction:
        step = stacked.sum(0)
    else:  # a custom reduction: Lightning keeps the last value
        return
    metric._forward_cache = step
    if not meta.on_epoch:  # Lightning's update keeps the step value as the value too
        metric.value = step
