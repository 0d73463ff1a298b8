"""A ``forward`` torch.fx cannot trace, captured with ``torch.export`` and grouped into layers by module.

torch.fx runs ``forward`` on symbolic values and stops at the first Python branch on one (Hugging Face's
mask helpers, a ResNet embedder checking its channels). ``torch.export.export(..., strict=False)`` runs
``forward`` on an example input instead, records the aten operations with the module path each one was
called under (``node.meta["nn_module_stack"]``) and keeps the sizes symbolic, so the capture holds for
other batch and sequence sizes. This module turns that flat graph into the form ``LayerGraph`` splits:

- **Layers by module.** A node belongs to the outermost module on its path that is a *block*: a module
  with no ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential`` below it (a GPT-2 ``h.2``, a Llama
  decoder layer, a ResNet conv layer), a module listed in ``leaf_modules``, or a split point. Operations a
  container-holding module runs itself (embedding sums, the final norm's reshape) form a layer per run.
- **The model's own parameters.** Each layer reads its parameters and buffers from the model by name at
  every call (``Layer.state_names``), so migrating a layer moves the real ``nn.Parameter`` objects and the
  optimizer keeps stepping them; a buffer the forward updates (BatchNorm's running statistics) is updated
  in place on the model, as the eager forward does.
- **One tensor per cut.** A value that depends only on sizes, further inputs of ``forward`` and state (a
  causal mask, rotary ``cos``/``sin``, position ids) is recomputed inside each layer that reads it instead
  of flowing between layers, and every size is read again from a tensor the layer holds: between two
  decoder layers only the hidden state is live, so the cut carries one tensor.
- **Train and eval.** The forward is exported in both modes (dropout, BatchNorm and Hugging Face's
  ``if self.training`` differ); each layer runs the graph of the module's mode at each call.
- **Devices.** The capture runs where the model is at setup (the host); a device written into the graph
  (``torch.arange(n, device=x.device)``) is replaced by the device of the layer's tensors at each call.

The example input is ``example_input_array`` where the LightningModule has one, else the arguments its
step passes to ``self(...)`` for the first batch of the run's loader (read once, the random number
generators and the sampler's left as they were).
"""

from __future__ import annotations

import inspect
import operator
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind

from lightning_hier.pipeline import trace_writes
from lightning_hier.pipeline.delegation import as_forward, forward_delegate

Example = tuple[tuple[Any, ...], dict[str, Any]]
aten = torch.ops.aten

# size queries: a node reading a tensor's size does not depend on its values
_SIZE_QUERIES = {
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
}
# checks export records that name the capture's dtype and device; the stages may run elsewhere
_DROPPED = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class ExportCaptureError(RuntimeError):
    """torch.export could not capture the forward (or had no example input to run it on)."""


# ---------------------------------------------------------------------------------------------- example
def as_call(example: Any) -> Example:
    """``example_input_array`` as call arguments, as Lightning applies it: a tuple is the positional
    arguments, a dict the keyword arguments, anything else the one argument."""
    if isinstance(example, tuple):
        return example, {}
    if isinstance(example, dict):
        return (), dict(example)
    return (example,), {}


class _Called(BaseException):
    """Ends a step at its call of ``self(...)``, carrying the arguments (not an error)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.call = (args, kwargs)


def forward_example(module: nn.Module) -> Example:
    """What ``module.forward`` is called with: ``example_input_array`` where set, else the arguments the
    run's step passes to ``self(...)`` for the first batch of its loader (the batch read once, every random
    number generator and the loader's sampler left as they were, so the run reads what it would have)."""
    example = getattr(module, "example_input_array", None)
    if example is not None:
        return as_call(example)
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        raise ExportCaptureError(
            "torch.export needs an example input: set the LightningModule's `example_input_array` (the "
            "arguments of forward), or run it under a Trainer whose loader gives the first batch"
        )
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    runs = {
        TrainerFn.FITTING: (trainer.fit_loop, "training_step"),
        TrainerFn.VALIDATING: (trainer.validate_loop, "validation_step"),
        TrainerFn.TESTING: (trainer.test_loop, "test_step"),
        TrainerFn.PREDICTING: (trainer.predict_loop, "predict_step"),
    }
    loop, step_name = runs.get(trainer.state.fn, (trainer.fit_loop, "training_step"))
    step = getattr(module, step_name)
    source = getattr(loop, "_data_source", None)
    if source is None or not source.is_defined() or is_param_in_hook_signature(step, "dataloader_iter", True):
        raise ExportCaptureError(
            f"torch.export needs an example input and {step_name} has no batch to take it from: set the "
            "LightningModule's `example_input_array` (the arguments of forward)"
        )
    loader = _first_loader(source.dataloader())
    try:
        with _rng_kept(loader):
            batch = next(iter(loader))
    except StopIteration as empty:
        raise ExportCaptureError("torch.export needs an example input and the loader is empty") from empty
    batch = trainer.precision_plugin.convert_input(batch)
    batch = module._on_before_batch_transfer(batch, dataloader_idx=0)  # type: ignore[operator]
    batch = module._apply_batch_transfer_handler(  # type: ignore[operator]
        batch, device=_device_of_module(module), dataloader_idx=0
    )
    return _call_of_forward(module, step, batch)


