"""Live layer migration between running stage processes.

For each layer that changes stage (in layer order, the same list on every rank): the source
announces it with the shapes and dtypes of its parameters and buffers; the target builds the
empty layer and answers ready; the source sends parameters, buffers and optimizer state. What a
stage no longer holds is released once every move has run (a tensor tied across layers may leave one
stage for several): ``PipelineEngine.apply_partition``. Migrations run at an optimizer-step boundary,
where the synchronous schedules (GPipe, 1F1B) have flushed, so no stashed activation needs to move: every
micro-batch's backward has already run on the stage that ran its forward.

Processing one shared list in order cannot deadlock: the earliest unfinished move always has
both of its ranks waiting on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_hier.pipeline.graph import LayerGraph
from lightning_hier.pipeline.object_wire import from_wire, to_wire
from lightning_hier.pipeline.partition import StagePartition
from lightning_hier.pipeline.tied_parameters import canonical_names, held_keys


@dataclass(frozen=True)
class LayerMove:
    """Layer ``layer`` (with its parameter/buffer names) moves from stage ``src`` to ``dst``."""

    layer: str
    state_names: tuple[str, ...]
    src: int
    dst: int


@dataclass
class MigrationReport:
    """What one rank did in one migration: moves, bytes, and the pause it caused."""

    moves: list[LayerMove] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [f"{m.layer}: {m.src}->{m.dst}" for m in self.moves],
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "seconds": self.seconds,
        }


def plan_moves(graph: LayerGraph, old: StagePartition, new: StagePartition) -> list[LayerMove]:
    """Every layer that owns state and sits on a different stage under ``new``, each tensor once per
    stage that needs it.

    A module applied twice, or two layers sharing a parameter (tied weights), put the same tensor in
    several layers. It moves with the first of them that reaches a stage; a second move to the same stage
    would read a tensor the source may have released and overwrite what the target has just received.
    Where the target already holds the tensor (a replica of a parameter tied across stages) nothing of it
    travels.
    """
    canonical = canonical_names(graph.root)
    held = [held_keys(graph, old, stage, canonical) for stage in range(old.num_stages)]
    moved: set[tuple[str, int]] = set()
    moves = []
    for cluster in graph.clusters:
        src, dst = old.stage_of_cluster(cluster.index), new.stage_of_cluster(cluster.index)
        if src == dst:
            continue
        for layer in graph.cluster_layers(cluster):
            names = []
            for name in layer.state_names:
                key = canonical.get(name, name)
                if (key, dst) not in moved and key not in held[dst]:
                    moved.add((key, dst))
                    names.append(name)
            if names:
                moves.append(LayerMove(layer.name, tuple(names), src, dst))
    return moves


# ---------------------------------------------------------------------- local state surgery
def named_state(root: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by every name they have (tied tensors appear under each name)."""
    state: dict[str, torch.Tensor] = dict(root.named_parameters(remove_duplicate=False))
    state.update(dict(root.named_buffers(remove_duplicate=False)))
    return state


