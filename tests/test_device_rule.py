"""The device rule and one issuing order, proved on CPU.

Every strategy runs on 4 gloo processes with its groups built exactly as on CUDA (an emulated
NCCL registered for the ``cuda`` device type: a group without a CPU backend refuses CPU tensors
as NCCL does) while every ``torch.distributed`` operation is recorded. The records of all ranks
must show: no tensor on a group without a backend for its device, the same collectives in the
same order on every member of each group, every send met by a matching receive, one global
issuing order (no cycle of waits), all from the training thread. The analysis itself is tested on
records that break each rule.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_torchrun

from lightning_hier.audit import CollectiveAudit, analyze
from lightning_hier.audit.emulation import EMULATED_NCCL, register_emulated_nccl
from lightning_hier.topology import DEVICE_BACKEND_ENV, host_capable_backend, resolve_backend


# ---------------------------------------------------------------------- the rule itself
def test_backend_on_cuda_has_a_cpu_backend_beside_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_BACKEND_ENV, raising=False)
    assert resolve_backend(torch.device("cuda", 0)) == "cuda:nccl,cpu:gloo"
    assert resolve_backend(torch.device("cpu")) == "gloo"
    assert resolve_backend(torch.device("cuda", 0), "nccl") == "nccl"  # the user's choice is kept
    monkeypatch.setenv(DEVICE_BACKEND_ENV, EMULATED_NCCL)
    assert resolve_backend(torch.device("cpu")) == f"cuda:{EMULATED_NCCL},cpu:gloo"


def _single_process_group(backend: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=0, world_size=1)


@pytest.fixture
def emulated_nccl_only() -> None:
    """An NCCL-only default group, as a user's own ``init_process_group("nccl")`` makes on a GPU."""
    from helpers import free_port

    register_emulated_nccl()
    _single_process_group(f"cuda:{EMULATED_NCCL}", free_port())
    yield
    dist.destroy_process_group()


def test_a_cpu_tensor_on_an_nccl_only_group_is_refused_and_recorded(emulated_nccl_only: None) -> None:
    assert host_capable_backend() == f"cuda:{EMULATED_NCCL},cpu:gloo"
    with CollectiveAudit() as audit, pytest.raises(RuntimeError, match="device type cpu"):
        dist.all_reduce(torch.ones(2))  # what engine.py's `_used` did on the default group
    (record,) = audit.records
    assert record.op == "all_reduce" and record.group_devices == ["cuda"]
    assert record.violation is not None and "cpu" in record.violation
    assert record.caller.endswith(f"{Path(__file__).name}:{_line_of('dist.all_reduce(torch.ones(2))')}")


def test_a_control_group_beside_an_nccl_only_default_takes_cpu_tensors(emulated_nccl_only: None) -> None:
    from lightning_hier.topology import control_group

    group = control_group()
    assert group is not dist.group.WORLD
    assert {d.type for d in group._device_types} == {"cpu", "cuda"}
    flag = torch.ones(1)
    with CollectiveAudit(raise_on_violation=True) as audit:
        dist.all_reduce(flag, group=group)
    assert flag.item() == 1.0 and audit.violations() == []


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)


# ---------------------------------------------------------------------- the analysis
def _rec(op: str, group: str = "0", ranks=(0, 1), peer=None, batch=None, dtype="float32", shape=(4,)):  # noqa: ANN001, ANN202
    return {
        "op": op, "group": group, "group_ranks": list(ranks), "group_devices": ["cpu"],
        "tensors": [["cpu", dtype, list(shape)]], "peer": peer, "batch": batch, "thread": "MainThread",
        "main_thread": True, "caller": "x.py:1", "package": True, "violation": None,
    }  # fmt: skip


def test_analysis_finds_two_groups_entered_in_opposite_orders() -> None:
    records = {
        0: [_rec("all_reduce", "intra"), _rec("all_reduce", "inter")],
        1: [_rec("all_reduce", "inter"), _rec("all_reduce", "intra")],
    }
    report = analyze(records)
    assert any("no global issuing order" in p for p in report.problems), report.problems
    records[1].reverse()
    assert analyze(records).ok


def test_analysis_orders_host_operations_per_thread_and_device_operations_across_threads() -> None:
    def interleaved(device: str) -> dict:
        main, side = _rec("all_reduce", "dense"), _rec("all_reduce", "tables")
        side.update(thread="tables", main_thread=False)
        for record in (main, side):
            record["tensors"] = [[device, "float32", [4]]]
        return {0: [main, side], 1: [dict(side), dict(main)]}

    # a host-tensor collective on another thread blocks only that thread: any interleaving is fine
    assert analyze(interleaved("cpu"), require_main_thread=False).ok
    # two threads enqueueing device work in opposite orders on two ranks can deadlock the devices
    problems = analyze(interleaved("cuda"), require_main_thread=False).problems
    assert any("no global issuing order" in p for p in problems), problems


def test_analysis_finds_different_collectives_on_one_group() -> None:
    records = {0: [_rec("all_reduce"), _rec("broadcast")], 1: [_rec("all_reduce"), _rec("all_reduce")]}
    problems = analyze(records).problems
    assert any("collective #1" in p and "broadcast" in p for p in problems), problems


def test_analysis_accepts_paired_sends_and_refuses_unpaired_crossing_ones() -> None:
    def exchange(batched: bool) -> dict:
        b = 1 if batched else None
        return {
            0: [_rec("isend", peer=1, batch=b), _rec("irecv", peer=1, batch=b)],
            1: [_rec("isend", peer=0, batch=b), _rec("irecv", peer=0, batch=b)],
        }

    assert analyze(exchange(batched=True)).ok
    unpaired = analyze(exchange(batched=False)).problems
    assert any("no global issuing order" in p for p in unpaired), unpaired


