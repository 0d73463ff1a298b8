"""Run under torchrun (2 processes) with ``LIGHTNING_HIER_DEVICE_BACKEND=emulated_nccl``: hier_bsp's host
collectives between drains, with its groups built as on CUDA.

``bsp_host_collectives.py OUT SCENARIO`` writes ``OUT/rank<r>.json``:

- ``lockstep_fit``: a lockstep fit (``max_staleness=0, superstep=1``) whose ``training_step`` logs
  ``(rank + 1) x (batch_idx + 1)`` with ``sync_dist=True`` and the default mean, reduces an integer with
  the default mean and a float with ``ReduceOp.AVG``, and meets in a barrier, a broadcast from rank 0
  and an ``all_gather``. The default group is ``"cuda:emulated_nccl,cpu:gloo"``, so Lightning's own
  reduce hands ``ReduceOp.AVG`` to gloo (torch 2.13's gloo averages floating tensors but fails on
  integer ones; older ones refuse it) and calls ``torch.distributed.barrier`` on the default group, a
  device collective on CUDA (its bound device), from the worker's thread beside the BSP thread's. The
  script counts those barriers inside ``training_step``.
- ``nccl_only_default``: a default group with the emulated device backend alone (what
  ``process_group_backend="nccl"`` makes on a GPU: CPU tensors refused), and the strategy between drains
  in lockstep: ``reduce``, ``barrier``, ``broadcast`` and ``all_gather`` of host tensors. A whole fit
  cannot run so on CPU: the model's parameters are host tensors there, which ddp's own collectives on
  the default group (the model's first broadcast, checkpoint paths) would then carry; on a GPU they
  are device tensors.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: E402
from models import EquivModel, loader  # noqa: E402

from lightning_hier import HierBSPStrategy  # noqa: E402
from lightning_hier.audit import start_from_env  # noqa: E402
from lightning_hier.topology import device_backend_name  # noqa: E402


class CountedBarriers:
    """Counts ``torch.distributed.barrier`` calls from the main thread while ``counting`` is set."""

    def __init__(self) -> None:
        self.counting, self.count = False, 0
        self._barrier = dist.barrier

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        if self.counting and threading.current_thread() is threading.main_thread():
            self.count += 1
        return self._barrier(*args, **kwargs)


class HostCollectivesInTraining(EquivModel):
    """Every training step: a ``sync_dist`` mean, two ``strategy.reduce`` means, a barrier, a broadcast and
    an ``all_gather``; the logged value as Lightning holds it after the step."""

    def __init__(self, barriers: CountedBarriers) -> None:
        super().__init__(optimizer="sgd")
        self.barriers = barriers
        self.steps: list[dict] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        strategy = self.trainer.strategy
        rank = self.global_rank
        self.barriers.counting = True
        self.log("value", float((rank + 1) * (batch_idx + 1)), on_step=True, on_epoch=False, sync_dist=True)
        strategy.barrier("step")
        self.steps.append(
            {
                "int_mean": strategy.reduce(torch.tensor(rank + 1)).tolist(),
                "avg": strategy.reduce(torch.tensor(float(rank)), reduce_op=dist.ReduceOp.AVG).item(),
                "broadcast": strategy.broadcast(rank),
                "gathered": self.all_gather(torch.tensor(rank)).tolist(),
            }
        )
        self.barriers.counting = False
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.steps[-1]["logged"] = float(self.trainer.callback_metrics["value"])


def lockstep_fit(out: Path) -> dict:
    barriers = CountedBarriers()
    dist.barrier = barriers  # Lightning's _sync_ddp calls torch.distributed.barrier by this name
    model = HostCollectivesInTraining(barriers)
    strategy = HierBSPStrategy(
        superstep=1, max_staleness=0, bucket_cap_mb=0.002, timeout=timedelta(seconds=60)
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=out,
    )  # fmt: skip
    try:
        trainer.fit(model, train_dataloaders=loader(n=64))
    finally:
        dist.barrier = barriers._barrier
    return {"backend": dist.get_backend(), "steps": model.steps, "barriers_in_steps": barriers.count}


def nccl_only_default(out: Path) -> dict:
    """The strategy's methods between drains in lockstep on a default group that refuses host tensors."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    start_from_env()  # the emulated backend: this group is made here, not by a strategy's setup
    dist.init_process_group(f"cuda:{device_backend_name()}", rank=rank, world_size=world)
    environment = LightningEnvironment()
    environment.set_world_size(world)
    environment.set_global_rank(rank)
    strategy = HierBSPStrategy(superstep=1, max_staleness=0, cluster_environment=environment)
    strategy.engine = SimpleNamespace(memory=SimpleNamespace(paused=False))  # between drains
    try:
        strategy.barrier("between drains")
        return {
            "backend": dist.get_backend(),
            "mean": strategy.reduce(torch.tensor(float(rank + 1))).item(),
            "sum": strategy.reduce(torch.tensor(rank + 1), reduce_op="sum").item(),
            "broadcast": strategy.broadcast(f"from {rank}"),
            "gathered": strategy.all_gather(torch.tensor(rank)).tolist(),
        }
    finally:
        strategy.engine = None


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    try:
        result = {"lockstep_fit": lockstep_fit, "nccl_only_default": nccl_only_default}[scenario](out)
    except Exception as error:  # noqa: BLE001 - reported to the test, which shows it
        result = {"error": f"{type(error).__name__}: {error}"[:600]}
    (out / f"rank{dist.get_rank() if dist.is_initialized() else os.environ['RANK']}.json").write_text(
        json.dumps(result)
    )


if __name__ == "__main__":
    main()
