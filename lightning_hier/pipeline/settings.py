"""Validated settings of ``hier_pipeline`` and the initial partition they ask for."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_hier.checks import check_names, is_integer, is_real
from lightning_hier.pipeline.graph import LayerGraph
from lightning_hier.pipeline.partition import StagePartition, partition_balanced, partition_uniform
from lightning_hier.pipeline.replicas import ReplicaLayout
from lightning_hier.pipeline.schedule import SCHEDULES

PARTITION_MODES = ("parameters", "uniform", "time")
ACTIVATION_POLICIES = ("auto", "keep", "swap", "recompute")


def _plain_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_non_negative(value: object) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value >= 0  # type: ignore[arg-type,operator]


@dataclass(frozen=True)
class Rebalance:
    """When ``hier_pipeline`` re-splits its stages from measured layer times, and how eagerly.

    ``HierPipelineStrategy(rebalance=Rebalance(every=50, imbalance_threshold=0.2))``; in a LightningCLI
    config ``rebalance: {class_path: lightning_hier.Rebalance, init_args: {every: 50}}``. See
    ``docs/hier_pipeline.md`` (section "Rebalance").

    Args:
        every: ``"epoch"`` (check at each epoch's last step), ``"never"``, or check every N optimizer steps.
        imbalance_threshold: re-split when ``(max - min) / mean`` of the stage times exceeds this.
        balance_tolerance: splits whose slowest stage is within this fraction of the best one compete on
            the bytes crossing stage boundaries (fewest wins).
        min_gain: apply a new split only if its slowest stage is predicted at least this fraction faster
            than the current slowest stage (no back-and-forth on measurement noise); in ``[0, 1)``.
    """

    every: Literal["epoch", "never"] | int = "epoch"
    imbalance_threshold: float = 0.1
    balance_tolerance: float = 0.02
    min_gain: float = 0.05

    def __post_init__(self) -> None:
        every = self.every
        if isinstance(every, bool) or not (
            every in ("epoch", "never") or (isinstance(every, int) and every >= 1)
        ):
            raise ValueError(
                f"Rebalance.every must be 'epoch', 'never' or a positive number of optimizer steps "
                f"(rebalance=N), got {every!r}."
            )
        for name in ("imbalance_threshold", "balance_tolerance"):
            value = getattr(self, name)
            if not _finite_non_negative(value):
                raise ValueError(f"Rebalance.{name} must be a finite number >= 0, got {value!r}.")
        if not (_finite_non_negative(self.min_gain) and self.min_gain < 1):
            raise ValueError(f"Rebalance.min_gain must be in [0, 1), got {self.min_gain!r}.")

    @classmethod
    def of(cls, value: Rebalance | str | int) -> Rebalance:
        """``value`` as a ``Rebalance``: one as it is; ``"epoch"``, ``"never"`` or N as its ``every``."""
        return value if isinstance(value, Rebalance) else cls(every=value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class PipelineSettings:
    """Everything the pipeline engine reads, flat; invalid values raise at construction.

    ``HierPipelineStrategy`` builds it from its arguments (the ``rebalance``, ``imbalance_threshold``,
    ``balance_tolerance`` and ``min_rebalance_gain`` fields from a :class:`Rebalance`)."""

    stages: int | None = None
    micro_batches: int = 4
    schedule: str = "1f1b"
    partition: str | Sequence[int] | Sequence[str] = "parameters"
    rebalance: str | int = "epoch"
    imbalance_threshold: float = 0.1
    balance_tolerance: float = 0.02
    min_rebalance_gain: float = 0.05
    memory_limit: int | None = None
    swap_bandwidth: float | None = None
    profile_steps: int = 3
    leaf_modules: tuple[str, ...] = ()
    activation_policy: str = "auto"
    static_shapes: bool = False
    split_tied_parameters: bool = True
    extra_warmup: int | str = "auto"
    split_backward: bool = False
    split_points: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.stages is not None and (not is_integer(self.stages) or self.stages < 1):
            raise ValueError(f"stages must be a positive integer or None, got {self.stages!r}.")
        if not is_integer(self.micro_batches) or self.micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive integer, got {self.micro_batches!r}.")
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {list(SCHEDULES)}.")
        if isinstance(self.partition, str):
            if self.partition not in PARTITION_MODES:
                raise ValueError(
                    f"partition={self.partition!r} is not one of {list(PARTITION_MODES)}, a list of clusters "
                    "per stage, or a list of layer names where stages begin."
                )
        else:
            sequence = isinstance(self.partition, Sequence) and not isinstance(self.partition, bytes)
            items = list(self.partition) if sequence else []
            if not items or not (
                all(_plain_int(i) for i in items) or all(isinstance(i, str) and i for i in items)
            ):
                raise ValueError(
                    f"partition={self.partition!r}: give clusters per stage (positive integers) or the layer "
                    "names where stages 1..K-1 begin (strings)."
                )
            if _plain_int(items[0]) and any(i < 1 for i in items):
                raise ValueError(f"partition={items}: every stage needs at least one cluster.")
            if isinstance(items[0], str) and len(set(items)) != len(items):
                raise ValueError(f"partition={items}: a layer name where a stage begins appears twice.")
        self.rebalance_config()  # the rebalance family's checks, in one place
        if self.memory_limit is not None and (not is_integer(self.memory_limit) or self.memory_limit < 1):
            raise ValueError(
                f"memory_limit must be a positive number of bytes or None, got {self.memory_limit!r}."
            )
        if self.swap_bandwidth is not None and not (
            is_real(self.swap_bandwidth) and 0 < self.swap_bandwidth < math.inf
        ):
            raise ValueError(f"swap_bandwidth must be positive bytes/s or None, got {self.swap_bandwidth!r}.")
        object.__setattr__(self, "leaf_modules", check_names("leaf_modules", self.leaf_modules))
        if self.activation_policy not in ACTIVATION_POLICIES:
            raise ValueError(
                f"activation_policy={self.activation_policy!r} is not one of {list(ACTIVATION_POLICIES)}."
            )
        if not isinstance(self.static_shapes, bool):
            raise ValueError(f"static_shapes must be True or False, got {self.static_shapes!r}.")
        if not isinstance(self.split_tied_parameters, bool):
            raise ValueError(
                f"split_tied_parameters must be True or False, got {self.split_tied_parameters!r}."
            )
        if self.extra_warmup != "auto" and (
            isinstance(self.extra_warmup, bool)
            or not isinstance(self.extra_warmup, int)
            or self.extra_warmup < 0
        ):
            raise ValueError(
                f"extra_warmup must be 'auto' or an integer >= 0 (extra forwards per stage before its first "
                f"backward), got {self.extra_warmup!r}."
            )
        if not isinstance(self.split_backward, bool):
            raise ValueError(f"split_backward must be True or False, got {self.split_backward!r}.")
        if not is_integer(self.profile_steps) or self.profile_steps < 1:
            raise ValueError(f"profile_steps must be a positive integer, got {self.profile_steps!r}.")
        self._check_split_point_names()

    def _check_split_point_names(self) -> None:
        points = self.split_points
        if isinstance(points, (str, bytes)) or not isinstance(points, Iterable):
            raise ValueError(f"split_points must be a list of module names (strings), got {points!r}.")
        points = tuple(points)
        if not all(isinstance(point, str) and point for point in points):
            raise ValueError(f"split_points must be a list of module names (strings), got {points!r}.")
        if len(set(points)) != len(points):
            raise ValueError(f"split_points={list(points)}: a module where a stage begins appears twice.")
        if points and self.partition != "parameters":
            raise ValueError(
                f"split_points={list(points)} and partition={self.partition!r} both say where stages begin; "
                "give one of them."
            )
        object.__setattr__(self, "split_points", points)

    def check_split_points(self, world_size: int, module: Any) -> None:
        """``split_points`` names one submodule of ``module`` per stage after the first (called before the
        process group exists; their order and whether each can begin a stage are checked once the forward
        is captured, on every rank alike: ``LayerGraph.split_point_starts``)."""
        points = self.split_points
        if not points:
            return
        stages = self.stages if self.stages is not None else world_size
        if len(points) != stages - 1:
            raise ValueError(
                f"split_points={list(points)} names {len(points)} module(s) where stages begin, but {stages} "
                f"stages need {stages - 1}: stage k begins at the k-th name (stage 0 where forward begins)."
            )
        if module is None:
            return
        modules = dict(module.named_modules())
        missing = [point for point in points if point not in modules]
        if missing:
            close = {p: difflib.get_close_matches(p, list(modules), n=1) for p in missing}
            hints = "; ".join(f"{p!r}: did you mean {c[0]!r}?" for p, c in close.items() if c)
            raise ValueError(
                f"split_points {missing} are not submodules of {type(module).__name__} (names as "
                f"named_modules() gives them){': ' + hints if hints else ''}."
            )

    def rebalance_config(self) -> Rebalance:
        """The rebalance fields as the :class:`Rebalance` they came from."""
        return Rebalance(
            every=self.rebalance,  # type: ignore[arg-type]
            imbalance_threshold=self.imbalance_threshold,
            balance_tolerance=self.balance_tolerance,
            min_gain=self.min_rebalance_gain,
        )

    def check_world_size(self, world_size: int) -> None:
        """``stages`` divides the processes, which run ``world_size / stages`` replicas of the pipeline, and a
        partition list describes that many stages (called before the process group exists)."""
        stages = ReplicaLayout.of_world(world_size, self.stages).stages
        if not isinstance(self.partition, str):
            items = list(self.partition)
            expected = len(items) if isinstance(items[0], int) else len(items) + 1
            if expected != stages:
                launched = (
                    f"the Trainer launches {world_size} process(es)"
                    if self.stages is None
                    else f"stages={self.stages}"
                )
                raise ValueError(f"partition={items} describes {expected} stages but {launched}.")


def _module_start(graph: LayerGraph, module: str) -> int | None:
    """The cluster that the first layer (in execution order) calling into ``module`` begins, if any."""
    prefix = module + "."
    begins = {cluster.start: cluster.index for cluster in graph.clusters}
    for position, layer in enumerate(graph.layers):
        if layer.owner is not None and (layer.owner == module or layer.owner.startswith(prefix)):
            return begins.get(position)
    return None


def _cluster_label(graph: LayerGraph, layer_index: int) -> str:
    """How a user names the layer beginning a cluster: the module it calls, else its fx node name."""
    layer = graph.layers[layer_index]
    return layer.owner if layer.owner is not None else layer.name


def _starts_from_names(graph: LayerGraph, names: Sequence[str]) -> tuple[int, ...]:
    """Cluster indices where the stages named by ``names`` begin. A name is a layer's fx node name, the
    module it calls (``"blocks.12.fc1"``), or a module holding layers (``"blocks.12"``): the stage then
    begins at that module's first layer in execution order, which must begin a cluster."""
    cluster_start: dict[str, int] = {}
    for cluster in graph.clusters:
        first = graph.layers[cluster.start]
        cluster_start[first.name] = cluster.index
        if first.owner is not None:
            cluster_start.setdefault(first.owner, cluster.index)
    starts = [0]
    for name in names:
        index = cluster_start.get(name)
        if index is None:
            index = _module_start(graph, name)
        if index is None:
            valid = [_cluster_label(graph, cluster.start) for cluster in graph.clusters]
            raise ValueError(
                f"partition: stages can only begin where a cluster begins; {name!r} does not. Valid split "
                f"points (a module holding them works too): {valid[1:]}"
            )
        starts.append(index)
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"partition: split points {list(names)} must be in execution order and distinct.")
    return tuple(starts)


