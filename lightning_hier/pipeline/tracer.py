"""The fx tracer of hier_pipeline: what becomes one layer, and the Python in a forward it accepts.

On top of ``torch.fx.Tracer``:

- the user's ``leaf_modules`` and ``torch.compile``'d submodules are opaque layers;
- an ``assert`` on a traced value (``assert t <= self.block_size``) becomes a ``torch._assert`` layer
  instead of failing the trace (fx cannot branch on a traced value, but an assert does not branch: it
  passes or raises);
- a ``with torch.no_grad():`` block in ``forward`` (which fx does not record) keeps its meaning: the values
  computed inside reach the rest through a ``stop_gradient`` layer;
- a custom ``torch.autograd.Function`` applied to traced values is one layer that applies it (fx would
  trace through its ``forward`` and drop its ``backward``);
- with ``proxy_buffers``, reading a buffer yields a traced value, as reading a parameter does, so that it
  can be indexed by one (``self.bias[:, :, :T, :T]`` with ``T`` from ``x.size()``, the causal mask of a
  GPT). ``trace_model`` takes this only for a forward that fails to trace without it, so the graphs of
  models that traced before stay the same.
"""

from __future__ import annotations

import dis
import linecache
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.autograd import Function


class PipelineTracer(fx.Tracer):
    """fx tracer that also treats the user's ``leaf_modules`` (qualified names) as opaque layers."""

    def __init__(self, leaf_modules: Sequence[str] = (), proxy_buffers: bool = False) -> None:
        super().__init__()
        self.extra_leaves = set(leaf_modules)
        self.proxy_buffers = proxy_buffers
        self._buffer_names: dict[int, str] = {}
        self._buffer_proxies: dict[str, fx.Proxy] = {}

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        if self.proxy_buffers and isinstance(root, nn.Module):
            self._buffer_names = {id(b): n for n, b in root.named_buffers(remove_duplicate=False)}
            self._buffer_proxies = {}
        original = Function.__dict__["apply"]
        Function.apply = classmethod(self._function_apply(original))  # type: ignore[method-assign]
        self._autocast_at_start = _autocast_state()
        self.autocast_changed_at: str | None = None
        try:
            graph = super().trace(root, concrete_args)
        finally:
            Function.apply = original  # type: ignore[method-assign]
        if torch.is_grad_enabled():
            _stop_gradients_leaving_no_grad(graph)
        return graph

    def create_node(
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any | None = None,
    ) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        # fx does not record a ``with torch.no_grad():`` block, but the block really runs while tracing:
        # what is computed inside it is marked (a parameter read there is only a reference: not marked)
        if kind in ("call_module", "call_function", "call_method") and not torch.is_grad_enabled():
            node.meta[NO_GRAD] = True
        if self.autocast_changed_at is None and _autocast_state() != self._autocast_at_start:
            self.autocast_changed_at = _user_frame() or "<unknown location>"
        return node

    def _function_apply(self, original: Any) -> Any:
        """``MyFunction.apply(x, ...)`` on traced values becomes one layer calling it: fx would otherwise
        run the Function's ``forward`` on the proxies and record its operations, so the layer's custom
        ``backward`` (a gradient reversal, a straight-through estimator) would be lost silently."""
        tracer = self

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            leaves, _ = pytree.tree_flatten((args, kwargs))
            if not any(isinstance(leaf, fx.Proxy) for leaf in leaves):
                return original.__get__(None, cls)(*args, **kwargs)
            return tracer.create_proxy("call_function", _FunctionCall(cls), args, kwargs)

        return apply

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        name = self._buffer_names.get(id(attr_val)) if isinstance(attr_val, torch.Tensor) else None
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in self._buffer_proxies:
            self._buffer_proxies[name] = self.create_proxy("get_attr", name, (), {})
        return self._buffer_proxies[name]

    def to_bool(self, obj: fx.Proxy) -> bool:
        """An ``assert`` on a traced value (``assert t <= self.block_size``, as nanoGPT's forward has)
        becomes a ``torch._assert`` layer, checked at each call on the stage that computes it; any other
        branch on a traced value stays an error (fx cannot know which way it goes)."""
        where = _asserting_frame()
        if where is None:
            return super().to_bool(obj)
        self.create_proxy("call_function", torch._assert, (obj, f"assertion failed at {where}"), {})
        return True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # a torch.compile'd submodule runs compiled as one layer on whichever stage holds it (fx cannot
        # trace into a dynamo-optimized module)
        if module_qualified_name in self.extra_leaves or isinstance(m, OptimizedModule):
            return True
        return super().is_leaf_module(m, module_qualified_name)


NO_GRAD = "lightning_hier_no_grad"


def _autocast_state() -> tuple[bool, ...]:
    return tuple(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def stop_gradient(value: Any) -> Any:
    """``value`` with every tensor in it detached: where a value computed under ``torch.no_grad()`` in
    ``forward`` is used after the block."""
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


def _stop_gradients_leaving_no_grad(graph: fx.Graph) -> None:
    """Keep a ``with torch.no_grad():`` block's meaning in the graph, which runs without the block: every
    value computed inside it reaches the code after it through :func:`stop_gradient`, so no gradient flows
    back into the block (a teacher network, a target computed without gradient), as in the eager forward.
    The block's layers still record autograd history on their stage (memory, not results)."""
    for node in list(graph.nodes):
        if not node.meta.get(NO_GRAD):
            continue
        outside = [user for user in node.users if not user.meta.get(NO_GRAD)]
        if not outside:
            continue
        with graph.inserting_after(node):
            stopped = graph.call_function(stop_gradient, (node,))
        for user in outside:
            user.replace_input_with(node, stopped)


class _FunctionCall:
    """A layer's target that applies the autograd ``Function`` ``cls`` (its own forward and backward)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.__name__ = f"{cls.__name__}_apply"
        self.__qualname__ = self.__name__
        self.__module__ = cls.__module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.cls.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.cls.__qualname__}.apply"


def _user_frame() -> str | None:
    """``file:line `code``` of the innermost frame outside torch and this module (the user's line)."""
    frame = _outside_frame()
    if frame is None:
        return None
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno} `{code}`"


_TORCH_DIR = str(torch.__file__).rsplit("/", 1)[0]


def is_tracing_machinery(filename: str) -> bool:
    """Whether code in ``filename`` is torch's or this module's, not the user's."""
    return filename.startswith(_TORCH_DIR) or filename == __file__


def _outside_frame() -> Any:
    """The innermost frame outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None and is_tracing_machinery(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _asserting_frame() -> str | None:
    """``file:line `code``` of the user's ``assert`` whose condition is being converted to bool right now,
    or ``None`` where the conversion is not an assert's (an ``if``, ``and``, ``bool(...)``): read from the
    bytecode, where an assert's conditional jump is followed by ``LOAD_ASSERTION_ERROR``."""
    frame = _outside_frame()
    if frame is None:
        return None
    instructions = list(dis.get_instructions(frame.f_code))
    for now, following in zip(instructions, instructions[1:]):
        if now.offset == frame.f_lasti:
            return _user_frame() if following.opname == "LOAD_ASSERTION_ERROR" else None
    return None
