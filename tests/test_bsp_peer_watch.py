"""A dead peer named while the local BSP module waits on it forever, as it waits on an NCCL collective
whose peer is gone: the worker compares the ranks' heartbeats while it waits."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import free_port, run_torchrun

from lightning_hier.bsp.liveness import PeerWatch, peer_check_seconds


def test_a_worker_waiting_on_a_stuck_push_names_the_dead_peer_within_the_timeout(tmp_path: Path) -> None:
    """Rank 1 dies inside a superstep's push while rank 0's push never returns (gloo would fail at once;
    NCCL waits until its watchdog ends the process at the timeout, 20 s here, naming no rank). Rank 0's
    worker, waiting for the model that push would make, names rank 1 well within the timeout (not "no new
    model from the parameter server after 20 s (timeout)", which names no rank)."""
    run_torchrun("bsp_stuck_collective.py", 2, str(tmp_path), timeout=300)
    died = float((tmp_path / "died_at").read_text())
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["error"] and result["error"].startswith("BSPStopped"), result
    assert "lost rank(s) [1]" in result["error"], result
    assert result["ended"] - died < 20, result  # named before the groups' timeout


def test_peer_watch_names_a_rank_whose_counter_stopped_and_not_one_that_left(tmp_path: Path) -> None:
    """Two samples ``every_s`` apart: rank 0's counter moved, rank 1's did not (lost), rank 2's did not but
    it left in order (not lost); a first sample, or one too old to compare with, names nobody."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set("run/left/2", "1")
        watch = PeerWatch("run", world_size=3, every_s=0.2)
        assert watch.check() == []  # nothing to compare with yet
        store.add("run/beat/0", 1)
        time.sleep(0.25)
        assert watch.check() == [1]
        time.sleep(0.7)  # more than three periods: an earlier wait's sample
        assert watch.check() == []
    finally:
        dist.destroy_process_group()


def test_peer_checks_fit_twice_in_the_timeout_and_span_several_beats() -> None:
    assert peer_check_seconds(1800.0) == 10.0
    assert peer_check_seconds(30.0) == 5.0
    assert peer_check_seconds(6.0) == 3.0  # never under three beats


def test_peer_watch_answers_within_the_store_bound_when_the_store_is_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that does not answer (its host cut off, not closed) reads as unreachable after the store bound,
    not after the store's own timeout: the waiting worker's main thread makes these calls."""
    import lightning_hier.bsp.liveness as bsp_liveness
    from lightning_hier import liveness

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(liveness, "STORE_TIMEOUT_S", 0.5)
        monkeypatch.setattr(bsp_liveness, "_beats", lambda *args: time.sleep(30))
        watch = PeerWatch("run", world_size=2, every_s=0.2)
        started = time.monotonic()
        assert watch.check() is None
        assert time.monotonic() - started < 5
    finally:
        dist.destroy_process_group()
