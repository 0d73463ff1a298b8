"""Every public constructor and the ``plan`` command, fed values of the right and the wrong types and ranges.

The property: a combination with an invalid value raises ``ValueError`` or ``TypeError`` whose message names
an offending setting (never another exception, never accepted), a valid one constructs, and no process
group exists afterwards. Each argument is, independently, left out, valid or invalid; which values are
valid is stated here, beside the strategy that draws them, not read from the code under test. The
``@example`` cases are inputs that once crashed differently or were accepted although invalid.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import string
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lightning_hier import (
    CommProfiler,
    GradientTimingProfiler,
    HierBSPStrategy,
    HierPipelineStrategy,
    HierSlicedStrategy,
    HybridEmbedding,
    Rebalance,
    SlicePlan,
    StageRebalancer,
    TimeBuckets,
)
from lightning_hier.plan.cli import main as plan_main
from lightning_hier.plan.cost_model import DTYPE_BYTES
from lightning_hier.sliced.compressed_hop import INTER_NODE_DTYPES

NAN, INF = math.nan, math.inf
FUZZ = settings(max_examples=120, deadline=None, database=None)  # nothing written into the tree

Case = tuple[dict[str, Any], frozenset[str]]  # keyword arguments, and the names of the invalid ones


@dataclass(frozen=True)
class Arg:
    """The values an argument may take, and values it must refuse."""

    valid: st.SearchStrategy | None
    invalid: st.SearchStrategy
    required: bool = False  # always given (its default is not valid on its own)


def one_of(*values: Any) -> st.SearchStrategy:
    return st.sampled_from(values)


def positive_ints(low: int = 1, high: int = 10**6) -> st.SearchStrategy:
    return st.integers(low, high)


def not_int(*extra: Any) -> st.SearchStrategy:
    """Not an integer: floats (even whole ones), booleans, strings, lists."""
    return one_of(2.0, 1.5, True, False, "2", NAN, INF, [2], *extra)


def ints_below(bound: int) -> st.SearchStrategy:
    return st.integers(-(10**6), bound - 1)


BOOL = Arg(st.booleans(), one_of(1, 0, "yes", "", None))
PATH_OR_NONE = Arg(one_of(None, "out", Path("out")), one_of(5, ["out"], b"out", 1.5))
NAMES = Arg(
    st.one_of(st.just(()), st.lists(one_of("Lion", "Sophia", "MyAdam"), max_size=3)),
    one_of("Adam", 5, None, [5], [""], ["Adam", None], {"Adam": 1}),
)
MEGABYTES = Arg(
    st.one_of(st.floats(1e-6, 1e6), positive_ints(1, 1000)),
    st.one_of(st.floats(max_value=0.0), one_of(NAN, INF, 1e308, 2.0**44, "25", None, True, [25])),
)
DEVICES_PER_NODE = Arg(st.one_of(st.none(), positive_ints(1, 8)), st.one_of(ints_below(1), not_int()))


def cases(args: dict[str, Arg]) -> st.SearchStrategy[Case]:
    """Keyword arguments for a constructor: about half the time all valid, else one or two invalid."""

    @st.composite
    def draw(draw_: Callable) -> Case:
        names = sorted(args)
        wrong = (
            draw_(st.sets(st.sampled_from(names), min_size=1, max_size=2)) if draw_(st.booleans()) else set()
        )
        kwargs: dict[str, Any] = {}
        for name in names:
            arg = args[name]
            if name in wrong or (arg.valid is None and arg.required):
                kwargs[name] = draw_(arg.invalid)
            elif arg.valid is not None and (arg.required or draw_(st.booleans())):
                kwargs[name] = draw_(arg.valid)
        return kwargs, frozenset(wrong)

    return draw()


def regressions(examples: list[Case]) -> Callable:
    """``@example`` for each case (kwargs and the names of its invalid settings, stated by hand)."""

    def decorate(test: Callable) -> Callable:
        for case in reversed(examples):
            test = example(case=case)(test)
        return test

    return decorate


def check(build: Callable[..., Any], kwargs: dict[str, Any], offenders: frozenset[str] | set[str]) -> Any:
    """The property: ``build(**kwargs)`` constructs when nothing offends, else raises ``ValueError`` or
    ``TypeError`` naming one of ``offenders``; either way no process group is left."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations and ignored-DDP-argument warnings are not the point
        try:
            if not offenders:
                return build(**kwargs)
            with pytest.raises((ValueError, TypeError)) as info:
                build(**kwargs)
            message = str(info.value)
            assert any(name in message for name in offenders), (kwargs, sorted(offenders), message)
        finally:
            assert not dist.is_initialized()
    return None


