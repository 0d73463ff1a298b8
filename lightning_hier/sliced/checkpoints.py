"""What a ``hier_sliced`` checkpoint holds, and how it is written and read back.

Two formats (``checkpoint_format``):

- ``"consolidated"`` (default): one ordinary checkpoint file written by global rank 0 through the
  trainer's ``CheckpointIO``. ``state_dict`` holds plain tensors under the module's own names and
  ``optimizer_states`` the unsharded optimizer's layout (gathered from the slices), so it loads into
  a bare LightningModule and resumes under any topology or under ``ddp``.
- ``"sharded"``: a directory where each rank writes, and on resume reads, only its own parameter and
  optimizer slices (:mod:`.sharded_checkpoint`, ``torch.distributed.checkpoint``).

Either way the checkpoint also records the engine's time plan (``checkpoint["hier_sliced"]``), so a
resumed run keeps its buckets without profiling again. The Lightning strategy only forwards its
checkpoint calls here; writing or reading a whole file stays with Lightning (passed in as callables).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_hier.sliced.engine import HierSlicedEngine
from lightning_hier.sliced.sharded_checkpoint import (
    META_FILE,
    check_layout,
    consolidate_sharded_checkpoint,
    is_sharded_checkpoint,
    load_meta,
    load_sharded_optimizer,
    load_sharded_params,
    save_sharded,
)

CHECKPOINT_FORMATS = ("consolidated", "sharded")
PLAN_KEY = "hier_sliced"
LOADED_FROM = "_hier_sliced_loaded_from"  # set on what read() returns for a sharded directory

PathLike = str | os.PathLike


def validate_checkpoint_format(checkpoint_format: str) -> None:
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format={checkpoint_format!r} is not one of {list(CHECKPOINT_FORMATS)}.")


def _checkpoint_problem(checkpoint: Any) -> str | None:
    """What keeps ``checkpoint`` from being restored here (``None``: nothing): the parts the strategy reads
    are checked when the file is read, where the error can name it."""
    if not isinstance(checkpoint, dict):
        return f"holds a {type(checkpoint).__name__}, not a checkpoint dict"
    if not isinstance(checkpoint.get("state_dict"), dict):
        return "has no state_dict"
    states = checkpoint.get("optimizer_states", [])
    entries = states.values() if isinstance(states, dict) else states
    if not isinstance(states, (list, dict)) or not all(
        isinstance(e, dict)
        and (not e or isinstance(e.get("state"), dict) and isinstance(e.get("param_groups"), list))
        for e in entries  # {}: the state of Lightning's no-op optimizer (configure_optimizers gave none)
    ):
        return "holds an optimizer state without its 'state' and 'param_groups'"
    return None


class SlicedCheckpoints:
    """Checkpoint layout of a ``hier_sliced`` run in ``checkpoint_format`` (see the module docstring).

    ``engine`` is ``None`` outside fitting (validate/test/predict): then there are no slices and
    everything is read and written whole.
    """

    def __init__(self, checkpoint_format: str) -> None:
        validate_checkpoint_format(checkpoint_format)
        self.checkpoint_format = checkpoint_format

    def writes_sharded(self, engine: HierSlicedEngine | None) -> bool:
        return self.checkpoint_format == "sharded" and engine is not None

    # ------------------------------------------------------------------ save
    def optimizer_state(self, engine: HierSlicedEngine) -> dict[str, Any]:
        """The optimizer's entry of the checkpoint: the unsharded layout, or a placeholder when sharded
        (the slices then go to the DCP files)."""
        return {} if self.writes_sharded(engine) else engine.optimizer_state_dict()

    def module_state(self, engine: HierSlicedEngine | None, state: dict[str, Any]) -> dict[str, Any]:
        """Plain tensors (not views into the flat buckets), loadable into the bare module. When sharded,
        only what the slices do not cover (buffers, frozen parameters, second names of tied ones)."""
        if self.writes_sharded(engine):
            assert engine is not None
            sliced = set(engine.param_names)
            state = {k: v for k, v in state.items() if k not in sliced}
        return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}

    def save(
        self,
        engine: HierSlicedEngine | None,
        checkpoint: dict[str, Any],
        filepath: PathLike,
        is_global_zero: bool,
        write_file: Callable[[dict[str, Any]], None],
    ) -> None:
        """Record the time plan, then write: ``write_file(checkpoint)`` (consolidated) or every rank's
        slices plus rank 0's ``meta.pt`` (sharded; a collective over all ranks)."""
        plan_state = engine.checkpoint_state() if engine is not None else None
        if plan_state is not None:
            checkpoint[PLAN_KEY] = plan_state
        if not self.writes_sharded(engine):
            write_file(checkpoint)
            return
        assert engine is not None
        save_sharded(engine, filepath, checkpoint, is_global_zero)

    @staticmethod
    def remove(filepath: PathLike, is_global_zero: bool, remove_file: Callable[[PathLike], None]) -> None:
        """Delete a checkpoint of either format (a sharded one is a directory)."""
        if is_global_zero and Path(filepath).is_dir():
            shutil.rmtree(filepath)
        else:
            remove_file(filepath)

    # ------------------------------------------------------------------ load
    @staticmethod
    def loads_before_setup(path: PathLike, module: nn.Module) -> bool:
        """Whether the module in ``path`` loads into the plain module before the engines exist: a
        consolidated file does; a sharded directory needs the slices, and node-shared embedding tables
        their shared memory, which the strategy's setup creates."""
        from lightning_hier.sparse.checkpoint import find_hybrid_embeddings

        return not is_sharded_checkpoint(path) and not find_hybrid_embeddings(module)

    @staticmethod
    def read(
        path: PathLike, read_file: Callable[[PathLike], dict[str, Any]], weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint at ``path``: a sharded directory's ``meta.pt`` (slices are read later, in
        place; plain data, so loaded with ``weights_only`` unless it is ``False``), or ``read_file(path)``.
        A file that cannot be read raises naming it."""
        if is_sharded_checkpoint(path):
            meta = load_meta(path, weights_only=weights_only is not False)
            meta[LOADED_FROM] = str(path)
            return meta
        if Path(path).is_dir():
            raise ValueError(
                f"the checkpoint {path} is a directory without {META_FILE}: not a sharded hier_sliced "
                "checkpoint (another strategy's sharded format?). Convert it to one checkpoint file first."
            )
        try:
            checkpoint = read_file(path)
        except FileNotFoundError:
            raise
        except Exception as err:  # torch.load's errors on a damaged file name neither the file nor the cause
            raise RuntimeError(
                f"cannot read the checkpoint {path} (damaged, or no checkpoint): {type(err).__name__}: {err}"
            ) from err
        problem = _checkpoint_problem(checkpoint)
        if problem is not None:
            raise ValueError(f"the checkpoint {path} {problem} (damaged, or not a Lightning checkpoint).")
        return checkpoint

    @staticmethod
    def restore_model(
        engine: HierSlicedEngine | None,
        module: nn.Module,
        checkpoint: dict[str, Any],
        strict: bool,
        load_whole: Callable[[dict[str, Any], bool], None],
    ) -> None:
        """Load the model (and the saved time plan, when it fits) from what :meth:`read` returned."""
        if engine is not None:
            engine.load_checkpoint_state(checkpoint.get(PLAN_KEY))
        path = checkpoint.get(LOADED_FROM)
        if path is None:
            load_whole(checkpoint, strict)
        elif engine is None:  # validate/test/predict: no slices here, read the whole model
            module.load_state_dict(consolidate_sharded_checkpoint(path)["state_dict"], strict=strict)
        else:
            check_layout(engine, checkpoint, path)
            module.load_state_dict(checkpoint["state_dict"], strict=False)
            load_sharded_params(engine, path)

    @staticmethod
    def restore_optimizers(engines: Sequence[HierSlicedEngine], checkpoint: dict[str, Any]) -> None:
        """Load each optimizer's state into its sharded optimizer: this rank's slices only."""
        if LOADED_FROM in checkpoint:
            load_sharded_optimizer(engines[0], checkpoint[LOADED_FROM], checkpoint)  # one optimizer
            return
        states = checkpoint["optimizer_states"]
        if len(states) == 0:
            return  # none saved (an empty list or dict): nothing to load, as Lightning's own loader does
        if len(states) != len(engines):
            raise ValueError(
                f"the checkpoint holds {len(states)} optimizer state(s); this run has {len(engines)} "
                "optimizer(s)."
            )
        for engine, state in zip(engines, states):
            engine.load_optimizer_state_dict(state)
