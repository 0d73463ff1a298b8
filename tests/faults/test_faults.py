"""A rank killed by SIGKILL while state is in flight: the survivors fail within the strategy timeout
with a distributed error naming the lost rank, nothing of the job outlives it, and a rerun resumes from
the last complete checkpoint to the parameters of an uninterrupted run.
Run with ``python -m pytest -m faults tests/faults``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.faults

TESTS = Path(__file__).parents[1]
SCRIPT = Path(__file__).parent / "scripts" / "fault_run.py"
STRATEGY_TIMEOUT_S = 30.0  # fault_run.TIMEOUT
GRACE_S = 90.0  # the launcher's wait after the first death: longer than the strategy timeout
RUN_TIMEOUT_S = 180.0  # a subprocess bound on every run; a case is never retried
CHECKPOINT_NAME = re.compile(r"(epoch=\d+-step=\d+|last)\.ckpt(\.tables)?")
ERROR_WORDS = ("connection", "peer", "rank", "timed out", "timeout", "closed", "reset")

# the migration at the fault epoch's last step moves layers from stage 0 (rank 1) to stage 1 (rank 0): the
# source announces and sends the state, the target answers ready, the source releases what it sent
MIGRATION_STEPS = (("announce", 1), ("ready", 0), ("state", 1), ("release", 1))
NPROC = {"hier_sliced_2nodes": 4}  # 2 nodes x 2 (devices_per_node=2); every other strategy runs on 2


def case(strategy: str, point: str, killed: int, name: str, **marks):  # noqa: ANN003, ANN201
    """(strategy, fault point of fault_run.POINTS, killed rank, the last complete checkpoint the rerun must
    start from: every fault is in the second epoch, so the first epoch's)."""
    return pytest.param(strategy, point, killed, "epoch=0-step=4.ckpt", id=f"{strategy}-{name}", **marks)


CASES = [
    case("hier_sliced", "reduce_scatter", 1, "reduce_scatter"),
    case("hier_sliced_2nodes", "inter_all_reduce", 3, "inter_node_all_reduce"),
    case("hier_sliced_2nodes", "slice_all_gather", 2, "slice_all_gather"),
    case("hier_sliced", "save", 0, "consolidated_save"),
    case("hier_sliced", "gather", 1, "save_gather"),
    case("hier_sliced_sharded", "sharded_save", 1, "sharded_save"),
    case("hier_bsp", "push", 1, "superstep_push"),
    case("hier_bsp", "pull", 1, "superstep_pull"),
    case("hier_bsp", "drain", 1, "draining"),
    case("hier_pipeline", "p2p", 1, "1f1b_send_recv"),
    *(case("hier_pipeline", f"migrate_{step}", rank, f"migration_{step}") for step, rank in MIGRATION_STEPS),
    case("hier_pipeline", "swap_out", 1, "swap_to_host"),
    case("hier_pipeline", "swap_in", 1, "swap_back"),
    case("hybrid_embedding", "row_update", 0, "row_update"),
    case("hybrid_embedding", "table_save", 0, "table_checkpoint"),
    case("hier_sliced", "write", 0, "save_write"),
]


@dataclass
class Run:
    """One launch: its exit code, output, directory, and its launcher's session id."""

    code: int
    output: str
    out: Path
    session: int

    def rank_result(self, rank: int) -> dict | None:
        path = self.out / f"rank{rank}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def pids(self) -> list[int]:
        return [int(p.read_text()) for p in sorted(self.out.glob("pid*"))]


def launch(strategy: str, mode: str, root: Path, nproc: int = 2, **fault_env: str) -> Run:
    """``fault_run.py`` on ``nproc`` forked ranks (tests/fork_launch.py), in a session of its own, with
    ``root/tmp`` as its ``TMPDIR``; killed (and the test failed) after :data:`RUN_TIMEOUT_S`."""
    out, tmp = root / mode, root / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp), **fault_env}
    cmd = [sys.executable, str(TESTS / "fork_launch.py"), "--nproc", str(nproc), "--grace", str(GRACE_S),
           str(SCRIPT), strategy, mode, str(out)]  # fmt: skip
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    ) as popen:
        try:
            output, _ = popen.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            output, _ = popen.communicate()
            pytest.fail(f"{mode} run of {strategy} did not end in {RUN_TIMEOUT_S} s:\n{output[-6000:]}")
    return Run(popen.returncode, output, out, popen.pid)


