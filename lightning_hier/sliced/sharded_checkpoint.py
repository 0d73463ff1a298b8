"""Sharded checkpoints: every rank writes and reads only its own parameter and optimizer slices.

Format: a directory written with ``torch.distributed.checkpoint`` (DCP) plus ``meta.pt``.

- DCP keys ``model/bucket{b}/slice{k}`` hold slice ``k`` of bucket ``b``'s flat parameters and
  ``optim/bucket{b}/slice{k}/{state}`` its optimizer state. The ranks with local index ``k`` on
  every node hold identical slices; DCP keeps one copy of each key.
- ``meta.pt`` (written by rank 0) holds the rest of Lightning's checkpoint (loops, schedulers,
  callbacks, buffers and frozen parameters under ``state_dict``) and the *layout*: parameter
  names, bucket membership, offsets and slice bounds.

On resume with the same layout each rank loads only its slices and the full model is stitched
by an all-gather inside the node. :func:`consolidate_sharded_checkpoint` turns the directory
into an ordinary ``.ckpt`` file (full ``state_dict``, unsharded optimizer state) on one process,
for inference, or for resuming with another topology.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_hier.sliced.engine import HierSlicedEngine

META_FILE = "meta.pt"
FORMAT_KEY = "hier_sliced_sharded"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def layout_of(engine: HierSlicedEngine) -> dict[str, Any]:
    """What a sharded checkpoint must agree on to be loaded slice by slice."""
    names = {id(p): n for n, p in engine.module.named_parameters(remove_duplicate=True)}
    return {
        "devices_per_node": engine.topology.devices_per_node,
        "buckets": [
            {
                "names": [engine.param_names[slot.index] for slot in bucket.slots],
                "offsets": [slot.offset for slot in bucket.slots],
                "shapes": [list(slot.shape) for slot in bucket.slots],
                "bounds": [list(b) for b in bucket.bounds],
                "padded_numel": bucket.padded_numel,
                "dtype": str(bucket.dtype),
            }
            for bucket in engine.buckets
        ],
        # the unsharded optimizer's numbering: original groups, each parameter once (frozen ones too)
        "param_groups": [
            [names.get(id(p), "") for p in group] for group in engine.sharding.original_groups()
        ],
    }


def _model_key(bucket: int, local: int) -> str:
    return f"model/bucket{bucket}/slice{local}"


def _optim_key(bucket: int, local: int, state: str) -> str:
    return f"optim/bucket{bucket}/slice{local}/{state}"


def save_sharded(
    engine: HierSlicedEngine, path: str | os.PathLike, meta: dict[str, Any], is_rank_zero: bool
) -> None:
    """Write this rank's slices (a collective over all ranks) and, on rank 0, ``meta.pt``."""
    local = engine.topology.local_rank
    state: dict[str, Any] = {}
    for b, shard in enumerate(engine.sharding.shards):
        state[_model_key(b, local)] = shard.detach()
        for key, value in engine.optimizer.state.get(shard, {}).items():
            state[_optim_key(b, local, key)] = value
    Path(path).mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(path), process_group=engine.topology.world_group)
    if is_rank_zero:
        meta = {**meta, FORMAT_KEY: {"layout": layout_of(engine), "hyper": _group_hyper(engine)}}
        torch.save(meta, Path(path) / META_FILE)


def _group_hyper(engine: HierSlicedEngine) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    return torch.load(Path(path) / META_FILE, map_location="cpu", weights_only=False)


def check_layout(engine: HierSlicedEngine, meta: dict[str, Any], path: str | os.PathLike) -> None:
    saved = meta[FORMAT_KEY]["layout"]
    current = layout_of(engine)
    if saved != current:
        raise ValueError(
            f"the sharded checkpoint {path} was written with another slice layout "
            f"(devices_per_node={saved['devices_per_node']}, {len(saved['buckets'])} buckets) than this "
            f"run's (devices_per_node={current['devices_per_node']}, {len(current['buckets'])} buckets). "
            "Resume with the same "
            "devices_per_node, slice_weights and bucket_cap_mb, or convert it first with "
            "lightning_hier.consolidate_sharded_checkpoint()."
        )


