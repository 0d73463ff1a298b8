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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_hier.partial_saves import replace_directory
from lightning_hier.sliced.engine import HierSlicedEngine

META_FILE = "meta.pt"
PARTIAL_SUFFIX = ".partial"  # a sharded save in progress (or cut short): never read as a checkpoint
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
    """Write this rank's slices (a collective over all ranks) and, on rank 0, ``meta.pt``.

    Everything goes to ``<path>.partial`` first, which rank 0 renames to ``path`` once complete: a save
    cut short (a rank killed mid-write) leaves no directory named as a checkpoint, and a previous one at
    ``path`` (``last.ckpt``) whole rather than partly overwritten. A later save to ``path`` reuses and
    renames a partial directory left so."""
    final = Path(path)
    # not <name>.partial-<pid> removed once its process is dead (checkpoint files and tables, written by one
    # process): every rank writes here, on every node, so no one pid tells whether the save still runs, and
    # all ranks must agree on the name without exchanging it; removing it first would need a barrier before
    # DCP's writes. Reusing it is safe: it becomes a checkpoint only by rank 0's rename, after this save's
    # slices, DCP's metadata (which names the files read) and meta.pt are written
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    local = engine.topology.local_rank
    state: dict[str, Any] = {}
    for b, shard in enumerate(engine.sharding.shards):
        state[_model_key(b, local)] = shard.detach()
        for key, value in engine.optimizer.state.get(shard, {}).items():
            state[_optim_key(b, local, key)] = value
    partial.mkdir(parents=True, exist_ok=True)
    # returns on every rank once the coordinator has written DCP's metadata: every slice is on disk
    dcp.save(state, checkpoint_id=str(partial), process_group=engine.topology.world_group)
    if is_rank_zero:
        meta = {**meta, FORMAT_KEY: {"layout": layout_of(engine), "hyper": _group_hyper(engine)}}
        torch.save(meta, partial / META_FILE)
        replace_directory(partial, final)


def _group_hyper(engine: HierSlicedEngine) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint directory that cannot be read: damaged, incomplete, or not one at all."""


@contextmanager
def _reading(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Any failure to read ``what`` of the checkpoint at ``path`` as a :class:`ShardedCheckpointError`
    naming both. DCP reports a failed read as a ``CheckpointException``, a ``BaseException`` that an
    ``except Exception`` would let through; every rank of a collective read raises it alike (DCP gathers the
    failures; run on one CPU process only, not on several ranks or over NCCL: docs/gpu.md)."""
    try:
        yield
    except ShardedCheckpointError:
        raise
    except (Exception, CheckpointException) as err:
        if isinstance(err, CheckpointException) and err.failures:
            err = next(iter(err.failures.values()))[0]  # the first rank's own exception
        text = str(err).strip()
        cause = type(err).__name__ + (f": {text.splitlines()[0][:300]}" if text else "")
        raise ShardedCheckpointError(
            f"cannot read the sharded checkpoint {path} ({what}), damaged or incomplete ({cause}); resume "
            "from another checkpoint."
        ) from err


