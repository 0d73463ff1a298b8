"""Parameters a fit unfreezes or adds to its optimizer (Lightning's ``BaseFinetuning``) are taken in by
``hier_sliced`` and ``hier_bsp`` and trained to ``ddp``'s values; optimizers these strategies cannot shard
(one parameter in two optimizers, torch's ``ZeroRedundancyOptimizer``) are refused at setup, naming the
alternative."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import free_port, run_torchrun
from scripts.finetuning_checks import SCENARIOS
from scripts.models import loader
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_hier import HierBSPStrategy, HierSlicedEngine, HierSlicedStrategy, Topology
from lightning_hier.audit import AUDIT_DIR_ENV, EMULATED_NCCL, analyze
from lightning_hier.topology import DEVICE_BACKEND_ENV

TRAINER = dict(
    accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
    enable_model_summary=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("finetuning") / "results.json"
    run_torchrun("finetuning_checks.py", 2, str(out), timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_backbone_finetuning_trains_to_ddps_parameters(results: dict, scenario: str) -> None:
    """``BackboneFinetuning`` unfreezes the backbone at epoch 1 (a param group of its own with a tenth of the
    head's lr, raised every epoch; or, ``in_group``, already in the optimizer's group): after 3 epochs on 2
    processes the parameters are ``ddp``'s, and the backbone really trained (the callback is not refused at
    setup)."""
    result = results[scenario]
    assert "error" not in result, result
    assert result["backbone_moved"] > 1e-3, result
    assert result["ranks_differ"] == 0.0, result
    if scenario == "hier_bsp_free_adam":  # off lockstep a worker steps on stale models: not ddp's numbers
        return
    assert result["reference_moved"] > 1e-3, result
    assert result["max_rel_diff"] < 1e-5, result


@pytest.mark.parametrize(
    ("scenario", "thread"),
    [("hier_sliced_adam_1x2", None), ("hier_bsp_lockstep_adam", "hier-bsp-rank")],
    ids=["hier_sliced", "hier_bsp"],
)
def test_taking_parameters_in_is_legal_under_nccl_and_issued_in_one_order(
    tmp_path: Path, scenario: str, thread: str | None
) -> None:
    """The fine-tuning fit with its groups built as on CUDA (an emulated NCCL that refuses CPU tensors) and
    every collective recorded: the consolidation and new layout at the unfreezing, like every other
    collective, legal under NCCL and issued in one order on both ranks (tests/test_device_rule.py)."""
    audit_dir = tmp_path / "audit"
    env = {DEVICE_BACKEND_ENV: EMULATED_NCCL, AUDIT_DIR_ENV: str(audit_dir)}
    run_torchrun(
        "finetuning_checks.py", 2, str(tmp_path / "out.json"), scenario, "audit", env=env, timeout=300
    )
    report = analyze(audit_dir, require_main_thread=thread is None)
    assert sorted(report.records) == [0, 1]
    report.raise_if_problems()
    beside = {r["thread"] for rs in report.records.values() for r in rs if not r["main_thread"]}
    assert all(name.startswith(thread) for name in beside) if thread else not beside, beside


def _engine_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, engine: HierSlicedEngine, x: torch.Tensor
) -> None:
    model(x).square().mean().backward()
    engine.finish_backward()
    optimizer.step()
    engine.after_step()


def _reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def test_the_engine_takes_in_an_added_group_and_unfrozen_parameters_as_torch_steps_them() -> None:
    """Without Lightning: a frozen layer in the optimizer's group unfrozen, and another added as a param group
    of its own lr mid-training (its lr changed later), give torch's Adam on the whole model: parameters,
    step counts per parameter (the newly trained start at 1) and the unsharded state dict."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
        reference = copy.deepcopy(model)
        engines, optimizers = [], []
        for net in (model, reference):
            net[0].requires_grad_(False)
            net[2].requires_grad_(False)
            optimizers.append(torch.optim.Adam([*net[2].parameters(), *net[4].parameters()], lr=1e-2))
        optimizer, reference_optimizer = optimizers
        engine = HierSlicedEngine(model, optimizer, Topology(1, 0, 1).build_groups(), bucket_cap_mb=1e-4)
        engines.append(engine)
        inputs = torch.randn(7, 3, 4)
        for x in inputs[:2]:
            _engine_step(model, optimizer, engine, x)
            _reference_step(reference, reference_optimizer, x)
        assert not engine.take_in_new_parameters()  # nothing new yet
        for net, opt in ((model, optimizer), (reference, reference_optimizer)):
            net[2].requires_grad_(True)
            net[0].requires_grad_(True)
            opt.add_param_group({"params": list(net[0].parameters()), "lr": 3e-3})
        assert engine.take_in_new_parameters()
        for step, x in enumerate(inputs[2:]):
            if step == 2:
                optimizer.param_groups[1]["lr"] = reference_optimizer.param_groups[1]["lr"] = 5e-3
            _engine_step(model, optimizer, engine, x)
            _reference_step(reference, reference_optimizer, x)
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
        state, expected = engine.optimizer_state_dict(), reference_optimizer.state_dict()
        assert [g["params"] for g in state["param_groups"]] == [g["params"] for g in expected["param_groups"]]
        assert [g["lr"] for g in state["param_groups"]] == [1e-2, 5e-3]
        steps = {index: float(entry["step"]) for index, entry in state["state"].items()}
        assert steps == {index: float(entry["step"]) for index, entry in expected["state"].items()}
        assert sorted(set(steps.values())) == [5.0, 7.0]  # the unfrozen ones count their own steps
        for index, entry in expected["state"].items():
            torch.testing.assert_close(
                state["state"][index]["exp_avg"], entry["exp_avg"], rtol=1e-6, atol=1e-8
            )
    finally:
        for engine in engines:
            engine.close()
        dist.destroy_process_group()


