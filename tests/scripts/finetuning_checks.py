"""Run under torchrun (2 processes): fine-tuning callbacks under ``hier_sliced`` (and ``hier_bsp``) against
``ddp``, same seed, data and steps.

The model's backbone is frozen at first and unfrozen at epoch 1 by Lightning's ``BackboneFinetuning``,
which adds it to the optimizer as a param group of its own (its ``lr`` a tenth of the head's, then raised
every epoch) or, where the optimizer holds the backbone from the start (``in_group``), only makes it
trainable. ``ddp``'s reference freezes the backbone after it wrapped the model: ``ddp`` all-reduces only
the gradients of parameters trainable when it wrapped the model, so with the callback's own freezing (in
``setup``, before that) each rank would train its own copy of the backbone.

Rank 0 writes ``{scenario: {"max_rel_diff": ..., "backbone_moved": ..., "ranks_differ": ...}}`` to argv[1].
``finetuning_checks.py OUT SCENARIOS audit`` runs the scenarios' strategies alone (no ``ddp``), for a run
whose groups are built as on CUDA and whose collectives are recorded (tests/test_finetuning.py).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import BackboneFinetuning  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from models import loader, reported  # noqa: E402
from torch import nn  # noqa: E402
from train_equivalence import max_rel_diff  # noqa: E402

from lightning_hier import HierBSPStrategy, HierSlicedStrategy  # noqa: E402

EPOCHS = 3
BATCHES = 4  # per epoch and rank


class WithBackbone(pl.LightningModule):
    """A backbone and a head; the optimizer holds the head only, or (``in_group``) every parameter.
    ``unfreezes``: the module itself freezes the backbone when the fit starts and unfreezes it at epoch 1,
    adding a param group (no callback)."""

    def __init__(self, optimizer: str = "adam", in_group: bool = False, unfreezes: bool = False) -> None:
        super().__init__()
        self.optimizer_name, self.in_group, self.unfreezes = optimizer, in_group, unfreezes
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def on_fit_start(self) -> None:
        if self.unfreezes:
            self.backbone.requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        if self.unfreezes and self.current_epoch == 1:
            self.backbone.requires_grad_(True)
            self.trainer.optimizers[0].add_param_group(
                {"params": list(self.backbone.parameters()), "lr": 3e-3}
            )

    def configure_optimizers(self):  # noqa: ANN201
        params = self.parameters() if self.in_group else self.head.parameters()
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1)
        return torch.optim.Adam(params, lr=1e-2)


class FreezingAfterWrap(BackboneFinetuning):
    """``BackboneFinetuning`` that freezes the backbone when the fit starts (after ``ddp`` wrapped the model,
    so ``ddp`` reduces its gradients once it is unfrozen) instead of in ``setup``."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        pass

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.backbone)
        super().on_fit_start(trainer, pl_module)


def train(strategy, callback: pl.Callback, model_kwargs: dict) -> dict:  # noqa: ANN001
    pl.seed_everything(1234, verbose=False)
    model = WithBackbone(**model_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_epochs=EPOCHS,
        limit_train_batches=BATCHES, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader())
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


def initial(model_kwargs: dict) -> dict:
    pl.seed_everything(1234, verbose=False)
    return {k: v.detach().clone().float() for k, v in WithBackbone(**model_kwargs).state_dict().items()}


def ranks_differ(state: dict) -> float:
    """The largest difference of any parameter between this rank and rank 0 (the same on every rank)."""
    worst = torch.zeros(())
    for value in state.values():
        theirs = value.clone()
        dist.broadcast(theirs, src=0)
        worst = torch.maximum(worst, (theirs - value).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


AUDIT = "audit" in sys.argv[3:]


def compare(strategy, model_kwargs: dict) -> dict:  # noqa: ANN001
    """``strategy`` against ``ddp`` (``unfreezes``: the module unfreezes, no callback)."""
    by_module = model_kwargs.get("unfreezes", False)
    callback = (
        (lambda: pl.Callback()) if by_module else (lambda: BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    )
    if AUDIT:
        train(strategy, callback(), model_kwargs)
        return {}
    wrapped_first = pl.Callback() if by_module else FreezingAfterWrap(unfreeze_backbone_at_epoch=1)
    reference = train(DDPStrategy(find_unused_parameters=True), wrapped_first, model_kwargs)
    contender = train(strategy, callback(), model_kwargs)
    start = initial(model_kwargs)
    backbone = {k: v for k, v in start.items() if k.startswith("backbone")}
    return {
        "max_rel_diff": max_rel_diff(reference, contender),
        "reference_moved": max_rel_diff(reference, start),
        "backbone_moved": max_rel_diff(backbone, {k: contender[k] for k in backbone}),
        "ranks_differ": ranks_differ(contender),
    }


def lockstep_bsp() -> HierBSPStrategy:
    """``hier_bsp`` in lockstep with one micro-step per superstep: ``ddp``'s steps."""
    steps = "superstep" if "superstep" in inspect.signature(HierBSPStrategy).parameters else "superstep_steps"
    return HierBSPStrategy(max_staleness=0, **{steps: 1})


SCENARIOS = {
    "hier_sliced_adam_1x2": lambda: compare(HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002), {}),
    "hier_sliced_adam_2x1": lambda: compare(HierSlicedStrategy(devices_per_node=1, bucket_cap_mb=0.002), {}),
    "hier_sliced_sgd_in_group_1x2": lambda: compare(
        HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002), dict(optimizer="sgd", in_group=True)
    ),
    "hier_sliced_module_unfreezes_1x2": lambda: compare(
        HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002), dict(unfreezes=True)
    ),
    "hier_sliced_adam_whole_1x2": lambda: compare(
        HierSlicedStrategy(devices_per_node=2, shard_optimizer=False), {}
    ),
    "hier_bsp_lockstep_adam": lambda: compare(lockstep_bsp(), {}),
    "hier_bsp_free_adam": lambda: compare(HierBSPStrategy(), {}),
}


def main() -> None:
    out = Path(sys.argv[1])
    selected = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SCENARIOS)
    results = {name: reported(SCENARIOS[name]) for name in selected}
    if os.environ["RANK"] == "0":
        out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
