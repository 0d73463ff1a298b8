"""A short 2-process fit under one strategy, with a rank killed by SIGKILL at a chosen point.

``fault_run.py STRATEGY MODE OUT``: ``MODE`` is ``reference`` (uninterrupted), ``fault`` (the fault of
``FAULT_POINT`` on rank ``FAULT_RANK`` in epoch ``FAULT_EPOCH``) or ``resume`` (``ckpt_path="last"``).
Every rank writes ``OUT/pid<r>`` at start and ``OUT/rank<r>.json`` (the error it ended with, when) at
the end, and its module's final state to ``OUT/params<r>.pt``. Checkpoints go to ``OUT/../ckpt`` at the
end of every epoch (``last.ckpt`` as well). The fault is patched in here, never in the package."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import EquivModel, loader  # noqa: E402

from lightning_hier import (  # noqa: E402
    HierBSPStrategy,
    HierPipelineStrategy,
    HierSlicedStrategy,
    HybridEmbedding,
)

EPOCHS = 3
TIMEOUT = timedelta(seconds=30)
DEATH_FILE = "died_at"

RANK = int(os.environ.get("RANK", "0"))
FAULT_POINT = os.environ.get("FAULT_POINT", "")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_EPOCH = int(os.environ.get("FAULT_EPOCH", "1"))
_armed = {"on": False}


def _die(out: Path) -> None:
    (out / DEATH_FILE).write_text(json.dumps({"rank": RANK, "time": time.time(), "point": FAULT_POINT}))
    os.kill(os.getpid(), signal.SIGKILL)


def _trap(module, name: str, out: Path, when: str = "on") -> None:  # noqa: ANN001
    """Replace ``module.name`` by a wrapper that kills this process on its first call while armed (and,
    with ``when="consolidating"``, inside an optimizer state's consolidation)."""
    original = getattr(module, name, None)
    if original is None:
        return

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if _armed["on"] and _armed.get(when):
            _die(out)
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def _flag_inside(cls: type, method: str, flag: str) -> None:
    """Set ``_armed[flag]`` while ``cls.method`` runs (the collectives' traps fire only inside it)."""
    original = getattr(cls, method)

    def flagged(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        _armed[flag] = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _armed[flag] = False

    setattr(cls, method, flagged)


def _mark_consolidation() -> None:
    """Flag the calls of every sharded optimizer's ``consolidated_state_dict`` (a checkpoint's gather)."""
    from lightning_hier.sliced import piece_sharding, sharded_optim

    for module in (piece_sharding, sharded_optim):
        for cls in list(vars(module).values()):
            if isinstance(cls, type) and "consolidated_state_dict" in vars(cls):
                _flag_inside(cls, "consolidated_state_dict", "consolidating")


class Regressor(pl.LightningModule):
    """A 5-layer MLP that ``hier_pipeline`` splits into stages."""

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


class Clicks(pl.LightningModule):
    """A ``HybridEmbedding`` bag (node-shared table, row-wise Adagrad) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = HybridEmbedding(64, 8, mode="sum", optimizer="adagrad", lr=0.05, seed=3)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        ids, clicks = batch
        offsets = torch.arange(0, ids.numel(), ids.shape[1])
        logits = self.head(self.emb(ids.reshape(-1), offsets)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, clicks)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.head.parameters(), lr=0.01)

    def on_train_end(self) -> None:  # the node-shared table is detached at teardown
        self.final_table = self.emb.weight.detach().clone()


def clicks_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (64, 3), generator=generator)
    return DataLoader(TensorDataset(ids, torch.rand(64, generator=generator).round()), batch_size=8)


def regression_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 8, generator=generator), torch.randn(32, 1, generator=generator))
    return DataLoader(data, batch_size=8)


class Arm(pl.Callback):
    """Arms the trap in the fault epoch: at its third batch (``batch``) or at its end (``checkpoint``)."""

    def __init__(self, at_epoch_end: bool) -> None:
        self.at_epoch_end = at_epoch_end

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if not self.at_epoch_end and trainer.current_epoch == FAULT_EPOCH and batch_idx == 2:
            _armed["on"] = RANK == FAULT_RANK

    def on_train_epoch_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if self.at_epoch_end and trainer.current_epoch == FAULT_EPOCH:
            _armed["on"] = RANK == FAULT_RANK  # ModelCheckpoint saves after this hook


def strategy_for(name: str):  # noqa: ANN201
    if name in ("hier_sliced", "hybrid_embedding"):
        return HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002, timeout=TIMEOUT)
    if name == "hier_bsp":  # plain BSP (lockstep): a resumed run can equal an uninterrupted one
        return HierBSPStrategy(
            superstep=1, max_staleness=0, devices_per_node=2, bucket_cap_mb=0.002, timeout=TIMEOUT
        )
    if name == "hier_pipeline":
        return HierPipelineStrategy(timeout=TIMEOUT)
    raise ValueError(name)


def main() -> None:
    name, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid{RANK}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=out.parent / "ckpt", every_n_epochs=1, save_top_k=-1, save_last=True)
    ]
    if mode == "fault":
        if FAULT_POINT == "reduce_scatter":
            for collective in ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"):
                _trap(dist, collective, out)
        elif FAULT_POINT == "save":
            _trap(torch, "save", out)
        elif FAULT_POINT == "write":  # half of the checkpoint's bytes written
            import fsspec.implementations.local as local

            write = local.LocalFileOpener.write

            def write_half(self, data):  # noqa: ANN001, ANN202
                if _armed["on"] and len(data) > 1:
                    write(self, data[: len(data) // 2])
                    self.f.flush()
                    os.fsync(self.f.fileno())
                    _die(out)
                return write(self, data)

            local.LocalFileOpener.write = write_half
        elif FAULT_POINT == "gather":  # the peer's part of the optimizer state's consolidation
            gathers = ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single")
            for collective in gathers:
                _trap(dist, collective, out, when="consolidating")
            _mark_consolidation()
        elif FAULT_POINT == "push":  # hier_bsp's superstep push of the gradient sums
            from lightning_hier.bsp.server import ShardedParameterServer

            pushes = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
            for collective in pushes:
                _trap(dist, collective, out, when="pushing")
            _flag_inside(ShardedParameterServer, "push", "pushing")
        elif FAULT_POINT == "p2p":  # an activation or gradient between pipeline stages
            # (isend and irecv stay: P2POp accepts only those very functions)
            for p2p in ("send", "recv", "batch_isend_irecv"):
                _trap(dist, p2p, out)
        elif FAULT_POINT == "row_update":  # local rank 0 writing the node-shared table's rows
            from lightning_hier.sparse.row_optim import RowOptimizer

            _trap(RowOptimizer, "step", out)
        else:
            raise ValueError(FAULT_POINT)
        callbacks.append(Arm(at_epoch_end=FAULT_POINT in ("save", "write", "gather")))
    pl.seed_everything(7, verbose=False)
    pipeline = name == "hier_pipeline"
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy_for(name), max_epochs=EPOCHS, logger=False,
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=not pipeline,  # every stage sees the same batches
    )  # fmt: skip
    if name == "hybrid_embedding":
        model, data = Clicks(), clicks_loader()
    elif pipeline:
        model, data = Regressor(), regression_loader()
    else:
        model, data = EquivModel(optimizer="adamw_groups"), loader(n=64)
    error = None
    try:
        trainer.fit(model, train_dataloaders=data, ckpt_path="last" if mode == "resume" else None)
    except Exception as err:  # noqa: BLE001 - recorded for the test, then the process fails
        error = f"{type(err).__name__}: {err}"
    (out / f"rank{RANK}.json").write_text(json.dumps({"error": error, "ended": time.time()}))
    if error is not None:
        print(f"rank {RANK} failed: {error}", file=sys.stderr)
        sys.exit(1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if isinstance(model, Clicks):
        state["emb.table"] = model.final_table
    torch.save(state, out / f"params{RANK}.pt")


if __name__ == "__main__":
    main()
