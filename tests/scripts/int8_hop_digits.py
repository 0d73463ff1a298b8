"""Run under torchrun (4 processes as 2 nodes x 2): the digits example for a few dozen steps under
``hier_sliced`` in full precision and with ``inter_node_dtype="int8"``, each with a CommProfiler; rank 0
writes to argv[1] each run's loss over the whole training set and every rank's inter-node bytes per step
(``[rank][step] -> [bytes, wire_bytes]``). With ``--audit``: only the int8 run, for a few steps over several
buckets (the test sets the environment that records every collective).

Options for measuring the hop's accuracy by hand: ``--optimizer adam`` (Adam at lr 1e-3 instead of the
example's SGD), ``--steps N``, ``--seed S``, ``--block B`` (the codec's block size, in place of
``int8_codec.BLOCK``) and ``--dtype fp8`` (the compressed run's ``inter_node_dtype``, int8 by default),
e.g. ``python -m torch.distributed.run --standalone --nproc_per_node=4 tests/scripts/int8_hop_digits.py
/tmp/out.json --optimizer adam --steps 200 --block 128``."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_hier import CommProfiler, HierSlicedStrategy
from lightning_hier.examples.digits import DigitsClassifier, DigitsDataModule
from lightning_hier.sliced import int8_codec

STEPS = 40


class AdamDigitsClassifier(DigitsClassifier):
    """The example's model under Adam at lr 1e-3, whose per-element normalisation makes the int8 hop's
    rounding of small elements visible in the loss."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def use_block(block: int) -> None:
    """The codec's block size set everywhere it is read: the constant and the defaults bound from it."""
    old = int8_codec.BLOCK
    int8_codec.BLOCK = block
    for fn in (int8_codec.blocks_of, int8_codec.quantize, int8_codec.dequantize, int8_codec.int8_all_reduce):
        fn = inspect.unwrap(fn)  # int8_all_reduce is wrapped by torch.no_grad
        fn.__defaults__ = tuple(block if d is old else d for d in fn.__defaults__)


def _option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def train(
    inter_node_dtype: str | None,
    out_dir: Path,
    audit: bool = False,
    optimizer: str = "sgd",
    steps: int = STEPS,
    seed: int = 0,
) -> dict:
    """One fit; with ``audit`` a short one over several buckets, without the profiler (whose wrappers would
    stand between the audit and the package's calls)."""
    steps, bucket_cap_mb = (4, 0.01) if audit else (steps, 25.0)
    pl.seed_everything(seed, verbose=False)
    data = DigitsDataModule(batch_size=32)
    kind = AdamDigitsClassifier if optimizer == "adam" else DigitsClassifier
    model = kind(hidden=128, lr=0.05, momentum=0.9)
    profiler = CommProfiler(output_dir=str(out_dir), save_figure=False, print_summary=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, max_steps=steps, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=HierSlicedStrategy(
            devices_per_node=2, inter_node_dtype=inter_node_dtype, bucket_cap_mb=bucket_cap_mb
        ),
        callbacks=[] if audit else [profiler], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data)
    x, y = zip(*data.train_set)
    with torch.no_grad():
        loss = float(nn.functional.cross_entropy(model(torch.stack(x)), torch.tensor(y)))
    if audit:
        return {"loss": loss}
    inter = [step.kinds.get("inter") for step in profiler.stats.steps]
    mine = [[k.nbytes, k.wire_bytes] if k is not None else [0, 0] for k in inter]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"loss": loss, "inter_bytes": every}


def main() -> None:
    out_dir = Path(sys.argv[1]).parent
    if "--block" in sys.argv:
        use_block(int(_option("--block", "")))
    if "--audit" in sys.argv:
        results = {"int8": train("int8", out_dir, audit=True)}
    else:
        run = {"optimizer": _option("--optimizer", "sgd"), "steps": int(_option("--steps", str(STEPS)))}
        run["seed"] = int(_option("--seed", "0"))
        dtype = _option("--dtype", "int8")
        results = {"fp32": train(None, out_dir, **run), dtype: train(dtype, out_dir, **run)}
        results["block"] = int8_codec.BLOCK
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
