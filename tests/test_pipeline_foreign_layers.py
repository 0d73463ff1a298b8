"""A step that calls, outside ``self(...)``, a layer another pipeline stage holds gets the reason and the fix.

Before 2026-11-28 Lightning's ``LitAutoEncoder`` (a ``training_step`` running ``self.encoder`` and
``self.decoder`` itself) failed under hier_pipeline inside torch with ``mat2 must be a matrix, got 1-D
tensor`` on one stage.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import run_torchrun
from torch import nn

from lightning_hier.pipeline.foreign_layers import ForeignLayerGuard, LayerHeldElsewhereError
from lightning_hier.pipeline.migration import named_state, release_state


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        self.norm = nn.BatchNorm1d(2)
        self.scale = nn.Parameter(torch.ones(2))  # the root's own: self(...) is never refused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.encoder(x)) * self.scale


def test_only_modules_whose_state_this_stage_released_refuse_calls() -> None:
    net = Net()
    foreign = [name for name in named_state(net) if name.startswith(("encoder.2", "norm.", "scale"))]
    release_state(net, foreign, [])
    guard = ForeignLayerGuard(net, stage=0, num_stages=2)
    guard.refresh(foreign)
    assert guard.guarded == ["encoder.2", "norm"]  # not the ReLU (no state), not the root
    net.encoder[0](torch.randn(3, 4))  # held here: runs
    with pytest.raises(LayerHeldElsewhereError, match=r"`encoder\.2` \(Linear\) was called outside"):
        net.encoder(torch.randn(3, 4))
    with pytest.raises(LayerHeldElsewhereError, match=r"`norm` \(BatchNorm1d\).*stage 0 of 2.*stage 1\)"):
        net.norm(torch.randn(3, 2))
    guard.clear()  # the whole model back on this rank: nothing refused
    assert guard.guarded == [] and not any(module._forward_pre_hooks for module in net.modules())


def test_a_module_holding_only_part_of_its_state_elsewhere_is_left_alone() -> None:
    net = Net()
    guard = ForeignLayerGuard(net, stage=1, num_stages=2)
    guard.refresh(["norm.weight", "norm.bias"])  # its running statistics still here
    assert guard.guarded == []


def test_lightnings_autoencoder_calling_its_layers_itself_is_refused_with_the_fix() -> None:
    with pytest.raises(AssertionError) as failed:
        run_torchrun("pipeline_direct_calls.py", 2, timeout=180)
    output = str(failed.value)
    assert "did not finish" not in output  # the stage waiting for the failed one ended as well
    named = r"LayerHeldElsewhereError: hier_pipeline: `(en|de)coder\.\d` \(Linear\) was called"
    assert re.search(named, output)
    assert "needs a `forward` returning `self.decoder(self.encoder(x))`" in output
    assert "mat2 must be a matrix" not in output