def session_members(session: int) -> list[int]:
    """Live (not zombie) processes whose session is ``session``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == session:
            members.append(int(stat.parent.name))
    return members


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def shm_segments(*runs: Run) -> set[str]:
    """The package's segments in /dev/shm that a process of ``runs`` made (``lightning_hier.sparse.
    shared_store`` names them ``lightning_hier-<uid>-<pid>-...``; other jobs of this user may hold some)."""
    from lightning_hier.sparse.shared_store import PREFIX

    pids = {str(pid) for run in runs for pid in run.pids()}
    shm = Path("/dev/shm")
    found = shm.glob(f"{PREFIX}-{os.getuid()}-*") if shm.is_dir() else []
    return {p.name for p in found if p.name.split("-")[2] in pids}


def leftover_files(directory: Path) -> list[str]:
    """Files under the job's TMPDIR (torch makes an empty inductor cache directory there: not a file)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if not p.is_dir())


def load_params(run: Run) -> dict[str, torch.Tensor]:
    """Every rank's final module state, keyed ``"<rank>/<name>"``."""
    return {
        f"{path.stem[len('params'):]}/{name}": value
        for path in sorted(run.out.glob("params*.pt"))
        for name, value in torch.load(path, map_location="cpu", weights_only=True).items()
    }


def progress(checkpoint: Path) -> tuple[int, int]:
    """(epoch, global_step) of a checkpoint file, or of a sharded checkpoint's directory (its ``meta.pt``)."""
    path = checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint
    loaded = torch.load(path, map_location="cpu", weights_only=False)
    return loaded["epoch"], loaded["global_step"]


@pytest.fixture(scope="module")
def reference_params(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """The final parameters of an uninterrupted run, per strategy (one run per strategy and module)."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(strategy: str) -> dict[str, torch.Tensor]:
        if strategy not in cache:
            root = tmp_path_factory.mktemp(f"reference-{strategy}")
            run = launch(strategy, "reference", root, NPROC.get(strategy, 2))
            assert run.code == 0, run.output[-6000:]
            cache[strategy] = load_params(run)
        return cache[strategy]

    return get


def check_fault_run(strategy: str, point: str, killed: int, root: Path) -> Run:
    nproc = NPROC.get(strategy, 2)
    run = launch(strategy, "fault", root, nproc, FAULT_POINT=point, FAULT_RANK=str(killed), FAULT_EPOCH="1")
    death_file = run.out / "died_at"
    assert death_file.exists(), f"the fault at {point} was never reached:\n{run.output[-6000:]}"
    death = json.loads(death_file.read_text())
    assert death["rank"] == killed, death
    assert run.code != 0, run.output[-4000:]
    # (a) every survivor ended on its own with a distributed error, within the strategy timeout. On gloo the
    # survivors see the closed connection at once; NCCL's watchdog path is not shown here (docs/gpu.md)
    for rank in set(range(nproc)) - {killed}:
        result = run.rank_result(rank)
        assert result is not None, f"rank {rank} did not end on its own:\n{run.output[-6000:]}"
        assert result["error"], f"rank {rank} ended without an error"
        assert any(word in result["error"].lower() for word in ERROR_WORDS), result["error"]
        # every strategy names it (where the killed rank hosted the job's store: "global rank 0 ... may be
        # the lost rank"), beside gloo's "Connection closed by peer [address]"
        assert re.search(rf"\brank(\(s\))? \[?{killed}\b", result["error"]), result["error"]
        assert result["ended"] - death["time"] < STRATEGY_TIMEOUT_S + 15, (result, death)
    # (b) no process of the job is alive 5 s after the launcher returned
    time.sleep(5)
    assert [pid for pid in run.pids() if alive(pid)] == []
    assert session_members(run.session) == []
    # (c) no segment of the package in /dev/shm (the job's TMPDIR is checked after the rerun)
    assert shm_segments(run) == set()
    return run


@pytest.mark.parametrize(("strategy", "point", "killed", "resumes_from"), CASES)
def test_killed_rank(
    strategy: str, point: str, killed: int, resumes_from: str, tmp_path: Path, reference_params
) -> None:  # noqa: ANN001
    fault = check_fault_run(strategy, point, killed, tmp_path)
    # (d) the interrupted run left complete checkpoints only, last.ckpt the last complete one
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("*.ckpt")) == sorted([resumes_from, "last.ckpt"])
    assert progress(ckpt / "last.ckpt") == progress(ckpt / resumes_from)
    # the rerun (ckpt_path="last") ends with the parameters of the uninterrupted run
    resumed = launch(strategy, "resume", tmp_path, NPROC.get(strategy, 2))
    assert resumed.code == 0, resumed.output[-6000:]
    assert f"Restored all states from the checkpoint at {ckpt / 'last.ckpt'}" in resumed.output
    params = load_params(resumed)
    expected = reference_params(strategy)  # after the fault's checks: a failing case ends sooner
    assert params.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert shm_segments(fault, resumed) == set()
    # (c) no file of either run left in the job's TMPDIR, nor in the checkpoint directory anything but
    # checkpoints (and their tables): the rerun's saves replace what the interrupted one left there
    assert leftover_files(tmp_path / "tmp") == []
    assert [p.name for p in ckpt.iterdir() if not CHECKPOINT_NAME.fullmatch(p.name)] == []
