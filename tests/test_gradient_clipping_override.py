"""A LightningModule's own ``configure_gradient_clipping`` under ``hier_sliced``: after ``super()`` every
``param.grad`` is the clipped averaged gradient, as under ``ddp``, and the optimizer steps it."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from helpers import run_torchrun


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("clipping") / "out.json"
    run_torchrun("gradient_clipping_override.py", 2, str(out))
    return json.loads(out.read_text())


def _close(actual: float | list[float], expected: float | list[float]) -> None:
    as_float64 = partial(torch.tensor, dtype=torch.float64)
    torch.testing.assert_close(as_float64(actual), as_float64(expected), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_configure_gradient_clipping_sees_ddps_clipped_gradients(records: dict, algorithm: str) -> None:
    clip = records["clip"][algorithm]
    for rank, results in enumerate(records["ranks"]):
        ddp, hier = results[f"ddp/{algorithm}"], results[f"hier_sliced/{algorithm}"]
        assert len(ddp["seen"]) == len(hier["seen"]) == records["steps"], rank
        for step, (expected, actual) in enumerate(zip(ddp["seen"], hier["seen"])):
            # Lightning's own check: the clipped norm (by norm) or the largest value (by value) is the clip
            # value, so the gradient did need clipping there (the comparison below is not vacuous)
            measured = expected["norm" if algorithm == "norm" else "max_abs"]
            assert measured == pytest.approx(clip, rel=1e-4), (rank, step)  # 1e-6 in the clip coefficient
            for key in ("norm", "max_abs", "grads"):
                _close(actual[key], expected[key])
        _close(hier["params"], ddp["params"])  # the optimizer stepped the clipped average


def test_auto_counts_configure_gradient_clipping_as_reading_gradients() -> None:
    import lightning.pytorch as pl

    from lightning_hier.strategies.gradient_readers import hooks_read_gradients

    class Plain(pl.LightningModule):
        pass

    class OwnClipping(pl.LightningModule):
        def configure_gradient_clipping(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().configure_gradient_clipping(*args, **kwargs)

    assert not hooks_read_gradients(Plain(), [])
    assert hooks_read_gradients(OwnClipping(), [])
