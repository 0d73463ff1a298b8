"""Parameters that layers on different stages share: tied input and output embeddings, a module called
in two places of ``forward``.

Such a parameter has a replica on every stage whose layers use it. Each replica collects the gradient of
its own uses; :func:`sum_tied_gradients` adds them up over the stages before the optimizer step, so every
replica steps with the whole gradient that one process would have computed, and, starting equal, the
replicas stay equal (the same gradient, the same optimizer state, the same update). This is what
Megatron-LM does for its tied word embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.pipeline.graph import LayerGraph
from lightning_hier.pipeline.partition import StagePartition


@dataclass(frozen=True)
class TiedParameter:
    """A parameter with a replica on each of ``stages`` (named by its first name in the model)."""

    name: str
    stages: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


def canonical_names(root: nn.Module) -> dict[str, str]:
    """Each parameter/buffer name -> the first name of the same tensor (tied tensors share one)."""
    first: dict[int, str] = {}
    canonical = {}
    for name, tensor in [
        *root.named_parameters(remove_duplicate=False),
        *root.named_buffers(remove_duplicate=False),
    ]:
        canonical[name] = first.setdefault(id(tensor), name)
    return canonical


def other_names(canonical: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """Each name of a tensor known under several names -> all its names (in model order)."""
    by_key: dict[str, list[str]] = {}
    for name, key in canonical.items():
        by_key.setdefault(key, []).append(name)
    return {name: tuple(names) for names in by_key.values() if len(names) > 1 for name in names}


def held_keys(
    graph: LayerGraph, partition: StagePartition, stage: int, canonical: dict[str, str]
) -> set[str]:
    """The tensors (by first name) that the layers of ``stage`` use under ``partition``."""
    first, last = partition.stage_ranges()[stage]
    return {canonical.get(name, name) for name in graph.state_names(first, last)}


def parameter_shapes(root: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every parameter's shape and dtype, read while the model is whole (a released replica is empty)."""
    return {name: (tuple(p.shape), p.dtype) for name, p in root.named_parameters(remove_duplicate=False)}


def find_tied(
    graph: LayerGraph,
    partition: StagePartition,
    canonical: dict[str, str],
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> list[TiedParameter]:
    """The parameters that layers of more than one stage use under ``partition``, in model order (the
    same list on every rank: it depends on the model and the split only). ``shapes``: from
    :func:`parameter_shapes`."""
    stages_of: dict[str, list[int]] = {}
    for stage in range(partition.num_stages):
        for key in held_keys(graph, partition, stage, canonical):
            if key in shapes:
                stages_of.setdefault(key, []).append(stage)
    order = {name: i for i, name in enumerate(shapes)}
    return [
        TiedParameter(key, tuple(stages), *shapes[key])
        for key, stages in sorted(stages_of.items(), key=lambda item: order[item[0]])
        if len(stages) > 1
    ]


@torch.no_grad()
def start_replicas_equal(
    tied: Sequence[TiedParameter], params: Mapping[str, nn.Parameter], group: dist.ProcessGroup | None
) -> None:
    """Give every process rank 0's values of the tied parameters (``params``: the model's, by every
    name; collective, while every process still holds the whole model). Processes that built the model
    without a common seed would otherwise start their replicas apart and keep them apart; rank 0's
    values are the ones ``ddp`` would train too."""
    for t in tied:
        dist.broadcast(params[t.name].data, src=0, group=group)


@torch.no_grad()
def sum_tied_gradients(
    tied: Sequence[TiedParameter],
    params: Mapping[str, nn.Parameter],
    stage: int,
    device: torch.device,
    groups: Mapping[tuple[int, ...], dist.ProcessGroup | None],
) -> None:
    """Give every replica of each tied parameter the sum of all replicas' gradients (collective over the
    stages holding it: ``groups[t.stages]``; a stage without a replica does nothing).

    Per parameter, first one small all-reduce of a host flag (the group's CPU backend: no device
    synchronisation) says whether some replica got a gradient; one that none did keeps ``grad=None``
    (the optimizer skips it, as one process would). Then one all-reduce of the gradient on the device.
    Every stage takes the parameters in the same order, so the groups' collectives never cross (the
    device rule of :mod:`lightning_hier.topology`)."""
    for t in tied:
        if stage not in t.stages:
            continue
        group, param = groups[t.stages], params[t.name]
        has_grad = torch.tensor([int(param.grad is not None)])
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
        if not has_grad.item():
            continue
        grad = param.grad
        if grad is None or not grad.is_contiguous():
            summed = torch.zeros(t.shape, dtype=t.dtype, device=device)
            if grad is not None:
                summed.copy_(grad)
            param.grad = summed
        dist.all_reduce(param.grad, group=group)
