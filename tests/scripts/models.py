"""Small LightningModules shared by the distributed test scripts, and how a script reports a scenario."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_dataset(n: int = 256, features: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = torch.randint(0, classes, (n,), generator=generator)
    return TensorDataset(x, y)


class ConstructedStateSGD(torch.optim.Optimizer):
    """Momentum SGD whose buffers exist from construction on, as torch 2.11's ``Adagrad`` does; its
    step reads them and fails where a strategy lost them."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": lr, "momentum": momentum})
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param]["buffer"] = torch.zeros_like(param)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    buffer = self.state[param]["buffer"]
                    buffer.mul_(group["momentum"]).add_(param.grad)
                    param.add_(buffer, alpha=-group["lr"])
        return loss


class TrustRatioSGD(torch.optim.SGD):
    """A layer-wise trust ratio (LARS-like: each tensor's step scaled by ``||w|| / ||g||``): an update
    that looks at whole tensors, which no strategy knows."""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        loss = None
        if closure is not None:  # Lightning's closure runs the backward: the gradients exist after it
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    ratio = param.norm() / (param.grad.norm() + 1e-6)
                    param.grad.mul_(ratio.clamp(max=10.0))
        super().step()
        return loss


class EquivModel(pl.LightningModule):
    """An MLP with optional frozen, tied and unused parameters and a BatchNorm buffer."""

    def __init__(
        self,
        optimizer: str = "sgd",
        quirks: bool = False,
        batch_norm: bool = False,
        scheduler: bool = False,
        partly_used: bool = False,
        sparse_embedding: bool = False,
        features: int = 16,
        hidden: int = 32,
        classes: int = 4,
    ) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        self.quirks = quirks
        self.partly_used = partly_used
        self.inp = nn.Linear(features, hidden)
        self.norm = nn.BatchNorm1d(hidden) if batch_norm else nn.Identity()
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)
        if quirks:
            self.frozen = nn.Linear(hidden, hidden)
            self.frozen.requires_grad_(False)
            self.unused = nn.Linear(hidden, hidden)
            self.tied_in = nn.Linear(hidden, hidden, bias=False)
            self.tied_out = nn.Linear(hidden, hidden, bias=False)
            self.tied_out.weight = self.tied_in.weight
        if partly_used:  # in the forward of every third step only (on every rank alike)
            self.sometimes = nn.Linear(hidden, hidden)
        # sparse gradients (nn.Embedding(sparse=True)) for ids taken from the features
        self.emb = nn.Embedding(16, hidden, sparse=True) if sparse_embedding else None

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        h = torch.relu(self.norm(self.inp(x)))
        if self.emb is not None:
            h = h + self.emb((x[:, :3].abs() * 4).long().clamp(max=15)).mean(1)
        if extra:
            h = h + torch.tanh(self.sometimes(h))
        if self.quirks:
            h = torch.relu(self.frozen(h))
            h = h + self.tied_out(torch.tanh(self.tied_in(h)))
        h = torch.relu(self.mid(h))
        return self.out(h)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.cross_entropy(self(x, extra=self.partly_used and batch_idx % 3 == 0), y)

    def configure_optimizers(self):  # noqa: ANN201
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        elif self.optimizer_name == "sgd_plain":  # what sparse gradients allow
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        elif self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        elif self.optimizer_name == "constructed_state_sgd":
            optimizer = ConstructedStateSGD(self.parameters())
        elif self.optimizer_name == "adafactor":  # factored second moments per matrix: not elementwise
            optimizer = torch.optim.Adafactor(self.parameters(), lr=1e-2)
        elif self.optimizer_name == "trust_ratio_sgd":
            optimizer = TrustRatioSGD(self.parameters(), lr=0.05, momentum=0.9)
        elif self.optimizer_name == "adamw_groups":
            decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
            no_decay = [p for n, p in self.named_parameters() if not n.endswith("weight")]
            optimizer = torch.optim.AdamW(
                [
                    {"params": decay, "weight_decay": 0.1},
                    {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3},
                ],
                lr=1e-2,
            )
        else:
            raise ValueError(self.optimizer_name)
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Regressor(pl.LightningModule):
    """A 5-layer MLP (MSE, Adam) that ``hier_pipeline`` splits into stages."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader(batch_size: int = 8, **dataset_kwargs) -> DataLoader:  # noqa: ANN003
    return DataLoader(make_dataset(**dataset_kwargs), batch_size=batch_size, shuffle=False)


def reported(scenario: Callable[..., Any], *args: Any) -> Any:
    """The scenario's result, or the error it raised (the test shows which scenario failed and how)."""
    try:
        return scenario(*args)
    except Exception as error:  # noqa: BLE001 - reported, not hidden: the test fails with it
        return {"error": f"{type(error).__name__}: {error}"[:400]}


def tuned(strategy: Any, **attributes: Any) -> Any:
    """``strategy`` with tuning attributes set (``_reducer=...``, ``_early_push=...``: each strategy module's
    docstring lists them); an attribute the strategy does not have is an error, not a silent no-op."""
    for name, value in attributes.items():
        if not hasattr(strategy, name):
            raise AttributeError(f"{type(strategy).__name__} has no tuning attribute {name!r}")
        setattr(strategy, name, value)
    return strategy


def built(strategy_class: type, **kwargs: Any) -> Any:
    """``strategy_class(**kwargs)``, where names starting with ``_`` are tuning attributes set after it."""
    tuning = {name: kwargs.pop(name) for name in list(kwargs) if name.startswith("_")}
    return tuned(strategy_class(**kwargs), **tuning)
