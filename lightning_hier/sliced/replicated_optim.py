"""The user's optimizer left on the whole model on every rank, for updates that are not elementwise.

``hier_sliced`` normally shards the optimizer by flat parameter slices (:mod:`.sharded_optim`), which
gives ``ddp``'s result only for elementwise updates. ``Adafactor`` (factored second moments per matrix),
``Muon`` (an orthogonalised update per matrix), LAMB or LARS (a trust ratio per tensor) look at a whole
parameter, so under ``shard_optimizer=False`` (the default for them) the optimizer keeps its parameters
and its full state on every rank, as under ``ddp``. The gradients are still reduced hierarchically
(reduce-scatter in the node, the slices across nodes, all-gather in the node): the slow link carries the
same bytes as with a sharded optimizer; what is not saved is the optimizer state's memory.

Each rank steps identical full gradients with identical state, so the parameters stay identical without
an all-gather after the step. This object stands where :class:`.sharded_optim.OptimizerSharding` stands in
the engine: ``shards`` are the slices that receive the reduced gradient, from which the engine assembles the
full one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_hier.sliced.flat_buckets import FlatBucket


class ReplicatedOptimizer:
    """The optimizer as the user built it; checkpoints hold its own ``state_dict()``."""

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: Sequence[FlatBucket]) -> None:
        self.optimizer = optimizer
        self.shards = [nn.Parameter(bucket.owned_params(), requires_grad=False) for bucket in buckets]

    def consolidated_state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def unshard(self) -> None:
        """Nothing to give back: the optimizer always held its own parameters."""

    def unshard_into(self, groups: Sequence[Sequence[nn.Parameter]]) -> None:
        """Every param group holds ``groups``' parameters (its own already), and its state stays."""
        for group, params in zip(self.optimizer.param_groups, groups):
            group["params"] = list(params)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the full gradients, the same on every rank (as ``ddp`` clips)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return torch.zeros(())
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=float(norm_type))
