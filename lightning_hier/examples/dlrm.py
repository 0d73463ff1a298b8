"""A DLRM-style click-through model on a synthetic Criteo-like stream, with ``HybridEmbedding`` tables.

``SyntheticClicks`` draws 13 dense features and ``num_sparse`` categorical features whose ids follow
a Zipf law (a few ids are very frequent, most are rare, as in real click logs), and a click label
from a fixed hidden logistic model of both, so the task is learnable. ``DLRM`` has a bottom MLP
for the dense features, one ``HybridEmbedding`` bag per categorical feature, pairwise dot-product
interactions and a top MLP; it logs loss and torchmetrics AUROC.

Run: ``python -m lightning_hier fit --config examples/configs/dlrm_hybrid.yaml``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_hier.sparse import HybridEmbedding


def zipf_ids(count: int, vocab: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """``count`` ids in ``[0, vocab)`` with ``P(id = k) ~ 1 / (k + 1) ** exponent``."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** exponent
    return torch.multinomial(weights, count, replacement=True, generator=generator)


class SyntheticClicks(Dataset):
    """Criteo-like samples: (dense [13], sparse ids [num_sparse, ids_per_feature], click)."""

    def __init__(
        self,
        samples: int = 4096,
        num_sparse: int = 4,
        vocab: int = 10_000,
        ids_per_feature: int = 2,
        zipf_exponent: float = 1.05,
        seed: int = 0,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.dense = torch.randn(samples, 13, generator=generator)
        self.sparse = zipf_ids(samples * num_sparse * ids_per_feature, vocab, zipf_exponent, generator).view(
            samples, num_sparse, ids_per_feature
        )
        hidden_dense = torch.randn(13, generator=torch.Generator().manual_seed(1234))
        hidden_ids = torch.randn(vocab, generator=torch.Generator().manual_seed(4321))
        logits = self.dense @ hidden_dense * 0.5 + hidden_ids[self.sparse].sum(dim=(1, 2)) * 0.5
        self.clicks = torch.bernoulli(torch.sigmoid(logits), generator=generator)

    def __len__(self) -> int:
        return len(self.clicks)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dense[index], self.sparse[index], self.clicks[index]


class SyntheticClicksDataModule(pl.LightningDataModule):
    def __init__(
        self,
        batch_size: int = 128,
        train_samples: int = 8192,
        val_samples: int = 2048,
        num_sparse: int = 4,
        vocab: int = 10_000,
        ids_per_feature: int = 2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _dataset(self, samples: int, seed: int) -> SyntheticClicks:
        h = self.hparams
        return SyntheticClicks(samples, h.num_sparse, h.vocab, h.ids_per_feature, seed=seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self._dataset(self.hparams.train_samples, 0), batch_size=self.hparams.batch_size, shuffle=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(self.hparams.val_samples, 1), batch_size=512)


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(pl.LightningModule):
    """Bottom MLP + HybridEmbedding bags + dot interactions + top MLP; dense optimizer is Adam."""

    def __init__(
        self,
        num_sparse: int = 4,
        vocab: int = 10_000,
        embedding_dim: int = 16,
        embedding_optimizer: str = "adagrad",
        embedding_lr: float = 0.05,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.bottom = mlp([13, 64, embedding_dim])
        self.tables = nn.ModuleList(
            HybridEmbedding(
                vocab, embedding_dim, mode="sum", optimizer=embedding_optimizer, lr=embedding_lr, seed=i
            )
            for i in range(num_sparse)
        )
        pairs = (num_sparse + 1) * num_sparse // 2
        self.top = mlp([embedding_dim + pairs, 64, 1])
        self.val_auroc = torchmetrics.classification.BinaryAUROC()

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        features = [self.bottom(dense)] + [table(sparse[:, i]) for i, table in enumerate(self.tables)]
        stacked = torch.stack(features, dim=1)  # batch x (1 + num_sparse) x dim
        dots = stacked @ stacked.transpose(1, 2)
        rows, cols = torch.triu_indices(stacked.shape[1], stacked.shape[1], offset=1)
        return self.top(torch.cat([features[0], dots[:, rows, cols]], dim=1)).squeeze(1)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        dense, sparse, clicks = batch
        loss = nn.functional.binary_cross_entropy_with_logits(self(dense, sparse), clicks)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        dense, sparse, clicks = batch
        self.val_auroc(torch.sigmoid(self(dense, sparse)), clicks.long())
        self.log("val_auroc", self.val_auroc, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # the HybridEmbedding tables are not parameters: they update themselves, row by row
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
