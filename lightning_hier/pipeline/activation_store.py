"""Apply a stage's keep / swap / recompute plan at run time, and measure what the plan needs.

:class:`LayerRunner` runs one layer under one policy of
:mod:`lightning_hier.pipeline.memory_policy`:

* ``keep``: the layer runs as is; with a meter attached, saved tensors are only accounted;
* ``recompute``: the layer runs under a non-reentrant ``torch.utils.checkpoint``; only its inputs
  stay alive until backward, which re-runs its forward (with the buffers its forward writes put back after,
  so BatchNorm's running statistics advance once per micro-batch, as when kept);
* ``swap``: every tensor the layer saves for backward is copied to host memory during forward
  (pinned memory, asynchronously on a side CUDA stream when the tensor is on a GPU) and the device
  tensor is let go; backward copies it back, prefetching the previous swapped layer while the
  current one computes.

:class:`ActivationMeter` counts device-resident bytes of tensors saved for backward (current and
peak, one storage counted once however many ops save it) and host bytes of swapped tensors, and
records per-layer saved bytes; :func:`measure_layer_stats` turns a chain of layers into the
:class:`~lightning_hier.pipeline.memory_policy.LayerMemoryStats` the policy decides from.

Parameters (``nn.Parameter``, any leaf tensor that requires grad, and views of those, such as the
``weight.t()`` a linear layer saves) are never counted and never swapped: they stay on the device
regardless of the policy.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import _StopRecomputationError, checkpoint, noop_context_fn

from lightning_hier.pipeline.memory_policy import (
    KEEP,
    POLICIES,
    RECOMPUTE,
    SWAP,
    LayerMemoryStats,
    MemoryPlan,
)

__all__ = ["ActivationMeter", "LayerRunner", "is_parameter_like", "measure_layer_stats", "storage_bytes"]


def is_parameter_like(t: torch.Tensor) -> bool:
    """True for ``nn.Parameter``, leaf tensors that require grad, and views of either.

    Such tensors live outside the activation stash (the model or the caller holds them), so the
    meter does not count them and swap leaves them where they are.
    """
    for x in (t, t._base if t._is_view() else None):
        if x is not None and (isinstance(x, nn.Parameter) or (x.is_leaf and x.requires_grad)):
            return True
    return False


def _storage_key(t: torch.Tensor) -> tuple[tuple[Any, ...], int] | None:
    """``(key, bytes)`` of the storage behind ``t``; ``None`` for tensors that hold no memory."""
    try:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        nbytes = t.numel() * t.element_size()
        return (("tensor", id(t)), nbytes) if nbytes else None
    if nbytes == 0 or ptr == 0:
        return None
    return (t.device.type, t.device.index, ptr), nbytes


def storage_bytes(tensors: Sequence[Any], *, skip_parameters: bool = False) -> int:
    """Bytes of the storages behind the tensors in ``tensors``, each storage once.

    ``skip_parameters``: leave out parameter-like tensors (see :func:`is_parameter_like`), e.g. for
    what a recomputed layer's checkpoint stashes of its inputs.
    """
    seen: dict[tuple[Any, ...], int] = {}
    for arg in tensors:
        if isinstance(arg, torch.Tensor) and not (skip_parameters and is_parameter_like(arg)):
            found = _storage_key(arg)
            if found is not None:
                seen[found[0]] = found[1]
    return sum(seen.values())


class ActivationMeter:
    """Device-resident bytes of tensors saved for backward: current, peak, and per layer.

    Bytes are counted per storage (a tensor saved by two ops, or saved as two views, counts once)
    from the moment an op saves it until autograd releases it (after that node's backward, or when
    the graph is dropped). Tensors swapped to the host are counted apart, in ``host_bytes``.
    ``layer_bytes[name]`` holds the device bytes saved while :meth:`record` (``name``) was active
    (the last time), ``layer_host_bytes[name]`` the host bytes; the runner records every layer it
    runs. Thread-safe (autograd releases saved tensors on its own threads).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._storages: dict[tuple[Any, ...], list[int]] = {}
        self._current = 0
        self._peak = 0
        self._host = 0
        self._peak_host = 0
        self._recording: list[tuple[str, dict[tuple[Any, ...], int], list[int]]] = []
        self.layer_bytes: dict[str, int] = {}
        self.layer_host_bytes: dict[str, int] = {}

    # ------------------------------------------------------------------ figures
    @property
    def current_bytes(self) -> int:
        """Device bytes of saved activations alive now."""
        return self._current

    @property
    def peak_bytes(self) -> int:
        """Highest :attr:`current_bytes` since creation or the last :meth:`reset_peak`."""
        return self._peak

    @property
    def host_bytes(self) -> int:
        """Host bytes of swapped activations alive now."""
        return self._host

    @property
    def peak_host_bytes(self) -> int:
        """Highest :attr:`host_bytes` since creation or the last :meth:`reset_peak`."""
        return self._peak_host

    def reset_peak(self) -> None:
        """Restart the peaks from the current figures."""
        with self._lock:
            self._peak = self._current
            self._peak_host = self._host

    def snapshot(self) -> dict[str, int]:
        """``{current_bytes, peak_bytes, host_bytes, peak_host_bytes}`` at once."""
        with self._lock:
            return {
                "current_bytes": self._current,
                "peak_bytes": self._peak,
                "host_bytes": self._host,
                "peak_host_bytes": self._peak_host,
            }

    @contextlib.contextmanager
    def record(self, name: str) -> Iterator[None]:
        """Attribute tensors saved inside the block to layer ``name`` (see :attr:`layer_bytes`).

        Within one layer a storage counts once; a storage saved by two layers counts for both, so
        per-layer figures add up to at least the measured total.
        """
        device: dict[tuple[Any, ...], int] = {}
        host = [0]
        self._recording.append((name, device, host))
        try:
            yield
        finally:
            self._recording.pop()
            self.layer_bytes[name] = sum(device.values())
            self.layer_host_bytes[name] = host[0]

    # ------------------------------------------------------------------ accounting
    def track(self, owner: object, t: torch.Tensor) -> None:
        """Count ``t``'s storage as device-resident for as long as ``owner`` is alive."""
        found = _storage_key(t)
        if found is None:
            return
        key, nbytes = found
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                self._storages[key] = [1, nbytes]
                self._current += nbytes
                self._peak = max(self._peak, self._current)
            else:
                entry[0] += 1
        if self._recording:
            self._recording[-1][1][key] = nbytes
        weakref.finalize(owner, self._untrack, key)

    def hold(self, owner: object, tensors: Sequence[Any]) -> int:
        """Count the tensors in ``tensors`` as device-resident while ``owner`` lives (a pipeline
        schedule's received input and output of a micro-batch in flight, which stay whatever the
        layers' policies); returns their bytes, each storage once."""
        held = [t for t in tensors if isinstance(t, torch.Tensor)]
        for tensor in held:
            self.track(owner, tensor)
        return storage_bytes(held)

    def _untrack(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[0] -= 1
            if entry[0] == 0:
                del self._storages[key]
                self._current -= entry[1]

    def track_host(self, owner: object, nbytes: int) -> None:
        """Count ``nbytes`` of host memory for as long as ``owner`` is alive."""
        if nbytes <= 0:
            return
        with self._lock:
            self._host += nbytes
            self._peak_host = max(self._peak_host, self._host)
        if self._recording:
            self._recording[-1][2][0] += nbytes
        weakref.finalize(owner, self._untrack_host, nbytes)

    def _untrack_host(self, nbytes: int) -> None:
        with self._lock:
            self._host -= nbytes

    def __repr__(self) -> str:
        s = self.snapshot()
        return (
            f"ActivationMeter(current={s['current_bytes']}, peak={s['peak_bytes']}, "
            f"host={s['host_bytes']}, peak_host={s['peak_host_bytes']})"
        )


class _Kept:
    """What a kept (or checkpoint-input) saved tensor is packed into: the tensor and its version."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version


def _unpack_kept(obj: Any) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        return obj
    if obj.tensor._version != obj.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: a saved tensor of shape {tuple(obj.tensor.shape)} is at version "
            f"{obj.tensor._version}; expected version {obj.version} instead."
        )
    return obj.tensor


class _SwapGroup:
    """The swapped tensors of one ``run`` call (one layer of one micro-batch)."""

    __slots__ = ("name", "entries", "prev", "started", "__weakref__")

    def __init__(self, name: str, prev: weakref.ref[_SwapGroup] | None) -> None:
        self.name = name
        self.entries: list[weakref.ref[_SwapEntry]] = []
        self.prev = prev
        self.started = False


class _SwapEntry:
    """One swapped tensor: its host copy, and the device copy once it is on its way back."""

    __slots__ = ("host", "device", "group", "pending", "restored", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, group: _SwapGroup) -> None:
        self.host = host
        self.device = device
        self.group = group  # keeps the group alive while any of its tensors is
        self.pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self.restored: weakref.ref[torch.Tensor] | None = None


# Buffers a kernel may write without bumping their version counter: torch's batch_norm writes
# running_mean / running_var in place and its schema does not declare the write (nor do instance_norm's,
# cuDNN's batch norm or SyncBatchNorm's gather of the statistics). The CPU tests see the counter stay put;
# that the CUDA kernels leave it too is not verified on a GPU (docs/gpu.md), and they are copied regardless.
_SILENTLY_WRITTEN_NAMES = frozenset({"running_mean", "running_var"})

# an exported program's buffers some operation writes (in place, or passed to one that may write its
# arguments without saying which, as BatchNorm's): found once per program
_EXPORTED_WRITES: weakref.WeakKeyDictionary[nn.Module, frozenset[int]] = weakref.WeakKeyDictionary()


def _exported_writes(gm: nn.Module) -> frozenset[int]:
    """Positions of ``gm``'s placeholders that an operation of its graph writes or may write."""
    written = _EXPORTED_WRITES.get(gm)
    if written is None:
        graph = getattr(gm, "graph", None)
        nodes = list(graph.nodes) if graph is not None else []
        position = {node: i for i, node in enumerate(n for n in nodes if n.op == "placeholder")}
        found: set[int] = set()
        for node in nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            may_write = torch.Tag.maybe_aliasing_or_mutating in node.target.tags
            for i, argument in enumerate(node.target._schema.arguments):
                value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
                writes = argument.alias_info is not None and argument.alias_info.is_write
                if value in position and (writes or may_write):
                    found.add(position[value])
        written = _EXPORTED_WRITES[gm] = frozenset(found)
    return written


def _exported_written_names(fn: Any) -> set[str] | None:
    """The state names an exported layer's programs (one per mode) write or may write; None when ``fn``
    does not carry its programs (then every buffer it names counts as written)."""
    programs = getattr(fn, "programs", None)
    if not isinstance(programs, dict):
        return None
    names: set[str] = set()
    for program in programs.values():
        gm, slots = getattr(program, "gm", None), getattr(program, "slots", None)
        if not isinstance(gm, nn.Module) or not isinstance(slots, list):
            return None
        for i in _exported_writes(gm):
            if i < len(slots) and slots[i][0] == "state":
                names.add(slots[i][1])
    return names


def _layer_buffers(fn: Any, depth: int = 0) -> dict[int, tuple[torch.Tensor, bool]]:
    """The buffers of the modules behind a layer callable: a module, a bound method of one, a
    ``functools.partial`` or closure over one, or an exported layer (its state names under its root).
    Each comes with whether the layer may write it without bumping its version counter: a buffer of a
    torch norm layer or named like its running statistics, or one an exported layer's graph writes."""
    found: dict[int, tuple[torch.Tensor, bool]] = {}

    def add(buffer: torch.Tensor, silent: bool) -> None:
        known = found.get(id(buffer))
        found[id(buffer)] = (buffer, silent or (known is not None and known[1]))

    if isinstance(fn, nn.Module):
        for module in fn.modules():
            norm = isinstance(module, _NormBase)
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    add(buffer, norm or name in _SILENTLY_WRITTEN_NAMES)
        return found
    if depth > 2:
        return found
    parts: list[Any] = [getattr(fn, "__self__", None)]
    if isinstance(fn, functools.partial):
        parts += [fn.func, *fn.args, *fn.keywords.values()]
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            parts.append(cell.cell_contents)
    root, names = getattr(fn, "root", None), getattr(fn, "state_names", None)
    if isinstance(root, nn.Module) and isinstance(names, tuple):
        written = _exported_written_names(fn)
        for name in names:
            with contextlib.suppress(AttributeError):  # a parameter, not a buffer
                add(root.get_buffer(name), written is None or name in written)
    for part in parts:
        if part is not None and (isinstance(part, nn.Module) or callable(part)):
            for buffer, silent in _layer_buffers(part, depth + 1).values():
                add(buffer, silent)
    return found


class _BufferGuard:
    """Puts layers' buffers back after a block that re-runs them: a recompute, or profiling.

    A layer that updates buffers in forward (BatchNorm's running statistics in training mode) would
    update them again when its forward is re-run in backward, unlike a kept layer or one process. The
    recompute copies the buffers the layer's forward writes before it runs and copies them back after:
    device-side copies on the current stream, nothing waits on the device.

    Only written buffers are copied: a constant buffer every forward reads (a causal mask of
    ``1 x 1 x n x n``) would otherwise cost its size in memory and two copies per recompute. Which ones
    are written is told from their version counters (host integers, no read of the device): a buffer
    whose counter moved during the micro-batch's first forward is copied for its recompute. Kernels that
    write without bumping the counter (batch_norm's running statistics) are covered by always copying the
    buffers of torch's norm layers, buffers named ``running_mean`` / ``running_var``, and those an exported
    layer's graph writes. A write the counter does not see in another module (through ``.data``, or a
    custom kernel that does not declare it) is not put back. A
    recompute that bumps the counter of a buffer its forward left alone (the forward took another path)
    raises, as that buffer was not copied. The recomputed output is unchanged where the layer's output
    does not read what it updates (BatchNorm in training mode normalises with the batch statistics). CPU
    runs check this; on CUDA, that cuDNN's BatchNorm backward accepts the running statistics written back
    after the recompute is unverified (docs/gpu.md).
    """

    def __init__(self, buffers: list[torch.Tensor], silent: list[torch.Tensor] | None = None) -> None:
        self.buffers = buffers
        # copied for every recompute, whatever the forward's version counters say
        self.silent = list(buffers) if silent is None else silent

    @classmethod
    def contexts_for(cls, fn: Any) -> Callable[[], tuple[Any, Any]]:
        """A ``context_fn`` for ``torch.utils.checkpoint``: the default one when ``fn`` has no buffers.
        Each call pairs the forward's context, which notes the buffers it writes, with the recompute's,
        which copies those (and the silently written ones) and puts them back."""
        guard = cls.over([fn])
        if not guard.buffers:
            return noop_context_fn

        def contexts() -> tuple[Any, Any]:
            written: list[torch.Tensor] = []
            return guard.noting_writes(written), guard.restoring(written)

        return contexts

    @classmethod
    def over(cls, fns: Sequence[Any]) -> _BufferGuard:
        """A guard over the buffers behind every callable in ``fns``."""
        found: dict[int, tuple[torch.Tensor, bool]] = {}
        for fn in fns:
            for key, (buffer, silent) in _layer_buffers(fn).items():
                found[key] = (buffer, silent or (key in found and found[key][1]))
        # an inference tensor cannot be written outside inference mode, so no layer can update it
        kept = [(b, silent) for b, silent in found.values() if not b.is_inference()]
        return cls([b for b, _ in kept], [b for b, silent in kept if silent])

    @contextlib.contextmanager
    def noting_writes(self, written: list[torch.Tensor]) -> Iterator[None]:
        """Around a forward: adds to ``written`` the buffers whose version counter the block moved."""
        before = [b._version for b in self.buffers]
        yield
        written.extend(b for b, version in zip(self.buffers, before) if b._version != version)

    @contextlib.contextmanager
    def restoring(self, written: Sequence[torch.Tensor] | None = None) -> Iterator[None]:
        """Copy the buffers before the block and copy them back after it: the silently written ones and
        ``written``, or every buffer when ``written`` is None (profiling, where no earlier forward tells)."""
        chosen = self.buffers if written is None else (*self.silent, *written)
        copied = list({id(b): b for b in chosen}.values())
        ids = {id(b) for b in copied}
        others = [(b, b._version) for b in self.buffers if id(b) not in ids]
        with torch.no_grad():
            saved = [b.clone() for b in copied]
        try:
            yield
        except _StopRecomputationError:
            # the checkpoint ends a recompute early once it has the tensors backward needs
            self._check_unwritten(others)
            raise
        finally:
            with torch.no_grad():
                for buffer, value in zip(copied, saved):
                    buffer.copy_(value)
        self._check_unwritten(others)

    @staticmethod
    def _check_unwritten(others: list[tuple[torch.Tensor, int]]) -> None:
        """Raise if the block moved the version counter of a buffer it did not copy."""
        moved = [tuple(b.shape) for b, version in others if b._version != version]
        if moved:
            raise RuntimeError(
                f"a recomputed layer wrote {len(moved)} buffer(s) (shapes {moved}) that its forward did not; "
                "they cannot be put back. A layer under the recompute policy must take the same path in "
                "its recompute as in its forward; keep or swap it otherwise."
            )


class LayerRunner:
    """Runs layers under ``keep`` / ``swap`` / ``recompute`` and reports to an optional meter.

    ``runner.run(name, policy, fn, *args)`` returns ``fn(*args)``; gradients are the same under
    every policy (bit-identical for deterministic layers). ``runner(name, policy, fn, args)`` is
    the same with the arguments as one tuple, so a runner can serve directly as a stage's
    ``layer_run``. ``device``: the stage's device; on CUDA the copy stream is created up front
    (otherwise it is created on first use, per device of the swapped tensors).

    Swapped layers of one forward pass are chained: when backward first unpacks a swapped layer,
    its copies back and those of the previous swapped layer start on the side stream, so the
    transfer overlaps the current layer's backward. Call :meth:`begin_forward` at the start of
    each micro-batch's forward to chain only layers of the same micro-batch.
    """

    def __init__(self, meter: ActivationMeter | None = None, device: torch.device | None = None) -> None:
        self.meter = meter
        self.device = torch.device(device) if device is not None else None
        self._lock = threading.Lock()  # swap entries' copy-back state
        self._stream_lock = threading.Lock()  # the side streams (taken while _lock is held)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last_group: weakref.ref[_SwapGroup] | None = None
        if self.device is not None and self.device.type == "cuda":
            self._side_stream(self.device)

    # ------------------------------------------------------------------ public API
    def begin_forward(self) -> None:
        """Start a new micro-batch: later swapped layers do not prefetch earlier ones."""
        self._last_group = None

    def run(self, name: str, policy: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` with its saved activations kept, swapped or recomputed per ``policy``."""
        if policy not in POLICIES:
            raise ValueError(f"layer {name!r}: unknown policy {policy!r}, expected one of {POLICIES}.")
        record = self.meter.record(name) if self.meter is not None else contextlib.nullcontext()
        with record:
            if policy == KEEP:
                if self.meter is None:
                    return fn(*args)
                with saved_tensors_hooks(self._pack_kept, _unpack_kept):
                    return fn(*args)
            if not torch.is_grad_enabled():
                return fn(*args)
            if policy == RECOMPUTE:
                # The checkpoint stashes its inputs as saved tensors, so the keep hooks around it
                # count them (device-resident until backward frees them); the layer's own saved
                # tensors go through the checkpoint's inner hooks and are not materialised.
                context = _BufferGuard.contexts_for(fn)
                if self.meter is None:
                    return checkpoint(fn, *args, use_reentrant=False, context_fn=context)
                with saved_tensors_hooks(self._pack_kept, _unpack_kept):
                    return checkpoint(fn, *args, use_reentrant=False, context_fn=context)
            assert policy == SWAP
            group = _SwapGroup(name, self._last_group)
            seen: dict[int, tuple[weakref.ref[torch.Tensor], _SwapEntry]] = {}
            with saved_tensors_hooks(lambda t: self._pack_swapped(t, group, seen), self._unpack_swapped):
                result = fn(*args)
            if group.entries:  # a layer that swapped nothing does not break the prefetch chain
                self._last_group = weakref.ref(group)
            return result

    def __call__(self, name: str, policy: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """``run(name, policy, fn, *args)``; matches the stage executor's ``layer_run`` hook."""
        return self.run(name, policy, fn, *args)

    def run_sequential(
        self,
        layers: Sequence[tuple[str, Callable[..., Any]]],
        x: Any,
        policies: Mapping[str, str] | MemoryPlan | None = None,
    ) -> Any:
        """Feed ``x`` through ``layers`` in order, each under its policy (default ``keep``).

        One call is one micro-batch's forward (it calls :meth:`begin_forward` first).
        """
        mapping = policies.as_mapping() if isinstance(policies, MemoryPlan) else dict(policies or {})
        self.begin_forward()
        for name, fn in layers:
            x = self.run(name, mapping.get(name, KEEP), fn, x)
        return x

    # ------------------------------------------------------------------ keep
    def _pack_kept(self, t: torch.Tensor) -> Any:
        if is_parameter_like(t):
            return t
        # Detached alias (same storage and version counter): holding ``t`` itself would make a
        # reference cycle for outputs an op saves (output -> grad_fn -> saved -> output).
        kept = _Kept(t.detach(), t._version)
        if self.meter is not None:
            self.meter.track(kept, t)
        return kept

    # ------------------------------------------------------------------ swap
    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._stream_lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _pack_swapped(
        self,
        t: torch.Tensor,
        group: _SwapGroup,
        seen: dict[int, tuple[weakref.ref[torch.Tensor], _SwapEntry]],
    ) -> Any:
        if is_parameter_like(t):
            return t
        prior = seen.get(id(t))
        if prior is not None and prior[0]() is t:
            return prior[1]  # the same tensor saved twice in this layer: one host copy
        with torch.no_grad():
            if t.device.type == "cuda":
                stream = self._side_stream(t.device)
                stream.wait_stream(torch.cuda.current_stream(t.device))
                host = torch.empty_like(t, device="cpu", pin_memory=True)
                with torch.cuda.stream(stream):
                    host.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the caching allocator must not reuse t before the copy
            elif t.device.type == "cpu":
                host = t.detach().clone()
            else:
                host = t.detach().to("cpu")
        entry = _SwapEntry(host, t.device, group)
        group.entries.append(weakref.ref(entry))
        seen[id(t)] = (weakref.ref(t), entry)
        if self.meter is not None:
            found = _storage_key(host)
            self.meter.track_host(entry, found[1] if found is not None else 0)
        return entry

    def _unpack_swapped(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, torch.Tensor):
            return obj
        entry: _SwapEntry = obj
        self._prefetch(entry.group)
        return self._restore(entry)

    def _copy_back(self, entry: _SwapEntry) -> None:
        """Start bringing ``entry`` back to its device (the caller holds ``_lock``).

        CUDA: an asynchronous host-to-device copy on the side stream, with an event to wait on.
        Other devices (the CPU included): a synchronous copy.
        """
        if entry.pending is not None:
            return
        if entry.restored is not None and entry.restored() is not None:
            return
        if entry.device.type == "cuda":
            stream = self._side_stream(entry.device)
            with torch.cuda.stream(stream):  # ordered after the device-to-host copy on this stream
                device_tensor = entry.host.to(entry.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            entry.pending = (device_tensor, event)
        elif entry.device.type == "cpu":
            # A real copy, as on a GPU: CPU runs then hold what a device would (the layer back
            # beside its host copy), so the estimate can be checked against the CPU allocator.
            entry.pending = (entry.host.clone(), None)
        else:
            entry.pending = (entry.host.to(entry.device), None)

    def _prefetch(self, group: _SwapGroup) -> None:
        """On a group's first unpack: bring back all its tensors and the previous group's."""
        with self._lock:
            if group.started:
                return
            group.started = True
            groups = [group]
            prev = group.prev() if group.prev is not None else None
            if prev is not None and not prev.started:
                groups.append(prev)
            for g in groups:
                for ref in g.entries:
                    entry = ref()
                    if entry is not None:
                        self._copy_back(entry)

    def _restore(self, entry: _SwapEntry) -> torch.Tensor:
        with self._lock:
            restored = entry.restored() if entry.restored is not None else None
            if restored is not None:
                return restored  # saved twice by one node: both get the same device copy
            self._copy_back(entry)
            assert entry.pending is not None
            device_tensor, event = entry.pending
            entry.pending = None
            entry.restored = weakref.ref(device_tensor)
        if event is not None:
            stream = torch.cuda.current_stream(entry.device)
            stream.wait_event(event)
            device_tensor.record_stream(stream)  # allocated on the side stream, used on this one
        return device_tensor


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def _graph_leaves(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf tensors that require grad reachable from ``outputs`` (parameters, leaf inputs)."""
    leaves: dict[int, torch.Tensor] = {}
    # the nodes themselves are kept: a graph node's Python object lives only while referenced (in torch
    # 2.11 at least), and a freed one's id can come back for another node, which would then be skipped
    seen: dict[int, Any] = {}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves[id(variable)] = variable
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return list(leaves.values())


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    @contextlib.contextmanager
    def measure(self, out: list[float]) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1000.0)
        else:
            begin = perf_counter()
            yield
            out.append(perf_counter() - begin)


def _as_chain_input(example_input: Any) -> Any:
    """A copy of the input that is an activation (non-leaf) when it can carry a gradient."""
    if isinstance(example_input, torch.Tensor):
        x = example_input.detach()
        if x.is_floating_point() or x.is_complex():
            return x.requires_grad_(True).clone()
        return x
    return example_input


def measure_layer_stats(
    named_fns: Sequence[tuple[str, Callable[..., Any]]],
    example_input: Any,
    repeats: int = 3,
) -> list[LayerMemoryStats]:
    """Profile a sequential chain ``x -> fn_1 -> fn_2 -> ...`` into per-layer memory stats.

    Each ``fn`` takes the previous output (``example_input`` for the first) and returns the next.
    ``saved_bytes`` comes from an :class:`ActivationMeter` over one all-keep pass whose input is a
    non-leaf copy of ``example_input`` (as a stage's activations are); ``input_bytes`` are the
    bytes of each layer's tensor input; forward and backward seconds are medians over
    ``repeats`` runs of each layer alone (after one warm-up), with ``time.perf_counter`` on the
    CPU and CUDA events on a GPU. Backward covers the gradients of the layer's input and of every
    leaf it uses (its parameters) but leaves their ``.grad`` untouched, and the layers' buffers (BatchNorm's
    running statistics) as they were.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    names = [name for name, _ in named_fns]
    if len(set(names)) != len(names):
        raise ValueError(f"layer names must be unique, got {names}.")

    # every layer runs several times here: buffers it updates in forward (running statistics) are put back
    with _BufferGuard.over([fn for _, fn in named_fns]).restoring():
        meter = ActivationMeter()
        runner = LayerRunner(meter)
        inputs: list[Any] = []
        x = _as_chain_input(example_input)
        with torch.enable_grad():
            for name, fn in named_fns:
                inputs.append(x)
                x = runner.run(name, KEEP, fn, x)
        del x
        input_bytes = [storage_bytes([v], skip_parameters=True) for v in inputs]
        inputs = [v.detach() if isinstance(v, torch.Tensor) else v for v in inputs]

        stats: list[LayerMemoryStats] = []
        for (name, fn), layer_input, in_bytes in zip(named_fns, inputs, input_bytes):
            device = layer_input.device if isinstance(layer_input, torch.Tensor) else torch.device("cpu")
            timer = _Timer(device)
            forward: list[float] = []
            backward: list[float] = []
            for i in range(repeats + 1):
                fwd: list[float] = []
                bwd: list[float] = []
                h = _as_chain_input(layer_input)
                with torch.enable_grad():
                    with timer.measure(fwd):
                        out = fn(h)
                    outs = [t for t in _tensors_in(out) if t.requires_grad]
                    if outs:
                        leaves = _graph_leaves(outs)
                        grads = [torch.ones_like(t) for t in outs]
                        with timer.measure(bwd):
                            torch.autograd.grad(outs, leaves, grads, allow_unused=True)
                    else:
                        bwd.append(0.0)
                if i > 0:
                    forward += fwd
                    backward += bwd
                del out, outs
            stats.append(
                LayerMemoryStats(
                    name=name,
                    saved_bytes=meter.layer_bytes.get(name, 0),
                    input_bytes=in_bytes,
                    forward_seconds=statistics.median(forward),
                    backward_seconds=statistics.median(backward),
                )
            )
        return stats