@torch.no_grad()
def load_sharded_params(engine: HierSlicedEngine, path: str | os.PathLike) -> None:
    """Read only this rank's parameter slices, then stitch full parameters by intra-node all-gather."""
    local = engine.topology.local_rank
    targets = {_model_key(b, local): shard.detach() for b, shard in enumerate(engine.sharding.shards)}
    state = dict(targets)
    dcp.load(state, checkpoint_id=str(path), process_group=engine.topology.world_group)  # in place
    for key, target in targets.items():
        if state[key] is not target:  # only if DCP handed back a new tensor instead
            target.copy_(state[key])
    engine.gather_params()


def load_sharded_optimizer(engine: HierSlicedEngine, path: str | os.PathLike, meta: dict[str, Any]) -> None:
    """Read only this rank's optimizer-state slices into the sharded optimizer."""
    local = engine.topology.local_rank
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state: dict[str, Any] = {}
    for b, shard in enumerate(engine.sharding.shards):
        prefix = f"optim/bucket{b}/slice{local}/"
        for key, item in metadata.items():
            if key.startswith(prefix):
                if isinstance(item, TensorStorageMetadata):
                    state[key] = torch.empty(item.size, dtype=item.properties.dtype, device=shard.device)
                else:
                    state[key] = None  # a pickled object; DCP puts the loaded value here
    # every rank loads, even one with no optimizer state for its slices: DCP's load is a collective
    dcp.load(state, checkpoint_id=str(path), process_group=engine.topology.world_group)
    engine.optimizer.state.clear()
    for b, shard in enumerate(engine.sharding.shards):
        prefix = f"optim/bucket{b}/slice{local}/"
        entries = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
        if entries:
            engine.optimizer.state[shard] = entries
    for group, hyper in zip(engine.optimizer.param_groups, meta[FORMAT_KEY]["hyper"]):
        group.update(hyper)


def consolidate_sharded_checkpoint(
    path: str | os.PathLike, output: str | os.PathLike | None = None
) -> dict[str, Any]:
    """Turn a sharded checkpoint directory into an ordinary Lightning checkpoint (one process).

    The result holds the full ``state_dict`` under the LightningModule's own names and the
    optimizer state in the unsharded optimizer's ``state_dict`` layout. It is saved to
    ``output`` when given, and returned.
    """
    meta = load_meta(path)
    layout = meta[FORMAT_KEY]["layout"]
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    slices: dict[str, Any] = {}
    for key, item in metadata.items():
        if isinstance(item, TensorStorageMetadata):
            slices[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            slices[key] = None
    dcp.load(slices, checkpoint_id=str(path), no_dist=True)

    state_dict = dict(meta.get("state_dict", {}))
    names_in_order = [name for group in layout["param_groups"] for name in group]
    index_of = {name: i for i, name in enumerate(names_in_order)}
    optim_state: dict[int, dict[str, Any]] = {}
    for b, bucket in enumerate(layout["buckets"]):
        flat = torch.cat([slices[_model_key(b, k)] for k in range(len(bucket["bounds"]))])
        state_keys = sorted(
            {key.rsplit("/", 1)[1] for key in slices if key.startswith(f"optim/bucket{b}/slice0/")}
        )
        flat_state = {}
        for state_key in state_keys:
            parts = [slices[_optim_key(b, k, state_key)] for k in range(len(bucket["bounds"]))]
            elementwise = torch.is_tensor(parts[0]) and parts[0].dim() == 1 and state_key != "step"
            flat_state[state_key] = torch.cat(parts) if elementwise else parts[0]
        for name, offset, shape in zip(bucket["names"], bucket["offsets"], bucket["shapes"]):
            numel = int(torch.Size(shape).numel())
            state_dict[name] = flat[offset : offset + numel].view(shape).clone()
            entry = optim_state.setdefault(index_of[name], {})
            for state_key, value in flat_state.items():
                if torch.is_tensor(value) and value.dim() == 1 and state_key != "step":
                    entry[state_key] = value[offset : offset + numel].view(shape).clone()
                else:
                    entry[state_key] = value.clone() if torch.is_tensor(value) else value
    groups, start = [], 0
    for hyper, names in zip(meta[FORMAT_KEY]["hyper"], layout["param_groups"]):
        groups.append({**hyper, "params": list(range(start, start + len(names)))})
        start += len(names)
    checkpoint = {k: v for k, v in meta.items() if k not in (FORMAT_KEY, "optimizer_states")}
    checkpoint["state_dict"] = state_dict
    checkpoint["optimizer_states"] = [{"state": optim_state, "param_groups": groups}]
    if output is not None:
        torch.save(checkpoint, output)
    return checkpoint
