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