def test_analysis_finds_a_message_received_with_another_shape_and_a_thread() -> None:
    records = {0: [_rec("isend", peer=1, shape=(4,))], 1: [_rec("recv", peer=0, shape=(8,))]}
    records[1][0].update(main_thread=False, thread="comm")
    problems = analyze(records).problems
    assert any("received as" in p for p in problems), problems
    assert any("thread 'comm'" in p for p in problems), problems


# ---------------------------------------------------------------------- every strategy, 4 processes
CASES = {
    # case: (caller substrings that must appear among the package's records)
    "sliced_size": (
        "sliced/engine.py", "sliced/reducer.py", "sliced/slicing.py", "sliced/sharded_optim.py",
        "sliced/sharded_checkpoint.py",
    ),
    "sliced_time": ("bucketing/time_bucketing.py", "sliced/reducer.py", "sliced/sharded_optim.py"),
    "sliced_none": ("sliced/engine.py", "sliced/reducer.py", "sliced/sharded_optim.py"),
    # two optimizers, one engine each (a GAN, toggled and not)
    "sliced_gan": ("sliced/engine.py", "sliced/reducer.py", "sliced/sharded_optim.py"),
    # the tables' thread exchanges and updates beside the step, on groups of its own
    "hybrid": ("sparse/sync.py", "sparse/embedding.py", "sparse/checkpoint.py"),
    # the local BSP module thread issues the training phase's collectives; the main thread only at drains;
    # the push across nodes in int8 blocks (the codec's collectives in place of the server's all-reduce)
    "bsp": ("bsp/local_module.py", "sliced/int8_codec.py", "sliced/reducer.py", "sliced/piece_sharding.py"),
    # plain BSP: the buckets of each superstep's last micro-step are pushed as they fill
    "bsp_plain": ("bsp/local_module.py", "bsp/server.py", "sliced/reducer.py"),
    # fresh gradients with fill_idle: time-dependent rows, the same decision on every rank
    "bsp_fill": ("bsp/local_module.py", "bsp/server.py", "sliced/reducer.py"),
    # time buckets: the profile's mean over ranks, then an engine rebuilt on the plan (a new BSP thread)
    "bsp_time": ("bsp/engine.py", "bsp/local_module.py", "bsp/server.py", "sliced/piece_sharding.py"),
    "pipeline_1f1b": (
        "pipeline/schedule.py", "pipeline/migration.py", "pipeline/engine.py", "strategies/hier_pipeline.py",
    ),
    "pipeline_gpipe": ("pipeline/schedule.py", "pipeline/engine.py", "strategies/stage_metrics_sync.py"),
    # replicas of a tied embedding on the first and the last of 4 stages: a group of their own
    "pipeline_tied": ("pipeline/tied_parameters.py", "pipeline/schedule.py"),
}  # fmt: skip
BACKGROUND_THREADS = {
    "bsp": "hier-bsp-rank",
    "bsp_plain": "hier-bsp-rank",
    "bsp_fill": "hier-bsp-rank",
    "bsp_time": "hier-bsp-rank",
    "hybrid": "lightning_hier-tables",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_collective_is_legal_under_nccl_and_issued_in_one_order(case: str, tmp_path: Path) -> None:
    audit_dir = tmp_path / "audit"
    env = {DEVICE_BACKEND_ENV: EMULATED_NCCL, "LIGHTNING_HIER_AUDIT_DIR": str(audit_dir)}
    run_torchrun("device_rule_run.py", 4, case, str(tmp_path), env=env, timeout=300)
    report = analyze(audit_dir, require_main_thread=case not in BACKGROUND_THREADS)
    assert sorted(report.records) == [0, 1, 2, 3]
    report.raise_if_problems()
    ours = report.select(package=True)
    for where in CASES[case]:
        assert any(where in r["caller"] for r in ours), f"no collective from {where} was recorded"
    if case in BACKGROUND_THREADS:  # off the main thread: only that thread, only the expected code
        beside = [r for rs in report.records.values() for r in rs if not r["main_thread"]]
        assert beside, f"{case}: nothing ran on {BACKGROUND_THREADS[case]!r}"
        threads = {r["thread"] for r in beside}
        assert all(name.startswith(BACKGROUND_THREADS[case]) for name in threads), threads
    # the groups really were built as on CUDA: every group used serves both device types
    served = {tuple(sorted(r["group_devices"])) for rs in report.records.values() for r in rs}
    assert served == {("cpu", "cuda")}


def test_a_backward_hook_on_an_autograd_thread_counts_as_the_main_threads() -> None:
    """On CUDA a backward hook runs on torch's autograd device thread, which Python did not start; the
    thread that called backward() waits for it, so the recorder credits the hook's collectives to
    the main thread. Stood in for here by a thread started outside ``threading``."""
    import _thread
    import threading
    import time

    from lightning_hier.audit.recorder import issuing_thread

    seen: dict[str, tuple[str, bool]] = {}

    def foreign_thread() -> None:
        seen["outside backward"] = issuing_thread()
        x = torch.ones(2, requires_grad=True)
        x.register_hook(lambda grad: seen.setdefault("in backward", issuing_thread()))
        (x * 2).sum().backward()
        seen["done"] = ("", True)

    _thread.start_new_thread(foreign_thread, ())
    deadline = time.monotonic() + 10
    while "done" not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
    main = threading.main_thread().name
    assert seen["in backward"] == (main, True)
    name, is_main = seen["outside backward"]
    assert name != main and not is_main
    assert issuing_thread() == (main, True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
