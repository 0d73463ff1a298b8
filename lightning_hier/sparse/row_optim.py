"""Row-wise optimizers that update only the rows a step touched, in place in the shared table.

Their state (Adagrad's sum of squares, Adam's moments) is a table of the same shape, also in
node-shared memory, so the node's single updater keeps it once per node. Semantics follow torch:

- ``sgd``: ``w[r] -= lr * g``;
- ``adagrad``: ``torch.optim.Adagrad`` on the touched rows (``lr_decay=0``, ``weight_decay=0``);
- ``adam``: ``torch.optim.SparseAdam`` (moments of touched rows only, a global step count).
"""

from __future__ import annotations

import math

import torch

ROW_OPTIMIZERS = ("sgd", "adagrad", "adam")


def state_names(kind: str) -> tuple[str, ...]:
    """Per-row state tables an optimizer keeps."""
    return {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq")}[kind]


class RowOptimizer:
    """Applies one averaged sparse gradient ``(rows, grads)`` to ``table``."""

    def __init__(
        self,
        kind: str,
        table: torch.Tensor,
        state: dict[str, torch.Tensor],
        lr: float,
        eps: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        initial_accumulator_value: float = 0.0,
    ) -> None:
        if kind not in ROW_OPTIMIZERS:
            raise ValueError(f"optimizer={kind!r} is not one of {list(ROW_OPTIMIZERS)}.")
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr!r}.")
        self.kind = kind
        self.table = table
        self.state = state
        self.lr = lr
        self.eps = eps if eps is not None else (1e-10 if kind == "adagrad" else 1e-8)
        self.betas = betas
        self.initial_accumulator_value = initial_accumulator_value
        self.step_count = 0

    @torch.no_grad()
    def step(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """``rows`` unique int64 row indices, ``grads`` their averaged gradients (float32)."""
        self.step_count += 1
        if rows.numel() == 0:
            return
        if self.kind == "sgd" and self.table.dtype == torch.float32:
            # one pass over the touched rows (gather, update and scatter would be three)
            self.table.index_add_(0, rows, grads, alpha=-self.lr)
            return
        weight = self.table.index_select(0, rows).float()
        if self.kind == "sgd":
            weight.add_(grads, alpha=-self.lr)
        elif self.kind == "adagrad":
            total = self.state["sum"].index_select(0, rows).float().addcmul_(grads, grads)
            self.state["sum"][rows] = total.to(self.state["sum"].dtype)
            weight.addcdiv_(grads, total.sqrt().add_(self.eps), value=-self.lr)
        else:
            beta1, beta2 = self.betas
            exp_avg = self.state["exp_avg"].index_select(0, rows).float()
            exp_avg_sq = self.state["exp_avg_sq"].index_select(0, rows).float()
            exp_avg.mul_(beta1).add_(grads, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1 - beta2)
            self.state["exp_avg"][rows] = exp_avg.to(self.state["exp_avg"].dtype)
            self.state["exp_avg_sq"][rows] = exp_avg_sq.to(self.state["exp_avg_sq"].dtype)
            bias1 = 1 - beta1**self.step_count
            bias2 = 1 - beta2**self.step_count
            step_size = self.lr * math.sqrt(bias2) / bias1
            weight.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(self.eps), value=-step_size)
        self.table[rows] = weight.to(self.table.dtype)
