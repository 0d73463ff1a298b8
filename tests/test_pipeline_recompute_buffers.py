"""The recompute policy puts back only the buffers a layer's forward writes: BatchNorm's running statistics
and buffers written in place advance once per micro-batch, and a constant buffer (a causal mask) is never
copied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hier.pipeline.activation_store import ActivationMeter, LayerRunner
from lightning_hier.pipeline.memory_policy import KEEP, RECOMPUTE

CONTEXT = 1024  # the mask's size, as GPT-2 registers it: 1 x 1 x 1024 x 1024
TOKENS, WIDTH = 6, 4


class StorageOps(TorchDispatchMode):
    """Records the name of every operation that reads or writes ``tensor``'s storage."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.storage = tensor.untyped_storage().data_ptr()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.storage:
                self.ops.append(func.overloadpacket.__name__)
                break
        return func(*args, **kwargs)


class MaskedBlock(nn.Module):
    """Causal attention over a constant mask buffer, a BatchNorm, and a counter and a running mean it
    writes in place (the counter through ``+=``, the running mean through a view); its output reads none
    of what it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH).double()
        self.norm = nn.BatchNorm1d(TOKENS, momentum=0.3).double()
        self.register_buffer("mask", torch.tril(torch.ones(1, 1, CONTEXT, CONTEXT, dtype=torch.bool)))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("history", torch.zeros(2, WIDTH, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        scores = (x @ x.transpose(1, 2)).unsqueeze(1)
        scores = scores.masked_fill(~self.mask[:, :, :t, :t], float("-inf")).softmax(-1).squeeze(1)
        with torch.no_grad():
            self.calls += 1
            self.history[0].mul_(0.5).add_(x.mean((0, 1)), alpha=0.5)
        return self.norm(self.proj(scores @ x))


def _micro_batches(
    policy: str, fn: Callable[..., Any], micro_batches: int = 3
) -> tuple[list[torch.Tensor], list[str], list[str], torch.Tensor]:
    """``micro_batches`` forwards through a runner, then their backwards in reverse (as a pipeline stage
    runs them): the input gradients, the operations on the mask's storage in the forwards and in the
    backwards, and the last output."""
    torch.manual_seed(1)
    runner = LayerRunner(ActivationMeter())
    inputs = [
        (torch.randn(3, TOKENS, WIDTH, dtype=torch.float64) * (i + 1) + i).requires_grad_()
        for i in range(micro_batches)
    ]
    mask = _mask_of(fn)
    outputs = []
    with StorageOps(mask) as forward_ops:
        for x in inputs:
            runner.begin_forward()
            outputs.append(runner.run("block", policy, fn, x * 1.0))
    with StorageOps(mask) as backward_ops:
        for y in reversed(outputs):
            (y * torch.arange(WIDTH, dtype=torch.float64)).pow(2).sum().backward()
    return [x.grad for x in inputs], forward_ops.ops, backward_ops.ops, outputs[-1].detach()


def _mask_of(fn: Callable[..., Any]) -> torch.Tensor:
    module = fn if isinstance(fn, nn.Module) else fn.__self__ if hasattr(fn, "__self__") else None
    if module is None:
        module = next(c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, nn.Module))
    return module.mask


def _wrapped(block: nn.Module, wrap: str) -> Callable[..., Any]:
    return {"module": block, "closure": lambda x: block(x), "method": block.forward}[wrap]


@pytest.mark.parametrize("wrap", ["module", "closure", "method"])
def test_recompute_does_not_copy_a_constant_mask(wrap: str) -> None:
    """In backward, the recompute touches the 1024 x 1024 mask only with the forward's own reads (two slices
    and the negation, once per micro-batch): it is neither cloned nor copied back."""
    torch.manual_seed(0)
    block = MaskedBlock()
    _, forward_ops, backward_ops, _ = _micro_batches(RECOMPUTE, _wrapped(block, wrap))
    assert forward_ops == ["slice", "slice", "bitwise_not"] * 3
    assert backward_ops == forward_ops


@pytest.mark.parametrize("wrap", ["module", "closure", "method"])
def test_buffers_written_in_place_advance_once_per_micro_batch_under_recompute(wrap: str) -> None:
    """A counter (``+=``) and a running mean written through a view, and BatchNorm's running statistics,
    end as under keep (each micro-batch's forward once), with the same gradients; the mask is unchanged."""
    torch.manual_seed(0)
    kept = MaskedBlock()
    torch.manual_seed(0)
    recomputed = MaskedBlock()
    want_grads, _, _, want_out = _micro_batches(KEEP, _wrapped(kept, wrap))
    grads, _, _, out = _micro_batches(RECOMPUTE, _wrapped(recomputed, wrap))
    assert int(kept.calls) == 3 and int(kept.norm.num_batches_tracked) == 3
    assert float(kept.history.abs().sum()) > 0
    for name, buffer in kept.named_buffers():
        assert torch.equal(dict(recomputed.named_buffers())[name], buffer), name
    assert torch.equal(out, want_out)
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)


