"""HybridEmbedding under hier_sliced on 4 processes as 2 nodes x 2."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import init_gloo, run_spawned, run_torchrun

from lightning_hier import HybridEmbedding, Topology
from lightning_hier.sparse.background import TableJobs
from lightning_hier.sparse.sync import frequency_average


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    scratch: Path = tmp_path_factory.mktemp("hybrid")
    run_torchrun("hybrid_checks.py", 4, str(scratch / "out.json"), str(scratch))
    return json.loads((scratch / "out.json").read_text())


def test_hierarchical_exchange_gives_the_frequency_rule(results: dict) -> None:
    assert len(results["rule"]) == 2  # both node leaders got the result
    for leader in results["rule"]:
        assert leader["ids_equal"] and leader["max_diff"] < 1e-6


def test_leader_and_shared_merges_give_the_frequency_rule_bit_for_bit_on_uneven_ranks(results: dict) -> None:
    # rank 2 has no rows; rank 1 has more than its mailbox holds (those go by message)
    assert len(results["uneven_rule"]) == 2
    for leader in results["uneven_rule"]:
        assert leader["ids_equal"] and leader["max_diff"] < 1e-6
        assert leader["shared_bitwise"]


def test_the_leader_merge_reads_rows_from_the_mailboxes_and_sends_by_message_only_what_overflows(
    results: dict,
) -> None:
    # rank 3's 7 rows fit its mailbox: only the header goes; rank 1's 300 overflow: header and rows go
    sends = results["uneven_sends"]
    assert [s["leader"] for s in sends] == [0, 2, 0, 2]  # without mailboxes every row goes by message
    assert [s["leader_mailboxes"] for s in sends] == [0, 2, 0, 1]
    assert results["leader_merge_in_training_has_mailboxes"]  # the default merge gets them at attach


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_training_with_the_shared_merge_gives_the_leader_merges_table_to_the_bit(
    results: dict, optimizer: str
) -> None:
    assert results[f"shared_merge_{optimizer}_bitwise"]


def test_one_segment_per_node_and_updated_rows_seen_everywhere(results: dict) -> None:
    segments = results["segments"]
    assert segments[0] and segments[2]
    assert segments[0] == segments[1] and segments[2] == segments[3]
    assert set(segments[0]).isdisjoint(segments[2])
    assert results["tables_equal_everywhere"]
    assert results["table_moved"] > 1e-4  # the rows every process reads were really updated


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_matches_ddp_with_dense_embedding_when_every_id_is_everywhere(results: dict, optimizer: str) -> None:
    result = results[f"ddp_{optimizer}"]
    assert result["moved"] > 1e-3
    assert result["table_diff"] < 1e-5 and result["head_diff"] < 1e-5


def test_tables_survive_checkpoint_and_resume_bit_for_bit(results: dict) -> None:
    assert results["resume_bit_for_bit"]
    assert results["hashed_resume_bit_for_bit"]
    assert results["tables_dir"] == [
        "emb.exp_avg.tbl",
        "emb.exp_avg_sq.tbl",
        "emb.weight.tbl",
        "manifest.json",
    ]


def test_a_callbacks_copy_of_the_model_made_after_setup_reads_the_trained_table(results: dict) -> None:
    assert results["shadow_reads_the_trained_table"]


def test_training_under_ddp_is_refused_instead_of_a_table_that_never_trains(tmp_path: Path) -> None:
    run_torchrun("hybrid_under_ddp.py", 2, str(tmp_path / "out.json"))
    error = json.loads((tmp_path / "out.json").read_text())["error"]
    assert error is not None and "strategy='hier_sliced'" in error


def _table_peer_dies_mid_exchange(rank: int, world: int, store: str) -> dict:
    init_gloo(rank, world, store, timeout_s=20)
    topology = Topology(world, rank, world).build_groups()
    exchange = topology.build_groups(dedicated=True)
    table = HybridEmbedding(50, 4, mode="sum", optimizer="sgd", lr=0.1)
    table.attach(
        topology.intra_group,
        topology.inter_group,
        rank,
        managed=True,
        exchange_groups=(exchange.intra_group, exchange.inter_group),
        jobs=TableJobs(),
    )
    table(torch.tensor([[1, 2, 3]])).sum().backward()
    if rank == 1:
        os._exit(3)  # a peer crashes before its part of the exchange
    start = time.monotonic()
    table.sync_gradients()
    table.apply_update()  # both queued on the tables' thread: this returns at once
    queued_s = time.monotonic() - start
    try:
        table(torch.tensor([[1, 2]]))  # the next forward waits for the update, and so sees the error
    except Exception as err:
        return {"raised": type(err).__name__, "seconds": time.monotonic() - start, "queued_s": queued_s}
    return {"raised": None, "seconds": time.monotonic() - start, "queued_s": queued_s}


def test_a_peer_lost_in_the_tables_exchange_ends_training_with_an_error_not_a_hang(tmp_path: Path) -> None:
    results = run_spawned(_table_peer_dies_mid_exchange, 2, tmp_path)
    assert results[1] is None  # it died without reporting
    assert results[0]["raised"] is not None, results[0]
    assert results[0]["seconds"] < 30 and results[0]["queued_s"] < 1.0


def _mailbox_rows(rank: int, world: int, store: str) -> dict:
    init_gloo(rank, world, store)
    topology = Topology(world, rank, world).build_groups()
    found = {}
    for merge, rows, dim in (("leader", 50, 4), ("shared", 50, 4), ("leader", 1_000_000, 4)):
        table = HybridEmbedding(rows, dim, mode="sum", node_merge=merge)
        table.attach(topology.intra_group, topology.inter_group, rank)
        staging = table._staging
        found[f"{merge} {rows}"] = [
            [None if box is None else box.shape[0] for box in boxes]
            for boxes in (staging.inboxes, staging.outboxes)
        ]
    return found


def test_mailboxes_are_no_larger_than_the_table_and_the_leader_merge_has_no_inbox(tmp_path: Path) -> None:
    # a process never sends more unique ids than the table has rows; only the shared merge uses inboxes
    results = run_spawned(_mailbox_rows, 2, tmp_path)
    for found in results:
        assert found["leader 50"] == [[None, None], [50, 50]], found
        assert found["shared 50"] == [[50, 50], [50, 50]], found
        cap = (4 << 20) // (8 + 4 * 4)  # 4 MiB of packed rows (an int64 id and 4 float32 values)
        assert found["leader 1000000"] == [[None, None], [cap, cap]], found


def _two_syncs_before_one_update(rank: int, world: int, store: str) -> dict:
    init_gloo(rank, world, store)
    topology = Topology(world, rank, world).build_groups()
    table = HybridEmbedding(20, 3, mode="sum", optimizer="sgd", lr=0.5)
    table.attach(topology.intra_group, topology.inter_group, rank, managed=True)
    before = table.weight.clone()
    generator = torch.Generator().manual_seed(rank)
    parts = []
    for _ in range(2):  # two synchronising backward passes, then one update (a loss scaler's order)
        ids = torch.randperm(20, generator=generator)[:6]
        table(ids.view(1, -1)).pow(2).sum().backward()
        parts.append(table.pending_gradient())
        table.sync_gradients()
    table.apply_update()
    everyone: list = [None] * world
    torch.distributed.all_gather_object(everyone, parts)
    want = before.clone()
    for i in range(2):  # each sync is frequency-averaged on its own; the two add up
        ids, rows = frequency_average([p[i] for p in everyone])
        want.index_add_(0, ids, rows, alpha=-0.5)
    return {"max_diff": (table.weight - want).abs().max().item(), "mailboxes": table._staging is not None}


def test_two_syncs_before_one_update_apply_both_gradients(tmp_path: Path) -> None:
    # under a loss scaler the update waits for the optimizer step: a second synchronising backward
    # before it must add its gradient to the first's (it replaced it), and must not rewrite a mailbox
    # the leader may still be reading
    for result in run_spawned(_two_syncs_before_one_update, 2, tmp_path):
        assert result["mailboxes"]
        assert result["max_diff"] < 1e-6, result
