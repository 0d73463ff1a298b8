"""Run under torchrun (4 processes): what ``param.grad`` holds in Lightning's gradient hooks.

Under ``ddp`` the hooks ``on_after_backward`` and ``on_before_optimizer_step`` see the averaged
gradient (Lightning's ``grad_norm`` idiom relies on it). ``hier_sliced`` with
``_full_gradients_in_hooks=True`` must show the same, and so must the default (``"auto"``), since a callback
here overrides those hooks; with ``False``, each rank's own gradient.
Rank 0 writes the largest relative difference to ddp per run and hook to argv[1].
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.utilities import grad_norm  # noqa: E402
from models import EquivModel, loader, tuned  # noqa: E402

from lightning_hier import HierSlicedStrategy  # noqa: E402


class GradSnapshot(pl.Callback):
    def __init__(self) -> None:
        self.seen: dict[str, dict[str, torch.Tensor]] = {}

    def _take(self, hook: str, module: pl.LightningModule) -> None:
        if hook not in self.seen:  # the first step only
            self.seen[hook] = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
            self.seen[hook + "/norm"] = {k: v.detach().clone() for k, v in grad_norm(module, 2).items()}

    def on_after_backward(self, trainer, pl_module):  # noqa: ANN001
        self._take("on_after_backward", pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001
        self._take("on_before_optimizer_step", pl_module)


def run(strategy) -> dict:  # noqa: ANN001
    pl.seed_everything(3, verbose=False)
    snapshot = GradSnapshot()
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[snapshot], use_distributed_sampler=False,
    )  # fmt: skip
    # each rank its own batch (RANK is set by torchrun before the process group exists)
    trainer.fit(EquivModel(optimizer="adam"), loader(batch_size=8, n=64, seed=int(os.environ["RANK"])))
    return snapshot.seen


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-12)).item() for k in b)


def main() -> None:
    out = Path(sys.argv[1])
    reference = run("ddp")
    def strategy() -> HierSlicedStrategy:
        return HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002)

    full = run(tuned(strategy(), _full_gradients_in_hooks=True))
    auto = run(strategy())
    local = run(tuned(strategy(), _full_gradients_in_hooks=False))
    results = {
        f"{name}/{hook}": max_rel(seen[hook], reference[hook])
        for name, seen in (("full", full), ("auto", auto), ("local", local))
        for hook in reference
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))


if __name__ == "__main__":
    main()
