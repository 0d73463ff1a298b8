"""The TorchRec anchor of benchmarks/bench_hybrid_embedding.py trains the table as the other contenders do:
one step of its table-wise sharded table equals ``nn.EmbeddingBag`` + ddp's averaged SGD step. Runs where
TorchRec is installed (the ``bench`` extra, benchmarks/README.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import init_gloo, run_spawned

try:
    import torchrec  # noqa: F401
except Exception as exc:  # not installed, or a CUDA fbgemm-gpu whose library does not load on CPU
    pytest.skip(f"TorchRec does not import: {exc}", allow_module_level=True)

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
ROWS, DIM, LR = 40, 8, 0.5


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s bags: flat ids and offsets, with ids that both ranks look up."""
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, ROWS // 2, (24,), generator=generator)
    return ids, torch.tensor([0, 3, 4, 9, 15, 20])


class Net(nn.Module):
    """A table and a linear head: a scalar loss per rank, the mean over its bags."""

    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = table
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids, offsets)).square().mean()


def one_step(rank: int, world: int, store: str) -> dict[str, torch.Tensor]:
    """One table-wise TorchRec step on every rank; rank 0 (the table's owner) returns the table before
    and after, and the ``nn.EmbeddingBag`` + averaged-gradient SGD step from the same start."""
    import torch.distributed as dist

    init_gloo(rank, world, store)
    sys.path.insert(0, str(BENCHMARKS))
    from _torchrec_worker import CollectionBag, TorchRecStrategy

    model = TorchRecStrategy("table_wise", LR)._setup_model(Net(CollectionBag(ROWS, DIM)))
    key = next(k for k in model.state_dict() if k.endswith("table.weight"))
    shards = model.state_dict()[key].local_shards()
    before = shards[0].tensor.clone() if shards else torch.zeros(ROWS, DIM)
    dist.broadcast(before, src=0)
    model(*batch(rank)).backward()  # the fused update runs in backward
    after = model.state_dict()[key].local_shards()[0].tensor.clone() if shards else None
    grads = []
    for r in range(world):  # ddp: every rank's gradient, averaged
        reference = Net(nn.EmbeddingBag(ROWS, DIM, mode="sum", _weight=before.clone()))
        reference(*batch(r)).backward()
        grads.append(reference.table.weight.grad)
    expected = before - LR * torch.stack(grads).mean(0)
    dist.destroy_process_group()
    return {"before": before, "after": after, "expected": expected}


def test_table_wise_step_equals_ddp_averaged_sgd(tmp_path: Path) -> None:
    results = run_spawned(one_step, 2, tmp_path)
    assert all(r is not None and "error" not in r for r in results), results
    rank0 = results[0]
    assert not torch.equal(rank0["after"], rank0["before"])  # the step changed the table
    torch.testing.assert_close(rank0["after"], rank0["expected"], rtol=1e-5, atol=1e-6)
