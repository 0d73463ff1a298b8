"""Importing ``lightning_hier`` defines names and registers the strategy names with Lightning, nothing
else; the collective audit, the emulated NCCL backend and the exit handlers start where a run asks for
them: at a strategy's setup, by :func:`lightning_hier.audit.start_from_env`, or where a
``HybridEmbedding`` meets process groups under another strategy.

The multi-process runs of tests/test_device_rule.py show the same at full scale: their four processes
set both variables, build every group as ``cuda:emulated_nccl,cpu:gloo`` and write an audit record each,
which only the strategies' setup starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import init_gloo, run_spawned, run_torchrun

from lightning_hier.audit import AUDIT_DIR_ENV, EMULATED_NCCL
from lightning_hier.topology import DEVICE_BACKEND_ENV

REPOSITORY = Path(__file__).resolve().parent.parent

# a fresh interpreter: what torch.distributed, atexit, threads and the environment hold before and after
# `import lightning_hier`, then after the explicit start
PROBE = r"""
import atexit, json, os, threading
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from lightning.pytorch.strategies import StrategyRegistry

def functions():
    modules = (dist, c10d)
    return {f"{m.__name__}.{n}": getattr(m, n) for m in modules for n in dir(m) if callable(getattr(m, n))}

def handlers_added(action):
    added = []
    register = atexit.register
    def recording(fn, *args, **kwargs):
        added.append(f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', fn)}")
        return register(fn, *args, **kwargs)
    atexit.register = recording
    count = atexit._ncallbacks()
    try:
        action()
    finally:
        atexit.register = register
    return added, atexit._ncallbacks() - count

def state():
    return functions(), list(dist.Backend.backend_list), set(threading.enumerate()), dict(os.environ)

def changes(before, after):
    (functions_0, backends_0, threads_0, env_0), (functions_1, backends_1, threads_1, env_1) = before, after
    return {
        "replaced": sorted(n for n, f in functions_0.items() if functions_1.get(n) is not f),
        "backends": sorted(set(backends_1) - set(backends_0)),
        "threads": sorted(t.name for t in threads_1 - threads_0),
        "environment": sorted(k for k in set(env_0) | set(env_1) if env_0.get(k) != env_1.get(k)),
    }

def do_import():
    import lightning_hier

def do_start():
    from lightning_hier.audit import start_from_env
    start_from_env()

before = state()
imported = handlers_added(do_import)
after_import = state()
started = handlers_added(do_start)
after_start = state()
print(json.dumps({
    "import": {**changes(before, after_import), "atexit": imported[0], "atexit_count": imported[1]},
    "start": {**changes(after_import, after_start), "atexit": started[0], "atexit_count": started[1]},
    "registered": sorted(n for n in ("hier_sliced", "hier_bsp", "hier_pipeline") if n in StrategyRegistry),
}))
"""


def probe(env: dict[str, str]) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in (AUDIT_DIR_ENV, DEVICE_BACKEND_ENV)}
    full.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPOSITORY, env=full, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def asked_for(tmp_path_factory: pytest.TempPathFactory) -> dict:
    audit_dir = tmp_path_factory.mktemp("audit")
    return probe({AUDIT_DIR_ENV: str(audit_dir), DEVICE_BACKEND_ENV: EMULATED_NCCL})


def test_importing_with_both_variables_set_starts_nothing(asked_for: dict) -> None:
    imported = asked_for["import"]
    assert imported["replaced"] == [], "torch.distributed's functions were wrapped at import"
    assert imported["backends"] == [], "a backend was registered at import"
    assert imported["atexit"] == [] and imported["atexit_count"] == 0, imported["atexit"]
    assert imported["threads"] == []
    assert imported["environment"] == []
    assert asked_for["registered"] == ["hier_bsp", "hier_pipeline", "hier_sliced"]


def test_the_explicit_start_registers_the_backend_and_records_every_operation(asked_for: dict) -> None:
    started = asked_for["start"]
    assert started["backends"] == [EMULATED_NCCL]
    wrapped = {name.rsplit(".", 1)[1] for name in started["replaced"]}
    assert {"all_reduce", "broadcast", "isend", "irecv", "batch_isend_irecv", "barrier"} <= wrapped
    assert started["atexit"] == ["lightning_hier.audit.recorder.CollectiveAudit.dump"]
    assert started["atexit_count"] == 1
    assert started["threads"] == [] and started["environment"] == []


def test_the_explicit_start_without_the_variables_starts_nothing() -> None:
    started = probe({})["start"]
    assert started["replaced"] == [] and started["backends"] == [] and started["atexit_count"] == 0


@pytest.mark.parametrize("strategy", ["hier_sliced", "hier_bsp", "hier_pipeline"])
def test_a_strategys_setup_starts_what_the_environment_asks_for(strategy: str, tmp_path: Path) -> None:
    out, audit_dir = tmp_path / "out.json", tmp_path / "audit"
    env = {DEVICE_BACKEND_ENV: EMULATED_NCCL, AUDIT_DIR_ENV: str(audit_dir)}
    run_torchrun("setup_from_env.py", 1, strategy, str(out), env=env, timeout=300)
    seen = json.loads(out.read_text())
    nothing = {"emulated_backend": False, "default_group": None, "audit": False, "exit_handler": False}
    assert seen["after_import"] == nothing
    assert seen["at_fit_start"] == {
        "emulated_backend": True,
        "default_group": f"cuda:{EMULATED_NCCL},cpu:gloo",
        "audit": True,
        "exit_handler": True,
    }
    assert [p.name for p in audit_dir.iterdir()] == ["rank0.json"]  # written at exit


def _hybrid_under_another_strategy(rank: int, world: int, store: str, attach: bool) -> dict:
    from lightning_hier import HybridEmbedding
    from lightning_hier.sparse.shared_store import REGISTRY
    from lightning_hier.strategies import process_group_exit
    from lightning_hier.topology import Topology

    before = process_group_exit._registered
    init_gloo(rank, world, store, timeout_s=30)
    table = HybridEmbedding(20, 4, mode="sum", optimizer="sgd", lr=0.1)
    error = None
    if attach:  # the user's own groups: the user syncs and updates
        topology = Topology(world, rank, world).build_groups()
        table.attach(topology.intra_group, topology.inter_group, rank)
        REGISTRY.remove_all()  # the node's shared-memory segments (the process ends without atexit)
    else:  # training under ddp: refused at the first step
        try:
            table(torch.tensor([[1, 2]])).sum().backward()
        except RuntimeError as err:
            error = str(err)
    return {"before": before, "after": process_group_exit._registered, "error": error}


@pytest.mark.parametrize("attach", [False, True], ids=["refused", "attached"])
def test_a_hybrid_embedding_under_another_strategy_registers_the_exit_handler(
    attach: bool, tmp_path: Path
) -> None:
    results = run_spawned(_hybrid_under_another_strategy, 2, tmp_path, attach)
    for result in results:
        assert result is not None and "traceback" not in result, result
        assert result["before"] is False and result["after"] is True, result
        assert (result["error"] is None) == attach, result
