"""Record every ``torch.distributed`` collective and point-to-point operation of one process.

:class:`CollectiveAudit` wraps the functions of ``torch.distributed`` (and of
``distributed_c10d``, which torch's own helpers call) while it is active. Only the outermost call
is recorded: ``broadcast_object_list`` counts once, not as the broadcasts it is made of. Each
:class:`CollectiveRecord` says which group, which tensors on which devices, which thread, and which
line outside torch issued it; ``violation`` names a tensor whose device type the group has no
backend for (a CPU tensor on an NCCL-only group), which torch would refuse on a GPU.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

AUDIT_DIR_ENV = "LIGHTNING_HIER_AUDIT_DIR"

COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor", "all_gather_single", "gather", "scatter", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)  # fmt: skip
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "send_object_list", "recv_object_list")
SENDS = ("send", "isend", "send_object_list")
OBJECT_OPS = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
WRAPPED = (*COLLECTIVES, *POINT_TO_POINT, "batch_isend_irecv")
_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_SELF = str(Path(__file__).resolve())


@dataclass
class CollectiveRecord:
    """One operation as this rank issued it."""

    index: int
    op: str
    group: str  # the group's name: the same on every member rank
    group_ranks: list[int]
    group_devices: list[str]  # device types the group has a backend for
    tensors: list[tuple[str, str, list[int]]]  # (device type, dtype, shape) per tensor
    peer: int | None  # global rank of the other side (point-to-point)
    batch: int | None  # which batch_isend_irecv call this op belongs to
    thread: str
    main_thread: bool
    caller: str  # file:line of the nearest frame outside torch
    package: bool  # issued from lightning_hier
    violation: str | None = None

    @property
    def is_send(self) -> bool:
        return self.op in SENDS


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``: itself, or those inside (nested) lists and tuples."""
    found: list[torch.Tensor] = []
    _tensors_of(value, found)
    return found


