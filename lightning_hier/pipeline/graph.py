"""A model's forward as a list of layers in execution order, grouped into clusters.

The forward is traced with ``torch.fx``: every ``call_module`` / ``call_function`` /
``call_method`` / ``get_attr`` node is a *layer*. A forward fx cannot trace is captured with
``torch.export`` instead (``export_capture.py``): each layer is then one module's operations.
A pipeline cut is only allowed where exactly one value produced by a layer is still needed later
(the cut carries one tensor, so each stage has a single entry and a single exit). The layers
between two allowed cuts form a *cluster*: an Inception- or ResNet-like block, whose branches keep
several values alive between the fork and the join, becomes one cluster; in a plain stack every
layer is its own cluster. Layers that share a buffer (a normalisation module called twice) are kept
in one cluster, so a buffer always lives on exactly one stage, unless no exported layer writes it
(a rotary embedding's frequencies): each stage reading such a buffer holds it. Layers that share only
parameters (tied embedding and output weights, a module called twice) may be split: each stage using
such a parameter holds a replica, and the engine sums the replicas' gradients before the optimizer
step (``split_tied_parameters=False`` keeps them in one cluster instead).
"""

from __future__ import annotations

import inspect
import linecache
import operator
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from lightning_hier.pipeline import trace_writes
from lightning_hier.pipeline.export_capture import (
    ExportCaptureError,
    ExportedLayer,
    export_forward,
    forward_example,
)
from lightning_hier.pipeline.tracer import PipelineTracer, is_tracing_machinery

COMPUTE_OPS = ("call_module", "call_function", "call_method", "get_attr")


def relay(value: Any) -> Any:
    """A stage with no layer of its own passes its input on: a fresh view, so the stage's output is a
    tensor of its own (hooks and the stage's bookkeeping never see the received tensor twice)."""
    return value.view_as(value) if isinstance(value, torch.Tensor) else value


class PipelineTraceError(ValueError):
    """The model's forward could not be traced into layers."""


