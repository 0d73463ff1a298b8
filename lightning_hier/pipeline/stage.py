"""Run one stage's share of a traced model, and time every layer while doing so.

The stage interprets its slice of the fx graph node by node (rather than building a sub
``GraphModule``) because its slice changes at run time when layers migrate: re-slicing is just a
new ``[start, end)``. Layers call the model's own submodules, so parameters keep their names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from lightning_hier.pipeline.activation_store import storage_bytes
from lightning_hier.pipeline.graph import LayerGraph
from lightning_hier.pipeline.layer_rng import (
    layer_seed,
    may_draw_random,
    may_draw_random_ever,
    module_draws_random,
    seeded,
)
from lightning_hier.pipeline.partition import StagePartition

if TYPE_CHECKING:
    from lightning_hier.pipeline.weight_grad import WeightGradients

KEEP = "keep"
_NEVER, _ALWAYS, _ASK = 0, 1, 2  # whether a node may draw random numbers (layer_rng.py)


def _random_kind(node: fx.Node, module: torch.nn.Module | None) -> int:
    """``_NEVER`` / ``_ALWAYS`` where the answer cannot change between calls, ``_ASK`` for a module that
    may draw in some mode and setting (a dropout draws nothing in eval mode or with p=0)."""
    if node.op != "call_module" or module is None:
        return _ALWAYS if may_draw_random(node, None) else _NEVER
    # a user's module is asked too: layer_rng answers "may draw" for it in either mode, at once
    return _ASK if may_draw_random_ever(module) else _NEVER


@dataclass(slots=True)
class _NodePlan:
    """One node of this stage, with what running it needs resolved (see ``StageExecutor._plan_node``)."""

    index: int
    node: fx.Node
    op: str
    fn: Any  # the module or function; a method is looked up on its object at each call
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    arg_slots: tuple[tuple[int, str], ...] | None  # (position, node name); None: nested, use map_arg
    kwarg_slots: tuple[tuple[str, str], ...]
    follows_mode: list[tuple[int | str, bool, bool]] | None
    random: int
    free: tuple[str, ...]  # values no later layer of this stage reads
    exit_cluster: int | None
    cluster_end: bool


LayerRun = Callable[[str, str, Callable[..., Any], tuple[Any, ...]], Any]


def _in_current_mode(
    args: Any, kwargs: dict[str, Any], follows_mode: list[tuple[int | str, bool, bool]], training: bool
) -> tuple[Any, dict[str, Any]]:
    """``args`` / ``kwargs`` with each mode-following bool (``self.training`` at trace time) set for the
    module's mode now."""
    args, kwargs = list(args), dict(kwargs)
    for key, in_train, in_eval in follows_mode:
        value = in_train if training else in_eval
        if isinstance(key, int):
            args[key] = value
        else:
            kwargs[key] = value
    return tuple(args), kwargs


class LayerTimes:
    """Running sums of per-layer forward and backward seconds (per micro-batch) and exit bytes.

    Counts are weights: :meth:`age` scales sums and counts alike, so the means stay and every later
    sample weighs more than each earlier one.
    """

    def __init__(self, num_layers: int, num_clusters: int) -> None:
        self.forward = [0.0] * num_layers
        self.backward = [0.0] * num_layers
        self.forward_count = [0.0] * num_layers
        self.backward_count = [0.0] * num_layers
        self.exit_bytes = [0] * num_clusters
        self.input_bytes = [0] * num_layers

    def mean_forward(self, layer: int) -> float:
        """Mean forward seconds (0 where unmeasured); aged weights may lie below one sample."""
        count = self.forward_count[layer]
        return self.forward[layer] / count if count else 0.0

    def mean_backward(self, layer: int) -> float:
        count = self.backward_count[layer]
        return self.backward[layer] / count if count else 0.0

    def summary(self, layers: range) -> dict[int, tuple[float, float]]:
        """``{layer: (mean forward s, mean backward s)}`` for layers measured at least once."""
        return {i: (self.mean_forward(i), self.mean_backward(i)) for i in layers if self.forward_count[i] > 0}

    def age(self, keep: float) -> None:
        """Keep what was measured so far at weight ``keep`` (0 < keep <= 1) against each new sample."""
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep={keep} must lie in (0, 1].")
        for values in (self.forward, self.backward, self.forward_count, self.backward_count):
            values[:] = [v * keep for v in values]


