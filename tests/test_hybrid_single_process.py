"""HybridEmbedding without hier_sliced on one process: the table steps with the optimizer."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_hier import HybridEmbedding

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hybrid_checks import AllIdsEverywhere, Click  # noqa: E402


def _fit(model: pl.LightningModule, **trainer_kwargs) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(AllIdsEverywhere(0), batch_size=3))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_single_device_trainer_trains_the_table_like_a_dense_embedding(optimizer: str) -> None:
    # 4 optimizer steps of 2 accumulated batches each: the table must step at each optimizer step with
    # the summed gradient, as nn.EmbeddingBag's weight does under the same optimizer.
    pl.seed_everything(0, verbose=False)
    hybrid = Click(hybrid=True, optimizer=optimizer)
    pl.seed_everything(0, verbose=False)
    dense = Click(hybrid=False, optimizer=optimizer)
    torch.testing.assert_close(hybrid.head.weight, dense.head.weight, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="HybridEmbedding")  # e.g. gradients never applied
        _fit(hybrid, accumulate_grad_batches=2)
    _fit(dense, accumulate_grad_batches=2)
    assert not torch.equal(dense.emb.weight.detach(), _initial_table())  # the reference moved
    torch.testing.assert_close(hybrid.emb.weight, dense.emb.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hybrid.head.weight, dense.head.weight, rtol=1e-5, atol=1e-6)
    assert not hybrid.emb._pending


def _initial_table() -> torch.Tensor:
    reference = HybridEmbedding(12, 4, mode="sum", seed=3)
    reference.attach()
    return reference.weight.clone()


def test_plain_torch_loop_steps_the_table_with_any_optimizer_step() -> None:
    torch.manual_seed(0)
    auto = HybridEmbedding(20, 3, optimizer="sgd", lr=0.1, seed=5)
    by_hand = HybridEmbedding(20, 3, optimizer="sgd", lr=0.1, seed=5)
    head_auto, head_hand = nn.Linear(3, 1), nn.Linear(3, 1)
    head_hand.load_state_dict(head_auto.state_dict())
    opt_auto = torch.optim.SGD(head_auto.parameters(), lr=0.1)
    opt_hand = torch.optim.SGD(head_hand.parameters(), lr=0.1)
    for _ in range(3):
        ids = torch.randint(0, 20, (6,))
        target = torch.randn(6, 1)
        opt_auto.zero_grad()
        (head_auto(auto(ids)) - target).pow(2).mean().backward()
        before = auto.weight.clone()
        opt_auto.step()  # the table steps here, with no call to sync_and_update
        assert not torch.equal(auto.weight[ids.unique()], before[ids.unique()])
        opt_hand.zero_grad()
        (head_hand(by_hand(ids)) - target).pow(2).mean().backward()
        by_hand.sync_and_update()
        opt_hand.step()
    torch.testing.assert_close(auto.weight, by_hand.weight, rtol=0, atol=0)


def test_float16_autocast_without_hier_sliced_is_refused() -> None:
    table = HybridEmbedding(10, 4, seed=0)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError, match="bf16-mixed"):
        table(torch.tensor([1, 2]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        table(torch.tensor([1, 2]))  # bf16 carries no loss scale: fine
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        table(torch.tensor([1, 2]))  # inference is fine too