def _set_buffer(root: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    owner._buffers[attr] = value


def release_state(root: nn.Module, names: Iterable[str], optimizers: Sequence[Optimizer]) -> int:
    """Drop the storage (and optimizer state) of ``names``; returns the bytes freed.

    Parameters stay registered (empty), so the module, its optimizer param groups and Lightning
    keep their structure; an optimizer skips them because their gradient is ``None``.
    """
    state = named_state(root)
    params = dict(root.named_parameters(remove_duplicate=False))
    freed = 0
    seen: set[int] = set()
    for name in names:
        tensor = state[name]
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        freed += tensor.numel() * tensor.element_size()
        empty = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        if name in params:
            params[name].data = empty
            params[name].grad = None
            for opt in optimizers:
                opt.state.pop(params[name], None)
        else:
            _set_buffer(root, name, empty)
    return freed


def materialize_state(
    root: nn.Module, values: dict[str, torch.Tensor], device: torch.device | None = None
) -> None:
    """Give ``names`` their storage back with the given values (a copy on ``device``)."""
    params = dict(root.named_parameters(remove_duplicate=False))
    for name, value in values.items():
        target_device = device if device is not None else value.device
        data = value.detach().to(target_device, copy=True)
        if name in params:
            params[name].data = data
        else:
            _set_buffer(root, name, data)


def state_on_host(state: dict[str, Any]) -> dict[str, Any]:
    """One parameter's optimizer state with its tensors copied to the host (for pickling)."""
    return {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in state.items()}


def _optimizer_state(param: nn.Parameter, optimizers: Sequence[Optimizer]) -> list[dict[str, Any] | None]:
    return [state_on_host(opt.state[param]) if param in opt.state else None for opt in optimizers]


def _install_optimizer_state(
    param: nn.Parameter, states: list[dict[str, Any] | None], optimizers: Sequence[Optimizer]
) -> None:
    for opt, state in zip(optimizers, states):
        if state is None:
            continue
        opt.state[param] = {
            # Adam-style `step` counters stay where torch keeps them (on the host unless fused)
            k: (v.to(param.device) if torch.is_tensor(v) and k != "step" else v)
            for k, v in state.items()
        }


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_nbytes(optim: dict[str, list[dict[str, Any] | None]]) -> int:
    """Bytes of the optimizer state tensors that travel with a layer (momentum, Adam moments...)."""
    return sum(
        _nbytes(v for v in state.values() if torch.is_tensor(v))
        for states in optim.values()
        for state in states
        if state is not None
    )


# ---------------------------------------------------------------------- the protocol
def _send_layer(
    move: LayerMove,
    peer: int,
    root: nn.Module,
    params: dict[str, nn.Parameter],
    optimizers: Sequence[Optimizer],
    group: dist.ProcessGroup | None,
) -> int:
    """Source side: announce, wait for ready, send state; returns bytes sent.

    The handshake and the pickled state are host data, so they travel over the group's CPU
    backend (the device rule of :mod:`lightning_hier.topology`).
    """
    state = named_state(root)
    meta = {n: (tuple(state[n].shape), state[n].dtype) for n in move.state_names}
    dist.send_object_list([{"layer": move.layer, "meta": meta}], dst=peer, group=group)
    ready = torch.zeros(1, dtype=torch.int64)
    dist.recv(ready, src=peer, group=group)
    if int(ready.item()) != 1:
        raise RuntimeError(f"stage {move.dst} refused layer {move.layer}.")
    tensors = {n: state[n].detach().cpu() for n in move.state_names}
    optim = {n: _optimizer_state(params[n], optimizers) for n in move.state_names if n in params}
    dist.send_object_list([to_wire({"tensors": tensors, "optim": optim})], dst=peer, group=group)
    return _nbytes(tensors.values()) + _optimizer_nbytes(optim)


def _receive_layer(
    move: LayerMove,
    peer: int,
    root: nn.Module,
    params: dict[str, nn.Parameter],
    optimizers: Sequence[Optimizer],
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> int:
    """Target side: build the empty layer, answer ready, fill it; returns bytes received."""
    announce: list[Any] = [None]
    dist.recv_object_list(announce, src=peer, group=group)
    if announce[0]["layer"] != move.layer:
        raise RuntimeError(f"expected layer {move.layer}, stage {move.src} announced {announce[0]['layer']}.")
    meta = announce[0]["meta"]
    materialize_state(
        root, {n: torch.empty(shape, dtype=dtype) for n, (shape, dtype) in meta.items()}, device
    )
    dist.send(torch.ones(1, dtype=torch.int64), dst=peer, group=group)
    payload: list[Any] = [None]
    dist.recv_object_list(payload, src=peer, group=group)
    payload[0] = from_wire(payload[0])
    state = named_state(root)
    with torch.no_grad():
        for name, value in payload[0]["tensors"].items():
            state[name].copy_(value)
    for name, states in payload[0]["optim"].items():
        _install_optimizer_state(params[name], states, optimizers)
    return _nbytes(payload[0]["tensors"].values()) + _optimizer_nbytes(payload[0]["optim"])


def migrate(
    moves: Sequence[LayerMove],
    stage: int,
    rank_of_stage: Callable[[int], int],
    root: nn.Module,
    optimizers: Sequence[Optimizer],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> MigrationReport:
    """Carry out ``moves`` on this rank (every rank calls this with the same list); the caller releases
    what this stage no longer holds afterwards."""
    report = MigrationReport()
    start = perf_counter()
    params = dict(root.named_parameters(remove_duplicate=False))
    for move in moves:
        if stage not in (move.src, move.dst):
            continue
        report.moves.append(move)
        peer = rank_of_stage(move.dst if stage == move.src else move.src)
        try:
            if stage == move.src:
                report.bytes_sent += _send_layer(move, peer, root, params, optimizers, group)
            else:
                report.bytes_received += _receive_layer(move, peer, root, params, optimizers, device, group)
        except (RuntimeError, ConnectionError) as exc:
            raise RuntimeError(
                f"hier_pipeline: migrating layer {move.layer} from stage {move.src} to stage {move.dst} "
                f"failed ({exc}). The other stage (rank {peer}) probably died; checkpoints are only written "
                "between steps, so the last one describes a valid partition: resume from it."
            ) from exc
    report.seconds = perf_counter() - start
    return report
