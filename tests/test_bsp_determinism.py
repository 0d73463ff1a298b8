"""hier_bsp in lockstep (``max_staleness=0`` with a step count) gives ``ddp``'s parameters whatever the
timing: which batches a superstep sums never depends on which worker gets somewhere first."""

from __future__ import annotations

import json

import pytest
from helpers import run_torchrun
from torch.utils.data.distributed import DistributedSampler

from lightning_hier.bsp.batch_claims import ClaimingSampler


class RefusingStore:
    """A store that must not be asked: chunks in turn need no claims."""

    def add(self, key: str, amount: int) -> int:
        raise AssertionError(f"claimed {key} in lockstep")


def test_in_turn_chunks_follow_the_rank_whatever_the_reading_order() -> None:
    n, batch, world = 96, 4, 3  # 24 chunks, 8 per worker
    orders = []
    for speeds in ((1, 1, 1), (5, 1, 2)):  # batches read per round by each rank
        samplers = [
            ClaimingSampler(n, batch, False, "t", r, world, seed=3, store=RefusingStore(), in_turn=True)
            for r in range(world)
        ]
        streams = [iter(s) for s in samplers]
        taken: list[list[int]] = [[] for _ in range(world)]
        while any(len(t) < n // world for t in taken):
            for rank, stream in enumerate(streams):
                for _ in range(speeds[rank] * batch):
                    index = next(stream, None)
                    if index is not None:
                        taken[rank].append(index)
        orders.append(taken)
    assert orders[0] == orders[1]  # the same batches for each worker, however fast each reads
    # two micro-steps per worker sum the samples of ddp's step with two accumulated batches
    ddp = [list(DistributedSampler(list(range(n)), world, r, shuffle=True, seed=3)) for r in range(world)]
    for step in range(4):
        window = slice(2 * step * batch, 2 * (step + 1) * batch)
        assert sorted(i for t in orders[0] for i in t[window]) == sorted(i for d in ddp for i in d[window])


def test_in_turn_chunks_cover_an_uneven_epoch_once() -> None:
    n, batch, world = 103, 8, 2  # 13 chunks, the last one of 7
    store = RefusingStore()
    samplers = [ClaimingSampler(n, batch, False, "u", r, world, store=store, in_turn=True) for r in (0, 1)]
    taken = [list(s) for s in samplers]
    assert sorted(taken[0] + taken[1]) == list(range(n))
    assert (len(taken[0]), len(taken[1])) == (7 * 8 - 1, 6 * 8)  # rank 0 takes the 7th chunk, the short one


@pytest.fixture(scope="module")
def lockstep_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bsp") / "lockstep.json"
    run_torchrun("bsp_lockstep_determinism.py", 2, str(out), timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("scenario", ["fixed_shards", "shared_batches"])
def test_superstep_of_two_equals_ddp_with_two_accumulated_batches_with_a_worker_held_back(
    lockstep_results: dict, scenario: str
) -> None:
    """superstep=2, max_staleness=0, float64: rank 1 starts every superstep late, so rank 0 folds the
    superstep's second micro-step, and drains at the epoch's end, while rank 1 still computes its first.
    Every superstep must still hold two micro-steps of each worker and the parameters equal ddp's."""
    result = lockstep_results[scenario]
    assert result["reference_moved"] > 1e-2
    assert result["micro_steps"] == [[2, 2]] * 6, result
    assert result["max_abs_diff"] < 1e-12, result
