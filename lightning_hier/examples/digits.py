"""Handwritten digits (scikit-learn's 8x8 set, shipped offline) with an MLP classifier.

Used by ``python -m lightning_hier fit --config examples/configs/hier_sliced.yaml``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split


class DigitsDataModule(pl.LightningDataModule):
    """1,797 8x8 digit images from ``sklearn.datasets.load_digits``, split 80/20, pixels scaled to [0, 1]."""

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the digits example needs scikit-learn: pip install 'lightning_hier[examples]'"
            ) from err
        digits = load_digits()
        images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        dataset = TensorDataset(images, labels)
        val_size = int(len(dataset) * self.val_fraction)
        generator = torch.Generator().manual_seed(self.seed)
        self.train_set, self.val_set = random_split(dataset, [len(dataset) - val_size, val_size], generator)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=256)


class DigitsClassifier(pl.LightningModule):
    """A two-hidden-layer MLP; logs ``train_loss`` and torchmetrics accuracy ``val_acc``."""

    def __init__(self, hidden: int = 128, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_acc(self(x), y)
        self.log("val_acc", self.val_acc, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


class DigitsPipelineClassifier(DigitsClassifier):
    """A deeper tanh MLP of uneven widths (the wide layers first), to split into pipeline stages.

    With ``partition="uniform"`` the wide layers all land on the first stage; ``hier_pipeline``
    measures that imbalance and migrates layers to even it out.
    """

    def __init__(
        self, widths: tuple[int, ...] = (512, 512, 64, 64, 64, 64), lr: float = 0.05, momentum: float = 0.9
    ) -> None:
        super().__init__(hidden=widths[0], lr=lr, momentum=momentum)
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        prev = 64
        for width in widths:
            layers += [nn.Linear(prev, width), nn.Tanh()]
            prev = width
        layers.append(nn.Linear(prev, 10))
        self.net = nn.Sequential(*layers)
