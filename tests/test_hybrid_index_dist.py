"""The hashed-id index of HybridEmbedding shared by the processes of a node."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import init_gloo, run_spawned


def _hashed_lookups(rank: int, world: int, store: str) -> dict:
    import torch.distributed as dist

    from lightning_hier import HybridEmbedding

    init_gloo(rank, world, store)
    module = HybridEmbedding(64, 4, hashed_ids=True, seed=1)
    module.attach(dist.group.WORLD, None, local_rank=rank)  # both processes form one node
    ids = torch.tensor([5, 10**15, 77, 3 + rank, 900 + rank], dtype=torch.int64)  # shared and own ids
    module(ids)
    dist.barrier()
    probe = torch.tensor([5, 10**15, 77, 3, 4, 900, 901], dtype=torch.int64)
    rows = module.index.lookup(probe.numpy()).tolist()
    values = module.weight[torch.tensor(rows)].clone()
    dist.barrier()  # every process has read the initial values
    # each process writes the row of an id only it inserted; the other must read what was written
    mine = int(module.index.lookup(torch.tensor([3 + rank]).numpy())[0])
    module.weight[mine] = 10.0 * (rank + 1)
    dist.barrier()
    theirs = int(module.index.lookup(torch.tensor([3 + (1 - rank)]).numpy())[0])
    return {"rows": rows, "values": values, "seen_from_other": module.weight[theirs].tolist()}


def test_hashed_index_is_shared_by_the_node_and_consistent(tmp_path: Path) -> None:
    from lightning_hier.sparse.id_index import hashed_init

    results = run_spawned(_hashed_lookups, 2, tmp_path)
    for result in results:
        assert result is not None and "error" not in result, result
    assert results[0]["rows"] == results[1]["rows"]  # one index: both see every id at the same row
    # one table: what each process wrote is what the other reads (separate copies would show the init)
    assert results[0]["seen_from_other"] == [20.0] * 4 and results[1]["seen_from_other"] == [10.0] * 4
    assert sorted(results[0]["rows"]) == list(range(7))  # 7 distinct ids, 7 rows, none handed out twice
    probe = [5, 10**15, 77, 3, 4, 900, 901]
    expected = hashed_init(__import__("numpy").array(probe), 4, 0.5, seed=1)  # init_scale = 1/sqrt(4)
    torch.testing.assert_close(results[0]["values"], expected)
