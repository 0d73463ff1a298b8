"""One "node" of a 2 x 2 job started the way a cluster's node agents start Lightning: one process per
node with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set and no ``LOCAL_RANK``, so Lightning's own
launcher starts the node's second process (``Trainer(num_nodes=2, devices=2)``).

``two_node_launch.py OUT STRATEGY`` trains ``EquivModel`` (BatchNorm, frozen, unused and tied parameters,
SGD with momentum and a step LR schedule) for two epochs; every rank writes ``OUT/rank<r>.json`` with the
layout its strategy resolved, and global rank 0 saves the final weights to ``OUT/weights.pt``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from models import EquivModel, loader  # noqa: E402

from lightning_hier import HierBSPStrategy, HierSlicedStrategy  # noqa: E402

STRATEGIES = {
    "ddp": lambda: "ddp_find_unused_parameters_true",  # quirks: an unused layer
    "hier_sliced": lambda: HierSlicedStrategy(bucket_cap_mb=0.002),
    # plain BSP (lockstep): one superstep per step is ddp's synchronous SGD
    "hier_bsp": lambda: HierBSPStrategy(superstep=1, max_staleness=0, bucket_cap_mb=0.002),
}


def main() -> None:
    out, name = Path(sys.argv[1]), sys.argv[2]
    pl.seed_everything(5, verbose=False)
    model = EquivModel(optimizer="sgd", quirks=True, batch_norm=True, scheduler=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, strategy=STRATEGIES[name](), max_epochs=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader(n=256))
    topology = getattr(trainer.strategy, "topology", None)
    layout = {
        "global_rank": trainer.global_rank,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "devices_per_node": topology.devices_per_node if topology is not None else None,
        "topology_rank": topology.rank if topology is not None else None,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(layout))
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "weights.pt")


if __name__ == "__main__":
    main()