def _first_loader(loaders: Any) -> Any:
    """The first loader of a ``*_dataloader()`` result (a loader, or a list or dict of them)."""
    if isinstance(loaders, (list, tuple)) and loaders:
        return _first_loader(loaders[0])
    if isinstance(loaders, dict) and loaders:
        return _first_loader(next(iter(loaders.values())))
    return loaders


def _call_of_forward(module: nn.Module, step: Callable[..., Any], batch: Any) -> Example:
    """The arguments ``step(batch, 0)`` passes to ``self(...)`` (or to the child ``forward`` hands its
    inputs to); the step ends there."""

    def called(*args: Any, **kwargs: Any) -> Any:
        raise _Called(args, kwargs)

    delegate = forward_delegate(module)
    child = module.get_submodule(delegate) if delegate is not None else None
    module.forward = called  # type: ignore[method-assign]
    if child is not None:
        child.forward = as_forward(module, child, called)  # type: ignore[method-assign]
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    args = (batch, 0) if is_param_in_hook_signature(step, "batch_idx", min_args=2) else (batch,)
    try:
        with torch.no_grad():
            step(*args)
    except _Called as call:
        return call.call
    except Exception as exc:  # noqa: BLE001 - the step's own error, reported as the missing example
        raise ExportCaptureError(
            f"torch.export needs an example input; {type(module).__name__}'s step raised {exc!r} before it "
            "called self(...) on the first batch. Set `example_input_array` (the arguments of forward)"
        ) from exc
    finally:
        del module.forward
        if child is not None:
            del child.forward
    raise ExportCaptureError(
        f"torch.export needs an example input; {type(module).__name__}'s step did not call self(...) on the "
        "first batch. Set `example_input_array` (the arguments of forward)"
    )


@contextmanager
def _rng_kept(loader: Any) -> Iterator[None]:
    """Leave torch's, Python's and NumPy's generators, and the loader's own, as they were: reading one batch
    must not change what the run draws (a shuffling sampler draws its order from them)."""
    generators = []
    for owner in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        for holder in (owner, getattr(owner, "sampler", None)):
            generator = getattr(holder, "generator", None)
            if isinstance(generator, torch.Generator) and all(generator is not g for g, _ in generators):
                generators.append((generator, generator.get_state()))
    python_state = random.getstate()
    try:
        import numpy

        numpy_state: Any = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch's test dependencies
        numpy = None  # type: ignore[assignment]
        numpy_state = None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy is not None:
                numpy.random.set_state(numpy_state)
            for generator, state in generators:
                generator.set_state(state)


