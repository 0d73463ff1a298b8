"""The split backward (``pipeline/weight_grad.py``): input gradient first, weight gradients after.

Each case runs a stage-like module over several micro-batches twice, once with plain ``backward`` and
once split (input pass, then the deferred weights' pass), on top of gradients already accumulated, and
compares the input gradients and every parameter's gradient. The pipeline's own equivalence tests
(``tests/test_pipeline_distributed.py``) run the split on every stage but the first against one
process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hier.pipeline.weight_grad import WeightGradients


class Scaled(nn.Module):
    """A module with a parameter of its own used in its forward (the ``autograd.grad`` path)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


class Stage(nn.Module):
    """Linear layers (one called twice), a LayerNorm, a module with its own parameter, a 3-d input, a
    parameter read by the stage's own code (``functional``) and one whose module does not depend on the
    stage's input (the input pass never reaches it)."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.shared = nn.Linear(width, width)
        self.scaled = Scaled(width)
        self.functional = nn.Parameter(torch.randn(width))
        self.offset = nn.Linear(1, width)  # fed a constant: not on the input gradient's path
        self.tail = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = self.shared(self.norm(h)) + self.shared(h)
        h = self.scaled(h) + self.functional * h
        h = h + self.offset(torch.ones(*h.shape[:-1], 1, dtype=h.dtype))
        return self.tail(h)


def _inputs(micro: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(micro)]


def _seed_grads(model: nn.Module) -> None:
    """Gradients already accumulated (gradient accumulation over batches): the passes add to them."""
    g = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def _plain(model: nn.Module, xs: list[torch.Tensor], upstream: list[torch.Tensor | None]):
    _seed_grads(model)
    grads_in = []
    for x, up in zip(xs, upstream):
        x = x.clone().requires_grad_(True)
        out = model(x)
        if up is None:
            out.pow(2).mean().backward()
        else:
            out.backward(up)
        grads_in.append(x.grad)
    return grads_in, {n: p.grad.clone() for n, p in model.named_parameters()}


def _split(
    model: nn.Module,
    xs: list[torch.Tensor],
    upstream: list[torch.Tensor | None],
    functional: tuple[nn.Parameter, ...] = (),
    deferred: int = 1,
):
    _seed_grads(model)
    split = WeightGradients()
    split.counts.keep_order = True
    split.watch([model], list(model.parameters()), functional)
    grads_in = []
    for m, (x, up) in enumerate(zip(xs, upstream)):
        x = x.clone().requires_grad_(True)
        with split.recording(m):
            out = model(x)
        loss = out.pow(2).mean() if up is None else out
        grads_in.append(split.input_backward(m, loss, up, x))
        assert x.grad is None  # the input pass returns the gradient, it accumulates nothing
        while len(split.pending) > deferred:
            split.run_oldest()
    split.run_all()
    return grads_in, {n: p.grad.clone() for n, p in model.named_parameters()}, split


@pytest.mark.parametrize("last", [True, False], ids=["last stage (a loss)", "middle stage (a gradient)"])
def test_split_gradients_equal_a_plain_backward(last: bool) -> None:
    torch.manual_seed(0)
    model = Stage().double()
    xs = _inputs(4, (5, 2, 6), seed=1)  # 3-d: the Linear pass flattens the leading dimensions
    upstream = [None] * 4 if last else _inputs(4, (5, 2, 3), seed=2)
    plain_in, plain = _plain(model, xs, upstream)
    split_in, got, split = _split(model, xs, upstream, functional=(model.functional,))
    for a, b in zip(plain_in, split_in):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    for name, value in plain.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=name)
    counts = split.counts
    assert counts.input_passes == counts.weight_passes == 4
    # first, shared (twice), scaled.inner and tail in one matmul each; norm and scaled through autograd
    assert counts.linear_calls == 4 * 5 and counts.module_calls == 4 * 2
    # functional and offset (its call is off the input gradient's path) from the stage's output
    assert counts.fallback_passes == 4
    assert counts.checked == 1 and counts.fell_back == 0 and split.usable
    # each micro-batch's input pass came before its weights' pass, which waited for the next input pass
    assert counts.order == [
        ("input", 0), ("input", 1), ("weight", 0), ("input", 2), ("weight", 1),
        ("input", 3), ("weight", 2), ("weight", 3),
    ]  # fmt: skip


class ReadsChildWeight(nn.Module):
    """Calls its child and also reads the child's weight directly: a per-module pass sees one use."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x) + x @ self.child.weight