def initial_partition(graph: LayerGraph, settings: PipelineSettings, num_stages: int) -> StagePartition:
    """The split training starts with (``"time"`` starts like ``"parameters"``)."""
    n = graph.num_clusters
    if num_stages > n:
        raise ValueError(
            f"hier_pipeline: {num_stages} stages but the model splits into only {n} cluster(s) "
            f"(single-entry/single-exit layer groups); use at most {n} stages.\n{graph.describe()}"
        )
    if settings.split_points:
        return StagePartition(graph.split_point_starts(settings.split_points), n)
    mode = settings.partition
    if mode == "uniform":
        return partition_uniform(graph.layer_counts(), num_stages)
    if mode in ("parameters", "time"):
        counts = [float(c) for c in graph.parameter_counts()]
        if sum(counts) == 0:
            return partition_uniform(graph.layer_counts(), num_stages)
        return partition_balanced(counts, num_stages, None, 0.0)
    items = list(mode)
    if isinstance(items[0], int):
        if sum(items) != n:
            raise ValueError(f"partition={items} covers {sum(items)} clusters; the model has {n}.")
        starts = [0]
        for count in items[:-1]:
            starts.append(starts[-1] + count)
        return StagePartition(tuple(starts), n)
    return StagePartition(_starts_from_names(graph, items), n)