def _device_of_module(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------- export
@dataclass
class _Forward:
    """``forward``'s parameters and the example call, bound to them."""

    parameters: list[inspect.Parameter]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaf_owner: list[tuple[str, tuple[Any, ...]]]  # per pytree leaf of (args, kwargs): parameter, path


def _bind(module: nn.Module, example: Example) -> _Forward:
    signature = inspect.signature(module.forward)
    try:
        bound = signature.bind(*example[0], **example[1])
    except TypeError as exc:
        raise ExportCaptureError(f"the example input does not fit forward{signature}: {exc}") from exc
    named = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if any(signature.parameters[name].kind in variadic for name in bound.arguments):
        raise ExportCaptureError("the example input passes *args or **kwargs; name forward's arguments")
    positional = [p for p in parameters if p.kind in named]
    last = max((i for i, p in enumerate(positional) if p.name in bound.arguments), default=-1)
    args = tuple(bound.arguments.get(p.name, p.default) for p in positional[: last + 1])
    kwargs = {
        p.name: bound.arguments[p.name]
        for p in parameters
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name in bound.arguments
    }
    owners: list[tuple[str, tuple[Any, ...]]] = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        top, key, *rest = path
        name = positional[key.idx].name if top.idx == 0 else key.key
        owners.append((name, tuple(rest)))
    return _Forward(parameters, args, kwargs, owners)


def _batch_of_two(example: Example) -> Example:
    """An example of one sample (every tensor's first dimension 1, as ``example_input_array`` often is)
    repeated to two: export fixes a dimension of size 1, and the graph would then refuse other batch sizes."""
    tensors = [v for v in pytree.tree_leaves(example) if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not tensors or any(t.shape[0] != 1 for t in tensors):
        return example
    return pytree.tree_map(
        lambda v: v.expand(2, *v.shape[1:]).clone() if isinstance(v, torch.Tensor) and v.dim() > 0 else v,
        example,
    )


def _dynamic_shapes(forward: _Forward) -> dict[str, Any]:
    """Every dimension of every tensor input symbolic where export can keep it so (``Dim.AUTO``)."""

    def spec(value: Any) -> Any:
        return {d: Dim.AUTO for d in range(value.dim())} if isinstance(value, torch.Tensor) else None

    positional = [p.name for p in forward.parameters][: len(forward.args)]
    shapes = {name: pytree.tree_map(spec, value) for name, value in zip(positional, forward.args)}
    shapes.update({name: pytree.tree_map(spec, value) for name, value in forward.kwargs.items()})
    return shapes


def _export(module: nn.Module, forward: _Forward, training: bool) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``module`` with every module's ``training`` flag set to ``training`` (the
    flags only: a user's ``train()`` override and Lightning's hooks stay unseen); the model, its attributes
    and every random number generator are left as they were."""
    modes = {sub: sub.training for sub in module.modules()}
    saved = trace_writes.snapshot(module)
    try:
        for sub in modes:
            sub.training = training
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # export's own notes on specialized sizes and the like
            return torch.export.export(
                module, forward.args, forward.kwargs, dynamic_shapes=_dynamic_shapes(forward), strict=False
            )
    finally:
        trace_writes.restore(saved, fx.Graph())
        for sub, mode in modes.items():
            sub.training = mode


def _where(exc: BaseException) -> str:
    """``file:line `code``` of the innermost frame outside torch (the user's failing line), if any."""
    from lightning_hier.pipeline.graph import _offending_call

    return _offending_call(exc)


# ---------------------------------------------------------------------------------------------- layers
@dataclass
class _Ref:
    """Where one input of a layer comes from: ``("value", producer node)`` of the flat graph, or
    ``("input", forward parameter name)``."""

    kind: str
    source: Any


@dataclass
class _Program:
    """One mode's graph of a layer: ``gm(*slots)`` returns the layer's outputs (a tuple if several)."""

    gm: fx.GraphModule
    slots: list[tuple[str, Any]]  # ("state", name) | ("const", tensor) | ("input", _Ref)
    num_outputs: int
    draws_random: bool

    def inputs(self) -> list[_Ref]:
        return [ref for kind, ref in self.slots if kind == "input"]


@dataclass
class _LayerPlan:
    """A layer of one export: its unit (the module call), owner module path and program."""

    unit: str
    owner: str | None
    nodes: list[fx.Node]
    program: _Program | None = None
    outputs: list[fx.Node] = field(default_factory=list)


class _Split:
    """The nodes of one exported forward grouped into layers (see the module docstring)."""

    def __init__(
        self,
        root: nn.Module,
        ep: torch.export.ExportedProgram,
        forward: _Forward,
        blocks: Callable[[str], bool],
        device: torch.device,
    ) -> None:
        self.root = root
        self.forward = forward
        self.device = device
        self.gm = ep.graph_module
        graph = self.gm.graph
        self.state: dict[fx.Node, str] = {}  # placeholder -> parameter or buffer name
        self.constants: dict[fx.Node, torch.Tensor] = {}
        self.leaves: dict[fx.Node, tuple[str, tuple[Any, ...]]] = {}  # user input -> parameter, path
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        user = 0
        for node, spec in zip(placeholders, ep.graph_signature.input_specs):
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                self.state[node] = spec.target  # type: ignore[assignment]
            elif spec.kind is InputKind.CONSTANT_TENSOR:
                self.constants[node] = ep.constants[spec.target]  # type: ignore[index]
            elif spec.kind is InputKind.USER_INPUT:
                if user >= len(forward.leaf_owner):
                    raise ExportCaptureError("the exported inputs do not match the example's")
                self.leaves[node] = forward.leaf_owner[user]
                user += 1
            else:
                raise ExportCaptureError(f"an exported input of kind {spec.kind.name} is not supported")
        kinds = {spec.kind for spec in ep.graph_signature.output_specs}
        if kinds - {OutputKind.USER_OUTPUT}:
            names = sorted(kind.name for kind in kinds - {OutputKind.USER_OUTPUT})
            raise ExportCaptureError(f"the exported forward has outputs of kind {names}, not supported")
        if any(n.op in ("get_attr", "call_module") for n in graph.nodes):
            raise ExportCaptureError("the exported forward holds control-flow operators (torch.cond, ...)")
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in _DROPPED:
                graph.erase_node(node)
        self.main = forward.parameters[0].name if forward.parameters else None
        self._place_buffer_copies(graph)
        self.nodes = [n for n in graph.nodes if n.op == "call_function"]
        self.output = next(n for n in graph.nodes if n.op == "output")
        self.out_spec = ep.call_spec.out_spec
        self.written = self._written_buffers()
        self.data: set[fx.Node] = set()
        self.effect: set[fx.Node] = set()
        self._classify()
        self.plans = self._group(blocks)

    # ----------------------------------------------------------------- analysis
    def _place_buffer_copies(self, graph: fx.Graph) -> None:
        """A buffer the forward reassigns (``self.mean = 0.9 * self.mean + ...``) is exported as a
        ``copy_`` into it at the end of the graph; moved to right after the new value exists (and after
        every read of the old one), into the layer that computes the value, so that value need not stay
        live, blocking every cut, until the end."""
        order = {node: i for i, node in enumerate(graph.nodes)}
        for node in list(graph.nodes):
            if node.target is not aten.copy_.default or node.users or node.args[0] not in self.state:
                continue
            buffer, value = node.args[0], node.args[1]
            earlier = [u for u in buffer.users if u is not node and order[u] < order[node]]
            after = max([value, *earlier], key=lambda n: order[n]) if isinstance(value, fx.Node) else None
            if after is None or after.op != "call_function":
                continue
            after.append(node)
            node.meta["nn_module_stack"] = after.meta.get("nn_module_stack")
            order = {n: i for i, n in enumerate(graph.nodes)}

    def _written_buffers(self) -> set[fx.Node]:
        """State placeholders some operation writes: in place, or, for a buffer, passed to an operation
        that may write its arguments without saying which (BatchNorm's running statistics)."""
        written: set[fx.Node] = set()
        for node in self.gm.graph.nodes:
            if not isinstance(node.target, torch._ops.OpOverload):
                continue
            schema = node.target._schema
            mutating = torch.Tag.maybe_aliasing_or_mutating in node.target.tags
            for i, argument in enumerate(schema.arguments):
                value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
                if not (isinstance(value, fx.Node) and value in self.state):
                    continue
                writes = argument.alias_info is not None and argument.alias_info.is_write
                buffer = not isinstance(_tensor(self.root, self.state[value]), nn.Parameter)
                if writes or (mutating and buffer):
                    written.add(value)
        return written

    def _classify(self) -> None:
        """``data``: nodes whose value depends on the main input's values (not only on its sizes);
        ``effect``: nodes that write state or draw random numbers, and everything computed from them."""
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                if node in self.leaves and self.leaves[node][0] == self.main:
                    self.data.add(node)
                continue
            if node.op != "call_function":
                continue
            inputs = node.all_input_nodes
            if node.target not in _SIZE_QUERIES and any(m in self.data for m in inputs):
                self.data.add(node)
            if _writes_or_draws(node) or any(m in self.effect for m in inputs):
                self.effect.add(node)
            if any(m in self.written for m in inputs):
                self.effect.add(node)  # reads state that changes during the forward: computed once

    def is_side(self, node: fx.Node) -> bool:
        """Whether ``node`` may be recomputed where it is read: no main-input values, no effects."""
        return node.op == "call_function" and node not in self.data and node not in self.effect

    def _group(self, blocks: Callable[[str], bool]) -> list[_LayerPlan]:
        plans: list[_LayerPlan] = []
        current: str | None = None
        for node in self.nodes:
            unit, owner = _unit_of(node, blocks)
            if unit != current:
                plans.append(_LayerPlan(unit, owner, []))
                current = unit
            plans[-1].nodes.append(node)
        return plans

    # ----------------------------------------------------------------- programs
    def build(self) -> list[_LayerPlan]:
        """Every layer's program; layers nothing reads (whose work the readers recompute) are dropped."""
        output_values = [a for a in pytree.tree_leaves(self.output.args[0]) if isinstance(a, fx.Node)]
        needed: set[fx.Node] = set(output_values)
        alive: list[_LayerPlan] = []
        for plan in reversed(self.plans):
            members = set(plan.nodes)
            plan.outputs = [
                n for n in plan.nodes if n in needed and not (self.is_side(n) and n not in output_values)
            ]
            program = _LayerBuilder(self, members).build(plan.nodes, plan.outputs)
            if program is None:
                continue
            plan.program = program
            needed.update(ref.source for ref in program.inputs() if ref.kind == "value")
            alive.append(plan)
        alive.reverse()
        return alive

    def output_program(self, produced: dict[fx.Node, Any]) -> _Program | None:
        """The program that rebuilds ``forward``'s return value from the layers' outputs, or ``None`` where
        it is one value a layer produces."""
        leaves = list(self.output.args[0])
        if self.out_spec.is_leaf() and len(leaves) == 1 and leaves[0] in produced:
            return None
        return _LayerBuilder(self, set()).build_output(leaves, self.out_spec)


def _writes_or_draws(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return True
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def _draws_random(node: fx.Node) -> bool:
    """Whether ``node`` may consume random numbers when it runs (a dropout with ``p=0`` or out of training
    does not)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    name = target._schema.name
    if name in ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention"):
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if name in (
        "aten::dropout",
        "aten::feature_dropout",
        "aten::alpha_dropout",
        "aten::feature_alpha_dropout",
    ):
        p, train = (list(node.args[1:3]) + [None, None])[:2]
        return not ((isinstance(p, (int, float)) and p == 0) or train is False)
    return True


def _unit_of(node: fx.Node, blocks: Callable[[str], bool]) -> tuple[str, str | None]:
    """The module call ``node`` belongs to (its ``nn_module_stack`` key, so two calls of one module are
    two units) and that module's path: the outermost block on its stack, else the innermost module."""
    stack = node.meta.get("nn_module_stack") or {}
    chosen: tuple[str, str] | None = None
    for key, (path, _) in stack.items():
        if not path:
            continue
        chosen = (key, path)
        if blocks(path):
            break
    if chosen is None:
        return "", None
    return chosen


class _LayerBuilder:
    """Builds one layer's program: its nodes, with what they read from elsewhere recomputed (values that
    need no main-input value), read again (sizes, from a tensor the layer holds) or taken as an input."""

    def __init__(self, split: _Split, members: set[fx.Node]) -> None:
        self.split = split
        self.members = members
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.slots: list[tuple[str, Any]] = []
        self.first_body: fx.Node | None = None
        self.sizes: dict[Any, tuple[fx.Node, int]] = {}  # symbolic size -> (tensor placeholder, dim)
        self.leaf_bases: dict[str, fx.Node] = {}

    # ------------------------------------------------------------- placeholders
    def _placeholder(self, name: str, slot: tuple[str, Any], val: Any) -> fx.Node:
        if self.first_body is None:
            node = self.graph.placeholder(name)
        else:
            with self.graph.inserting_before(self.first_body):
                node = self.graph.placeholder(name)
        node.meta["val"] = val
        self.slots.append(slot)
        if isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt):
                    self.sizes.setdefault(size.node.expr, (node, dim))
        return node

    def _body(self, make: Callable[[], fx.Node]) -> fx.Node:
        node = make()
        if self.first_body is None:
            self.first_body = node
        return node

    # ------------------------------------------------------------- resolution
    def get(self, node: fx.Node) -> fx.Node:
        """``node``'s value inside this layer."""
        if node in self.env:
            return self.env[node]
        split = self.split
        val = node.meta.get("val")
        if node.op == "placeholder":
            if node in split.state:
                made = self._placeholder(node.name, ("state", split.state[node]), val)
            elif node in split.constants:
                made = self._placeholder(node.name, ("const", split.constants[node]), val)
            else:
                made = self._leaf(node, val)
        elif _is_size(val) and node not in split.data and (local := self._size_here(val)) is not None:
            made = local
        elif split.is_side(node) or (_is_size(val) and node not in split.data and node not in split.effect):
            for arg in node.all_input_nodes:  # tensors first: their sizes serve the sizes read after
                if isinstance(arg.meta.get("val"), torch.Tensor):
                    self.get(arg)
            made = self._body(lambda: self.graph.node_copy(node, self.get))
        else:
            made = self._placeholder(node.name, ("input", _Ref("value", node)), val)
        self.env[node] = made
        return made

    def _leaf(self, node: fx.Node, val: Any) -> fx.Node:
        """A user input: ``forward``'s parameter (whole, as the stage binds it), and the leaf taken out of it
        where the parameter is a container."""
        name, path = self.split.leaves[node]
        base = self.leaf_bases.get(name)
        if not path:
            if base is None:
                base = self.leaf_bases[name] = self._placeholder(name, ("input", _Ref("input", name)), val)
            return base
        if base is None:
            base = self.leaf_bases[name] = self._placeholder(name, ("input", _Ref("input", name)), None)
        made = self._body(lambda: self.graph.call_function(_LeafAt(path), (base,)))
        made.meta["val"] = val
        if isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt):
                    self.sizes.setdefault(size.node.expr, (made, dim))
        return made

    def _size_here(self, val: Any) -> fx.Node | None:
        """A size read from a tensor this layer holds, where one has it as a dimension."""
        if not isinstance(val, torch.SymInt):
            return None
        found = self.sizes.get(val.node.expr)
        if found is None:
            return None
        tensor, dim = found
        key = ("size", tensor, dim)
        cached = self.env.get(key)  # type: ignore[call-overload]
        if cached is None:
            cached = self._body(lambda: self.graph.call_function(aten.sym_size.int, (tensor, dim)))
            cached.meta["val"] = val
            self.env[key] = cached  # type: ignore[index]
        return cached

    # ------------------------------------------------------------- programs
    def build(self, nodes: list[fx.Node], outputs: list[fx.Node]) -> _Program | None:
        split = self.split
        # the layer's inputs first, so their sizes are known before any size is read
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg not in self.members and not split.is_side(arg) and not _is_size(arg.meta.get("val")):
                    self.get(arg)
        for node in nodes:
            self.env[node] = self._body(lambda node=node: self.graph.node_copy(node, self.get))
        values = [self.env[n] for n in outputs]
        self.graph.output(values[0] if len(values) == 1 else tuple(values))
        self.graph.eliminate_dead_code()
        if not outputs and not any(n.is_impure() for n in self.graph.nodes if n.op == "call_function"):
            return None
        return self._finish(len(outputs))

    def build_output(self, leaves: list[Any], spec: Any) -> _Program:
        values = [self.get(leaf) if isinstance(leaf, fx.Node) else leaf for leaf in leaves]
        rebuilt = self._body(lambda: self.graph.call_function(_Rebuild(spec), (values,)))
        self.graph.output(rebuilt)
        self.graph.eliminate_dead_code()
        return self._finish(1)

    def _finish(self, num_outputs: int) -> _Program:
        graph, slots = self.graph, []
        kept = []
        for node, slot in zip([n for n in graph.nodes if n.op == "placeholder"], self.slots):
            if node.users:
                kept.append(slot)
            else:
                graph.erase_node(node)
        slots = kept
        self._rewrite_devices(slots)
        draws = any(_draws_random(n) for n in graph.nodes if n.op == "call_function")
        gm = fx.GraphModule(nn.Module(), graph, "ExportedLayer")
        return _Program(gm, slots, num_outputs, draws)

    def _rewrite_devices(self, slots: list[tuple[str, Any]]) -> None:
        """Every device the capture wrote into an operation (its own: the host) becomes the device of the
        layer's first tensor at each call, so a layer runs wherever its stage does."""
        capture = self.split.device
        graph = self.graph
        tensors = [
            n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
        ]
        body = next((n for n in graph.nodes if n.op != "placeholder"), None)
        if not tensors or body is None:
            return
        device_node: fx.Node | None = None

        def swap(value: Any) -> Any:
            nonlocal device_node
            if isinstance(value, torch.device) and value == capture:
                if device_node is None:
                    with graph.inserting_before(body):
                        device_node = graph.call_function(_device_of, (tensors[0],))
                return device_node
            return value

        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is _device_of:
                continue
            node.args = tuple(swap(a) for a in node.args)
            node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}


