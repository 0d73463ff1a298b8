"""A step that calls, outside ``self(...)``, a layer another pipeline stage holds gets the reason and the fix;
a call of the child ``forward`` only hands its inputs to runs as ``self(...)``.

Without that, a ``training_step`` running ``self.encoder`` and ``self.decoder`` itself (as Lightning's
``LitAutoEncoder`` does) would fail under hier_pipeline inside torch with ``mat2 must be a matrix, got 1-D
tensor`` on one stage.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import run_torchrun
from torch import nn

from lightning_hier.pipeline.delegation import as_forward, forward_delegate
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


def test_an_autoencoder_calling_its_layers_itself_is_refused_with_the_fix() -> None:
    with pytest.raises(AssertionError) as failed:
        run_torchrun("pipeline_direct_calls.py", 2, timeout=180)
    output = str(failed.value)
    assert "did not finish" not in output  # the stage waiting for the failed one ended as well
    named = r"LayerHeldElsewhereError: hier_pipeline: `(en|de)coder\.\d` \(Linear\) was called"
    assert re.search(named, output)
    assert "needs a `forward` returning `self.decoder(self.encoder(x))`" in output
    assert "mat2 must be a matrix" not in output


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 2)


class Delegates(Wrapper):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Hands x on."""
        return self.model(x)


class DelegatesEverything(Wrapper):
    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self.model(*args, **kwargs)


class DelegatesByKeyword(Wrapper):
    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return self.model(input=input)


class ComputesMore(Wrapper):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) + 1


class Reorders(Wrapper):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(y, x)


class AddsADefault(Wrapper):
    def forward(self, x: torch.Tensor, input: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002
        return self.model(x, input=input)  # Linear's input has no default: self.model(x) would differ


class AssignsThenReturns(Wrapper):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedding = self.model(x)
        return embedding


class ReturnsSomethingElse(Wrapper):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedding = self.model(x)  # noqa: F841 - computed, not returned
        return x


class CallsItself(Wrapper):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


@pytest.mark.parametrize(
    ("cls", "delegate"),
    [
        (Delegates, "model"),
        (AssignsThenReturns, "model"),
        (ReturnsSomethingElse, None),
        (DelegatesEverything, "model"),
        (DelegatesByKeyword, "model"),
        (ComputesMore, None),
        (Reorders, None),
        (AddsADefault, None),
        (CallsItself, None),
    ],
)
def test_a_forward_that_only_hands_its_inputs_to_a_child_is_recognised(
    cls: type, delegate: str | None
) -> None:
    assert forward_delegate(cls()) == delegate


def test_a_call_of_the_delegate_runs_as_self_with_forwards_arguments_or_says_why_not() -> None:
    module = Delegates()
    seen = []
    run = as_forward(module, module.model, lambda *args, **kwargs: seen.append((args, kwargs)) or "out")
    assert run(torch.ones(1)) == "out" and len(seen) == 1
    with pytest.raises(TypeError, match=r"do not fit Delegates.forward\(self, x"):
        run(torch.ones(1), labels=torch.ones(1))


def test_a_call_of_the_delegate_made_while_self_runs_is_the_childs_own_forward() -> None:
    """``forward`` returning ``self.layer(x)`` (Lightning's BoringModel): the engine itself calls ``layer``
    as a layer inside ``self(...)``; that inner call runs the Linear, the step's outer call runs as self."""
    module = Delegates()
    x = torch.randn(3, 2)
    module.model.forward = as_forward(module, module.model, lambda inp: module.model(inp) + 1)
    try:
        got = module.model(x)  # the step's call: as self(...), which runs the layer once
    finally:
        del module.model.forward
    torch.testing.assert_close(got, module.model(x) + 1, rtol=0, atol=0)
