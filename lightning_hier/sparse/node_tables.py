"""Every ``HybridEmbedding`` of a model, driven together by a data-parallel strategy.

A strategy that trains a model with node-shared tables does five things with them, always for all
tables at once: attach them to the node's shared memory at setup, average their sparse gradients
after backward, apply (or skip, under a loss scaler) the row update after the dense step, and write,
restore or remove their checkpoint files. :class:`NodeTables` is that one object, so the strategy
holds no table logic of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_hier.sparse.background import TableJobs
from lightning_hier.sparse.checkpoint import (
    CHECKPOINT_KEY,
    find_hybrid_embeddings,
    remove_tables,
    restore_tables,
    save_tables,
)
from lightning_hier.sparse.embedding import HybridEmbedding


class NodeTables:
    """The ``HybridEmbedding`` modules of ``module`` (found by name), with what a strategy does to them."""

    def __init__(self, module: nn.Module | None = None) -> None:
        self.modules: list[tuple[str, HybridEmbedding]] = find_hybrid_embeddings(module) if module else []
        self._jobs: TableJobs | None = None

    def __bool__(self) -> bool:
        return bool(self.modules)

    def attach(
        self,
        intra_group: dist.ProcessGroup | None,
        inter_group: dist.ProcessGroup | None,
        local_rank: int,
        exchange_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] | None = None,
    ) -> None:
        """Local rank 0 of each node creates every table in shared memory; the others map it.

        With ``exchange_groups`` (``(intra, inter)`` groups no other thread issues on) the gradient
        exchanges and row updates run on a thread of their own over them, beside the dense work of
        the step (:mod:`lightning_hier.sparse.background`); without, on the caller's thread.
        """
        if exchange_groups is not None and self._jobs is None:
            self._jobs = TableJobs()
        for name, module in self.modules:
            module.attach(
                intra_group,
                inter_group,
                local_rank,
                label=name,
                managed=True,
                exchange_groups=exchange_groups,
                jobs=self._jobs if exchange_groups is not None else None,
            )

    def wait(self) -> None:
        """Block until every queued exchange and update has run (raising the first error)."""
        if self._jobs is not None:
            self._jobs.wait()

    def close(self) -> None:
        """Wait for the queued work, then end the tables' thread (a later attach starts a new one)."""
        jobs, self._jobs = self._jobs, None
        if jobs is None:
            return
        try:
            jobs.close()
        finally:
            for _, module in self.modules:
                module.run_exchanges_inline()

    def finite_checks(self) -> list[Callable[[], bool]]:
        """One check per table: are its averaged gradients finite (folded into the loss scaler's decision)."""
        return [module.synced_gradients_finite for _, module in self.modules]

    def sync_gradients(self, update: bool = False) -> None:
        """Average every table's sparse gradients over the job; ``update``: apply them right after,
        else later by :meth:`apply_update` (under a loss scaler, which decides skip or step first)."""
        for _, module in self.modules:
            module.sync_gradients()
            if update:
                module.apply_update()

    def apply_update(self, inv_scale: float = 1.0, skipped: bool = False) -> None:
        """The row update of the step that just ran, unscaled by ``inv_scale``; nothing when ``skipped``."""
        for _, module in self.modules:
            module.apply_update(inv_scale, skipped)

    # ------------------------------------------------------------------ checkpoints
    def save(self, checkpoint: dict[str, Any], filepath: str | Path, write: bool) -> None:
        """Write the tables beside ``filepath`` (only where ``write``) and record them in ``checkpoint``."""
        self.wait()
        if self.modules:
            checkpoint[CHECKPOINT_KEY] = save_tables(self.modules, filepath, write=write)

    def restore(self, checkpoint: dict[str, Any], checkpoint_path: str | None) -> None:
        """Load the tables a checkpoint recorded (nothing when it recorded none)."""
        self.wait()
        if self.modules and CHECKPOINT_KEY in checkpoint:
            restore_tables(self.modules, checkpoint[CHECKPOINT_KEY], checkpoint_path)

    @staticmethod
    def remove(filepath: str | Path) -> None:
        """Delete the tables written beside ``filepath``."""
        remove_tables(filepath)
