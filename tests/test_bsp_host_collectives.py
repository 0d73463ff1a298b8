"""hier_bsp's host collectives between drains (values logged with ``sync_dist=True``, ``strategy.reduce``,
``barrier``, ``broadcast``, ``all_gather`` in lockstep) with its groups built as on CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_torchrun

from lightning_hier.audit.emulation import EMULATED_NCCL
from lightning_hier.strategies.hier_bsp import _host_reduce_op, _reduce_on_host
from lightning_hier.topology import DEVICE_BACKEND_ENV

EMULATION = {DEVICE_BACKEND_ENV: EMULATED_NCCL}


def _results(out: Path, world: int = 2) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def test_sync_dist_mean_in_lockstep_equals_the_mean_over_ranks(tmp_path: Path) -> None:
    """``self.log(..., sync_dist=True)`` (the default mean) and ``strategy.reduce`` in lockstep, where the
    default group is ``"cuda:nccl,cpu:gloo"``: Lightning's own reduce gives the host backend
    ``ReduceOp.AVG`` (an integer mean fails: "result type Float can't be cast to the desired output type
    Long"; torch before 2.13 refuses AVG outright) and meets in ``torch.distributed.barrier`` on the
    default group, a device collective on CUDA, from the worker's thread. Here the logged value is the mean
    over the ranks, hand-computed (rank r logs (r + 1) x (batch + 1): 1.5 x (batch + 1) on 2 ranks), an
    integer mean keeps its dtype, truncated as Lightning does on gloo ((1 + 2) / 2 -> 1), no barrier is
    issued inside the step, and the strategy's barrier, broadcast and gather pair step by step."""
    run_torchrun("bsp_host_collectives.py", 2, str(tmp_path), "lockstep_fit", env=EMULATION, timeout=300)
    for rank, result in enumerate(_results(tmp_path)):
        assert "error" not in result, result
        assert result["backend"] == f"cuda:{EMULATED_NCCL},cpu:gloo"
        assert [step["logged"] for step in result["steps"]] == [1.5 * (b + 1) for b in range(4)]
        expected = {"int_mean": 1, "avg": 0.5, "broadcast": 0, "gathered": [0, 1]}
        assert [{k: s[k] for k in expected} for s in result["steps"]] == [expected] * 4, rank
        assert result["barriers_in_steps"] == 0


def test_host_collectives_between_drains_take_the_control_group_beside_an_nccl_only_default(
    tmp_path: Path,
) -> None:
    """``process_group_backend="nccl"`` makes the default group NCCL-only: a host tensor there is refused
    (torch's "No backend type associated with device type cpu"). Between drains in lockstep the
    strategy's barrier, reduce, broadcast and all_gather carry host tensors, so they go over the control
    group, which has a CPU backend beside the device one."""
    run_torchrun("bsp_host_collectives.py", 2, str(tmp_path), "nccl_only_default", env=EMULATION, timeout=300)
    for rank, result in enumerate(_results(tmp_path)):
        assert result == {
            "backend": f"cuda:{EMULATED_NCCL}",
            "mean": 1.5,
            "sum": 3,
            "broadcast": "from 0",
            "gathered": [0, 1],
        }, rank


@pytest.mark.parametrize(
    ("reduce_op", "expected"),
    [
        (None, (dist.ReduceOp.SUM, False)),
        ("mean", (dist.ReduceOp.SUM, True)),
        ("AVG", (dist.ReduceOp.SUM, True)),
        (dist.ReduceOp.AVG, (dist.ReduceOp.SUM, True)),
        ("sum", (dist.ReduceOp.SUM, False)),
        ("max", (dist.ReduceOp.MAX, False)),  # Lightning's reduce_fx=torch.max passes its name
        (dist.ReduceOp.MIN, (dist.ReduceOp.MIN, False)),
    ],
)
def test_reduce_ops_take_lightnings_spellings(reduce_op: object, expected: tuple) -> None:
    assert _host_reduce_op(reduce_op) == expected


@pytest.mark.parametrize("reduce_op", ["median", dist.ReduceOp.PREMUL_SUM, 3])
def test_an_unsupported_reduce_op_is_refused_by_name(reduce_op: object) -> None:
    with pytest.raises(ValueError, match="reduce_op"):
        _reduce_on_host(torch.ones(1), None, reduce_op)
