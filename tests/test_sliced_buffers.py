"""hier_sliced's buffers (BatchNorm running statistics) against Lightning's ``ddp``: rank 0's are broadcast
at the forwards where DDP broadcasts them (the first of a fit, and the one after a forward whose backward
synchronised the gradients), so every rank's statistics, parameters and validation losses match ddp's."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import run_torchrun


def test_buffers_follow_ddp_with_accumulation_and_validation(tmp_path: Path) -> None:
    """After every batch of 2 epochs (7 batches each, accumulating over 2, validation after each epoch's 3rd
    and 6th), every rank's parameters and buffers, and each rank's own validation losses, are ddp's."""
    run_torchrun("sliced_buffers.py", 2, str(tmp_path), timeout=600)
    runs = {
        (name, rank): torch.load(tmp_path / f"{name}_rank{rank}.pt")
        for name in ("ddp", "hier_sliced")
        for rank in range(2)
    }
    # the ranks' statistics part between broadcasts (each reads its own shard): what the test can tell apart
    ddp_means = [[s["norm.running_mean"] for s in runs["ddp", rank]["states"]] for rank in range(2)]
    assert not torch.allclose(ddp_means[0][1], ddp_means[1][1])
    for rank in range(2):
        ddp, sliced = runs["ddp", rank], runs["hier_sliced", rank]
        assert len(ddp["states"]) == len(sliced["states"]) == 14
        for batch, (expected, got) in enumerate(zip(ddp["states"], sliced["states"])):
            assert expected.keys() == got.keys()
            for key in expected:
                torch.testing.assert_close(
                    got[key], expected[key], rtol=0, atol=1e-9, msg=f"rank {rank}, batch {batch}, {key}"
                )
        # the sanity check and 4 validations while fitting, 2 batches each
        assert len(ddp["val_losses"]) == len(sliced["val_losses"]) == 10
        torch.testing.assert_close(
            torch.stack(sliced["val_losses"]), torch.stack(ddp["val_losses"]), rtol=0, atol=1e-9
        )