class PathDependent(nn.Module):
    """Writes its buffer on its second call only: in the recompute of the first micro-batch, not in its
    forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH).double()
        self.register_buffer("seen", torch.zeros(WIDTH, dtype=torch.float64))
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        if self.count == 2:
            with torch.no_grad():
                self.seen.add_(1.0)
        return self.lin(x).tanh()


def test_a_recompute_that_writes_a_buffer_its_forward_did_not_raises() -> None:
    """That buffer was not copied before the recompute, so it cannot be put back: an error says so."""
    layer = PathDependent()
    x = torch.randn(3, WIDTH, dtype=torch.float64, requires_grad=True)
    y = LayerRunner().run("layer", RECOMPUTE, layer, x * 1.0)
    with pytest.raises(
        RuntimeError, match=r"wrote 1 buffer\(s\) \(shapes \[\(4,\)\]\) that its forward did not"
    ):
        y.sum().backward()


# ---------------------------------------------------------------------------------------------
# exported layers: the graph tells which buffers an operation writes
# ---------------------------------------------------------------------------------------------
class ExportedBlock(nn.Module):
    """The mask, and batch_norm's running statistics in buffers not named like BatchNorm's (a kernel writes
    them without bumping their version counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("mask", torch.tril(torch.ones(1, 1, CONTEXT, CONTEXT, dtype=torch.bool)))
        self.register_buffer("token_mean", torch.zeros(TOKENS))
        self.register_buffer("token_var", torch.ones(TOKENS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        scores = (x @ x.transpose(1, 2)).unsqueeze(1)
        scores = scores.masked_fill(~self.mask[:, :, :t, :t], float("-inf")).softmax(-1).squeeze(1)
        h = self.proj(scores @ x)
        return F.batch_norm(h, self.token_mean, self.token_var, training=self.training, momentum=0.3)


class ExportedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ExportedBlock(), ExportedBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.stack([row for row in x])  # fx cannot iterate a proxy: the graph is exported
        for block in self.blocks:
            x = block(x)
        return x


def _exported_step(policy: str) -> tuple[ExportedNet, dict[str, torch.Tensor], list[str], list[str]]:
    """Three micro-batches through a one-stage executor of the exported ``ExportedNet``, every layer under
    ``policy``: the model, the gradients, and the operations on the first block's mask in the forwards and
    in the backwards."""
    from lightning_hier.pipeline.graph import LayerGraph
    from lightning_hier.pipeline.partition import StagePartition
    from lightning_hier.pipeline.stage import StageExecutor

    torch.manual_seed(0)
    model = ExportedNet().double()
    graph = LayerGraph(model, example_input=((torch.zeros(2, TOKENS, WIDTH, dtype=torch.float64),), {}))
    assert graph.capture == "export"
    executor = StageExecutor(graph, StagePartition((0,), graph.num_clusters), 0)
    executor.layer_run, executor.layer_run_always = LayerRunner(ActivationMeter()), True
    executor.policies = {graph.layers[i].name: policy for i in executor.layer_range}
    torch.manual_seed(1)
    mask = model.blocks[0].mask
    with StorageOps(mask) as forward_ops:
        outputs = [executor.forward(torch.randn(3, TOKENS, WIDTH, dtype=torch.float64) + i) for i in range(3)]
    with StorageOps(mask) as backward_ops:
        for out in reversed(outputs):
            out.pow(2).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return model, grads, forward_ops.ops, backward_ops.ops


def test_exported_layers_copy_their_written_buffers_only() -> None:
    """Recomputed exported layers: batch_norm's statistics in custom-named buffers advance once per
    micro-batch (state and gradients equal keep's), and the mask is only read, as in the forward."""
    model, grads, forward_ops, backward_ops = _exported_step(RECOMPUTE)
    expected, expected_grads, _, _ = _exported_step(KEEP)
    assert "bitwise_not" in forward_ops and backward_ops == forward_ops
    assert not torch.equal(expected.blocks[0].token_mean, torch.zeros(TOKENS))
    for name, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert grads.keys() == expected_grads.keys() and grads
    for name, value in expected_grads.items():
        assert torch.equal(grads[name], value), name