class TwoOptimizers(pl.LightningModule):
    """A GAN-like module whose two optimizers both hold ``shared``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.shared = nn.Linear(16, 16)
        self.first, self.second = nn.Linear(16, 4), nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, _ = batch
        for optimizer, head in zip(self.optimizers(), (self.first, self.second)):
            optimizer.zero_grad()
            self.manual_backward(head(self.shared(x)).square().mean())
            optimizer.step()

    def configure_optimizers(self):  # noqa: ANN201
        return (
            torch.optim.SGD([*self.shared.parameters(), *self.first.parameters()], lr=0.1),
            torch.optim.SGD([*self.shared.parameters(), *self.second.parameters()], lr=0.1),
        )


def test_two_optimizers_sharing_a_parameter_are_refused_at_setup_naming_it_and_the_alternatives(
    tmp_path: Path,
) -> None:
    """``ddp`` steps such a parameter with both optimizers; ``hier_sliced`` lays each optimizer's parameters
    into buckets of its own, so it refuses before building any group, naming the parameter, what to do
    instead (one optimizer, with a param group of its own) and ``ddp``."""
    trainer = pl.Trainer(strategy=HierSlicedStrategy(), default_root_dir=tmp_path, **TRAINER)
    try:
        with pytest.raises(
            ValueError, match=r"both hold parameter 'shared.weight'.*param group.*strategy='ddp'"
        ):
            trainer.fit(TwoOptimizers(), train_dataloaders=loader())
        assert trainer.strategy.topology.intra_group is None  # no group built, no collective issued
        assert trainer.global_step == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WithZero(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)


@pytest.mark.parametrize("strategy", [HierSlicedStrategy, HierBSPStrategy], ids=lambda s: s.__name__)
def test_zero_redundancy_optimizer_is_refused_at_setup_naming_the_optimizer_to_use(
    tmp_path: Path, strategy: type
) -> None:
    """``hier_sliced`` shards the optimizer state itself (and ``hier_bsp``'s server does), so torch's
    ``ZeroRedundancyOptimizer`` is refused before any step (under ``hier_sliced`` it would train and fail at
    the first checkpoint with torch's own error)."""
    trainer = pl.Trainer(strategy=strategy(), default_root_dir=tmp_path, **TRAINER)
    try:
        with pytest.raises(
            ValueError, match=r"ZeroRedundancyOptimizer shards .* torch\.optim\.AdamW\(params"
        ):
            trainer.fit(WithZero(), train_dataloaders=loader())
        assert trainer.global_step == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