def _is_size(val: Any) -> bool:
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _device_of(tensor: torch.Tensor) -> torch.device:
    """The device a layer's written device stands for: that of its first tensor."""
    return tensor.device


class _LeafAt:
    """Takes one tensor out of a container argument of ``forward`` (``batch["ids"]``)."""

    def __init__(self, path: tuple[Any, ...]) -> None:
        self.path = path
        self.__name__ = "leaf_at"
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def __call__(self, value: Any) -> Any:
        for key in self.path:
            value = value[key.idx if hasattr(key, "idx") else key.key]
        return value


class _Rebuild:
    """Rebuilds ``forward``'s return value (a tuple, a dict, a ``ModelOutput``) from its tensors."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.__name__ = "forward_output"
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def __call__(self, leaves: list[Any]) -> Any:
        return pytree.tree_unflatten(list(leaves), self.spec)


# ---------------------------------------------------------------------------------------------- the layer
class ExportedLayer:
    """One layer of an exported forward, called by the stage that holds it: its module's operations, with
    the model's parameters and buffers read by name at each call (so a migrated layer uses the tensors
    that moved with it) and the graph of the model's current mode (train or eval)."""

    def __init__(self, root: nn.Module, owner: str | None, name: str, programs: dict[bool, _Program]) -> None:
        self.root = root
        self.owner = owner
        self.programs = programs
        self.primary = next(iter(programs))
        names: list[str] = []
        for program in programs.values():
            for kind, value in program.slots:
                if kind == "state" and value not in names:
                    names.append(value)
        self.state_names = tuple(names)
        self.draws_random = any(p.draws_random for p in programs.values())
        self._holders = {n: _holder(root, n) for n in names}
        self._constants: dict[torch.device, dict[int, torch.Tensor]] = {}
        self.__name__ = name
        self.__qualname__ = name
        self.__module__ = __name__

    def __call__(self, *inputs: Any) -> Any:
        program = self.programs.get(self.root.training) or self.programs[self.primary]
        values = iter(inputs)
        args: list[Any] = []
        constants: list[tuple[int, torch.Tensor]] = []
        for kind, value in program.slots:
            if kind == "state":
                module, attr = self._holders[value]
                tensor = module._parameters.get(attr)
                args.append(tensor if tensor is not None else module._buffers[attr])
            elif kind == "const":
                constants.append((len(args), value))
                args.append(value)
            else:
                args.append(next(values))
        if constants:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
            if device is not None:
                moved = self._constants.setdefault(device, {})
                for position, tensor in constants:
                    if id(tensor) not in moved:
                        moved[id(tensor)] = tensor.to(device)
                    args[position] = moved[id(tensor)]
        return program.gm.forward(*args)

    def __repr__(self) -> str:
        return f"ExportedLayer({self.owner or '<forward>'})"