# ---------------------------------------------------------------------- hier_sliced
INTER_NODE_DTYPE = Arg(
    st.sampled_from(list(INTER_NODE_DTYPES)), one_of("fp4", "BF16", "", ["bf16"], 16, True, torch.bfloat16)
)
SLICED = {
    "devices_per_node": DEVICES_PER_NODE,
    "slice_weights": Arg(
        st.one_of(
            one_of("equal", "memory", "memory+compute"),
            st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=4),
            st.just([1e308, 1e308]),
        ),
        st.one_of(
            one_of("bogus", "Equal", "", [], None, 5, 1.0, {"a": 1.0}),
            st.tuples(
                st.lists(st.floats(1e-3, 1e3), max_size=2), one_of(0, 0.0, -1.0, NAN, INF, "1", True, None)
            ).map(lambda t: [*t[0], t[1]]),
        ),
    ),
    "bucket_cap_mb": MEGABYTES,
    "inter_node_dtype": INTER_NODE_DTYPE,
    "broadcast_buffers": BOOL,
    "checkpoint_format": Arg(one_of("consolidated", "sharded"), one_of("Sharded", "", None, ["sharded"])),
    "bucketing": Arg(one_of("size", "time", "none", TimeBuckets()), one_of("fast", "", None, ["time"], 1)),
    "elementwise_optimizers": NAMES,
    "shard_optimizer": Arg(one_of(None, True, False), one_of(1, 0, "yes", "auto")),
}


def sliced_conflicts(kwargs: dict[str, Any], wrong: frozenset[str]) -> set[str]:
    weights, devices = kwargs.get("slice_weights", "equal"), kwargs.get("devices_per_node")
    if {"slice_weights", "devices_per_node"} & wrong or isinstance(weights, str) or devices is None:
        return set()
    return {"slice_weights"} if len(weights) != devices else set()


@FUZZ
@given(case=cases(SLICED))
@regressions(
    [
        ({"bucket_cap_mb": INF}, frozenset({"bucket_cap_mb"})),  # accepted, then int(inf) at setup
        ({"bucket_cap_mb": "25"}, frozenset({"bucket_cap_mb"})),  # a TypeError naming nothing
        ({"bucket_cap_mb": True}, frozenset({"bucket_cap_mb"})),  # accepted as 1 MB
        ({"inter_node_dtype": ["bf16"]}, frozenset({"inter_node_dtype"})),  # "unhashable type: 'list'"
        ({"elementwise_optimizers": "Adam"}, frozenset({"elementwise_optimizers"})),  # taken as A, d, a, m
        ({"elementwise_optimizers": 5}, frozenset({"elementwise_optimizers"})),  # "'int' is not iterable"
        ({"elementwise_optimizers": [5]}, frozenset({"elementwise_optimizers"})),
        ({"shard_optimizer": "yes"}, frozenset({"shard_optimizer"})),
        ({"broadcast_buffers": "no"}, frozenset({"broadcast_buffers"})),  # a truthy string: buffers broadcast
        ({"slice_weights": [True, 2]}, frozenset({"slice_weights"})),
        ({"slice_weights": ["1", "2"]}, frozenset({"slice_weights"})),
        ({"slice_weights": [1e308, 1e308], "devices_per_node": 2}, frozenset()),  # valid: see SlicePlan
    ]
)
def test_hier_sliced_strategy(case: Case) -> None:
    kwargs, wrong = case
    check(HierSlicedStrategy, kwargs, wrong | sliced_conflicts(kwargs, wrong))


# ---------------------------------------------------------------------- hier_bsp
BSP = {
    "superstep": Arg(
        st.one_of(
            st.integers(1, 10**30),
            st.timedeltas(min_value=timedelta(microseconds=1)),
            one_of("500ms", "2s", "1.5min", "1h", " 3 s", ".5s", "1e-3h"),
        ),
        st.one_of(
            ints_below(1),
            one_of(4.0, 0.5, NAN, INF, "4", "0s", "-1s", "1e999s", "5 parsecs", "", None, True, [4]),
            one_of(timedelta(0), timedelta(seconds=-1)),
        ),
    ),
    "max_staleness": Arg(positive_ints(0, 100), st.one_of(ints_below(0), not_int(None))),
    "fill_idle": Arg(positive_ints(0, 5), st.one_of(ints_below(0), not_int(None))),
    "gradient_average": Arg(one_of("folded", "nominal"), one_of("mean", "", None, ["folded"])),
    "devices_per_node": DEVICES_PER_NODE,
    "bucket_cap_mb": MEGABYTES,
    "log_supersteps": BOOL,
    "elementwise_optimizers": NAMES,
    "bucketing": Arg(one_of("size", "time", TimeBuckets()), one_of("none", "fast", None, ["size"])),
    "inter_node_dtype": INTER_NODE_DTYPE,
}


def bsp_conflicts(kwargs: dict[str, Any], wrong: frozenset[str]) -> set[str]:
    """The rules between settings, where the settings involved are valid on their own."""
    found: set[str] = set()
    superstep = kwargs.get("superstep", 4)
    steps = superstep if isinstance(superstep, int) else None
    staleness, fill = kwargs.get("max_staleness", 1), kwargs.get("fill_idle", 0)
    if not {"superstep", "max_staleness", "fill_idle"} & wrong and fill and (staleness != 0 or steps is None):
        found.add("fill_idle")
    if "superstep" not in wrong and kwargs.get("gradient_average") == "nominal" and steps is None:
        found.add("gradient_average")
    lockstep = staleness == 0 and steps is not None and fill == 0
    timed = kwargs.get("bucketing", "size") != "size"
    if not {"superstep", "max_staleness", "fill_idle", "bucketing"} & wrong and timed and not lockstep:
        found.add("bucketing")
    return found


@FUZZ
@given(case=cases(BSP))
@regressions(
    [
        ({"bucket_cap_mb": INF}, frozenset({"bucket_cap_mb"})),
        ({"bucket_cap_mb": "x"}, frozenset({"bucket_cap_mb"})),
        ({"log_supersteps": "x"}, frozenset({"log_supersteps"})),
        ({"elementwise_optimizers": "Adam"}, frozenset({"elementwise_optimizers"})),
        ({"superstep": 10**30}, frozenset()),  # a huge step count is a valid (if odd) setting
        ({"inter_node_dtype": ["int8"]}, frozenset({"inter_node_dtype"})),
    ]
)
def test_hier_bsp_strategy(case: Case) -> None:
    kwargs, wrong = case
    check(HierBSPStrategy, kwargs, wrong | bsp_conflicts(kwargs, wrong))


# ---------------------------------------------------------------------- hier_pipeline
NAME_TEXT = st.text(alphabet=string.ascii_lowercase + "._0123456789", min_size=1, max_size=8)
PIPELINE = {
    "micro_batches": Arg(positive_ints(1, 64), st.one_of(ints_below(1), not_int(None))),
    "schedule": Arg(one_of("1f1b", "gpipe"), one_of("1F1B", "", None, ["gpipe"], 1)),
    "partition": Arg(
        st.one_of(
            one_of("parameters", "uniform", "time"),
            st.lists(positive_ints(1, 5), min_size=1, max_size=4),
            st.lists(NAME_TEXT, min_size=1, max_size=3, unique=True),
        ),
        st.one_of(
            one_of("balanced", "", None, 5, [], [0], [True, 2], [1.5], ["a", "a"], [""], ["a", 1], b"\x01"),
            st.lists(st.integers(-3, 0), min_size=1, max_size=3),
        ),
    ),
    "rebalance": Arg(
        st.one_of(one_of("epoch", "never", Rebalance(every=5, min_gain=0.5)), positive_ints(1, 10**9)),
        one_of(0, -1, 2.0, True, None, "always", ["epoch"]),
    ),
    "memory_limit": Arg(st.one_of(st.none(), positive_ints(1, 2**50)), one_of(0, -1, 1e9, True, "1GB", NAN)),
    "profile_steps": Arg(positive_ints(1, 100), st.one_of(ints_below(1), not_int(None))),
    "leaf_modules": Arg(
        st.one_of(st.just(()), st.lists(NAME_TEXT, max_size=3)),
        one_of("blocks", 5, None, [5], [""], ["a", None]),
    ),
    "activation_policy": Arg(one_of("auto", "keep", "swap", "recompute"), one_of("off", None, ["keep"])),
    "static_shapes": BOOL,
    "split_tied_parameters": BOOL,
    "stages": Arg(st.one_of(st.none(), positive_ints(1, 8)), one_of(0, -1, True, 2.0, "2")),
}


@FUZZ
@given(case=cases(PIPELINE))
@regressions(
    [
        ({"micro_batches": True}, frozenset({"micro_batches"})),  # accepted as one micro-batch
        ({"partition": None}, frozenset({"partition"})),  # "'NoneType' object is not iterable"
        ({"partition": 5}, frozenset({"partition"})),
        ({"partition": [True, 2]}, frozenset({"partition"})),
        ({"partition": ["a", "a"]}, frozenset({"partition"})),  # refused only at setup, after tracing
        ({"partition": [""]}, frozenset({"partition"})),
        ({"memory_limit": True}, frozenset({"memory_limit"})),  # a limit of one byte
        ({"profile_steps": True}, frozenset({"profile_steps"})),
        ({"leaf_modules": "blocks"}, frozenset({"leaf_modules"})),  # taken as b, l, o, c, k, s
        ({"leaf_modules": 5}, frozenset({"leaf_modules"})),  # "'int' object is not iterable"
        ({"leaf_modules": [5]}, frozenset({"leaf_modules"})),
        ({"stages": True}, frozenset({"stages"})),
    ]
)
def test_hier_pipeline_strategy(case: Case) -> None:
    kwargs, wrong = case
    strategy = check(HierPipelineStrategy, kwargs, wrong)
    if strategy is not None and "leaf_modules" in kwargs:
        assert strategy.settings.leaf_modules == tuple(kwargs["leaf_modules"])


# ---------------------------------------------------------------------- Rebalance and TimeBuckets
NEGATIVE = st.floats(max_value=-1e-9)
REBALANCE = {
    "every": Arg(
        st.one_of(one_of("epoch", "never"), positive_ints(1, 10**9)), one_of(0, -1, True, 2.0, None, "x")
    ),
    "imbalance_threshold": Arg(st.floats(0, 1e6), st.one_of(NEGATIVE, one_of(NAN, INF, "0.1", True, None))),
    "balance_tolerance": Arg(st.floats(0, 1e6), st.one_of(NEGATIVE, one_of(NAN, INF, "0.1", True, None))),
    "min_gain": Arg(
        st.floats(0, 0.999), st.one_of(st.floats(1, 1e6), NEGATIVE, one_of(NAN, INF, True, None, "0.1"))
    ),
}


@FUZZ
@given(case=cases(REBALANCE))
def test_rebalance(case: Case) -> None:
    check(Rebalance, *case)


TIME_BUCKETS = {
    "profile_steps": Arg(st.integers(1, 10**30), st.one_of(ints_below(1), not_int(None))),
    "warmup_steps": Arg(positive_ints(0, 100), st.one_of(ints_below(0), not_int(None))),
    "reprofile_threshold": Arg(
        st.floats(0, 1, exclude_min=True),
        st.one_of(
            st.floats(max_value=0), st.floats(min_value=1, exclude_min=True), one_of(NAN, "0.5", True, None)
        ),
    ),
    "reprofile_check_every": Arg(positive_ints(1, 1000), st.one_of(ints_below(1), not_int(None))),
    "min_bucket_mb": Arg(
        st.floats(0, 1e6), st.one_of(NEGATIVE, one_of(NAN, INF, 1e308, 2.0**44, "1", True, None))
    ),
}


@FUZZ
@given(case=cases(TIME_BUCKETS))
@regressions([({"min_bucket_mb": 1e308}, frozenset({"min_bucket_mb"}))])  # OverflowError at the first step
def test_time_buckets(case: Case) -> None:
    check(TimeBuckets, *case)


# ---------------------------------------------------------------------- SlicePlan
@FUZZ
@given(weights=st.lists(st.floats(min_value=1e-300, max_value=1e308), min_size=1, max_size=8))
@example(weights=[1e308, 1e308])  # the sum overflowed to inf: every share became 0
def test_slice_plan_shares_are_the_weights_normalised(weights: list[float]) -> None:
    plan = SlicePlan(tuple(weights))
    assert math.isclose(sum(plan.weights), 1.0, rel_tol=1e-9)
    largest = max(weights)
    for share, weight in zip(plan.weights, weights):
        assert math.isclose(share / max(plan.weights), weight / largest, rel_tol=1e-9, abs_tol=1e-12)


@FUZZ
@given(
    weights=st.tuples(st.lists(st.floats(1e-3, 1e3), max_size=3), one_of(0.0, -1.0, NAN, INF, -INF)).map(
        lambda t: (*t[0], t[1])
    )
)
@example(weights=(NAN, 1.0))  # accepted: nan <= 0 is False
@example(weights=(INF, 1.0))  # accepted, with shares (nan, 0.0)
@example(weights=())
def test_slice_plan_refuses_weights_that_are_not_positive_and_finite(weights: tuple[float, ...]) -> None:
    check(SlicePlan, {"weights": weights}, {"slice weights"})


# ---------------------------------------------------------------------- HybridEmbedding
NON_NEGATIVE_OR_NONE = Arg(
    st.one_of(st.none(), st.floats(0, 10)), st.one_of(NEGATIVE, one_of(NAN, INF, "x", True))
)
HYBRID = {
    "num_embeddings": Arg(
        positive_ints(1, 10**6),
        st.one_of(ints_below(1), one_of(4.5, True, "4", NAN, None, 10**30)),
        required=True,
    ),
    "embedding_dim": Arg(
        positive_ints(1, 64), st.one_of(ints_below(1), one_of(2.5, True, None, "8")), required=True
    ),
    "mode": Arg(one_of(None, "sum", "mean"), one_of("max", "", ["sum"])),
    "optimizer": Arg(one_of("sgd", "adagrad", "adam"), one_of("adamw", None, "")),
    "lr": Arg(st.floats(1e-8, 10), st.one_of(st.floats(max_value=0), one_of(NAN, INF, "0.1", None, True))),
    "init": Arg(one_of("normal", "uniform", "zeros"), one_of("xavier", None)),
    "init_scale": NON_NEGATIVE_OR_NONE,
    "path": Arg(None, one_of(5, ["t.tbl"], 1.5)),
    "hashed_ids": BOOL,
    "seed": Arg(st.integers(0, 2**64 - 1), st.one_of(ints_below(0), one_of(2**64, 1.5, True, "0", None))),
    "dtype": Arg(
        one_of(None, torch.float32, torch.float16, torch.bfloat16, torch.float64),
        one_of(torch.int64, torch.int8, "float32", torch.complex64, [torch.float32]),
    ),
    "eps": NON_NEGATIVE_OR_NONE,
    "betas": Arg(
        st.tuples(st.floats(0, 0.999), st.floats(0, 0.999)),
        one_of((1.0, 0.9), (0.9,), None, (0.9, NAN), ("a", "b"), (-0.1, 0.5), (0.9, 0.99, 0.1), 0.9),
    ),
    "node_merge": Arg(one_of("leader", "shared"), one_of("all", None)),
    "prefault": BOOL,
}


@FUZZ
@given(case=cases(HYBRID))
@regressions(
    [
        ({"num_embeddings": 4.5, "embedding_dim": 2}, frozenset({"num_embeddings"})),
        ({"num_embeddings": True, "embedding_dim": 2}, frozenset({"num_embeddings"})),
        ({"num_embeddings": "4", "embedding_dim": 2}, frozenset({"num_embeddings"})),  # a TypeError
        ({"num_embeddings": 10**30, "embedding_dim": 2}, frozenset({"num_embeddings"})),  # struct.error later
        ({"num_embeddings": 4, "embedding_dim": 2, "lr": INF}, frozenset({"lr"})),
        ({"num_embeddings": 4, "embedding_dim": 2, "lr": "x"}, frozenset({"lr"})),
        ({"num_embeddings": 4, "embedding_dim": 2, "init_scale": NAN}, frozenset({"init_scale"})),
        ({"num_embeddings": 4, "embedding_dim": 2, "init_scale": -1.0}, frozenset({"init_scale"})),
        ({"num_embeddings": 4, "embedding_dim": 2, "dtype": torch.int64}, frozenset({"dtype"})),
        ({"num_embeddings": 4, "embedding_dim": 2, "dtype": "float32"}, frozenset({"dtype"})),
        ({"num_embeddings": 4, "embedding_dim": 2, "eps": -1.0}, frozenset({"eps"})),
        ({"num_embeddings": 4, "embedding_dim": 2, "betas": (2.0, 0.9)}, frozenset({"betas"})),
        ({"num_embeddings": 4, "embedding_dim": 2, "betas": (0.9,)}, frozenset({"betas"})),
        ({"num_embeddings": 4, "embedding_dim": 2, "seed": -1}, frozenset({"seed"})),  # OverflowError later
        ({"num_embeddings": 4, "embedding_dim": 2, "seed": 2**70}, frozenset({"seed"})),
        ({"num_embeddings": 4, "embedding_dim": 2, "hashed_ids": "x"}, frozenset({"hashed_ids"})),
        ({"num_embeddings": 4, "embedding_dim": 2, "path": 5}, frozenset({"path"})),  # a TypeError
    ]
)
def test_hybrid_embedding(case: Case) -> None:
    kwargs, wrong = case
    check(HybridEmbedding, kwargs, wrong)


def test_a_hybrid_embedding_of_a_valid_seed_initialises_on_its_first_forward() -> None:
    # the largest seed the constructor accepts is one the hashed initialisation can mix
    module = HybridEmbedding(4, 2, hashed_ids=True, seed=2**64 - 1)
    assert module(torch.tensor([123456789])).shape == (1, 2)


# ---------------------------------------------------------------------- callbacks
EVERY_OR_NONE = Arg(
    st.one_of(st.none(), positive_ints()), st.one_of(ints_below(1), one_of(1.5, NAN, True, "1"))
)
COMM_PROFILER = {
    "log_every_n_steps": EVERY_OR_NONE,
    "output_dir": PATH_OR_NONE,
    "filename": Arg(
        st.text(string.ascii_letters + "_-", min_size=1, max_size=12), one_of("", None, "a/b", 5)
    ),
    "save_figure": BOOL,
    "print_summary": BOOL,
    "ddp_timing_every": EVERY_OR_NONE,
    "time_every_n_steps": EVERY_OR_NONE,
}


@FUZZ
@given(case=cases(COMM_PROFILER))
@regressions(
    [
        ({"log_every_n_steps": "x"}, frozenset({"log_every_n_steps"})),  # a TypeError naming nothing
        ({"log_every_n_steps": True}, frozenset({"log_every_n_steps"})),
        ({"ddp_timing_every": NAN}, frozenset({"ddp_timing_every"})),
        ({"filename": "a/b"}, frozenset({"filename"})),  # the CSV's write fails after training
        ({"filename": None}, frozenset({"filename"})),
        ({"output_dir": 5}, frozenset({"output_dir"})),
    ]
)
def test_comm_profiler(case: Case) -> None:
    check(CommProfiler, *case)


GRADIENT_TIMING = {
    "reprofile_every_n_epochs": EVERY_OR_NONE,
    "log_every_n_steps": Arg(positive_ints(), st.one_of(ints_below(1), one_of(1.5, NAN, None, "1"))),
    "max_logged_buckets": Arg(positive_ints(0), st.one_of(ints_below(0), one_of(1.5, None, "x", True))),
    "save_figure": BOOL,
    "output_dir": PATH_OR_NONE,
}


@FUZZ
@given(case=cases(GRADIENT_TIMING))
@regressions(
    [
        ({"reprofile_every_n_epochs": NAN}, frozenset({"reprofile_every_n_epochs"})),
        ({"log_every_n_steps": None}, frozenset({"log_every_n_steps"})),  # a TypeError naming nothing
        ({"log_every_n_steps": 1.5}, frozenset({"log_every_n_steps"})),
        ({"max_logged_buckets": -1}, frozenset({"max_logged_buckets"})),
        ({"max_logged_buckets": "x"}, frozenset({"max_logged_buckets"})),
    ]
)
def test_gradient_timing_profiler(case: Case) -> None:
    check(GradientTimingProfiler, *case)


@FUZZ
@given(case=cases({"save_figure": BOOL, "output_dir": PATH_OR_NONE}))
@regressions(
    [({"save_figure": "x"}, frozenset({"save_figure"})), ({"output_dir": 5}, frozenset({"output_dir"}))]
)
def test_stage_rebalancer(case: Case) -> None:
    check(StageRebalancer, *case)


# ---------------------------------------------------------------------- python -m lightning_hier plan
def _numbers(values: st.SearchStrategy) -> st.SearchStrategy:
    return values.map(str)


PLAN = {
    "nodes": Arg(_numbers(positive_ints(1, 64)), one_of("0", "-1", "1.5", "x", "")),
    "devices-per-node": Arg(_numbers(positive_ints(1, 16)), one_of("0", "-2", "x", "2.5", ""), required=True),
    "intra-bandwidth": Arg(
        one_of("300GB/s", "50GB/s", "2e9", "100Mbit", "25 Gbit/s"),
        one_of("0", "-1GB/s", "fast", "inf", "1e999GB/s", "nan", "", "3 parsecs"),
        required=True,
    ),
    "inter-bandwidth": Arg(
        one_of("400Gbit/s", "12.5GB/s", "1e9", "100Mbit"),
        one_of("0", "-1Gbit/s", "slow", "inf", "1e999Gbit", "nan", ""),
        required=True,
    ),
    "latency": Arg(
        one_of("5us", "2ms", "0", "0.1s", "1e-6s"), one_of("-1us", "1e999s", "fast", "5 parsecs", "nan")
    ),
    "params": Arg(
        one_of("7e9", "1e3", "123456", "1.5e12"),
        one_of("0", "-1", "nan", "inf", "1e999", "1e308", "x", ""),
        required=True,
    ),
    "dtype": Arg(st.sampled_from(sorted(DTYPE_BYTES)), one_of("int4", "FP32", "")),
    "bucket-mb": Arg(one_of("25", "0.5", "1000"), one_of("0", "-1", "nan", "inf", "1e308", "x")),
    "backward": Arg(one_of("120ms", "0", "1s"), one_of("-5ms", "1e999s", "x", "nan")),
    "superstep-steps": Arg(_numbers(positive_ints(1, 16)), one_of("0", "-3", "1.5", "x")),
    "world-size": Arg(_numbers(positive_ints(1, 256)), one_of("0", "-8", "x", "2.5")),
    "slice-weights": Arg(
        st.lists(st.floats(0.1, 10).map(str), min_size=1, max_size=4),
        st.tuples(
            st.lists(st.floats(0.1, 10).map(str), max_size=2), one_of("0", "nan", "inf", "-1", "x")
        ).map(lambda t: [*t[0], t[1]]),
    ),
}


def plan_argv(kwargs: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in kwargs.items():
        if name == "slice-weights":
            argv += ["--slice-weights", *value]
        else:
            argv.append(f"--{name}={value}")
    return argv


def _whole(text: str) -> int | None:
    return int(text) if re.fullmatch(r"[0-9]+", text) else None


def plan_conflicts(kwargs: dict[str, Any], wrong: frozenset[str]) -> set[str]:
    found: set[str] = set()
    devices = None if "devices-per-node" in wrong else _whole(kwargs["devices-per-node"])
    if ("nodes" in kwargs) == ("world-size" in kwargs):  # one of them, not both
        found.add("nodes")
    world = kwargs.get("world-size")
    if "world-size" not in wrong and world is not None and devices is not None and int(world) % devices:
        found.add("world-size")
    weights = kwargs.get("slice-weights")
    if (
        "slice-weights" not in wrong
        and weights is not None
        and devices is not None
        and len(weights) != devices
    ):
        found.add("slice-weights")
    return found


def run_plan(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = plan_main(argv)
        except SystemExit as exit_:  # argparse's refusals
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def _spoken(text: str) -> str:
    return re.sub(r"[-_]", " ", text.lower())


BASE_PLAN = {
    "nodes": "2",
    "devices-per-node": "4",
    "intra-bandwidth": "300GB/s",
    "inter-bandwidth": "400Gbit/s",
}


def _plan_case(wrong: str, **options: Any) -> Case:
    kwargs = {**BASE_PLAN, "params": "7e9", **{k.replace("_", "-"): v for k, v in options.items()}}
    return kwargs, frozenset({wrong} if wrong else set())


@FUZZ
@given(case=cases(PLAN))
@regressions(
    [
        _plan_case("params", params="inf"),  # OverflowError: cannot convert float infinity to integer
        _plan_case("params", params="1e308"),  # the same, from 4e308 bytes
        _plan_case("bucket-mb", bucket_mb="inf"),  # accepted
        _plan_case("backward", backward="1e999s"),  # accepted: an infinite backward
        _plan_case("slice-weights", slice_weights=["inf", "1", "1", "1"]),  # a table of nan
        _plan_case("intra-bandwidth", intra_bandwidth="1e-320"),  # a table of inf
        _plan_case("world-size", nodes=None, world_size="0"),  # the message named nodes only
        _plan_case("", slice_weights=["1e308", "1e308", "1", "1"]),  # valid: the shares are computed scaled
        _plan_case("", nodes="1", devices_per_node="1"),  # valid: no communication, and no "vs ddp" of nan
    ]
)
def test_plan_command(case: Case) -> None:
    kwargs, wrong = case
    kwargs = {name: value for name, value in kwargs.items() if value is not None}
    offenders = wrong | plan_conflicts(kwargs, wrong)
    code, out, err = run_plan(plan_argv(kwargs))
    if not offenders:
        assert code == 0, (kwargs, err)
        assert "ddp (flat ring)" in out
        assert not re.search(r"\b(nan|inf)\b", out, re.IGNORECASE), out
    else:
        assert code == 2, (kwargs, sorted(offenders), code, out)
        assert any(_spoken(name) in _spoken(err) for name in offenders), (kwargs, sorted(offenders), err)
    assert not dist.is_initialized()