def _tensors_of(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors_of(item, found)


def group_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dist.ProcessGroup | None:
    """The process group a ``torch.distributed`` call names (``None``: the default group)."""
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return group


_P2P_NAMES: weakref.WeakKeyDictionary[Callable[..., Any], str] = weakref.WeakKeyDictionary()


def p2p_op_name(op: dist.P2POp) -> str:
    """``"isend"`` or ``"irecv"`` for an op of ``batch_isend_irecv``, whatever wraps its function."""
    # asked for every message a profiled pipeline sends: unwrapping costs ~2 us, a lookup a tenth
    name = _P2P_NAMES.get(op.op)
    if name is None:
        name = _P2P_NAMES[op.op] = "isend" if inspect.unwrap(op.op).__name__ == "isend" else "irecv"
    return name


Wrapper = Callable[..., Any]


def issuing_thread() -> tuple[str, bool]:
    """The thread a collective counts as issued by, and whether that is the main thread.

    On CUDA, backward runs on the autograd engine's device thread (started by torch, not by Python)
    while the thread that called ``backward()`` waits for it, so what a backward hook issues (DDP's
    comm hook, the inline reducer) follows that thread's program order: it counts as the main
    thread's, the thread that runs the training step. On the CPU backward runs on the caller itself.
    """
    current = threading.current_thread()
    autograd_worker = isinstance(current, threading._DummyThread) and torch._C._current_graph_task_id() >= 0
    if autograd_worker:
        return threading.main_thread().name, True
    return current.name, current is threading.main_thread()


def patch_distributed(make_wrapper: Callable[[str, Wrapper], Wrapper]) -> dict[tuple[Any, str], Any]:
    """Replace every function named in :data:`WRAPPED` in ``torch.distributed`` and ``distributed_c10d``
    by ``make_wrapper(name, original)``; returns what :func:`restore_distributed` puts back.

    Wrappers stack (an audit and a profiler at once): each sees the function it replaced as
    ``original``, and ``__wrapped__`` leads back to torch's own.
    """
    originals: dict[tuple[Any, str], Any] = {}
    for name in WRAPPED:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapped = make_wrapper(name, original)
        wrapped.__wrapped__ = original  # type: ignore[attr-defined]
        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                originals[(module, name)] = (original, wrapped)
                setattr(module, name, wrapped)
    return originals


def restore_distributed(originals: dict[tuple[Any, str], Any]) -> None:
    """Undo :func:`patch_distributed` where its wrapper is still the installed function (a wrapper
    installed later on top stays; it calls through to the original)."""
    for (module, name), (original, wrapped) in originals.items():
        if getattr(module, name, None) is wrapped:
            setattr(module, name, original)
    originals.clear()


def _caller() -> tuple[str, bool]:
    for frame, line in traceback.walk_stack(sys._getframe(2)):
        path = str(Path(frame.f_code.co_filename).resolve()) if frame.f_code.co_filename[0] != "<" else ""
        if path and not path.startswith(_TORCH_DIR) and path != _SELF:
            return f"{path}:{line}", path.startswith(_PACKAGE_DIR)
    return "?", False


@dataclass
class CollectiveAudit:
    """Records ``torch.distributed`` operations while active (``with CollectiveAudit() as audit``).

    ``raise_on_violation`` raises at the offending call (with the caller's location) instead of
    only recording it.
    """

    raise_on_violation: bool = False
    records: list[CollectiveRecord] = field(default_factory=list)
    rank: int | None = None

    def __post_init__(self) -> None:
        self._originals: dict[tuple[Any, str], Any] = {}
        self._local = threading.local()
        self._batches = 0
        self._lock = threading.Lock()
        self._active = False

    # ------------------------------------------------------------------ patching
    def __enter__(self) -> CollectiveAudit:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._active = True
        self._originals = patch_distributed(self._wrap)

    def stop(self) -> None:
        self._active = False
        restore_distributed(self._originals)

    def _wrap(self, name: str, original: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0) or not self._active:
                return original(*args, **kwargs)
            self._local.depth = 1
            try:
                if name == "batch_isend_irecv":
                    self._record_batch(args[0] if args else kwargs["p2p_op_list"])
                else:
                    self._record(name, args, kwargs)
                return original(*args, **kwargs)
            finally:
                self._local.depth = 0

        return wrapped

    # ------------------------------------------------------------------ recording
    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        group = group_in(args, kwargs)
        tensors: list[torch.Tensor] = []
        if name not in OBJECT_OPS and name not in ("send_object_list", "recv_object_list"):
            _tensors_of(list(args) + [v for k, v in kwargs.items() if k != "group"], tensors)
        peer = None
        if name in POINT_TO_POINT:
            peer = self._peer(name, args, kwargs, group)
        object_device = None
        if name in (*OBJECT_OPS, "barrier", "send_object_list", "recv_object_list"):
            object_device = c10d._get_object_coll_device(group)  # where torch puts the pickled bytes
        self._append(name, group, tensors, peer, None, object_device)

    @staticmethod
    def _peer(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], group: Any) -> int | None:
        key = "dst" if name in SENDS else "src"
        peer = kwargs.get(key, args[1] if len(args) > 1 and isinstance(args[1], int) else None)
        group_key = "group_dst" if name in SENDS else "group_src"
        if peer is None and kwargs.get(group_key) is not None:
            peer = dist.get_global_rank(group, kwargs[group_key])
        return peer

    def _record_batch(self, ops: list[dist.P2POp]) -> None:
        with self._lock:
            self._batches += 1
            batch = self._batches
        for op in ops:
            self._append(p2p_op_name(op), op.group, [op.tensor], op.peer, batch, None)

    def _append(
        self,
        name: str,
        group: Any,
        tensors: list[torch.Tensor],
        peer: int | None,
        batch: int | None,
        object_device: str | None,
    ) -> None:
        group = group if group is not None else dist.group.WORLD
        devices = [d.type for d in group._device_types]
        described = [(t.device.type, str(t.dtype).replace("torch.", ""), list(t.shape)) for t in tensors]
        if object_device is not None:
            described.append((object_device, "object", []))
        wrong = sorted({d for d, _, _ in described if d not in devices})
        violation = None
        if wrong:
            violation = (
                f"{name} on group {group.group_name} (backends for {devices}) got tensors on {wrong}: "
                "a GPU run would refuse them (NCCL takes no CPU tensors)"
            )
        caller, package = _caller()
        thread, is_main = issuing_thread()
        if self.rank is None:
            self.rank = dist.get_rank()
        record = CollectiveRecord(
            index=len(self.records),
            op=name,
            group=group.group_name,
            group_ranks=dist.get_process_group_ranks(group),
            group_devices=devices,
            tensors=described,
            peer=peer,
            batch=batch,
            thread=thread,
            main_thread=is_main,
            caller=caller,
            package=package,
            violation=violation,
        )
        with self._lock:
            record.index = len(self.records)
            self.records.append(record)
        if violation is not None and self.raise_on_violation:
            raise RuntimeError(f"{violation} (issued at {caller})")

    # ------------------------------------------------------------------ output
    def violations(self) -> list[CollectiveRecord]:
        return [r for r in self.records if r.violation is not None]

    def dump(self, directory: str | Path) -> Path | None:
        """Write ``directory/rank<N>.json`` (nothing if this process issued no operation)."""
        if self.rank is None:
            return None
        path = Path(directory) / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"rank": self.rank, "pid": os.getpid(), "records": [asdict(r) for r in self.records]}
        path.write_text(json.dumps(payload))
        return path


_ACTIVE: CollectiveAudit | None = None


def install_from_env() -> CollectiveAudit | None:
    """With ``LIGHTNING_HIER_AUDIT_DIR`` set, record this whole process and write its record at exit."""
    global _ACTIVE
    directory = os.environ.get(AUDIT_DIR_ENV)
    if not directory or _ACTIVE is not None:
        return _ACTIVE
    _ACTIVE = CollectiveAudit()
    _ACTIVE.start()
    atexit.register(_ACTIVE.dump, directory)
    return _ACTIVE