def load_meta(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """The checkpoint's ``meta.pt`` (plain data: loaded with ``weights_only`` unless told otherwise), after
    checking that it describes a slice layout this package wrote."""
    if not (Path(path) / META_FILE).is_file():
        raise ShardedCheckpointError(
            f"{path} is not a sharded hier_sliced checkpoint: it has no {META_FILE} (a consolidated "
            "checkpoint is one file and loads as it is)."
        )
    with _reading(path, META_FILE):
        meta = torch.load(Path(path) / META_FILE, map_location="cpu", weights_only=weights_only)
    problem = _meta_problem(meta)
    if problem is not None:
        raise ShardedCheckpointError(f"the sharded checkpoint {path}: {META_FILE} {problem}.")
    return meta


def _plain_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _meta_problem(meta: Any) -> str | None:
    """What makes ``meta`` no ``meta.pt`` of this format (``None``: nothing)."""
    if not isinstance(meta, dict):
        return f"holds a {type(meta).__name__}, not a checkpoint dict"
    if not isinstance(meta.get("state_dict"), dict):
        return "has no state_dict (buffers and what the slices do not hold)"
    entry = meta.get(FORMAT_KEY)
    if entry is None:
        return f"has no {FORMAT_KEY!r} entry: another strategy or tool wrote it"
    if not isinstance(entry, dict) or not isinstance(entry.get("layout"), dict):
        return f"has a {FORMAT_KEY!r} entry without its layout and optimizer settings"
    if not isinstance(entry.get("hyper"), list):
        return f"has a {FORMAT_KEY!r} entry without its layout and optimizer settings"
    layout = entry["layout"]
    local = layout.get("devices_per_node")
    if not _plain_int(local) or local < 1:
        return f"records devices_per_node={local!r}"
    groups, buckets = layout.get("param_groups"), layout.get("buckets")
    if not isinstance(groups, list) or not all(
        isinstance(group, list) and all(isinstance(n, str) for n in group) for group in groups
    ):
        return "records no list of parameter names per optimizer group"
    if len(entry["hyper"]) != len(groups) or not all(isinstance(h, dict) for h in entry["hyper"]):
        return f"records the settings of {len(entry['hyper'])} optimizer group(s) for {len(groups)}"
    if not isinstance(buckets, list):
        return "records no list of buckets"
    names = {name for group in groups for name in group}
    for b, bucket in enumerate(buckets):
        problem = _bucket_problem(bucket, local, names)
        if problem is not None:
            return f"records a bucket {b} that {problem}"
    return None


def _bucket_problem(bucket: Any, local: int, names: set[str]) -> str | None:
    keys = ("names", "offsets", "shapes", "bounds", "padded_numel")
    if not isinstance(bucket, dict) or any(not isinstance(bucket.get(k), list) for k in keys[:4]):
        return f"lacks one of {list(keys)}"
    padded, bounds = bucket.get("padded_numel"), bucket["bounds"]
    if not _plain_int(padded) or padded < 0:
        return f"has padded_numel={padded!r}"
    edges = [0]
    for bound in bounds:
        if not (isinstance(bound, list) and len(bound) == 2 and all(map(_plain_int, bound))):
            return f"has a slice bound {bound!r}"
        if bound[0] != edges[-1] or bound[1] < bound[0]:
            return f"has slices {bounds} that do not tile it"
        edges.append(bound[1])
    if len(bounds) != local or edges[-1] != padded:
        return f"has {len(bounds)} slice(s) of {edges[-1]} elements, not {local} of {padded}"
    if not len(bucket["names"]) == len(bucket["offsets"]) == len(bucket["shapes"]):
        return "lists different numbers of names, offsets and shapes"
    for name, offset, shape in zip(bucket["names"], bucket["offsets"], bucket["shapes"]):
        if name not in names:
            return f"holds {name!r}, in no optimizer group"
        if not (isinstance(shape, list) and all(_plain_int(d) and d >= 0 for d in shape)):
            return f"gives {name!r} the shape {shape!r}"
        if not _plain_int(offset) or not 0 <= offset <= offset + torch.Size(shape).numel() <= padded:
            return f"places {name!r} at offset {offset!r}, outside its {padded} elements"
    return None


def _slice_numel(bounds: list[list[int]], local: int) -> int:
    return bounds[local][1] - bounds[local][0]


def check_slices(path: str | os.PathLike, layout: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Every slice ``layout`` names is in the DCP files with its size, and so is its optimizer state (a
    checkpoint from another topology, or one whose files were lost, is refused here: before any rank reads
    a slice, so that all ranks refuse alike)."""
    for b, bucket in enumerate(layout["buckets"]):
        for k in range(len(bucket["bounds"])):
            numel = _slice_numel(bucket["bounds"], k)
            item = metadata.get(_model_key(b, k))
            if not isinstance(item, TensorStorageMetadata) or tuple(item.size) != (numel,):
                found = "nothing" if item is None else f"size {tuple(getattr(item, 'size', ()))}"
                raise ShardedCheckpointError(
                    f"the sharded checkpoint {path} lacks slice {k} of bucket {b} ({numel} elements; found "
                    f"{found}): its files are incomplete or from another layout than its {META_FILE} says."
                )
            prefix = f"optim/bucket{b}/slice{k}/"
            for key, item in metadata.items():
                sliced = key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
                if sliced and len(item.size) == 1 and not key.endswith("/step") and item.size[0] != numel:
                    raise ShardedCheckpointError(
                        f"the sharded checkpoint {path}: optimizer state {key} has {item.size[0]} elements "
                        f"for a slice of {numel}."
                    )


def read_slice_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The DCP metadata of the directory: what each key holds and its size."""
    with _reading(path, "DCP metadata"):
        return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def check_layout(engine: HierSlicedEngine, meta: dict[str, Any], path: str | os.PathLike) -> None:
    """Refuse a checkpoint whose slices this run cannot load in place (every rank decides alike)."""
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
    check_slices(path, saved, read_slice_metadata(path))


@torch.no_grad()
def load_sharded_params(engine: HierSlicedEngine, path: str | os.PathLike) -> None:
    """Read only this rank's parameter slices, then stitch full parameters by intra-node all-gather."""
    local = engine.topology.local_rank
    targets = {_model_key(b, local): shard.detach() for b, shard in enumerate(engine.sharding.shards)}
    state = dict(targets)
    with _reading(path, "parameter slices"):
        dcp.load(state, checkpoint_id=str(path), process_group=engine.topology.world_group)  # in place
    for key, target in targets.items():
        if state[key] is not target:  # only if DCP handed back a new tensor instead
            target.copy_(state[key])
    engine.gather_params()


def load_sharded_optimizer(engine: HierSlicedEngine, path: str | os.PathLike, meta: dict[str, Any]) -> None:
    """Read only this rank's optimizer-state slices into the sharded optimizer."""
    local = engine.topology.local_rank
    metadata = read_slice_metadata(path)
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
    with _reading(path, "optimizer slices"):
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
    metadata = read_slice_metadata(path)
    check_slices(path, layout, metadata)
    slices: dict[str, Any] = {}
    for key, item in metadata.items():
        if isinstance(item, TensorStorageMetadata):
            slices[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            slices[key] = None
    with _reading(path, "slices"):
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
