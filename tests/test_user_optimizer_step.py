"""A LightningModule's own ``optimizer_step`` that runs the closure itself and then decides whether to step
(``loss = optimizer_closure(); if torch.isfinite(loss): optimizer.step()``, the usual way to skip a
non-finite loss) trains as under Lightning's own strategies, and so does one whose ``optimizer_zero_grad``
clears the gradients on some batches only (the others' add to the next step's).

The failure modes checked (Lightning's ``test_lightning_optimizer`` forced onto the strategies checks
them too): ``optimizer.step()`` without a closure hands the strategy an empty one, which ``hier_bsp`` must
not read as a skipped step (dropping every such step's gradients); ``hier_sliced`` must not keep a skipped
step's gradients in its local buckets, where they would be added to the next step's (a NaN step would
poison the model for good); and neither may clear the gradients after every step itself, where ddp leaves
them to the next ``zero_grad``. One process per strategy, in this process; ``ddp`` is the reference
(``hier_pipeline``, one replica with no distributed sampler: Lightning on one device)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy

STRATEGIES = {
    "hier_sliced": (HierSlicedStrategy, "ddp"),
    "hier_bsp": (lambda: HierBSPStrategy(superstep=1, max_staleness=0), "ddp"),
    "hier_pipeline": (lambda: HierPipelineStrategy(micro_batches=2), "auto"),
}
NON_FINITE_BATCHES = (2, 5)


class StepsWhenFinite(pl.LightningModule):
    """Batches ``NON_FINITE_BATCHES`` produce a NaN loss (``poison``); ``optimizer_step`` runs the closure
    and steps only on a finite loss (``every_batch``: steps on every batch, the closure still run first)."""

    def __init__(self, poison: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.poison = poison
        self.steps_taken = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        return loss * float("nan") if self.poison and batch_idx in NON_FINITE_BATCHES else loss

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any) -> None:
        loss = optimizer_closure()
        if torch.isfinite(loss):
            optimizer.step()
            self.steps_taken += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(strategy: Any, poison: bool) -> tuple[torch.Tensor, int]:
    model = _fit_module(lambda: StepsWhenFinite(poison), strategy)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), model.steps_taken


def _fit_module(make_model: Callable[[], pl.LightningModule], strategy: Any) -> pl.LightningModule:
    """``make_model()`` (seeded) fitted for one epoch of 8 batches on one device under ``strategy``."""
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    model = make_model()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, DataLoader(data, batch_size=8))
    finally:
        if dist.is_initialized():  # the tests after this one check that no group exists yet
            dist.destroy_process_group()
    return model


@pytest.mark.parametrize("poison", [False, True], ids=["closure_then_step", "skip_non_finite"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_an_optimizer_step_that_runs_the_closure_first_trains_as_lightning(name: str, poison: bool) -> None:
    make, reference = STRATEGIES[name]
    expected, expected_steps = _fit(reference, poison)
    got, steps = _fit(make(), poison)
    assert expected_steps == steps == 8 - (len(NON_FINITE_BATCHES) if poison else 0)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


class ZeroesEveryOtherBatch(pl.LightningModule):
    """``optimizer_zero_grad`` clears the gradients on even batches only, so each odd batch's step applies
    its own gradient and the one before it (as Lightning's ``test_lightning_optimizer`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if batch_idx % 2 == 0:
            optimizer.zero_grad()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_gradients_left_uncleared_by_optimizer_zero_grad_add_to_the_next_step_as_under_ddp(name: str) -> None:
    make, reference = STRATEGIES[name]
    expected = _fit_module(ZeroesEveryOtherBatch, reference)
    got = _fit_module(ZeroesEveryOtherBatch, make())
    for a, b in zip(got.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