def test_a_parameter_the_split_cannot_see_falls_back_to_plain_gradients_with_a_warning() -> None:
    """A module calling its child and also reading the child's weight directly: the child's pass sees
    one use only. The check against a plain pass catches it; the gradients are the plain ones."""

    torch.manual_seed(0)
    model = ReadsChildWeight().double()
    xs, upstream = _inputs(3, (5, 4), seed=3), _inputs(3, (5, 4), seed=4)
    plain_in, plain = _plain(model, xs, upstream)
    with pytest.warns(UserWarning, match="plain backward"):
        split_in, got, split = _split(model, xs, upstream)
    assert not split.usable and split.counts.fell_back == 1
    for name, value in plain.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=name)
    for a, b in zip(plain_in, split_in):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_without_the_check_the_blind_spot_is_real() -> None:
    """The same model with the check skipped gives a wrong gradient: the check above is what catches
    it (this guards the test against passing because the split happened to see the direct read)."""

    torch.manual_seed(0)
    model = ReadsChildWeight().double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    up = torch.randn(5, 4, dtype=torch.float64)
    model(x).backward(up)
    expected = model.child.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    split = WeightGradients()
    split.watch([model], list(model.parameters()))
    split.checked = True  # skip the comparison
    x = x.detach().requires_grad_(True)
    with split.recording(0):
        out = model(x)
    split.input_backward(0, out, up, x)
    split.run_all()
    assert not torch.allclose(model.child.weight.grad, expected)


