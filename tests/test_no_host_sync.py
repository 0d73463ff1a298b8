"""No host-device synchronisation on the per-step path, checked on CPU.

A CPU run has no device to wait for, so the tensors that live on the accelerator in a CUDA run are
marked: they are :class:`OnDevice` tensors (a CPU tensor subclass that torch passes on to every result
computed from one), and :class:`HostSyncGuard` records each operation called from ``lightning_hier`` on
a marked tensor that makes the host wait for the device on CUDA: reading values (``.item()``, ``int()``,
``bool()``, ``float()``, ``.tolist()``, ``.numpy()``), a copy to the host (``.cpu()``, ``.to("cpu")``,
``copy_`` into a host tensor) and an operation whose result size depends on the values
(``torch.unique``, ``nonzero``). A copy to the host gives back an unmarked tensor, as a real one does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import run_spawned
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

import lightning_hier
from lightning_hier import HybridEmbedding

PACKAGE_DIR = str(Path(lightning_hier.__file__).parent)
TORCH_DIR = str(Path(torch.__file__).parent)
# the device a fake strategy names as its root device: torch makes CPU tensors for it, the guard marks them
STAND_IN_DEVICE = torch.device("cpu", 0)

HOST_COPIES = {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist}
VALUE_READS = {
    torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.equal, torch.allclose, torch.is_nonzero,
}  # fmt: skip
DATA_DEPENDENT_SIZES = {
    torch.unique, torch.Tensor.unique, torch.unique_consecutive, torch.Tensor.unique_consecutive,
    torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select,
}  # fmt: skip


class OnDevice(torch.Tensor):
    """A CPU tensor standing for one in accelerator memory."""


@dataclass
class Sync:
    op: str
    caller: str  # "path/inside/lightning_hier.py:line"


def _package_caller(frame: Any) -> str | None:
    """``file:line`` of the first frame outside torch, if it is in ``lightning_hier``."""
    while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(PACKAGE_DIR):
        return None
    return f"{frame.f_code.co_filename[len(PACKAGE_DIR) + 1 :]}:{frame.f_lineno}"


def _target_device(func: Callable, args: tuple, kwargs: dict) -> torch.device | None:
    if func is torch.Tensor.to:
        return torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    device = kwargs.get("device")
    return None if device is None else torch.device(device)


class HostSyncGuard(TorchFunctionMode):
    """Records what ``lightning_hier`` does to marked tensors that waits for the device on CUDA.

    ``stand_in``: tensors the package makes on this device (a factory's ``device=``, ``.to(...)``) are
    marked. Gradients reaching a hook the package registers are marked (they are on the device in a
    CUDA run)."""

    def __init__(self, stand_in: torch.device | None = None) -> None:
        super().__init__()
        self.stand_in = stand_in
        self.syncs: list[Sync] = []

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        caller = _package_caller(sys._getframe(1))
        if caller is None:
            return func(*args, **kwargs)
        if func is torch.Tensor.register_hook:
            hook = args[1] if len(args) > 1 else kwargs.pop("hook")
            return func(args[0], partial(self._run_hook, hook))
        target = _target_device(func, args, kwargs)
        marked = any(isinstance(a, OnDevice) for a in args[:2])
        to_host = (
            func in HOST_COPIES
            or (func is torch.Tensor.to and target is not None and target.type == "cpu")
            or (func is torch.Tensor.copy_ and not isinstance(args[0], OnDevice))
        )
        if marked and (to_host or func in VALUE_READS or func in DATA_DEPENDENT_SIZES):
            self.syncs.append(Sync(getattr(func, "__name__", str(func)), caller))
        result = func(*args, **kwargs)
        if marked and to_host and isinstance(result, torch.Tensor):
            return torch.Tensor.as_subclass(result, torch.Tensor).clone()  # what a copy gives: a host tensor
        if self.stand_in is not None and target == self.stand_in and isinstance(result, torch.Tensor):
            return result.as_subclass(OnDevice)
        return result

    def _run_hook(self, hook: Callable, grad: torch.Tensor) -> Any:
        # autograd runs hooks without the caller's function modes
        if self in _get_current_function_mode_stack():
            return hook(grad.as_subclass(OnDevice))
        with self:
            return hook(grad.as_subclass(OnDevice))


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return torch.Tensor.as_subclass(tensor, torch.Tensor)


# ---------------------------------------------------------------------- the guard itself
def test_the_guard_records_the_package_reading_a_device_tensor_and_nothing_else() -> None:
    from lightning_hier.sparse import sync as package_module  # any module of the package

    ids = torch.tensor([3, 1, 3]).as_subclass(OnDevice)
    namespace: dict = {"ids": ids, "torch": torch}
    code = compile("u = torch.unique(ids); n = int(u.max()); h = u.cpu(); m = int(h.max())",
                   package_module.__file__, "exec")  # fmt: skip
    with HostSyncGuard() as guard:
        int(ids.max())  # the test's own reads are not the package's
        exec(code, namespace)
    assert [s.op for s in guard.syncs] == ["unique", "__int__", "cpu"]
    assert type(namespace["h"]) is torch.Tensor  # the host copy is read freely


# ---------------------------------------------------------------------- HybridEmbedding
@pytest.mark.parametrize("kind", ["embedding", "bag", "hashed"])
def test_a_hybrid_embedding_step_copies_ids_and_gradient_to_the_host_once_each(kind: str) -> None:
    # the table is in host memory: the ids reach it once per forward, the rows' gradient once per
    # backward, and nothing else reads a device tensor (not a range check, not a unique on the device)
    table = HybridEmbedding(10, 4, mode="sum" if kind == "bag" else None, hashed_ids=kind == "hashed", seed=3)
    raw = torch.tensor([[3, 1, 3], [7, 1, 0]])
    if kind == "hashed":
        raw = raw * 10**12 + 5
    table(raw)  # attach, and hand the hashed ids their rows
    weights = torch.randn(2, 4) if kind == "bag" else torch.randn(2, 3, 4)
    with HostSyncGuard() as guard:
        out = table(raw.clone().as_subclass(OnDevice))
        in_forward = list(guard.syncs)
        out.backward(weights.as_subclass(OnDevice))
    in_backward = guard.syncs[len(in_forward) :]
    assert len(in_forward) == 1 and in_forward[0].op in ("to", "cpu", "copy_"), in_forward
    assert len(in_backward) == 1 and in_backward[0].op in ("to", "cpu", "copy_"), in_backward
    # and the step computed what a dense embedding of the same table computes
    unique, inverse = torch.unique(raw, return_inverse=True)
    rows = table.weight[table._rows_of(unique)].clone().requires_grad_(True)
    reference = F.embedding(inverse, rows).sum(1) if kind == "bag" else F.embedding(inverse, rows)
    reference.backward(weights)
    torch.testing.assert_close(_plain(out), reference.detach(), rtol=0, atol=0)
    ids, grad = table.pending_gradient()
    torch.testing.assert_close(_plain(ids), unique, rtol=0, atol=0)
    torch.testing.assert_close(_plain(grad), rows.grad, rtol=0, atol=0)


def test_out_of_range_ids_on_the_device_are_refused_after_one_copy() -> None:
    table = HybridEmbedding(10, 4, seed=0)
    table(torch.tensor([0]))
    with HostSyncGuard() as guard, pytest.raises(IndexError) as refused:
        table(torch.tensor([[4, -1], [12, 3]]).as_subclass(OnDevice))
    assert str(refused.value) == "ids must be in [0, 10); got ids from -1 to 12."
    assert len(guard.syncs) == 1, guard.syncs


def test_the_host_copy_of_a_cuda_tensor_is_made_outside_torchs_sync_debug_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the two copies a host table needs must not trip a run that sets the mode to "error" to find the others
    # (a stand-in: a CPU run cannot make a CUDA tensor)
    from lightning_hier.sparse.embedding import _to_host

    mode = {"now": 2}  # "error"
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda new: mode.update(now=new))
    copies = []

    class CudaTensor:
        device = torch.device("cuda", 0)

        def to(self, target: str) -> str:
            copies.append((target, mode["now"]))
            return "host copy"

    assert _to_host(CudaTensor()) == "host copy"  # type: ignore[arg-type]
    assert copies == [("cpu", 0)] and mode["now"] == 2


# ---------------------------------------------------------------------- SigtermBroadcast
def _sigterm_steps(rank: int, world: int, store: str, backend: str) -> dict:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_hier.audit.emulation import register_emulated_nccl
    from lightning_hier.strategies.lightning_patches import SIGTERM_BROADCAST as PATCHED
    from lightning_hier.strategies.sigterm_broadcast import SigtermBroadcast
    from lightning_hier.topology import control_group

    register_emulated_nccl()
    torch.set_num_threads(1)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    control = control_group()  # made by every rank before the steps (a collective the first time)
    sent: list[tuple[str, str, bool]] = []
    broadcast, barrier = dist.broadcast, dist.barrier

    def recorded_broadcast(tensor: torch.Tensor, src: int, group: Any = None, **kwargs: Any) -> Any:
        where = "device" if isinstance(tensor, OnDevice) else tensor.device.type
        sent.append(("broadcast", where, (group or dist.group.WORLD) is control))
        return broadcast(tensor, src, group=group, **kwargs)

    def recorded_barrier(group: Any = None, **kwargs: Any) -> Any:
        sent.append(("barrier", "", (group or dist.group.WORLD) is control))
        return barrier(group=group, **kwargs)

    dist.broadcast, dist.barrier = recorded_broadcast, recorded_barrier
    trainer = SimpleNamespace(
        received_sigterm=False,
        strategy=SimpleNamespace(root_device=STAND_IN_DEVICE),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()),
    )
    sigterm = SigtermBroadcast()
    sigterm.install(trainer)
    ended_at = None
    with HostSyncGuard(STAND_IN_DEVICE) as guard:
        for step in range(4):
            trainer.received_sigterm = rank == 0 and step >= 2  # rank 0's signal arrives in step 2
            try:
                getattr(trainer.fit_loop.epoch_loop, PATCHED)()
            except SIGTERMException:
                ended_at = step
                break
    sigterm.remove(trainer)
    dist.broadcast, dist.barrier = broadcast, barrier
    dist.barrier(group=control)
    dist.destroy_process_group()
    return {"ended_at": ended_at, "sent": sent, "syncs": [(s.op, s.caller) for s in guard.syncs]}


@pytest.mark.parametrize(
    "backend",
    ["cuda:emulated_nccl,cpu:gloo", "cuda:emulated_nccl"],
    ids=["default-group-with-cpu-backend", "nccl-only-default-group"],
)
def test_the_sigterm_flag_goes_from_the_host_over_the_control_group(tmp_path: Path, backend: str) -> None:
    # Lightning broadcasts rank 0's flag before every step; on the root device the receivers' read of
    # it would wait for the device every step. A host flag over the control group (which has a CPU backend
    # beside NCCL) still stops both ranks at the step rank 0 got the signal in.
    results = run_spawned(_sigterm_steps, 2, tmp_path, backend)
    for result in results:
        assert result is not None and "error" not in result, result
    # each rank: 3 host flags broadcast over the control group, then its barrier; no value read off the device
    sent = [("broadcast", "cpu", True)] * 3 + [("barrier", "", True)]
    expected = {"ended_at": 2, "sent": sent, "syncs": []}
    assert results == [expected, expected]
