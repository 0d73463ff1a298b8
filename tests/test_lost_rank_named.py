"""A rank SIGKILLed in the middle of a step: the survivor exits non-zero within the strategy's timeout, and
its stderr (an ERROR log line, and a note the traceback shows) names the lost rank, where gloo's own error
names only an address ("Connection closed by peer [127.0.0.1]:port")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import init_gloo, run_spawned

TESTS = Path(__file__).parent
STRATEGY_TIMEOUT_S = 30.0  # lost_rank_named.TIMEOUT
RUN_TIMEOUT_S = 240.0


def launch(strategy: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(TESTS / "fork_launch.py"), "--nproc", "2", "--grace", "90",
           str(TESTS / "scripts" / "lost_rank_named.py"), strategy, str(out)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)


@pytest.mark.parametrize("strategy", ["hier_sliced", "hier_pipeline"])
def test_survivor_names_the_killed_rank(strategy: str, tmp_path: Path) -> None:
    run = launch(strategy, tmp_path)
    output = run.stdout + run.stderr
    assert (tmp_path / "died_at").exists(), output[-6000:]
    died = float((tmp_path / "died_at").read_text())
    result_file = tmp_path / "rank0.json"
    assert result_file.exists(), f"rank 0 did not end with an error:\n{output[-6000:]}"
    result = json.loads(result_file.read_text())
    assert run.returncode != 0
    assert result["ended"] - died < STRATEGY_TIMEOUT_S, result
    named = rf"{strategy}: rank 1 \(node 0\) is gone"
    assert re.search(named, result["error"]), result["error"]  # the exception's note
    # rank 0's stderr: the ERROR log line (the launcher prefixes only the traceback's lines) and the
    # traceback's note, beside gloo's error
    assert re.search(rf"^(?!\[rank0\]).*{named}", output, re.MULTILINE), output[-6000:]
    assert re.search(rf"\[rank0\]: {named}", output), output[-6000:]


def _one_beating_thread(rank: int, world: int, store: str) -> dict:
    import threading
    import time

    import torch.distributed as dist

    from lightning_hier import liveness
    from lightning_hier.bsp.liveness import Heartbeat as ModuleHeartbeat

    init_gloo(rank, world, store)
    kv = dist.distributed_c10d._get_default_store()
    process = liveness.Heartbeat("process", rank)  # the strategy's, from setup to teardown
    process.start()
    module = ModuleHeartbeat("module", rank)  # hier_bsp's module, started later in the run
    module.start()
    time.sleep(2.5)
    threads = sorted(t.name for t in threading.enumerate() if "heartbeat" in t.name)
    module_beats = kv.add("module/beat/0", 0)
    module.stop()
    result = {
        "threads": threads,
        "module_beats": module_beats,
        "module_left": kv.check(["module/left/0"]),
        "process_beats_on": process.is_alive(),
    }
    process.stop()
    result["ended"] = not process.is_alive()
    return result


def test_one_heartbeat_thread_per_process(tmp_path: Path) -> None:
    """hier_bsp's module starts its heartbeat while the strategy's beats: its counter goes to that thread
    (one thread, both counters beat), and stopping it says it left without ending the strategy's."""
    (result,) = run_spawned(_one_beating_thread, 1, tmp_path)
    assert result == {
        "threads": ["hier-heartbeat-rank0"],
        "module_beats": result["module_beats"],
        "module_left": True,
        "process_beats_on": True,
        "ended": True,
    }, result
    assert result["module_beats"] >= 2  # beaten about once a second for 2.5 s


def test_an_unanswering_store_counts_as_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose host vanished without closing the connection: the question ends within its bound and
    answers ``None`` (unreachable), never hangs."""
    import time

    import torch.distributed as dist

    from lightning_hier import liveness

    class Silent:
        def add(self, key: str, amount: int) -> int:
            time.sleep(30)
            return 0

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", Silent)
    monkeypatch.setattr(liveness, "STORE_TIMEOUT_S", 0.3)
    started = time.monotonic()
    assert liveness.lost_ranks("run", 2, watch_s=0.1) is None
    assert time.monotonic() - started < 2.0


def test_an_error_raised_in_teardown_names_the_lost_rank_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A teardown that waits on a background thread's communication (HybridEmbedding's row updates under
    hier_sliced) raises that thread's error in place of the one the lost rank was named on: it carries the
    same note, so the error the user sees names the rank."""
    from types import SimpleNamespace

    from lightning_hier import liveness
    from lightning_hier.strategies.base import HierStrategy

    class Closing(HierStrategy):
        strategy_name = "closing"

        def teardown(self) -> None:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:2")  # before the base's teardown

    monkeypatch.setattr(liveness, "lost_ranks", lambda run_key, world_size: [1])
    strategy = Closing()
    strategy._heartbeat = SimpleNamespace(beating=True, run_key="run")
    first = RuntimeError("Connection reset by peer [127.0.0.1]:1")
    strategy.on_exception(first)
    note = "closing: rank 1 (node 1) is gone: its heartbeat stopped"
    assert any(n.startswith(note) for n in first.__notes__), first.__notes__
    with pytest.raises(RuntimeError) as raised:
        strategy.teardown()
    assert any(n.startswith(note) for n in raised.value.__notes__), getattr(raised.value, "__notes__", None)