def _holder(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return (root.get_submodule(owner) if owner else root), attr


def _state_name(root: nn.Module, name: str, owner: str | None, aliases: dict[int, list[str]]) -> str:
    """The name of tensor ``name`` under the layer's own module where it has one there (a tied output
    weight read by the embedding layer is ``transformer.wte.weight`` there), else ``name``."""
    if owner:
        for alias in aliases.get(id(_tensor(root, name)), []):
            if alias.startswith(owner + "."):
                return alias
    return name


def _tensor(root: nn.Module, name: str) -> torch.Tensor:
    module, attr = _holder(root, name)
    tensor = module._parameters.get(attr)
    return tensor if tensor is not None else module._buffers[attr]


# ---------------------------------------------------------------------------------------------- capture
def _blocks(
    root: nn.Module, leaf_modules: Sequence[str], split_points: Sequence[str]
) -> Callable[[str], bool]:
    """Whether a module path is one layer: a module without a container below it, a leaf module, or a
    split point; every ancestor of a split point is opened up."""
    opened: set[str] = set()
    for name, module in root.named_modules():
        if isinstance(module, _CONTAINERS):
            parts = name.split(".")
            opened.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    for point in split_points:
        parts = point.split(".")
        opened.update(".".join(parts[:i]) for i in range(len(parts)))
    leaves = set(leaf_modules) | set(split_points)

    def is_block(path: str) -> bool:
        return path in leaves or path not in opened

    return is_block


def _signature(plans: list[_LayerPlan], index: dict[fx.Node, tuple[int, int]]) -> list[Any]:
    """What must agree between the two modes' layers to run either mode's graph in each layer."""
    shape = []
    for plan in plans:
        assert plan.program is not None
        refs = [
            ("value", *index[ref.source]) if ref.kind == "value" else ("input", ref.source)
            for ref in plan.program.inputs()
        ]
        shape.append((plan.unit, plan.owner, tuple(refs), plan.program.num_outputs))
    return shape


def _output_index(plans: list[_LayerPlan]) -> dict[fx.Node, tuple[int, int]]:
    return {node: (i, k) for i, plan in enumerate(plans) for k, node in enumerate(plan.outputs)}


def export_forward(
    module: nn.Module,
    example: Example,
    leaf_modules: Sequence[str] = (),
    split_points: Sequence[str] = (),
) -> fx.GraphModule:
    """``module.forward`` captured with ``torch.export`` on ``example``, as a graph of layers: placeholders
    for ``forward``'s parameters, one ``call_function`` node per layer (an :class:`ExportedLayer`), an
    ``operator.getitem`` per output of a layer with several. ``meta``: ``specialized`` (arguments fixed at
    their example value), ``none_traced_as_input`` (empty), ``read_only_buffers`` (buffers no layer writes,
    which stages may each hold). Raises :class:`ExportCaptureError`."""
    device = _device_of_module(module)
    example = pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, example)
    forward = _bind(module, _batch_of_two(example))
    blocks = _blocks(module, leaf_modules, split_points)
    primary = module.training
    splits: dict[bool, _Split] = {}
    plans: dict[bool, list[_LayerPlan]] = {}
    for training in (primary, not primary):
        try:
            ep = _export(module, forward, training)
        except Exception as exc:  # noqa: BLE001 - export raises many kinds; the first mode's is reported
            if training == primary:
                raise ExportCaptureError(
                    f"{type(exc).__name__}: {_first_line(exc)} (at {_where(exc)})"
                ) from exc
            break
        splits[training] = _Split(module, ep, forward, blocks, device)
        plans[training] = splits[training].build()
    if not plans[primary]:
        raise ExportCaptureError("the exported forward has no layers")
    paired = len(plans) == 2 and _signature(plans[primary], _output_index(plans[primary])) == _signature(
        plans[not primary], _output_index(plans[not primary])
    )
    if len(plans) == 2 and not paired:
        warnings.warn(
            f"{type(module).__name__}.forward exports to different layers in train and eval mode: "
            f"hier_pipeline runs the graph exported in {'train' if primary else 'eval'} mode in both. List "
            "the module whose forward branches on self.training in leaf_modules to keep both.",
            stacklevel=3,
        )
    modes = [primary, not primary] if paired else [primary]
    aliases: dict[int, list[str]] = {}
    for name, tensor in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ):
        aliases.setdefault(id(tensor), []).append(name)

    graph = fx.Graph()
    inputs: dict[str, fx.Node] = {}
    specialized: dict[str, Any] = {}
    supplied = dict(zip([p.name for p in forward.parameters], forward.args)) | forward.kwargs
    plain = (type(None), bool, int, float, str)
    for parameter in forward.parameters:
        default = () if parameter.default is inspect.Parameter.empty else (parameter.default,)
        inputs[parameter.name] = graph.placeholder(
            parameter.name, default_value=default[0] if default else inspect.Signature.empty
        )
        value = supplied.get(parameter.name, parameter.default)
        if isinstance(value, plain) and value is not inspect.Parameter.empty:
            specialized[parameter.name] = value
    produced: dict[fx.Node, fx.Node] = {}  # primary mode's flat node -> outer node
    primary_plans = plans[primary]
    for i, plan in enumerate(primary_plans):
        programs = {mode: plans[mode][i].program for mode in modes}
        for program in programs.values():
            assert program is not None
            program.slots = [
                ("state", _state_name(module, value, plan.owner, aliases))
                if kind == "state"
                else (kind, value)
                for kind, value in program.slots
            ]
        name = (plan.owner or "forward").replace(".", "_")
        layer = ExportedLayer(module, plan.owner, name, programs)  # type: ignore[arg-type]
        args = []
        for ref in programs[primary].inputs():  # type: ignore[union-attr]
            args.append(produced[ref.source] if ref.kind == "value" else inputs[ref.source])
        node = graph.create_node("call_function", layer, tuple(args), {}, name=name)
        if len(plan.outputs) == 1:
            produced[plan.outputs[0]] = node
        else:
            for k, value in enumerate(plan.outputs):
                produced[value] = graph.call_function(operator.getitem, (node, k))
    split = splits[primary]
    rebuild = split.output_program(produced)
    if rebuild is None:
        (value,) = pytree.tree_leaves(split.output.args[0])
        graph.output(produced[value])
    else:
        rebuild.slots = [
            ("state", value) if kind == "state" else (kind, value) for kind, value in rebuild.slots
        ]
        layer = ExportedLayer(module, None, "forward_output", {primary: rebuild})
        args = [produced[r.source] if r.kind == "value" else inputs[r.source] for r in rebuild.inputs()]
        graph.output(graph.create_node("call_function", layer, tuple(args), {}, name="forward_output"))
    captured = fx.GraphModule(nn.Module(), graph, type(module).__name__)
    captured.meta["specialized"] = {k: v for k, v in specialized.items() if k != forward.parameters[0].name}
    captured.meta["none_traced_as_input"] = []
    read: set[str] = set()
    written: set[str] = set()
    for split in splits.values():
        for node, name in split.state.items():
            tensor = _tensor(module, name)
            if not isinstance(tensor, nn.Parameter):
                (written if node in split.written else read).update(aliases.get(id(tensor), [name]))
    captured.meta["read_only_buffers"] = frozenset(read - written)
    return captured


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
