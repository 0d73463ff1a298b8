"""Run under torchrun (2 processes): a Trainer pickles after fit under every strategy of the package.

Lightning's own tests (``test_model_torch_save*``) and users ``torch.save(trainer)`` / ``copy.deepcopy``
a fitted Trainer. Each rank fits ``SpawnNet`` for one epoch under each strategy, pickles the Trainer,
loads it back and records what the copy holds; then saves a checkpoint through the original Trainer
(its engines must be untouched by the pickling). Rank 0 writes ``OUT`` (JSON).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from spawn_launch import SpawnNet  # noqa: E402

from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy  # noqa: E402

STRATEGIES = {
    "hier_sliced": lambda: HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.0005),
    "hier_bsp": lambda: HierBSPStrategy(superstep=1, max_staleness=0),
    "hier_pipeline": lambda: HierPipelineStrategy(),
}


def check(name: str, workdir: Path) -> dict:
    torch.manual_seed(0)
    model = SpawnNet()
    trainer = pl.Trainer(
        strategy=STRATEGIES[name](),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model)
    buffer = io.BytesIO()
    torch.save(trainer, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    trained = trainer.lightning_module.state_dict()
    copied = copy.lightning_module.state_dict()
    # the original Trainer still saves a full checkpoint through its (unpickled) engines
    path = workdir / f"{name}.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    consolidated = saved["state_dict"]
    return {
        "copy_strategy": type(copy.strategy).__name__,
        "copy_engine": getattr(copy.strategy, "engine", "missing"),
        "copy_state_equal": sorted(k for k in trained if k in copied and torch.equal(trained[k], copied[k])),
        "keys": sorted(trained),
        "checkpoint_keys": sorted(consolidated),
        "optimizer_states": len(saved["optimizer_states"]),
        "global_step": [trainer.global_step, copy.global_step],
    }


def main() -> None:
    out = Path(sys.argv[1])
    results = {}
    for name in STRATEGIES:
        results[name] = check(name, out.parent)  # a folder every rank sees
        results[name]["copy_engine"] = results[name]["copy_engine"] is None
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
