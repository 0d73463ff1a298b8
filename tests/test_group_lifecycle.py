"""The package's process groups: built once per process, reused across fits, fresh on a new default group,
gloo alone where they only carry host data, with the strategy's timeout, forgotten at exit."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_torchrun

from lightning_hier.audit.emulation import EMULATED_NCCL, register_emulated_nccl
from lightning_hier.strategies.process_group_exit import _destroy_process_group_at_exit
from lightning_hier.topology import (
    DEVICE_BACKEND_ENV,
    Topology,
    all_ranks_group,
    control_group,
    registered_groups,
    subset_group,
)


def _init(store: Path, backend: str = "gloo", timeout: timedelta = timedelta(seconds=60)) -> None:
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout)


def _group_count() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _timeout_of(group: dist.ProcessGroup) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


@pytest.fixture
def store(tmp_path: Path):  # noqa: ANN201
    yield tmp_path / "store"
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------- one process
def test_groups_are_reused_and_fresh_after_the_default_group_is_recreated(store: Path) -> None:
    _init(store)
    first = Topology(1, 0, 1).build_groups(timedelta(seconds=30))
    built = _group_count()
    again = Topology(1, 0, 1).build_groups(timedelta(seconds=30))
    assert (again.intra_group, again.inter_group, again.world_group) == (
        first.intra_group, first.inter_group, first.world_group,
    )  # fmt: skip
    assert _group_count() == built
    # a thread's own set by name: the same set for the same name, another for another name
    bsp = Topology(1, 0, 1).build_groups(timedelta(seconds=30), dedicated="bsp")
    again_bsp = Topology(1, 0, 1).build_groups(timedelta(seconds=30), dedicated="bsp")
    assert again_bsp.intra_group is bsp.intra_group and again_bsp.world_group is bsp.world_group
    tables = Topology(1, 0, 1).build_groups(timedelta(seconds=30), dedicated="tables")
    assert len({id(first.intra_group), id(bsp.intra_group), id(tables.intra_group)}) == 3
    assert bsp.world_group is not first.world_group and bsp.world_group is not tables.world_group

    dist.destroy_process_group()  # destroys every group, the package's included
    (tmp := store.with_name("store2")).unlink(missing_ok=True)
    _init(tmp)
    fresh = Topology(1, 0, 1).build_groups(timedelta(seconds=30))
    assert fresh.intra_group is not first.intra_group
    live = dist.distributed_c10d._world.pg_map
    assert fresh.intra_group in live and fresh.inter_group in live
    flag = torch.ones(1)
    dist.all_reduce(flag, group=fresh.intra_group)  # a dead group would raise here
    assert flag.item() == 1.0
    assert set(registered_groups()) == {fresh.intra_group, fresh.inter_group}


def test_an_unnamed_dedicated_set_is_new_every_call(store: Path) -> None:
    _init(store)
    one = Topology(1, 0, 1).build_groups(dedicated=True)
    two = Topology(1, 0, 1).build_groups(dedicated=True)
    assert one.intra_group is not two.intra_group and one.world_group is not two.world_group


def test_subset_groups_are_built_once_per_role_and_ranks(store: Path) -> None:
    _init(store)
    tied = subset_group([0], timedelta(seconds=30), role="tied")
    count = _group_count()
    assert subset_group([0], timedelta(seconds=30), role="tied") is tied
    assert _group_count() == count
    assert subset_group([0], timedelta(seconds=30), role="other") is not tied


def test_a_group_without_a_timeout_gets_the_default_groups(store: Path) -> None:
    _init(store, timeout=timedelta(seconds=41))
    topology = Topology(1, 0, 1).build_groups(dedicated="bsp")
    assert _timeout_of(topology.intra_group) == timedelta(seconds=41)
    assert _timeout_of(topology.world_group) == timedelta(seconds=41)


def test_the_exit_handler_destroys_the_groups_and_empties_the_registry(store: Path) -> None:
    _init(store)
    Topology(1, 0, 1).build_groups(dedicated="bsp")
    assert registered_groups()
    _destroy_process_group_at_exit()
    assert not dist.is_initialized() and _group_count() == 0
    from lightning_hier import topology

    assert topology._REGISTRY.groups == {} and topology._REGISTRY.default is None


# ---------------------------------------------------------------------- under the CUDA emulation
@pytest.fixture
def emulated_nccl_only(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An NCCL-only default group with a 41 s timeout, as a user's ``init_process_group("nccl")`` makes."""
    monkeypatch.setenv(DEVICE_BACKEND_ENV, EMULATED_NCCL)
    register_emulated_nccl()
    _init(store, f"cuda:{EMULATED_NCCL}", timedelta(seconds=41))


def test_the_control_group_beside_an_nccl_only_default_is_gloo_alone(emulated_nccl_only: None) -> None:
    control = control_group()
    assert control is not dist.group.WORLD
    assert EMULATED_NCCL not in dist.get_backend_config(control)  # host data only: no NCCL communicator
    assert _timeout_of(control) == timedelta(seconds=41)  # the default group's (the strategy's) timeout
    assert control_group(timedelta(seconds=41)) is control
    # the all-rank group that device tensors go over keeps the device backend beside gloo
    world = all_ranks_group()
    assert world is not control and EMULATED_NCCL in dist.get_backend_config(world)
    assert all_ranks_group() is world
    # a thread's host-only groups are gloo alone, its device groups keep the pair
    bsp = Topology(1, 0, 1).build_groups(timedelta(seconds=30), dedicated="bsp", host_only=("world",))
    assert EMULATED_NCCL not in dist.get_backend_config(bsp.world_group)
    assert EMULATED_NCCL in dist.get_backend_config(bsp.intra_group)


# ---------------------------------------------------------------------- two processes, two fits each
STRATEGIES = ("hier_sliced", "hier_bsp", "hier_pipeline", "ddp")


def _assert_no_group_added(rank: int, result: dict) -> None:
    for name in STRATEGIES:
        first, second = result[name]["counts"]
        assert second == first, f"rank {rank}, {name}: {first} groups after the first fit, {second} after two"


def _run(tmp_path: Path, env: dict[str, str] | None = None) -> list[dict]:
    out = tmp_path / "groups"
    run_torchrun("group_lifecycle_checks.py", 2, str(out), env=env, timeout=600)
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(2)]


def test_a_second_fit_builds_no_group(tmp_path: Path) -> None:
    for rank, result in enumerate(_run(tmp_path)):
        _assert_no_group_added(rank, result)
        assert result["timeouts_s"] == [97.0]  # every group has the strategies' timeout


def test_host_only_groups_are_gloo_alone_under_the_cuda_emulation(tmp_path: Path) -> None:
    """The tables' exchange groups (sparse gradients of host tables) and the BSP thread's world group
    (control rows, counts, settings) carry host tensors only: no NCCL communicator behind them."""
    for rank, result in enumerate(_run(tmp_path, {DEVICE_BACKEND_ENV: EMULATED_NCCL})):
        for name in ("hier_sliced", "hier_bsp"):
            assert result[name]["host_only"], name
            for backend in result[name]["host_only"]:
                assert EMULATED_NCCL not in backend and "gloo" in backend, (rank, name, backend)
            for backend in result[name]["device"]:  # gradients and parameters: the device backend too
                assert f"cuda:{EMULATED_NCCL}" in backend and "cpu:gloo" in backend, (rank, name, backend)
        _assert_no_group_added(rank, result)
