"""Split backward: a stage sends its input gradient first and computes its weight gradients after.

In 1F1B the previous stage waits for this stage's input gradient, but a plain backward computes the
weight gradients along with it, so the wait includes work nothing downstream needs. Split as zero-bubble
pipelines split it (B and W), the input gradient goes out as soon as it exists and the weight gradients
are computed while this stage would otherwise wait for its next activation, or at the step's end. On
a 2-stage pipeline of 4 micro-batches that takes about one weight pass per micro-batch off the step's
critical path.

Why not ``torch.distributed.pipelining``'s ``stage_backward_input`` / ``stage_backward_weight``: they walk
the autograd graph in Python for every micro-batch and issue one ``autograd.grad`` per parameter group,
which on this project's CPU benchmark cost 1.1 ms per micro-batch on a 5-block stage (a weight pass is
2.8 ms). Here the weights' pass works per module call instead: each parameter-holding module's output
gradient is caught by a tensor hook during the input pass, and an ``nn.Linear``'s weight gradient is one
matmul from it, then added, as autograd adds it (the same bits; that stage's weights' pass through
per-module ``autograd.grad`` calls took 4.6 ms, a fused ``addmm_`` 2.6 ms, but rounded differently);
other modules take ``autograd.grad`` from their output's gradient edge to their own parameters, which
re-runs nothing outside the module. Parameters no captured call covers (used by the stage's own
functional code, or by a module whose output the input gradient does not pass through) get theirs from
the stage's output in one more ``autograd.grad``.

The first split backward after each partition change is checked against a plain one (one more backward
pass): where the two disagree (a module that uses a child's weight outside the child's call, whose
gradient no per-module pass can see) the stage's gradients are set from the plain pass, a warning says
so, and the stage goes back to plain backward passes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.nn.modules.module import register_module_forward_hook


@dataclass
class _ModuleCall:
    """One call of a parameter-holding module during a recorded forward."""

    module: nn.Module
    layer: int  # the stage's graph node it ran in
    params: tuple[nn.Parameter, ...]
    # the call output's node and output number, taken before any in-place change of the output (not
    # ``get_gradient_edge``: its ownership token, a view made per call, doubled a stage's forward time)
    node: Any
    output_nr: int
    linear_input: torch.Tensor | None  # an ``nn.Linear``'s input where its gradient is one matmul
    grad: torch.Tensor | None = None  # of the output, caught during the input pass
    handle: Any = None  # of the hook that catches it

    def release(self) -> None:
        """Drop the call's references: the output's node holds the hook, which holds this call, which
        held the node, a cycle through autograd's C++ that only Python's cycle collector would free (and
        until then the micro-batch's whole graph stayed: 1.6x longer forwards on the benchmark's stage)."""
        if self.handle is not None:
            self.handle.remove()
        self.handle = self.node = self.grad = self.linear_input = None


@dataclass
class _Deferred:
    """A micro-batch whose input gradient went out and whose weight gradients are still to compute."""

    calls: list[_ModuleCall]
    output: Any = None
    output_grad: torch.Tensor | None = None
    timed: bool = False

    def release(self) -> None:
        for call in self.calls:
            call.release()
        self.calls.clear()
        self.output = self.output_grad = None


@dataclass
class SplitCounts:
    """What the split backward did since it was made: tests and benchmarks read these."""

    input_passes: int = 0
    weight_passes: int = 0
    checked: int = 0
    fell_back: int = 0
    linear_calls: int = 0
    module_calls: int = 0
    fallback_passes: int = 0
    order: list[tuple[str, int]] = field(default_factory=list)  # ("input" | "weight", micro-batch)
    keep_order: bool = False  # tests: record ``order``


class WeightGradients:
    """Records a stage's module calls during a forward and computes its backward in two passes.

    ``watch(modules, stage_params, functional_params)`` names the stage's layers, the parameters it
    updates and those its graph reads outside module calls; ``recording(m)`` wraps micro-batch ``m``'s
    forward; ``input_backward`` runs the input pass and returns the input gradient; ``run_oldest`` /
    ``run_all`` compute the deferred weight gradients, accumulated into ``.grad`` as a plain backward
    would.
    """

    def __init__(
        self, mark: Callable[[], Any] | None = None, is_timed: Callable[[], bool] | None = None
    ) -> None:
        self._hook: Any = None  # the global forward hook, installed while a forward records
        self._stage_params: list[nn.Parameter] = []
        self._functional: set[int] = set()  # ids of parameters read outside module calls
        self._own: dict[nn.Module, tuple[nn.Parameter, ...]] = {}  # a watched module's direct parameters
        self._recording: list[_ModuleCall] | None = None
        self.layer = -1  # the node running: set by the executor while recording
        self.in_weight_pass = False  # the executor's backward-timing hooks ignore what fires meanwhile
        self.pending: dict[int, _Deferred] = {}
        self._recorded: dict[int, _Deferred] = {}
        self.checked = False  # the first split backward after watch() was compared with a plain one
        self.usable = True  # False once that comparison failed
        self.counts = SplitCounts()
        self._mark = mark
        self._is_timed = is_timed or (lambda: False)
        self.weight_times: list[list[tuple[int, Any, Any]]] = []  # per timed micro-batch: (layer, start, end)

    # ------------------------------------------------------------------ what to watch
    def watch(
        self,
        modules: Iterable[nn.Module],
        stage_params: Iterable[nn.Parameter],
        functional_params: Iterable[nn.Parameter] = (),
    ) -> None:
        """Watch the parameter-holding modules among ``modules`` (and their submodules). ``stage_params``:
        every parameter this stage updates; those no captured module call covers (``functional_params``,
        read by the stage's own code, always) take the stage-output pass."""
        self.unwatch()
        self._functional = {id(p) for p in functional_params}
        seen: set[int] = set()
        for top in modules:
            for module in top.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                own = tuple(p for p in module.parameters(recurse=False) if id(p) not in self._functional)
                if own:
                    self._own[module] = own
        self._stage_params = [p for p in dict.fromkeys(stage_params) if p.requires_grad]
        self.checked, self.usable = False, True

    def unwatch(self) -> None:
        self._own.clear()
        self.discard()

    def hooks_on_parameters(self) -> bool:
        """Whether a user hook on a parameter would see a different backward (the weights' pass writes
        ``.grad`` without going through each parameter's accumulator)."""
        return any(
            getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)
            for p in self._stage_params
        )

    # ------------------------------------------------------------------ forward
    @property
    def is_recording(self) -> bool:
        return self._recording is not None

    def recording(self, micro: int) -> _Recording:
        """Wraps micro-batch ``micro``'s forward (whether it is timed is read as it ends)."""
        return _Recording(self, micro)

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        calls = self._recording
        own = self._own.get(module)
        if own is None or calls is None or not isinstance(output, torch.Tensor) or output.grad_fn is None:
            return
        # read per call: a callback may freeze or unfreeze parameters between steps
        params = tuple(p for p in own if p.requires_grad)
        if not params:
            return
        linear_input = None
        if _plain_linear(module) and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            if x.dtype == output.dtype == module.weight.dtype and x.layout == torch.strided:
                linear_input = x
        call = _ModuleCall(module, self.layer, params, output.grad_fn, output.output_nr, linear_input)
        call.handle = output.register_hook(_catch(call))
        calls.append(call)

    # ------------------------------------------------------------------ backward
    def input_backward(
        self, micro: int, output: torch.Tensor, grad: torch.Tensor | None, received: torch.Tensor
    ) -> torch.Tensor:
        """The input pass of micro-batch ``micro``: the gradient of ``received`` (zeros where none flows),
        with the graph kept for the weights' pass, which is queued."""
        entry = self._recorded.pop(micro)
        (grad_in,) = torch.autograd.grad(
            output, (received,), grad, retain_graph=True, allow_unused=True, materialize_grads=True
        )
        entry.output, entry.output_grad = output, grad
        self.pending[micro] = entry
        self.counts.input_passes += 1
        if self.counts.keep_order:
            self.counts.order.append(("input", micro))
        return grad_in

    def refused(self, micro: int, error: RuntimeError) -> bool:
        """The input pass of micro-batch ``micro`` raised ``error``. Before this stage's first split pass
        was checked (the start, every migration) that means autograd refuses the split here (a reentrant
        ``torch.utils.checkpoint`` region refuses ``torch.autograd.grad``): the micro-batch's calls are
        forgotten, the stage goes back to plain backward passes with a warning, and the caller runs a
        plain backward. Returns False (the caller re-raises) once a split pass was checked: then the
        error is not the split's."""
        if self.checked:
            return False
        self.drop(micro)
        self._stop_splitting(
            "autograd refused to split this stage's backward (input gradient first, weight gradients "
            f"after): {str(error).splitlines()[0]} The stage runs plain backward passes"
        )
        return True

    def _stop_splitting(self, why: str) -> None:
        """This stage runs plain backward passes until the next :meth:`watch`; a warning says ``why``."""
        self.usable = False
        self.counts.fell_back += 1
        warnings.warn(f"hier_pipeline: {why} (strategy._split_backward = False silences this).", stacklevel=3)

    def has_record(self, micro: int) -> bool:
        return micro in self._recorded

    def drop(self, micro: int) -> None:
        """Micro-batch ``micro`` runs a plain backward (or none): forget its calls."""
        entry = self._recorded.pop(micro, None)
        if entry is not None:
            entry.release()

    def run_oldest(self) -> None:
        micro = next(iter(self.pending))
        self._weights(micro, self.pending.pop(micro))

    def run_all(self) -> None:
        while self.pending:
            self.run_oldest()

    def discard(self) -> None:
        """Forget what a failed step left (its graphs go with it)."""
        for entry in (*self.pending.values(), *self._recorded.values()):
            entry.release()
        self.pending.clear()
        self._recorded.clear()

    def _weights(self, micro: int, entry: _Deferred) -> None:
        self.in_weight_pass = True
        try:
            self._weights_of(micro, entry)
        finally:
            self.in_weight_pass = False

    def _weights_of(self, micro: int, entry: _Deferred) -> None:
        before = _grads(self._stage_params) if not self.checked else None
        mark = self._mark if entry.timed else None
        times: list[tuple[int, Any, Any]] = []
        # a parameter of a call the input pass did not reach (a module called twice, once off that path)
        # takes the stage-output pass for all its uses, with its module's other parameters; after a failed
        # check, every parameter does (the micro-batches of that step split already)
        whole = {id(p) for call in entry.calls if call.grad is None for p in call.params}
        covered: set[int] = set()
        for call in entry.calls if self.usable else ():
            if call.grad is None or any(id(p) in whole for p in call.params):
                continue
            start = mark() if mark is not None else None
            self._module_weights(call)
            covered.update(id(p) for p in call.params)
            if mark is not None and call.layer >= 0:
                times.append((call.layer, start, mark()))
        rest = [p for p in self._stage_params if id(p) not in covered]
        if rest:
            start = mark() if mark is not None else None
            self._stage_output_weights(entry, rest)
            if mark is not None and entry.calls and entry.calls[-1].layer >= 0:
                times.append((entry.calls[-1].layer, start, mark()))
        if times:
            self.weight_times.append(times)
        self.counts.weight_passes += 1
        if self.counts.keep_order:
            self.counts.order.append(("weight", micro))
        if before is not None:  # the first pass after watch()
            self._check(entry, before)
        entry.release()

    def _module_weights(self, call: _ModuleCall) -> None:
        grad = call.grad
        assert grad is not None
        x = call.linear_input
        if x is not None:
            self.counts.linear_calls += 1
            module = call.module
            g2 = grad.reshape(-1, grad.shape[-1])
            x2 = x.reshape(-1, x.shape[-1])
            if module.weight.requires_grad:
                _accumulate_mm(module.weight, g2, x2)
            if module.bias is not None and module.bias.requires_grad:
                _accumulate(module.bias, g2.sum(0), fresh=True)
            return
        self.counts.module_calls += 1
        edge = GradientEdge(call.node, call.output_nr)
        grads = torch.autograd.grad((edge,), call.params, (grad,), retain_graph=True, allow_unused=True)
        _accumulate_all(call.params, grads)

    def _stage_output_weights(self, entry: _Deferred, params: Sequence[nn.Parameter]) -> None:
        """Gradients of ``params`` from the stage's output: functional reads and calls the input pass
        did not reach."""
        self.counts.fallback_passes += 1
        grads = torch.autograd.grad(
            entry.output, params, entry.output_grad, retain_graph=True, allow_unused=True
        )
        _accumulate_all(params, grads)

    def _check(self, entry: _Deferred, before: list[torch.Tensor | None]) -> None:
        """Compare the split pass's gradients with a plain pass's; on a mismatch keep the plain ones and
        stop splitting on this stage."""
        self.checked = True
        self.counts.checked += 1
        params = self._stage_params
        if not params:
            return
        reference = torch.autograd.grad(
            entry.output, params, entry.output_grad, retain_graph=True, allow_unused=True
        )
        mismatched = []
        for param, old, ref in zip(params, before, reference):
            new = param.grad
            got = None if new is None else (new if old is None else new - old)
            if not _close(got, ref):
                mismatched.append(param)
            if ref is None:
                param.grad = old
            else:
                param.grad = ref.clone() if old is None else old + ref
        if mismatched:
            shapes = ", ".join(str(tuple(p.shape)) for p in mismatched[:3])
            self._stop_splitting(
                "splitting this stage's backward (input gradient first, weight gradients after) gave "
                f"different gradients for {len(mismatched)} parameter(s) (shapes {shapes}) than a plain "
                "backward: a module uses a parameter outside its own call. The stage's gradients come from "
                "the plain backward, and its later steps run plain backward passes"
            )