def test_bf16_autocast_takes_autograd_for_linear_layers_and_matches() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    xs = [t.float() for t in _inputs(3, (4, 8), seed=5)]
    upstream = [t.to(torch.bfloat16) for t in _inputs(3, (4, 8), seed=6)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_in, plain = _plain(model, xs, upstream)
        split_in, got, split = _split(model, xs, upstream)
    assert split.counts.linear_calls == 0 and split.counts.module_calls == 3 * 2
    for name, value in plain.items():
        torch.testing.assert_close(got[name], value, msg=name)
    for a, b in zip(plain_in, split_in):
        torch.testing.assert_close(b, a)


def test_frozen_parameters_get_no_gradient_and_hooks_on_parameters_are_reported() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[0].weight.requires_grad_(False)
    split = WeightGradients()
    split.watch([model], list(model.parameters()))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with split.recording(0):
        out = model(x)
    split.input_backward(0, out.sum(), None, x)
    split.run_all()
    assert model[0].weight.grad is None and model[0].bias.grad is not None
    assert not split.hooks_on_parameters()
    model[2].weight.register_hook(lambda g: g)
    assert split.hooks_on_parameters()


def test_a_released_call_leaves_no_reference_cycle_holding_the_graph() -> None:
    """After the weights' pass the micro-batch's graph is freed by reference counting alone (a cycle
    through a node's hooks kept it until Python's cycle collector ran)."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.LayerNorm(4)).double()
    split = WeightGradients()
    split.watch([model], list(model.parameters()))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with split.recording(0):
        out = model(x)
    alive = weakref.ref(split._recorded[0].calls[0])
    split.input_backward(0, out.sum(), None, x)
    del out
    gc.disable()
    try:
        split.run_all()
        assert alive() is None
    finally:
        gc.enable()


def test_a_pruned_linear_layer_takes_autograd_and_matches() -> None:
    """``torch.nn.utils.prune`` (Lightning's ``ModelPruning``) makes ``weight`` a tensor computed from
    ``weight_orig`` in a forward pre-hook: the one-matmul pass would write the wrong tensor's ``.grad``."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    xs, upstream = _inputs(3, (4, 6), seed=8), _inputs(3, (4, 3), seed=9)
    plain_in, plain = _plain(model, xs, upstream)
    split_in, got, split = _split(model, xs, upstream)
    assert split.counts.linear_calls == 3 and split.counts.module_calls == 3  # model[2], model[0]
    assert split.counts.fell_back == 0
    for name, value in plain.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=name)


def test_float32_gradients_equal_a_plain_backward_to_the_bit() -> None:
    """The one-matmul pass computes what autograd computes, in the same order: no drift at all."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(torch.tanh(self.fc1(x)))

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block())
    xs = [t.float() for t in _inputs(4, (32, 64), seed=10)]
    upstream = [t.float() for t in _inputs(4, (32, 64), seed=11)]
    plain_in, plain = _plain(model, xs, upstream)
    split_in, got, split = _split(model, xs, upstream)
    assert split.counts.linear_calls == 4 * 6
    assert all(torch.equal(got[name], value) for name, value in plain.items())
    assert all(torch.equal(a, b) for a, b in zip(plain_in, split_in))
    assert all(p.grad.is_contiguous() for p in model.parameters())


@pytest.mark.parametrize(
    ("stages", "micro", "split"),
    [(2, 4, [3]), (2, 16, [15]), (4, 8, [5, 6, 7]), (4, 16, [13, 14, 15]), (2, 5, [4]), (4, 2, [0, 1])],
)
def test_which_micro_batches_split(stages: int, micro: int, split: list[int]) -> None:
    """The drain's last S - 1 (all of a step with fewer micro-batches than that)."""
    from types import SimpleNamespace

    from lightning_hier.pipeline.schedule import PipelineSchedule

    schedule = PipelineSchedule(SimpleNamespace(stage=1, num_stages=stages))  # type: ignore[arg-type]
    schedule.num_micro = micro
    assert [m for m in range(micro) if schedule._splits_micro(m)] == split


def test_a_forward_that_raises_records_nothing_and_leaves_no_hook() -> None:
    import gc
    import weakref

    from torch.nn.modules import module as module_globals

    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.out = self.fc(x)
            self.calls = [weakref.ref(call) for call in split._recording or ()]
            raise RuntimeError("a step that fails")

    model = Fails()
    split = WeightGradients()
    split.watch([model], list(model.parameters()))
    hooks_before = len(module_globals._global_forward_hooks)
    with pytest.raises(RuntimeError, match="fails"), split.recording(0):
        model(torch.randn(2, 4, requires_grad=True))
    assert not split.has_record(0) and not split.is_recording
    assert len(module_globals._global_forward_hooks) == hooks_before
    assert len(model.calls) == 1
    del model.out
    gc.disable()
    try:
        assert model.calls[0]() is None  # freed by reference counting: no cycle through the caught call
    finally:
        gc.enable()


class Checkpointed(nn.Module):
    """A reentrant ``torch.utils.checkpoint`` region, which refuses ``torch.autograd.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.tail = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.tail(checkpoint(self.inner, x, use_reentrant=True))


def test_a_stage_whose_autograd_refuses_the_split_runs_a_plain_backward_with_a_warning() -> None:
    """The first split pass hits a reentrant checkpoint: that micro-batch's backward is a plain one (the
    gradients and the input gradient equal one's), the stage warns and splits no more; once a split pass
    was checked, the same error is raised (it is not the split's)."""
    from types import SimpleNamespace

    from lightning_hier.pipeline.schedule import PipelineSchedule, _InFlight

    torch.manual_seed(0)
    model = Checkpointed().double()
    x, upstream = _inputs(1, (5, 4), seed=3)[0], _inputs(1, (5, 4), seed=4)[0]
    reference_x = x.clone().requires_grad_(True)
    model(reference_x).backward(upstream)
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    split = WeightGradients()
    split.watch([model], list(model.parameters()))
    link = SimpleNamespace(stage=1, num_stages=3, send_grad_op=lambda grad: grad)
    schedule = PipelineSchedule(link)  # type: ignore[arg-type]
    received = x.clone().requires_grad_(True)
    with split.recording(0):
        output = model(received)
    with pytest.warns(UserWarning, match="refused"):
        (grad_in,) = schedule._split_backward(0, upstream, _InFlight(received, output, True), split)
    assert not split.usable and split.counts.fell_back == 1 and not split.pending
    assert split.counts.input_passes == 0
    torch.testing.assert_close(grad_in, reference_x.grad, rtol=0, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], rtol=0, atol=0, msg=name)

    split.watch([model], list(model.parameters()))
    split.checked = True  # as after a checked split pass: the error is the caller's
    received = x.clone().requires_grad_(True)
    with split.recording(1):
        output = model(received)
    with pytest.raises(RuntimeError, match="checkpoint"):
        schedule._split_backward(1, upstream, _InFlight(received, output, True), split)
