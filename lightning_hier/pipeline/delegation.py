"""A ``forward`` that only hands its inputs to one submodule: the steps may call that submodule instead.

Many LightningModules wrap a model built elsewhere (torchvision, timm, Hugging Face) and write::

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)   # the submodule, not self(...)

Under ``ddp`` the two calls are the same thing. Under ``hier_pipeline`` only ``self(...)`` runs the model
across the stages, so the strategy reads ``forward``'s source once: where it is ``return self.<child>(...)``
(or ``y = self.<child>(...)`` then ``return y``) passing its own parameters through unchanged, a call of that
child inside a step runs as ``self(...)``. Anything else (a ``forward`` that computes more, a child called
with arguments ``forward`` does not take) is left to the rule "call ``self(...)``", with
:class:`~lightning_hier.pipeline.foreign_layers.LayerHeldElsewhereError` where a step runs layers itself.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from torch import nn


def forward_delegate(module: nn.Module) -> str | None:
    """The attribute name of the child that ``type(module).forward`` hands its parameters to unchanged, or
    ``None`` where ``forward`` is anything else (or its source cannot be read)."""
    forward = type(module).forward
    try:
        source = textwrap.dedent(inspect.getsource(forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0] if tree.body else None
    if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    call = _returned_call(body)
    if call is None:
        return None
    target = call.func
    if not (
        isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    ):
        return None
    child = getattr(module, target.attr, None)
    if not isinstance(child, nn.Module) or child is module:
        return None
    if not _passes_parameters_through(function.args, call) or not _same_defaults(
        forward, type(child).forward
    ):
        return None
    return target.attr


def _returned_call(body: list[ast.stmt]) -> ast.Call | None:
    """The call ``forward`` returns: ``return self.child(...)``, or ``y = self.child(...)`` then ``return y``
    (as Lightning's own ``LitAutoEncoder`` writes it)."""
    if len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Call):
        return body[0].value
    if len(body) != 2 or not isinstance(body[0], ast.Assign) or not isinstance(body[1], ast.Return):
        return None
    assign, returned = body
    targets = assign.targets
    single = len(targets) == 1 and isinstance(targets[0], ast.Name)
    if not single or not isinstance(assign.value, ast.Call) or not isinstance(returned.value, ast.Name):
        return None
    return assign.value if returned.value.id == targets[0].id else None


def _passes_parameters_through(arguments: ast.arguments, call: ast.Call) -> bool:
    """Whether ``call`` passes ``forward``'s parameters (after ``self``) on as they came: positional ones in
    order, keyword-only ones by name, ``*args`` and ``**kwargs`` as such, and nothing else."""
    positional = [a.arg for a in [*arguments.posonlyargs, *arguments.args][1:]]
    args = list(call.args)
    if arguments.vararg is not None:
        if not args or not _is_starred_name(args[-1], arguments.vararg.arg):
            return False
        args = args[:-1]
    passed = [a.id if isinstance(a, ast.Name) else None for a in args]
    keywords = {k.arg: k.value for k in call.keywords}
    double_star = keywords.pop(None, None)
    if arguments.kwarg is not None:
        if not (isinstance(double_star, ast.Name) and double_star.id == arguments.kwarg.arg):
            return False
    elif double_star is not None:
        return False
    by_keyword = {name: value.id for name, value in keywords.items() if isinstance(value, ast.Name)}
    if len(by_keyword) != len(keywords) or any(name != value for name, value in by_keyword.items()):
        return False  # only ``name=name``
    if passed != positional[: len(passed)]:
        return False
    rest = positional[len(passed) :] + [a.arg for a in arguments.kwonlyargs]
    return sorted(rest) == sorted(by_keyword)


def _is_starred_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Starred) and isinstance(node.value, ast.Name) and node.value.id == name


def _same_defaults(forward: Callable[..., Any], child_forward: Callable[..., Any]) -> bool:
    """A default of ``forward`` must be the child's default for that parameter too (else calling the child
    without it differs from calling ``forward`` without it)."""
    try:
        ours, theirs = inspect.signature(forward).parameters, inspect.signature(child_forward).parameters
    except (TypeError, ValueError):
        return False
    for name, parameter in ours.items():
        if parameter.default is inspect.Parameter.empty:
            continue
        other = theirs.get(name)
        if other is None or other.default is not parameter.default and other.default != parameter.default:
            return False
    return True


def as_forward(module: nn.Module, child: nn.Module, stage_forward: Callable[..., Any]) -> Callable[..., Any]:
    """What ``child.forward`` is during a step: a step's call of the delegate child runs ``stage_forward``
    (what ``self(...)`` runs), with arguments that must bind to ``forward``'s parameters; a call made while
    that runs (the engine running the child itself as a layer: ``forward`` returning ``self.layer(x)``, as
    Lightning's ``BoringModel`` does) runs the child's own ``forward``."""
    signature = inspect.signature(type(module).forward)
    name = f"{type(module).__name__}.forward"
    own_forward = type(child).forward
    running = False

    def called_as_forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal running
        if running:
            return own_forward(child, *args, **kwargs)
        try:
            signature.bind(module, *args, **kwargs)
        except TypeError as error:
            raise TypeError(
                f"hier_pipeline runs a step's call of the submodule {name} hands its inputs to as self(...), "
                f"but this call's arguments do not fit {name}{signature}: {error}. Call self(...) with "
                "forward's arguments, or let forward take what the step passes."
            ) from error
        running = True
        try:
            return stage_forward(*args, **kwargs)
        finally:
            running = False

    return called_as_forward