class _Recording:
    """Context of one recorded forward: the module calls of micro-batch ``micro``."""

    def __init__(self, owner: WeightGradients, micro: int) -> None:
        self.owner, self.micro = owner, micro

    def __enter__(self) -> None:
        owner = self.owner
        owner._recording = []
        owner.layer = -1
        # a global hook, for the forward only: a hook on the user's modules would travel with them (a
        # pickled or deep-copied model, an EMA copy) and hold this object
        owner._hook = register_module_forward_hook(owner._on_forward)

    def __exit__(self, *exc: Any) -> None:
        owner = self.owner
        owner._hook.remove()
        owner._hook = None
        calls, owner._recording = owner._recording, None
        if calls is None:
            return
        if exc[0] is None:
            owner._recorded[self.micro] = _Deferred(calls, timed=owner._is_timed())
        else:  # the forward raised: break each call's cycle through its output's node now
            for call in calls:
                call.release()


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose ``weight`` and ``bias`` are its own parameters: pruned (``weight`` computed
    from ``weight_orig`` in a pre-hook) or parametrized (a subclass), autograd takes its pass."""
    if type(module) is not nn.Linear:
        return False
    own = module._parameters
    weight, bias = own.get("weight"), own.get("bias")
    return weight is not None and weight is module.weight and (bias is None or bias is module.bias)


def _catch(call: _ModuleCall) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        if call.grad is None:  # the input pass's; the later passes from the stage's output pass it again
            call.grad = grad

    return hook


def _accumulate(param: nn.Parameter, value: torch.Tensor, fresh: bool) -> None:
    """``param.grad += value``; a first ``value`` is kept as the gradient where it is ``fresh`` (made
    for this parameter alone), else copied (``autograd.grad`` may hand back a gradient it passed on)."""
    if param.grad is None:
        param.grad = value if fresh else value.detach().clone()
    else:
        param.grad.add_(value)


def _accumulate_all(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    """What ``autograd.grad`` returned for ``params``, added to their ``.grad`` (``None``: unused)."""
    for param, value in zip(params, grads):
        if value is not None:
            _accumulate(param, value, fresh=False)


def _accumulate_mm(param: nn.Parameter, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
    """``param.grad += grad_out.T @ inputs`` (an ``nn.Linear``'s weight gradient), the product computed
    whole and then added, as autograd's accumulator adds it: the result is a plain backward's to the bit (a
    fused ``addmm_`` rounded differently: float32 losses drifted apart by 1e-6 within a benchmark run).
    ``grad_out.T @ inputs`` has the weight's layout; the transposed product of the same bits,
    ``(inputs.T @ grad_out).T``, made the add strided and the step 0.90x a plain backward's."""
    _accumulate(param, torch.mm(grad_out.t(), inputs), fresh=True)


def _grads(params: Sequence[nn.Parameter]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def _close(got: torch.Tensor | None, ref: torch.Tensor | None) -> bool:
    if ref is None or got is None:
        return (got is None or not bool(got.any())) and (ref is None or not bool(ref.any()))
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return torch.allclose(got, ref, rtol=1e-3, atol=1e-5 * max(scale, 1e-30))
