"""One of the 4 training processes of a ``bench_hybrid_embedding.py`` TorchRec job: the same click model,
batches and Lightning loop as ``_hybrid_embedding_worker.py``, with the table an ``EmbeddingBagCollection``
sharded by TorchRec's ``DistributedModelParallel`` (variants ``torchrec_tw``: table-wise, ``torchrec_dp``:
data-parallel, ``torchrec_cw``: column-wise). Needs ``pip install -e ".[bench]"`` and the install steps
after it in benchmarks/README.md."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _hybrid_embedding_worker import MODEL, ClickModel, fit_and_measure
from harness.worker import setup
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

SHARDING = {"torchrec_tw": "table_wise", "torchrec_dp": "data_parallel", "torchrec_cw": "column_wise"}
FEATURE = "ids"


class CollectionBag(nn.Module):
    """``nn.EmbeddingBag``'s ``(ids, offsets) -> pooled`` on a one-table ``EmbeddingBagCollection``."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        config = EmbeddingBagConfig(
            name="table",
            embedding_dim=dim,
            num_embeddings=rows,
            feature_names=[FEATURE],
            pooling=PoolingType.SUM,
        )
        # on the meta device: DistributedModelParallel allocates only the shards a rank holds
        self.collection = EmbeddingBagCollection(tables=[config], device=torch.device("meta"))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Sum-pooled rows of each bag, ``[bags, dim]``."""
        from torchrec import KeyedJaggedTensor

        lengths = torch.diff(offsets, append=offsets.new_tensor([ids.numel()]))
        features = KeyedJaggedTensor(keys=[FEATURE], values=ids, lengths=lengths)
        return self.collection(features).values()


class TorchRecStrategy(DDPStrategy):
    """Lightning's ``ddp`` with the model wrapped by TorchRec's ``DistributedModelParallel`` instead of
    ``DistributedDataParallel``: the table sharded as ``sharding`` says, the rest replicated under DDP."""

    def __init__(self, sharding: str, lr: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sharding, self.lr = sharding, lr
        self.plan: str = ""

    def model_to_device(self) -> None:
        """Nothing to move: the benchmark runs on CPU, and the table stays on the meta device until
        ``DistributedModelParallel`` allocates its shards."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
        from torchrec.distributed.types import ShardingEnv

        world = dist.get_world_size()
        # the table's update is fused into backward (exact SGD) on gradients averaged over the ranks, as
        # ddp's are: at the model's lr it takes the other contenders' step (TorchRec's default lr is 0.01)
        fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": self.lr}
        sharders: list[Any] = [EmbeddingBagCollectionSharder(fused_params=fused)]
        constraints = {"table": ParameterConstraints(sharding_types=[self.sharding])}
        planner = EmbeddingShardingPlanner(
            Topology(world_size=world, compute_device="cpu"), constraints=constraints
        )
        plan = planner.collective_plan(model, sharders, dist.group.WORLD)
        self.plan = str(plan)
        env = ShardingEnv.from_process_group(dist.group.WORLD)
        return DistributedModelParallel(
            model, env=env, device=torch.device("cpu"), plan=plan, sharders=sharders
        )


class TorchRecClickModel(ClickModel):
    """The click model; its optimizer skips the table where TorchRec's fused kernel updates it in
    backward (those parameters never get a ``.grad``)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD on every parameter that receives a gradient (the MLP; a data-parallel table too)."""
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def main() -> None:
    """Train: ``warmup`` steps, the memory window, the timed window, one more step; rank 0 writes timings."""
    config = {**MODEL, **json.loads(sys.argv[1])}
    job_dir = Path(config.pop("job_dir"))
    setup()
    rank = int(os.environ["RANK"])
    (job_dir / f"pid.{rank}").write_text(str(os.getpid()))
    variant, rows, dim, lr = config["variant"], config["rows"], config["dim"], config["lr"]
    table = CollectionBag(rows, dim)
    strategy = TorchRecStrategy(SHARDING[variant], lr)
    model = TorchRecClickModel(table, dim, config["dense_features"], config["hidden"], lr)
    result = fit_and_measure(config, job_dir, model, strategy)
    if result is not None:
        result.update(table_class="EmbeddingBagCollection", plan=strategy.plan)  # the plan the fit made
        (job_dir / "rank0.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