class FxTraceError(PipelineTraceError):
    """torch.fx could not trace the forward: ``reason`` and ``location`` (``file:line `code```) say where."""

    def __init__(self, message: str, reason: str, location: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.location = location


@dataclass(frozen=True)
class Layer:
    """One traced node: ``name`` is the fx node name, ``owner`` the module/attribute it uses."""

    index: int
    name: str
    op: str
    target: str
    owner: str | None
    state_names: tuple[str, ...]  # parameter and buffer names (as in the model's state_dict)


@dataclass(frozen=True)
class Cluster:
    """Contiguous layers ``[start, end)`` with one value flowing out (``exit_value``)."""

    index: int
    start: int
    end: int
    exit_value: str | None  # fx node name crossing the cut after this cluster; None for the last

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def _offending_call(exc: BaseException) -> str:
    """``file:line `code``` of the innermost frame outside torch and the tracer, i.e. the user's call that
    failed."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if not is_tracing_machinery(frame.filename):
            code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
            return f"{frame.filename}:{frame.lineno} `{code}`"
    return "<unknown location>"


def trace_model(
    module: nn.Module, leaf_modules: Sequence[str] = (), check_writes: bool = True
) -> fx.GraphModule:
    """Trace ``module.forward``; the graph module shares the model's submodules and parameters. The model is
    left as it was before the trace (see ``trace_writes``); ``check_writes``: judge the forward's writes to
    the model (an error or a warning)."""
    names = dict(module.named_modules())
    missing = [m for m in leaf_modules if m not in names]
    if missing:
        raise ValueError(f"leaf_modules {missing} are not submodules of {type(module).__name__}.")
    defaults = _specialized_defaults(module)
    saved = trace_writes.snapshot(module)
    failure: Exception | None = None
    # further attempts: with buffers traced, for a buffer indexed by a traced value (a causal mask cut to the
    # sequence length); then with the ``None`` defaults traced as inputs (``attention_mask=None`` that forward
    # uses as a tensor, as Hugging Face signatures have it). The first attempt's error is the one reported.
    as_inputs = {name: None for name, value in defaults.items() if value is None}
    attempts = [(defaults, False), (defaults, True)]
    if as_inputs:
        without_none = {name: value for name, value in defaults.items() if name not in as_inputs}
        attempts += [(without_none, False), (without_none, True)]
    for concrete, proxy_buffers in attempts:
        tracer = PipelineTracer(leaf_modules, proxy_buffers=proxy_buffers)
        try:
            graph = tracer.trace(module, concrete_args=concrete or None)
            break
        except Exception as exc:  # noqa: BLE001 - fx raises TraceError, TypeError, RuntimeError, ...
            trace_writes.restore(saved, fx.Graph())
            failure = failure or exc
    else:
        assert failure is not None
        location = _offending_call(failure)
        raise FxTraceError(
            f"hier_pipeline could not trace {type(module).__name__}.forward: {failure} "
            f"(at {location}). Make that call traceable by torch.fx, list the submodule "
            "that contains it in `leaf_modules` (it then runs as one opaque layer), or build the "
            "model as an nn.Sequential of such blocks.",
            str(failure),
            location,
        ) from failure
    writes = trace_writes.restore(saved, graph)
    if check_writes:
        error, warning = trace_writes.problems(writes, graph, type(module).__name__)
        if error:
            raise PipelineTraceError(error)
        if warning:
            warnings.warn(warning, stacklevel=3)
        if tracer.autocast_changed_at is not None:
            warnings.warn(
                f"{type(module).__name__}.forward switches autocast (at {tracer.autocast_changed_at}): "
                "hier_pipeline runs the traced graph, which does not keep a `with torch.autocast(...)` "
                "block, so those layers run under the Trainer's precision. Put the block inside a submodule "
                "listed in leaf_modules (its forward runs as written).",
                stacklevel=3,
            )
    for node in graph.nodes:  # fx names a specialized input "extra_1": callers pass it as "extra"
        base, _, suffix = str(node.target).rpartition("_")
        if node.op == "placeholder" and suffix.isdigit() and base in concrete:
            node.target = base
    traced = fx.GraphModule(tracer.root, graph, type(module).__name__)
    traced.meta["specialized"] = concrete  # the defaults traced as constants
    traced.meta["none_traced_as_input"] = sorted(name for name in as_inputs if name not in concrete)
    return traced


def _export_instead(
    module: nn.Module,
    fx_failure: FxTraceError,
    leaf_modules: Sequence[str],
    split_points: Sequence[str],
    example_input: Any,
) -> fx.GraphModule:
    """``module.forward`` captured with ``torch.export`` where fx failed; one error naming both failures
    where export fails too."""
    try:
        if callable(example_input):
            example = example_input()
        elif example_input is not None:
            example = example_input
        else:
            example = forward_example(module)
        return export_forward(module, example, leaf_modules, split_points)
    except ExportCaptureError as export_failure:
        name = type(module).__name__
        raise PipelineTraceError(
            f"hier_pipeline could not capture {name}.forward into layers.\n"
            f"- torch.fx: {fx_failure.reason} (at {fx_failure.location}).\n"
            f"- torch.export (non-strict): {export_failure}.\n"
            "Make that code traceable (no Python branch on a tensor's value), list the submodule that holds "
            "it in `leaf_modules` (torch.fx then runs it as one opaque layer), or set `example_input_array` "
            "where torch.export had no example input. With the untraceable code inside leaf modules, "
            "`split_points=[...]` names the modules where stages begin, as torch.distributed.pipelining's "
            "split points do."
        ) from export_failure


ModeArgs = dict[str, list[tuple[int | str, bool, bool]]]


def _mode_dependent_args(module: nn.Module, leaf_modules: Sequence[str], traced: fx.GraphModule) -> ModeArgs:
    """The bool arguments that follow the module's train/eval mode: ``F.dropout(x, p, self.training)``
    traces to a constant, so the graph is traced once more with every module in the other mode, and an
    argument that differs between the two is re-read from the root's mode at each call (``node name ->
    [(position or keyword, value in train mode, value in eval mode)]``). A literal ``True`` (always-on
    dropout) stays as written. A forward that branches on ``self.training`` traces to other layers in
    each mode: it gets a warning, and runs its train-mode branch in evaluation too."""
    modes = {sub: sub.training for sub in module.modules()}
    was_training = module.training
    try:
        for sub in modes:  # the flags only: a user's train() override (and Lightning's hooks) stay unseen
            sub.training = not was_training
        other = trace_model(module, leaf_modules, check_writes=False)
    finally:
        for sub, mode in modes.items():
            sub.training = mode
    train_graph, eval_graph = (traced, other) if was_training else (other, traced)
    train_nodes, eval_nodes = list(train_graph.graph.nodes), list(eval_graph.graph.nodes)
    if [(n.op, n.name) for n in train_nodes] != [(n.op, n.name) for n in eval_nodes]:
        warnings.warn(
            f"{type(module).__name__}.forward traces to different layers in train and eval mode (a branch on "
            "self.training): hier_pipeline splits the graph traced in "
            f"{'train' if was_training else 'eval'} mode and runs it in both modes. Move the branch into a "
            "submodule listed in leaf_modules to keep it.",
            stacklevel=3,
        )
        return {}
    found: ModeArgs = {}
    for train_node, eval_node in zip(train_nodes, eval_nodes):
        pairs = [(i, a, b) for i, (a, b) in enumerate(zip(train_node.args, eval_node.args))]
        pairs += [(k, v, eval_node.kwargs.get(k)) for k, v in train_node.kwargs.items()]
        for key, in_train, in_eval in pairs:
            if isinstance(in_train, bool) and isinstance(in_eval, bool) and in_train != in_eval:
                found.setdefault(train_node.name, []).append((key, in_train, in_eval))
    return found


def _specialized_defaults(module: nn.Module) -> dict[str, Any]:
    """``forward``'s arguments with a plain default (``None``, a bool, a number, a string), traced as that
    value: a branch on them (``if extra:``, ``if mask is not None:``) cannot be traced symbolically. The
    graph checks each call's value against it (fx's "has been specialized" assertion), so passing another
    value fails loudly instead of running the traced branch. A ``None`` default forward cannot trace as
    ``None`` (it uses it as a tensor) is traced as an input instead (:func:`trace_model`)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return {}
    plain = (type(None), bool, int, float, str)
    return {
        p.name: p.default
        for p in parameters
        if p.default is not inspect.Parameter.empty
        and isinstance(p.default, plain)
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def _state_names(root: nn.Module, node: fx.Node) -> tuple[str | None, tuple[str, ...]]:
    if node.op == "call_function" and isinstance(node.target, ExportedLayer):
        return node.target.owner, node.target.state_names
    if node.op == "call_module":
        sub = root.get_submodule(str(node.target))
        prefix = f"{node.target}."
        names = [prefix + n for n, _ in sub.named_parameters(remove_duplicate=False)]
        names += [prefix + n for n, _ in sub.named_buffers(remove_duplicate=False)]
        return str(node.target), tuple(names)
    if node.op == "get_attr":
        return str(node.target), (str(node.target),)
    return None, ()


def _under(owner: str | None, module: str) -> bool:
    """Whether a layer whose module is ``owner`` runs inside ``module``."""
    return owner is not None and (owner == module or owner.startswith(module + "."))


def _unpacked_later(node: fx.Node) -> bool:
    """Whether a later layer takes an element out of ``node`` by an integer index: the value is then (as
    far as tracing can tell) a tuple or list, such as ``nn.LSTM``'s ``(output, (h, c))``, and a cut, which
    carries one tensor, cannot follow it. A tensor indexed this way loses a possible cut, never a result."""
    return any(
        user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)
        for user in node.users
    )