class StageClock:
    """Time stamps for per-layer timing: ``perf_counter`` on CPU, CUDA events on a GPU.

    GPU kernels run asynchronously, so a host clock would time their launch only; CUDA events
    are recorded on the stream and read once the device has passed them (``StageExecutor.resolve``).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ready(self, mark: Any) -> bool:
        """Whether ``mark`` can be read without waiting for the device."""
        return not self.cuda or mark.query()


class StageExecutor:
    """Executes clusters ``partition.stage_ranges()[stage]`` of ``graph``.

    ``forward(value)`` takes the single value entering the stage (for stage 0: the model's
    forward arguments) and returns the single value leaving it (the model's output on the last
    stage). Per-layer forward time is taken between consecutive nodes' clock marks (one mark per
    node boundary). Backward time is measured per cluster, by one gradient hook on the last
    differentiable output of each cluster, registered after the forward so its cost falls in no
    layer's time (the time between the gradient reaching it and the next hook firing), and shared
    among the cluster's layers in proportion to their forward times: rebalancing moves whole
    clusters and the memory plan reads the stage's total, so a hook per layer (about 25 us each on
    CPU, 64 per micro-batch in a 16-block MLP) would buy resolution nothing reads.
    """

    def __init__(
        self, graph: LayerGraph, partition: StagePartition, stage: int, device: torch.device | None = None
    ) -> None:
        self.graph = graph
        self.clock = StageClock(device)
        self._pending_forward: list[tuple[range, list[Any]]] = []  # (layers, marks) per forward
        self._module_cache: dict[int, torch.nn.Module] = {}
        self._pending_backward: list[tuple[list[tuple[Any, int]], Any]] = []
        self._pending_weight: list[list[tuple[int, Any, Any]]] = []
        self.stage = stage
        self.times = LayerTimes(len(graph.layers), graph.num_clusters)
        self.policies: dict[str, str] = {}
        self.layer_run: LayerRun | None = None
        self.timing = True  # whether the next forward (and its backward) records per-layer times
        self.timed_forwards = 0  # forwards timed since the last reset_times()
        self._events: list[tuple[Any, int]] = []
        self.device = device
        self.rng_base: int | None = None  # set by the engine: every stage the same (layer_rng.py)
        self.rng_position = (0, 0)  # (step, micro-batch) of the forward about to run
        # set by the engine where this stage splits its backward (pipeline/weight_grad.py)
        self.weight_grads: WeightGradients | None = None
        self.set_partition(partition)

    # ------------------------------------------------------------------ placement
    def set_partition(self, partition: StagePartition) -> None:
        if partition.num_clusters != self.graph.num_clusters:
            raise ValueError(
                f"partition has {partition.num_clusters} clusters, the model {self.graph.num_clusters}."
            )
        self.partition = partition
        first, last = partition.stage_ranges()[self.stage]
        clusters = self.graph.clusters
        self.cluster_range = range(first, last)
        self.layer_range = range(clusters[first].start, clusters[last - 1].end)
        self.entry_value = clusters[first - 1].exit_value if first > 0 else None
        self.exit_value = clusters[last - 1].exit_value
        self.is_first = first == 0
        self.is_last = last == self.graph.num_clusters
        last_use: dict[str, int] = {}
        for i in self.layer_range:
            for arg in self.graph.nodes[i].all_input_nodes:
                last_use[arg.name] = i
        keep = {self.exit_value} if self.exit_value is not None else set()
        self._free_after: dict[int, list[str]] = {}
        if not self.is_last:
            for name, i in last_use.items():
                if name not in keep:
                    self._free_after.setdefault(i, []).append(name)
        self._exit_of_layer = {
            clusters[c].end - 1: c for c in self.cluster_range if clusters[c].exit_value is not None
        }
        self._cluster_ends = {clusters[c].end - 1 for c in self.cluster_range}
        # forward's further inputs this (later) stage's layers read, bound from its own call of forward
        read = {arg.name for i in self.layer_range for arg in self.graph.nodes[i].all_input_nodes}
        self.reads_inputs = [] if self.is_first else sorted(read & self.graph.further_inputs)
        self._plan = [self._plan_node(i) for i in self.layer_range]

    def is_timing(self) -> bool:
        """Whether the forward running (or the last one) records per-layer times."""
        return self.timing

    def stage_modules(self) -> list[torch.nn.Module]:
        """The modules this stage's layers call."""
        return [step.fn for step in self._plan if step.op == "call_module"]

    def functional_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters this stage's graph reads directly (``get_attr``), outside any module call."""
        found = []
        for step in self._plan:
            if step.op == "get_attr":
                value = self.graph.fetch_attr(str(step.node.target))
                if isinstance(value, torch.nn.Parameter):
                    found.append(value)
        return found

    def _plan_node(self, i: int) -> _NodePlan:
        """What running node ``i`` needs, read once per partition instead of at every call (the loop over
        a stage's nodes runs per micro-batch; on a GPU its Python time is the step's floor)."""
        node = self.graph.nodes[i]
        fn: Any = None
        if node.op == "call_module":
            fn = self._module(i, str(node.target))
        elif node.op == "call_function":
            fn = node.target
        args, kwargs = node.args, dict(node.kwargs)
        flat = all(not isinstance(a, (list, tuple, dict, slice)) for a in (*args, *kwargs.values()))
        slots = tuple((k, a.name) for k, a in enumerate(args) if isinstance(a, fx.Node))
        module = fn if node.op == "call_module" else None
        return _NodePlan(
            index=i,
            node=node,
            op=node.op,
            fn=fn,
            args=args,
            kwargs=kwargs,
            arg_slots=slots if flat else None,
            kwarg_slots=tuple((k, a.name) for k, a in kwargs.items() if isinstance(a, fx.Node)),
            follows_mode=self.graph.mode_args.get(node.name),
            random=_random_kind(node, module),
            free=tuple(self._free_after.get(i, ())),
            exit_cluster=self._exit_of_layer.get(i),
            cluster_end=i in self._cluster_ends,
        )

    def state_names(self) -> list[str]:
        return self.graph.state_names(self.cluster_range.start, self.cluster_range.stop)

    # ------------------------------------------------------------------ forward
    def _bind_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        env: dict[str, Any] = {}
        placeholders = self.graph.placeholders
        if len(args) > len(placeholders):
            raise TypeError(f"forward takes {len(placeholders)} inputs, got {len(args)}.")
        for node, value in zip(placeholders, args):
            env[node.name] = value
        for node in placeholders[len(args) :]:
            name = str(node.target).lstrip("*")
            if name in kwargs:
                env[node.name] = kwargs[name]
            elif node.args:
                env[node.name] = node.args[0]
            else:
                raise TypeError(f"forward is missing the input {name!r}.")
        self._check_specialized(env)
        return env

    def _check_specialized(self, env: dict[str, Any]) -> None:
        """A clear error for an argument traced as its default (``mask=None``) that a call now passes
        (fx's own assertion names neither the cause nor the fix), and for one whose default ``None`` did
        not trace (traced as an input) that a call leaves at ``None``."""
        specialized, as_inputs = self.graph.specialized, self.graph.none_traced_as_input
        if not specialized and not as_inputs:
            return
        for node in self.graph.placeholders:
            name = str(node.target).lstrip("*")
            if name in as_inputs and env.get(node.name) is None:
                model = type(self.graph.root).__name__
                raise ValueError(
                    f"hier_pipeline traced {model}.forward with '{name}' as an input (forward uses its "
                    "value, so its default None does not trace), but this call leaves it None. "
                    f"Pass '{name}' on every call of forward, or make forward trace with None (``if "
                    f"{name} is None: ...`` cannot be traced; compute the default inside a submodule "
                    "listed in leaf_modules)."
                )
            if name not in specialized or node.name not in env:
                continue
            default, value = specialized[name], env[node.name]
            if value is default or (type(value) is type(default) and value == default):
                continue
            passed = f"a {type(value).__name__}" if isinstance(value, torch.Tensor) else repr(value)
            raise ValueError(
                f"hier_pipeline traced {type(self.graph.root).__name__}.forward with {name}={default!r}, its "
                f"default (a plain default is traced as a constant so that a branch on it traces), but this "
                f"call passes {passed}. Make '{name}' a required argument of forward (no default) to have it "
                "traced as an input, or leave it at its default."
            )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run this stage; stage 0 takes the model's inputs, the others the value sent to them."""
        if self.is_first:
            return self._run(self._bind_inputs(args, kwargs))
        (value,) = args
        return self.forward_received(value)

    def forward_received(
        self, value: Any, call_args: tuple[Any, ...] = (), call_kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run a later stage on the ``value`` sent to it; ``call_args`` / ``call_kwargs`` are this
        process's own call of ``forward`` (every process holds the batch), from which the further inputs
        its layers read (:attr:`reads_inputs`, a padding mask) are bound."""
        env: dict[str, Any] = {self.entry_value: value}
        if self.reads_inputs:
            bound = self._bind_inputs(call_args, call_kwargs or {})
            env.update((name, bound[name]) for name in self.reads_inputs)
        return self._run(env)

    def _run(self, env: dict[str, Any]) -> Any:
        record_backward = self.timing and torch.is_grad_enabled()
        if self.timing:
            self.timed_forwards += 1
        begin = getattr(self.layer_run, "begin_forward", None)
        if begin is not None:
            begin()
        graph = self.graph
        timing = self.timing
        # one clock mark per node boundary: node k ran from marks[k] to marks[k + 1]
        marks = [self.clock.mark()] if timing else None
        recording = self.weight_grads
        if recording is not None and not recording.is_recording:
            recording = None
        hookable: tuple[int, torch.Tensor] | None = None  # the cluster's last differentiable output
        to_hook: list[tuple[int, torch.Tensor]] = []  # hooked after the loop, outside the layers' marks
        for step in self._plan:
            if recording is not None:
                recording.layer = step.index
            value = self._run_node(step, env)
            if marks is not None:
                marks.append(self.clock.mark())
            env[step.node.name] = value
            if record_backward:
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    hookable = (step.index, value)
                if step.cluster_end and hookable is not None:
                    to_hook.append(hookable)
                    hookable = None
            if step.exit_cluster is not None and timing:
                exit_value = env[graph.clusters[step.exit_cluster].exit_value]
                if isinstance(exit_value, torch.Tensor):
                    self.times.exit_bytes[step.exit_cluster] = exit_value.numel() * exit_value.element_size()
            for name in step.free:
                env.pop(name, None)
        for layer, tensor in to_hook:
            tensor.register_hook(self._backward_hook(layer))
        if marks is not None:
            self._pending_forward.append((self.layer_range, marks))
            if not self.clock.cuda:
                self.resolve()
        if self.is_last:
            assert graph.output_node is not None
            return fx.node.map_arg(graph.output_node.args[0], lambda n: env[n.name])
        return env[self.exit_value]

    def _module(self, i: int, target: str) -> torch.nn.Module:
        # modules keep their identity across migrations (only tensors' storage moves): cache them
        module = self._module_cache.get(i)
        if module is None:
            module = self._module_cache[i] = self.graph.root.get_submodule(target)
        return module

    def _run_node(self, step: _NodePlan, env: dict[str, Any]) -> Any:
        if step.op == "get_attr":
            return self.graph.fetch_attr(str(step.node.target))
        if step.arg_slots is not None:  # the usual case: nodes and constants, no containers
            args: Any = step.args
            if step.arg_slots:
                filled = list(args)
                for k, name in step.arg_slots:
                    filled[k] = env[name]
                args = tuple(filled)
            kwargs = step.kwargs
            if step.kwarg_slots:
                kwargs = dict(kwargs)
                for key, name in step.kwarg_slots:
                    kwargs[key] = env[name]
        else:
            lookup = env.__getitem__
            args = fx.node.map_arg(step.args, lambda n: lookup(n.name))
            kwargs = fx.node.map_arg(step.kwargs, lambda n: lookup(n.name)) if step.kwargs else {}
        if step.follows_mode:
            args, kwargs = _in_current_mode(args, kwargs, step.follows_mode, self.graph.root.training)
        fn: Callable[..., Any] = step.fn
        if step.op == "call_method":
            self_obj, *rest = args
            fn = getattr(self_obj, str(step.node.target))
            args = tuple(rest)
        i = step.index
        if self.timing and self.times.forward_count[i] == 0:  # once per timing window
            # what a recompute checkpoint stashes: parameters and the received input stay anyway
            self.times.input_bytes[i] = storage_bytes(args, skip_parameters=True)
        if self.rng_base is not None and (
            step.random == _ALWAYS or (step.random == _ASK and module_draws_random(step.fn))
        ):
            # asked at every call for torch modules that may draw: nothing in eval mode or with p=0
            step_index, micro = self.rng_position
            with seeded(layer_seed(self.rng_base, step_index, micro, i), self.device):
                return self._call(step.node, fn, args, kwargs)
        return self._call(step.node, fn, args, kwargs)

    def _call(
        self, node: fx.Node, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        policy = self.policies.get(node.name, KEEP)
        if self.layer_run is None or (policy == KEEP and not self.layer_run_always):
            return fn(*args, **kwargs)
        call = (lambda *a: fn(*a, **kwargs)) if kwargs else fn
        return self.layer_run(node.name, policy, call, tuple(args))

    layer_run_always = False

    # ------------------------------------------------------------------ backward timing
    def _backward_hook(self, layer: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            # autograd runs a device's backward on one thread, so hooks fire in time order; a split
            # backward's weights' pass times itself (pipeline/weight_grad.py)
            split = self.weight_grads
            if split is None or not split.in_weight_pass:
                self._events.append((self.clock.mark(), layer))

        return hook

    def _share_backward(self, hooked: int, below: int, seconds: float) -> None:
        """Book the backward ``seconds`` measured from the hook on layer ``hooked`` to the next one
        (on layer ``below``, or the stage's start) to layers ``below + 1 .. hooked``, in proportion to
        their mean forward times (evenly where those are all zero)."""
        times = self.times
        backward, backward_count = times.backward, times.backward_count
        layers = range(below + 1, hooked + 1)
        weights = [times.mean_forward(i) for i in layers]
        total = sum(weights)
        for i, weight in zip(layers, weights):
            backward[i] += seconds * (weight / total if total > 0 else 1.0 / len(layers))
            backward_count[i] += 1

    def finish_backward(self) -> None:
        """Close one micro-batch's backward: its gradient-arrival marks become layer intervals."""
        if self._events:
            self._pending_backward.append((self._events, self.clock.mark()))
        self._events = []
        if not self.clock.cuda:
            self.resolve()

    def resolve(self, wait: bool = True) -> None:
        """Turn the recorded marks into per-layer seconds.

        On a GPU, ``wait`` synchronizes once and reads every mark; without it only the micro-batches
        the device has already finished are read and the rest stay pending, so the step's end never
        makes the host wait for the device (a synchronize there would drain the queue every step and
        leave the GPU idle while the host runs Lightning's loop). Whatever reads the times (a rebalance
        check, the memory plan) resolves with ``wait`` first.
        """
        split = self.weight_grads
        if split is not None and split.weight_times:
            self._pending_weight.extend(split.weight_times)
            split.weight_times = []
        if not (self._pending_forward or self._pending_backward or self._pending_weight):
            return
        if wait or not self.clock.cuda:
            self.clock.synchronize()
            forwards, backwards = self._pending_forward, self._pending_backward
            weights = self._pending_weight
            self._pending_forward, self._pending_backward, self._pending_weight = [], [], []
        else:
            ready = self.clock.ready
            forwards, backwards, weights = [], [], []
            pending_forward, pending_backward, pending_weight = [], [], []
            for entry in self._pending_forward:
                (forwards if ready(entry[1][-1]) else pending_forward).append(entry)
            for entry in self._pending_backward:
                (backwards if ready(entry[1]) else pending_backward).append(entry)
            for passes in self._pending_weight:
                (weights if ready(passes[-1][2]) else pending_weight).append(passes)
            self._pending_forward, self._pending_backward = pending_forward, pending_backward
            self._pending_weight = pending_weight
        forward, forward_count = self.times.forward, self.times.forward_count
        seconds = self.clock.seconds
        for layers, marks in forwards:
            for i, start, end in zip(layers, marks, marks[1:]):
                forward[i] += seconds(start, end)
                forward_count[i] += 1
        first = self.layer_range.start - 1
        for events, end in backwards:
            for (mark, layer), (next_mark, below) in zip(events, events[1:] + [(end, first)]):
                self._share_backward(layer, below, seconds(mark, next_mark))
        # a split backward's weights' pass: its layer's share of the micro-batch's backward, counted with
        # the input pass above (the mean stays per micro-batch)
        backward = self.times.backward
        for passes in weights:
            for layer, start, end in passes:
                backward[layer] += seconds(start, end)

    def age_times(self, keep: float) -> None:
        """Carry the measurements on at weight ``keep``: the layers and their device did not change."""
        self.resolve()
        self.times.age(keep)

    def reset_times(self) -> None:
        self._pending_forward.clear()
        self._pending_backward.clear()
        self._pending_weight.clear()
        self.timed_forwards = 0
        self.times = LayerTimes(len(self.graph.layers), self.graph.num_clusters)
