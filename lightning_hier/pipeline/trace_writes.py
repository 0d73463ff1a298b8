"""Attribute writes a traced ``forward`` makes on the model, undone after tracing and checked.

``torch.fx`` runs ``forward`` once with symbolic values. Whatever the forward assigns to its modules
(``self.seen += n``, ``self.last_attention = a``, ``self.calls = self.calls + 1``) is assigned for real
during that run, with fx's ``Proxy`` objects as values: left there, the user's model holds proxies
(``model.to(device)`` then fails inside fx, far from the cause). Every module's attributes, buffers and
parameters are therefore put back as they were before the trace, and each write is judged:

- an in-place update of a buffer (``self.seen += n`` on a tensor, ``self.ema.mul_(m)``) is a node of the
  graph: the stage that holds the buffer performs it at each call, as the model would. Nothing to say;
- a buffer or parameter replaced by a new value (``self.mean = 0.9 * self.mean + ...``) is not in the
  graph: the stages would train with a buffer that never changes. That is an error;
- any other attribute (a cache for inspection, a Python counter) is set once, during the trace, and never
  under the pipeline: a warning names it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import nn

# fx records ``a += b`` on a tensor as the in-place method (``add_``) or as ``operator.iadd``
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv}


@dataclass
class _ModuleState:
    attributes: dict[str, Any]
    buffers: dict[str, Any]
    parameters: dict[str, Any]


@dataclass
class TraceWrites:
    """What a traced forward wrote: ``(qualified name, value written)`` per kind of attribute."""

    buffers: list[tuple[str, Any]] = field(default_factory=list)
    parameters: list[tuple[str, Any]] = field(default_factory=list)
    attributes: list[tuple[str, Any]] = field(default_factory=list)


def snapshot(root: nn.Module) -> dict[str, tuple[nn.Module, _ModuleState]]:
    """Every module's attributes, buffers and parameters (the dicts copied, the values shared)."""
    return {
        name: (module, _ModuleState(dict(vars(module)), dict(module._buffers), dict(module._parameters)))
        for name, module in root.named_modules(remove_duplicate=False)
    }


def restore(saved: dict[str, tuple[nn.Module, _ModuleState]], graph: fx.Graph) -> TraceWrites:
    """Put every module back as :func:`snapshot` saw it; returns what had been written since. Constants fx
    stored on the root for the graph (``_tensor_constant0``: new names read by ``get_attr`` nodes) stay: the
    stages read every ``get_attr`` from the model, as they read its parameters."""
    constants = fx_constants(saved, graph)
    writes = TraceWrites()
    seen: set[int] = set()
    for prefix, (module, state) in saved.items():
        if id(module) in seen:  # a module reachable under two names: judged once
            continue
        seen.add(id(module))
        writes.buffers += _changed(prefix, module._buffers, state.buffers)
        writes.parameters += _changed(prefix, module._parameters, state.parameters)
        internal = {"_buffers", "_parameters", "_modules"}
        attributes = {k: v for k, v in vars(module).items() if k not in internal}
        changed = _changed(prefix, attributes, state.attributes)
        writes.attributes += [w for w in changed if w[0] not in constants]
        module._buffers.clear()
        module._buffers.update(state.buffers)
        module._parameters.clear()
        module._parameters.update(state.parameters)
        for name in [k for k in vars(module) if k not in state.attributes]:
            if _qualified(prefix, name) not in constants:
                delattr(module, name)
        vars(module).update(state.attributes)
    return writes


def fx_constants(saved: dict[str, tuple[nn.Module, _ModuleState]], graph: fx.Graph) -> set[str]:
    """Names the graph reads (``get_attr``) that no module had before the trace: fx's own constants."""
    existing = {
        _qualified(prefix, name)
        for prefix, (_, state) in saved.items()
        for name in (*state.attributes, *state.buffers, *state.parameters)
    }
    return {str(n.target) for n in graph.nodes if n.op == "get_attr" and str(n.target) not in existing}


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _changed(prefix: str, now: dict[str, Any], before: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(_qualified(prefix, k), v) for k, v in now.items() if k not in before or before[k] is not v]


def problems(writes: TraceWrites, graph: fx.Graph, model_name: str) -> tuple[str | None, str | None]:
    """``(error, warning)``: an error for a buffer or parameter the graph does not update, a warning for
    other attributes the forward sets (either ``None`` where there is nothing to say)."""
    replaced = [name for name, value in writes.buffers if not _updates_in_place(value, name, graph)]
    replaced += [name for name, _ in writes.parameters]
    error = warning = None
    if replaced:
        error = (
            f"{model_name}.forward assigns new values to {', '.join(replaced)}: hier_pipeline runs the "
            "traced graph, which keeps no assignment, so these would never change. Update them in place "
            "(`self.buffer.mul_(m).add_(x)`, `self.count += n` on a tensor), or do it in a submodule listed "
            "in leaf_modules, or in a hook (on_train_batch_end)."
        )
    if writes.attributes:
        names = ", ".join(name for name, _ in writes.attributes)
        warning = (
            f"{model_name}.forward sets {names}: under hier_pipeline the traced graph runs instead of "
            "forward, so these attributes keep the value they had before fit (set them in a submodule listed "
            "in leaf_modules, or in a hook, to keep them)."
        )
    return error, warning


def _updates_in_place(value: Any, buffer: str, graph: fx.Graph) -> bool:
    """Whether ``value`` is the proxy of an in-place op on buffer ``buffer`` recorded in ``graph``."""
    node = getattr(value, "node", None)
    if not isinstance(node, fx.Node) or node.graph is not graph or not node.args:
        return False
    target = node.args[0]
    if not (isinstance(target, fx.Node) and target.op == "get_attr" and target.target == buffer):
        return False
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_")
    return node.op == "call_function" and node.target in _INPLACE_OPERATORS
