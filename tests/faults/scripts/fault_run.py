"""A short 2-process fit under one strategy, with a rank killed by SIGKILL at a chosen point.

``fault_run.py STRATEGY MODE OUT``: ``MODE`` is ``reference`` (uninterrupted), ``fault`` (the fault of
``FAULT_POINT`` on rank ``FAULT_RANK`` in epoch ``FAULT_EPOCH``, see :data:`POINTS`) or ``resume``
(``ckpt_path="last"``). As many ranks as the launcher starts (``hier_sliced_2nodes``: 4, 2 nodes x 2).
Every rank writes ``OUT/pid<r>`` at start and ``OUT/rank<r>.json`` (the error it ended with, when) at
the end, and its module's final state to ``OUT/params<r>.pt``. Checkpoints go to ``OUT/../ckpt`` at the
end of every epoch (``last.ckpt`` as well). The fault is patched in here, never in the package."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import EquivModel, Regressor, loader  # noqa: E402

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
WORLD = int(os.environ.get("WORLD_SIZE", "2"))
FAULT_POINT = os.environ.get("FAULT_POINT", "")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_EPOCH = int(os.environ.get("FAULT_EPOCH", "1"))
_armed = {"on": False}
_inside = threading.local()  # the phase this thread is in (a reducer's or BSP module's thread has its own)


def _die(out: Path) -> None:
    (out / DEATH_FILE).write_text(json.dumps({"rank": RANK, "time": time.time(), "point": FAULT_POINT}))
    os.kill(os.getpid(), signal.SIGKILL)


def _trap(module, name: str, out: Path, when: str | None = None, skip: int = 0) -> None:  # noqa: ANN001
    """Replace ``module.name`` by a wrapper that kills this process on its first call while armed (with
    ``when``: only inside the phase of that name, see :func:`_flag_inside`), after ``skip`` such calls."""
    original = getattr(module, name, None)
    if original is None:
        return
    calls = {"n": 0}

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if _armed["on"] and (when is None or getattr(_inside, when, False)):
            calls["n"] += 1
            if calls["n"] > skip:
                _die(out)
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def _flag_inside(owner, method: str, flag: str) -> None:  # noqa: ANN001
    """Mark this thread as inside phase ``flag`` while ``owner.method`` runs (a class's method or a
    module's function)."""
    original = getattr(owner, method)

    def flagged(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        setattr(_inside, flag, True)
        try:
            return original(*args, **kwargs)
        finally:
            setattr(_inside, flag, False)

    setattr(owner, method, flagged)


def _mark_consolidation() -> None:
    """Flag the calls of every sharded optimizer's ``consolidated_state_dict`` (a checkpoint's gather)."""
    from lightning_hier.sliced import piece_sharding, sharded_optim

    for module in (piece_sharding, sharded_optim):
        for cls in list(vars(module).values()):
            if isinstance(cls, type) and "consolidated_state_dict" in vars(cls):
                _flag_inside(cls, "consolidated_state_dict", "consolidating")


GATHERS = ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single")


def _write_half(out: Path) -> None:
    """Half of the checkpoint file's bytes written, then the kill."""
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
    save = torch.save

    def save_half(obj, f, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        # the strategies' checkpoint IO serialises straight into the file beside the checkpoint
        if _armed["on"] and hasattr(f, "fileno") and not isinstance(f, io.BytesIO):
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            _die(out)
        return save(obj, f, *args, **kwargs)

    torch.save = save_half


def _inter_node_all_reduce(out: Path) -> None:
    """The inter-node all-reduce of a bucket's reduced slice (on 2 nodes x 2)."""
    from lightning_hier.sliced import reducer

    for cls in list(vars(reducer).values()):
        if isinstance(cls, type) and "_all_reduce_piece" in vars(cls):
            _flag_inside(cls, "_all_reduce_piece", "inter")
    _trap(dist, "all_reduce", out, when="inter")


def _slice_all_gather(out: Path) -> None:
    """The all-gather of the updated parameter slices inside the node."""
    from lightning_hier.sliced.engine import HierSlicedEngine

    _flag_inside(HierSlicedEngine, "gather_params", "gathering")
    for collective in (*GATHERS, "broadcast"):
        _trap(dist, collective, out, when="gathering")


def _sharded_write(out: Path) -> None:
    """Every rank writing its slices of a sharded checkpoint (DCP): the second item this rank writes."""
    import torch.distributed.checkpoint.filesystem as filesystem

    _trap(filesystem, "_write_item", out, skip=1)


def _bsp_push(out: Path) -> None:
    """hier_bsp's superstep push of the gradient sums."""
    from lightning_hier.bsp.server import ShardedParameterServer

    for collective in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"):
        _trap(dist, collective, out, when="pushing")
    _flag_inside(ShardedParameterServer, "push", "pushing")


def _bsp_pull(out: Path) -> None:
    """hier_bsp's pull: the all-gather of the slices the server updated."""
    from lightning_hier.bsp.server import ShardedParameterServer

    for collective in (*GATHERS, "broadcast"):
        _trap(dist, collective, out, when="pulling")
    _flag_inside(ShardedParameterServer, "pull", "pulling")


def _bsp_drain(out: Path) -> None:
    """A worker that asked for the drain (the epoch's last step) and waits for its local BSP module."""
    from lightning_hier.bsp.engine import BSPEngine

    _flag_inside(BSPEngine, "drain", "draining")
    _trap(BSPEngine, "_wait", out, when="draining")


def _pipeline_p2p(out: Path) -> None:
    """An activation or gradient between pipeline stages (isend and irecv stay: P2POp accepts only those
    very functions)."""
    for p2p in ("send", "recv", "batch_isend_irecv"):
        _trap(dist, p2p, out)


def _migration(step: str) -> Callable[[Path], None]:
    """A live layer migration's protocol step: the source's announcement, the target's ready, the source's
    state, or the release of what left once every move ran."""

    def install(out: Path) -> None:
        from lightning_hier.pipeline import engine

        _flag_inside(engine.PipelineEngine, "apply_partition", "migrating")
        if step == "release":
            _trap(engine, "release_state", out, when="migrating")
            return
        # send_object_list sends through distributed_c10d's own send: dist.send is the ready alone
        sends = {"announce": ("send_object_list", 0), "ready": ("send", 0), "state": ("send_object_list", 1)}
        name, skip = sends[step]
        _trap(dist, name, out, when="migrating", skip=skip)

    return install


def _swap(direction: str) -> Callable[[Path], None]:
    """A swapped activation going to the host (forward) or back (backward)."""

    def install(out: Path) -> None:
        from lightning_hier.pipeline.activation_store import LayerRunner

        _trap(LayerRunner, "_pack_swapped" if direction == "out" else "_copy_back", out)

    return install


def _row_update(out: Path) -> None:
    """Local rank 0 writing the node-shared table's rows."""
    from lightning_hier.sparse.row_optim import RowOptimizer

    _trap(RowOptimizer, "step", out)


def _table_save(out: Path) -> None:
    """Rank 0 writing a checkpoint's tables: the second table file."""
    from lightning_hier.sparse import checkpoint

    _trap(checkpoint, "save_table", out, skip=1)


# fault point: (installer, armed at the fault epoch's end rather than at its third batch)
POINTS: dict[str, tuple[Callable[[Path], None], bool]] = {
    "reduce_scatter": (
        lambda out: [
            _trap(dist, c, out) for c in ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
        ],
        False,
    ),
    "inter_all_reduce": (_inter_node_all_reduce, False),
    "slice_all_gather": (_slice_all_gather, False),
    "save": (lambda out: _trap(torch, "save", out), True),
    "write": (_write_half, True),
    "gather": (
        lambda out: ([_trap(dist, c, out, when="consolidating") for c in GATHERS], _mark_consolidation()),
        True,
    ),
    "sharded_save": (_sharded_write, True),
    "push": (_bsp_push, False),
    "pull": (_bsp_pull, False),
    "drain": (_bsp_drain, False),
    "p2p": (_pipeline_p2p, False),
    **{f"migrate_{step}": (_migration(step), False) for step in ("announce", "ready", "state", "release")},
    "swap_out": (_swap("out"), False),
    "swap_in": (_swap("in"), False),
    "row_update": (_row_update, False),
    "table_save": (_table_save, True),
}


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
    if name in ("hier_sliced", "hybrid_embedding", "hier_sliced_2nodes"):  # 2 nodes x 2 on 4 processes
        return HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002, timeout=TIMEOUT)
    if name == "hier_sliced_sharded":
        return HierSlicedStrategy(
            devices_per_node=2, bucket_cap_mb=0.002, timeout=TIMEOUT, checkpoint_format="sharded"
        )
    if name == "hier_bsp":  # plain BSP (lockstep): a resumed run can equal an uninterrupted one
        return HierBSPStrategy(
            superstep=1, max_staleness=0, devices_per_node=2, bucket_cap_mb=0.002, timeout=TIMEOUT
        )
    if name == "hier_pipeline":  # every activation swapped to the host; a migration every 2 steps
        _alternate_splits()
        return HierPipelineStrategy(timeout=TIMEOUT, activation_policy="swap", rebalance=2)
    raise ValueError(name)


def _alternate_splits() -> None:
    """Every rebalance check moves the layers, between a first stage of one cluster and a last stage of one
    (chosen here, not from measured times, so that every run migrates the same layers at the same steps;
    the placement never changes the math)."""
    from lightning_hier.pipeline import engine
    from lightning_hier.pipeline.partition import StagePartition

    decide = engine.decide_rebalance

    def alternate(graph, partition, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        decision = decide(graph, partition, *args, **kwargs)
        n = partition.num_clusters
        new = StagePartition((0, n - 1) if partition.starts[1] == 1 else (0, 1), n)
        return dataclasses.replace(decision, new=new, reason="alternating split")

    engine.decide_rebalance = alternate


def main() -> None:
    name, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid{RANK}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=out.parent / "ckpt", every_n_epochs=1, save_top_k=-1, save_last=True)
    ]
    if mode == "fault":
        install, at_epoch_end = POINTS[FAULT_POINT]
        install(out)
        callbacks.append(Arm(at_epoch_end))
    pl.seed_everything(7, verbose=False)
    pipeline = name == "hier_pipeline"
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy_for(name), max_epochs=EPOCHS, logger=False,
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=not pipeline,  # every stage sees the same batches
    )  # fmt: skip
    if name == "hybrid_embedding":
        model, data = Clicks(), clicks_loader()
    elif pipeline:
        model, data = Regressor(), regression_loader()
    else:
        model, data = EquivModel(optimizer="adamw_groups"), loader(n=32 * WORLD)  # 4 steps an epoch
    error = None
    try:
        trainer.fit(model, train_dataloaders=data, ckpt_path="last" if mode == "resume" else None)
    except Exception as err:  # noqa: BLE001 - recorded for the test, then the process fails
        # with its notes: the strategy's naming of the lost rank is one
        error = "\n".join([f"{type(err).__name__}: {err}", *getattr(err, "__notes__", ())])
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