def _target_text(node: fx.Node) -> str:
    if node.op in ("call_module", "get_attr", "call_method"):
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


class LayerGraph:
    """Layers, clusters and the allowed cuts of a traced model.

    Args:
        module: the model (a LightningModule works: its ``forward`` is traced).
        leaf_modules: qualified names of submodules to keep as one opaque layer (e.g. a block
            with data-dependent control flow that fx cannot trace).
        split_tied_parameters: allow a cut between layers that share a parameter (each stage then
            holds a replica of it); ``False`` keeps such layers in one cluster.
        example_input: what ``forward`` is called with, ``(args, kwargs)`` or a function returning them,
            for the ``torch.export`` capture of a forward fx cannot trace; by default the module's
            ``example_input_array``, else the first batch of its Trainer's loader (``export_capture.py``).
        split_points: module names where stages will begin: under ``torch.export`` each begins a layer.
    """

    def __init__(
        self,
        module: nn.Module,
        leaf_modules: Sequence[str] = (),
        split_tied_parameters: bool = True,
        example_input: Any = None,
        split_points: Sequence[str] = (),
    ) -> None:
        self.root = module
        self.split_tied_parameters = split_tied_parameters
        try:
            self.graph_module = trace_model(module, leaf_modules)
            self.capture = "fx"
        except FxTraceError as fx_failure:
            self.graph_module = _export_instead(module, fx_failure, leaf_modules, split_points, example_input)
            self.capture = "export"
        # forward's arguments traced as their plain default: a call passing another value is refused
        self.specialized: dict[str, Any] = self.graph_module.meta["specialized"]
        # defaults of None that only trace as inputs: a call must pass a value (stage.py checks)
        self.none_traced_as_input: list[str] = self.graph_module.meta["none_traced_as_input"]
        # an exported layer runs the graph of the model's mode itself (export_capture.ExportedLayer)
        self.mode_args = (
            _mode_dependent_args(module, leaf_modules, self.graph_module) if self.capture == "fx" else {}
        )
        # buffers no exported layer writes (a rotary embedding's frequencies): like a tied parameter, each
        # stage whose layers read one holds it, so they do not keep those layers on one stage
        self.replicable_buffers: frozenset[str] = self.graph_module.meta.get("read_only_buffers", frozenset())
        self.num_relays = 0
        self._index_nodes()
        if split_points:  # the same on every rank: each raises its error, before any collective
            self.split_point_starts(split_points)

    def _index_nodes(self) -> None:
        module = self.root
        self.placeholders: list[fx.Node] = []
        self.nodes: list[fx.Node] = []
        self.output_node: fx.Node | None = None
        for node in self.graph_module.graph.nodes:
            if node.op == "placeholder":
                self.placeholders.append(node)
            elif node.op == "output":
                self.output_node = node
            else:
                self.nodes.append(node)
        if not self.nodes:
            raise PipelineTraceError(f"{type(module).__name__}.forward has no layers to split.")
        self.layers: list[Layer] = []
        for i, node in enumerate(self.nodes):
            owner, names = _state_names(module, node)
            self.layers.append(Layer(i, node.name, node.op, _target_text(node), owner, names))
        self.index_of = {layer.name: layer.index for layer in self.layers}
        # inputs of forward after the first (a padding mask, conditioning): they never cross a stage
        # boundary, since every process holds the batch and binds them from its own call of forward
        self.further_inputs = frozenset(p.name for p in self.placeholders[1:])
        self.clusters = self._find_clusters()

    def pad_with_relays(self, num_clusters: int) -> int:
        """Append parameter-free relay layers until the graph has ``num_clusters`` clusters.

        A model that splits into fewer clusters than there are stages (Lightning's one-layer
        ``BoringModel`` on two devices) still runs: the extra stages each hold one relay, which
        passes the model's output on unchanged. It buys no speed; it only lets the pipeline start.
        Returns how many relays were added; 0 when the graph already has enough clusters. A
        forward that returns several values, or none, cannot be relayed as one tensor: the caller
        gets a ``ValueError`` naming the cause.
        """
        missing = num_clusters - self.num_clusters
        if missing <= 0:
            return 0
        assert self.output_node is not None
        value = self.output_node.args[0]
        if not isinstance(value, fx.Node):
            raise ValueError(
                f"hier_pipeline: {num_clusters} stages but {type(self.root).__name__}.forward splits into "
                f"only {self.num_clusters} cluster(s) and returns several values, which cannot be relayed "
                f"to the extra stages as one tensor; use at most {self.num_clusters} devices or split the "
                f"forward further.\n{self.describe()}"
            )
        graph = self.graph_module.graph
        with graph.inserting_before(self.output_node):
            for _ in range(missing):
                value = graph.call_function(relay, (value,))
        self.output_node.args = (value,)
        self.graph_module.recompile()
        self.num_relays += missing
        self._index_nodes()
        return missing

    # ------------------------------------------------------------------ clusters
    def _last_use(self) -> dict[str, int]:
        """Position of each value's last consumer (``len(nodes)`` for the graph output)."""
        end = len(self.nodes)
        last: dict[str, int] = {}
        for node in self.placeholders + self.nodes:
            uses = [end if u.op == "output" else self.index_of[u.name] for u in node.users]
            last[node.name] = max(uses, default=-1)
        return last

    def _find_clusters(self) -> list[Cluster]:
        last = self._last_use()
        placeholder_names = {p.name for p in self.placeholders}
        live: set[str] = {p.name for p in self.placeholders if last[p.name] >= 0}
        cuts: list[tuple[int, str]] = []  # (position of the last layer before the cut, crossing value)
        by_name = {node.name: node for node in self.nodes}
        for pos, node in enumerate(self.nodes[:-1]):
            live.add(node.name)
            live = {name for name in live if last[name] > pos}
            main = live - self.further_inputs  # those do not block a cut
            if len(main) == 1:
                (value,) = main
                if value not in placeholder_names and not _unpacked_later(by_name[value]):
                    cuts.append((pos, value))
        cuts = self._drop_cuts_inside_shared_state(cuts)
        clusters: list[Cluster] = []
        start = 0
        for pos, value in cuts:
            clusters.append(Cluster(len(clusters), start, pos + 1, value))
            start = pos + 1
        clusters.append(Cluster(len(clusters), start, len(self.nodes), None))
        return clusters

    def _drop_cuts_inside_shared_state(self, cuts: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """A buffer used by several layers must not be split across stages (a replica's running statistics
        would drift apart); a shared parameter only when ``split_tied_parameters`` is off."""
        params = dict(self.root.named_parameters(remove_duplicate=False))
        tensors = {**params, **dict(self.root.named_buffers(remove_duplicate=False))}
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for layer in self.layers:
            for name in layer.state_names:
                if self.split_tied_parameters and name in params:
                    continue  # replicated on each stage that uses it (the engine sums the gradients)
                if name in self.replicable_buffers:
                    continue  # never written: each stage reading it holds the same values
                key = id(tensors[name]) if name in tensors else hash(name)
                first.setdefault(key, layer.index)
                last[key] = layer.index
        spans = [(first[k], last[k]) for k in first if last[k] > first[k]]
        return [(pos, v) for pos, v in cuts if not any(a <= pos < b for a, b in spans)]

    # ------------------------------------------------------------------ queries
    @property
    def num_clusters(self) -> int:
        return len(self.clusters)

    def layer_counts(self) -> list[int]:
        return [c.num_layers for c in self.clusters]

    def cluster_layers(self, cluster: Cluster) -> list[Layer]:
        return self.layers[cluster.start : cluster.end]

    def state_names(self, start_cluster: int, end_cluster: int) -> list[str]:
        """Parameter and buffer names owned by clusters ``[start_cluster, end_cluster)``."""
        names: list[str] = []
        seen: set[str] = set()
        for cluster in self.clusters[start_cluster:end_cluster]:
            for layer in self.cluster_layers(cluster):
                for name in layer.state_names:
                    if name not in seen:
                        seen.add(name)
                        names.append(name)
        return names

    def parameter_counts(self) -> list[int]:
        """Number of parameter elements per cluster (for ``partition="parameters"``)."""
        params = dict(self.root.named_parameters(remove_duplicate=False))
        counts = []
        for c in self.clusters:
            names = self.state_names(c.index, c.index + 1)
            counts.append(sum(params[n].numel() for n in names if n in params))
        return counts

    def split_point_starts(self, names: Sequence[str]) -> tuple[int, ...]:
        """The clusters where stages begin at the modules ``names`` (stage k at the k-th name's first layer in
        execution order), after ``0``. A ``ValueError`` names a module that runs no layer, one whose first
        layer cannot begin a stage (with the values a cut there would carry) and names out of order."""
        begins = {cluster.start: cluster.index for cluster in self.clusters}
        firsts: list[int] = []
        for name in names:
            first = self._first_layer_under(name)
            if first is None:
                raise ValueError(
                    f"split_points: {name!r} runs no layer of {type(self.root).__name__}.forward (never "
                    f"called, or inside a layer of its parent). Layers: {[lay.name for lay in self.layers]}"
                )
            if first == 0:  # the module holding the whole model, or the one whose layer runs first
                raise ValueError(
                    f"split_points: a stage cannot begin at {name!r}: its first layer "
                    f"({self.layers[0].name}) is the first of forward, where stage 0 begins. Name a module "
                    f"whose first layer runs later; modules that can begin a stage: "
                    f"{self._split_point_names()}"
                )
            if first not in begins:
                carried = ", ".join(self._values_crossing(first)) or "state shared with earlier layers"
                raise ValueError(
                    f"split_points: a stage cannot begin at {name!r}: a cut before its first layer "
                    f"({self.layers[first].name}) would carry {carried}, and a cut carries one tensor. "
                    f"Modules that can begin a stage: {self._split_point_names()}"
                )
            firsts.append(first)
        if any(b <= a for a, b in zip(firsts, firsts[1:])):
            order = [name for _, name in sorted(zip(firsts, names))]
            raise ValueError(f"split_points={list(names)} must follow the order forward runs them: {order}.")
        return (0, *(begins[first] for first in firsts))

    def _values_crossing(self, position: int) -> list[str]:
        """The values computed before layer ``position`` and read at or after it (forward's further inputs
        excluded: every stage binds them), with the module computing each."""
        last = self._last_use()
        crossing = []
        for node in self.placeholders[:1] + self.nodes[:position]:
            if node.name in self.further_inputs or last[node.name] < position:
                continue
            owner = self.layers[self.index_of[node.name]].owner if node.name in self.index_of else None
            crossing.append(f"`{node.name}`" + (f" (from {owner})" if owner else ""))
        return crossing

    def _first_layer_under(self, name: str) -> int | None:
        """The first layer, in execution order, that runs inside the module ``name`` (a stage named by a
        split point begins there)."""
        return next((layer.index for layer in self.layers if _under(layer.owner, name)), None)

    def _split_point_names(self) -> list[str]:
        """The modules that begin a stage when named in ``split_points``, once each: the module of each
        later cluster's first layer where that layer is the module's first (a module called again further
        on, as a shared dropout, begins a stage only at its first call; forward's own code is no module)."""
        names: list[str] = []
        for cluster in self.clusters[1:]:
            owner = self.layers[cluster.start].owner
            if owner and owner not in names and self._first_layer_under(owner) == cluster.start:
                names.append(owner)
        return names

    def describe(self) -> str:
        lines = []
        for c in self.clusters:
            names = ", ".join(layer.name for layer in self.cluster_layers(c))
            lines.append(f"cluster {c.index}: [{names}]")
        return "\n".join(lines)

    def fetch_attr(self, target: str) -> Any:
        obj: Any = self.root
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj
