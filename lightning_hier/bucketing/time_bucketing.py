"""When to (re)plan time buckets: warm-up, profiling, drift watching.

:class:`TimeBucketing` sees one :class:`StepTimeline` per synchronising backward and answers,
after the optimizer step, whether the engine should switch to a new :class:`TimePlan`. All its
decisions that involve communication happen at step counts every rank agrees on, so ranks issue
the same collectives in the same order:

- steps ``[warmup_steps, warmup_steps + profile_steps)`` are profiled; after the last one the
  per-parameter ready times are averaged over those steps and over all ranks (one all-reduce),
  rank 0 clusters them and broadcasts the plan;
- afterwards every step measures how far the observed bucket-completion times drift from the
  plan's time points, each relative to its own backward's length
  (``|observed_i / T_observed - t_i / T_plan|``, smoothed), so a uniformly slower or faster
  backward is not drift but a change in where the bursts fall is; every ``reprofile_check_every``
  steps the ranks agree (all-reduce MAX) whether the drift exceeds ``reprofile_threshold``; if so, or if the
  set of parameters producing gradients changed, profiling starts again;
- :meth:`request_reprofile` (the ``GradientTimingProfiler`` callback's ``reprofile_every_n_epochs``)
  schedules a new profile at the next agreed check.

On CUDA a step's timeline resolves one step late (:mod:`lightning_hier.bucketing.step_clock`), so
:meth:`TimeBucketing.observe` takes the step each timeline belongs to and whether it ran on the current
bucket layout: the cold first step (lazy CUDA and NCCL set-up) stays out of the profile, the plan is
decided one step later, once the last profiled step has resolved, and a step that ran on the layout
before a rebuild is not measured against the new plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_hier.bucketing.size_plan import ParamInfo
from lightning_hier.bucketing.time_plan import TimePlan, plan_time_buckets
from lightning_hier.checks import MAX_MB

BUCKETING_MODES = ("size", "time", "none")
# the clustering's gap (a fraction of backward's length) and the drift's smoothing: fixed, not user settings
GAP_FRACTION = 0.02
DRIFT_SMOOTHING = 0.3


@dataclass(frozen=True)
class TimeBuckets:
    """Settings of ``bucketing="time"`` (``hier_sliced``, ``hier_bsp``); ``bucketing="time"`` is
    ``TimeBuckets()``. See ``docs/time_bucketing.md``.

    Args:
        profile_steps: steps whose gradient-ready times are averaged into the plan.
        warmup_steps: steps skipped before profiling (the first is slowed by lazy set-up).
        reprofile_threshold: drift of the buckets' send times from the plan, as a fraction of
            backward's length, that starts a new profile (``hier_sliced``).
        reprofile_check_every: steps between the ranks' agreement on drift (``hier_sliced``).
        min_bucket_mb: smallest bucket; smaller clusters join the next.

    A value out of range raises ``ValueError`` naming the field, the value and the valid range.
    """

    profile_steps: int = 3
    warmup_steps: int = 1
    reprofile_threshold: float = 0.25
    reprofile_check_every: int = 20
    min_bucket_mb: float = 1.0

    def __post_init__(self) -> None:
        _check_int(self.profile_steps, "profile_steps", 1)
        _check_int(self.warmup_steps, "warmup_steps", 0)
        in_unit = "a number in (0, 1]"
        _check_real(self.reprofile_threshold, "reprofile_threshold", in_unit, lambda x: 0 < x <= 1)
        _check_int(self.reprofile_check_every, "reprofile_check_every", 1)
        in_size = f"a number in [0, {MAX_MB}]"  # its bytes fit in 64 bits
        _check_real(self.min_bucket_mb, "min_bucket_mb", in_size, lambda x: 0 <= x <= MAX_MB)


TimeBucketingConfig = TimeBuckets  # the name the engines take it by


def _out_of_range(name: str, value: object, valid: str) -> ValueError:
    return ValueError(f"TimeBuckets({name}={value!r}): {name} must be {valid}.")


def _check_int(value: object, name: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise _out_of_range(name, value, f"an integer >= {least}")


def _check_real(value: object, name: str, valid: str, within: Callable[[float], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not within(float(value)):
        raise _out_of_range(name, value, valid)


def resolve_bucketing(
    bucketing: str | TimeBuckets, modes: Sequence[str] = BUCKETING_MODES
) -> tuple[str, TimeBuckets]:
    """A strategy's ``bucketing`` argument as ``(mode, time settings)``: ``"time"`` is ``TimeBuckets()``, a
    :class:`TimeBuckets` is ``"time"`` with its settings; ``ValueError`` naming the valid values otherwise."""
    if isinstance(bucketing, TimeBuckets):
        return "time", bucketing
    if not isinstance(bucketing, str) or bucketing not in modes:
        raise ValueError(f"bucketing={bucketing!r} is not one of {list(modes)} or a TimeBuckets(...).")
    return bucketing, TimeBuckets()


def validate_time_settings(
    bucketing: str, profile_steps: int, warmup_steps: int, reprofile_threshold: float
) -> None:
    """Raise ``ValueError`` naming the setting for a bad bucketing mode or time-bucketing value."""
    resolve_bucketing(bucketing)
    TimeBuckets(
        profile_steps=profile_steps, warmup_steps=warmup_steps, reprofile_threshold=reprofile_threshold
    )


@dataclass
class StepTimeline:
    """What one synchronising backward looked like (seconds; host clock on CPU, CUDA events on GPU)."""

    backward_start: float
    backward_end: float
    ready: list[float | None]  # per parameter, seconds after backward_start
    bucket_bytes: list[int] = field(default_factory=list)
    bucket_launch: list[float] = field(default_factory=list)  # seconds after backward_start
    bucket_done: list[float] = field(default_factory=list)  # seconds after backward_start

    @property
    def backward_seconds(self) -> float:
        return self.backward_end - self.backward_start

    def hidden_fraction(self) -> float:
        """Share of communication time that ran while backward was still running."""
        spans = sorted(zip(self.bucket_launch, self.bucket_done))
        if not spans:
            return 0.0
        total, hidden, cursor = 0.0, 0.0, float("-inf")
        end_of_backward = self.backward_seconds
        for start, done in spans:  # union of the spans, and its part before backward ended
            start = max(start, cursor)
            if done <= start:
                continue
            total += done - start
            hidden += max(0.0, min(done, end_of_backward) - start)
            cursor = done
        return hidden / total if total > 0 else 0.0


class ReadyTimes:
    """Per-parameter gradient-ready times summed over profiled steps; :meth:`packed` sums over ranks with
    one all-reduce (issued by the caller, on whatever thread owns the group) and :meth:`means` reads it."""

    def __init__(self, num_params: int) -> None:
        self._sums = torch.zeros(num_params, dtype=torch.float64)
        self._counts = torch.zeros(num_params, dtype=torch.float64)
        self._backward_sum = 0.0
        self.steps = 0

    def add(self, ready: Sequence[float | None], backward_seconds: float) -> None:
        """One profiled step: each parameter's ready time (``None``: no gradient) and backward's length."""
        for i, seconds in enumerate(ready):
            if seconds is not None:
                self._sums[i] += seconds
                self._counts[i] += 1
        self._backward_sum += backward_seconds
        self.steps += 1

    def clear(self) -> None:
        self._sums.zero_()
        self._counts.zero_()
        self._backward_sum = 0.0
        self.steps = 0

    def packed(self) -> torch.Tensor:
        """Sums, counts, backward sum and steps in one host tensor: all-reduced, every rank's together."""
        return torch.cat([self._sums, self._counts, torch.tensor([self._backward_sum, float(self.steps)])])

    @staticmethod
    def means(packed: torch.Tensor) -> tuple[list[float | None], float]:
        """Mean ready time per parameter (``None`` if it never had a gradient) and mean backward length."""
        n = (packed.numel() - 2) // 2
        sums, counts = packed[:n], packed[n : 2 * n]
        backward = float(packed[2 * n] / max(packed[2 * n + 1].item(), 1.0))
        return [float(sums[i] / counts[i]) if counts[i] > 0 else None for i in range(n)], backward


class TimeBucketing:
    """The profiling / planning / drift-watching state machine for ``bucketing="time"``."""

    def __init__(
        self,
        params: Sequence[ParamInfo],
        cap_bytes: int,
        config: TimeBuckets | None = None,
        group: dist.ProcessGroup | None = None,
        resolves_late: bool = False,
    ) -> None:
        config = config or TimeBuckets()
        # steps between a step's end and its timeline's arrival (CUDA events: the next step's end)
        self.lag = 1 if resolves_late else 0
        self.group = group  # all ranks, with a CPU backend: the statistics and flags are host tensors
        self.config = config
        self.params = list(params)
        self.cap_bytes = cap_bytes
        self.min_bucket_bytes = min(cap_bytes, int(config.min_bucket_mb * 1024 * 1024))
        self.profile_steps = config.profile_steps
        self.warmup_steps = config.warmup_steps
        self.reprofile_threshold = config.reprofile_threshold
        self.check_every = config.reprofile_check_every
        self.gap_fraction = GAP_FRACTION
        self.smoothing = DRIFT_SMOOTHING
        self.plan: TimePlan | None = None
        self.plans_made = 0
        self.drift = 0.0
        self._steps_since_start = 0
        self._profile_start = config.warmup_steps
        self._ready = ReadyTimes(len(self.params))
        self._used_at_plan: frozenset[int] | None = None
        self._reprofile_requested = False

    @property
    def step(self) -> int:
        """The index of the step now running (synchronising steps since the start)."""
        return self._steps_since_start

    @property
    def profiling(self) -> bool:
        """A profile is being taken: its steps are running, or the last of them has yet to resolve."""
        step = self._steps_since_start
        return self._profile_start <= step < self._profile_start + self.profile_steps + self.lag

    def _profiled(self, step: int) -> bool:
        return self._profile_start <= step < self._profile_start + self.profile_steps

    def request_reprofile(self) -> None:
        self._reprofile_requested = True

    def restore(self, plan: TimePlan) -> None:
        """Adopt a plan saved in a checkpoint instead of profiling at start.

        The set of parameters that produce gradients is taken from the first step after it, so a
        later change still triggers a new profile, as it does after a plan made in this run.
        """
        self.plan = plan
        self._profile_start = -(10**9)
        self._used_at_plan = None

    def observe(
        self,
        timeline: StepTimeline,
        globally_used: frozenset[int],
        step: int | None = None,
        same_layout: bool = True,
    ) -> None:
        """Record one synchronising step (called on every rank after the gradients are reduced).

        ``timeline`` is the timeline of step ``step`` (default: the step now running), which ran on the
        current bucket layout unless ``same_layout`` is False; ``globally_used`` is the current step's."""
        step = self._steps_since_start if step is None else step
        if self._profiled(step):
            self._ready.add(timeline.ready, timeline.backward_seconds)
        elif self.plan is not None and not self.profiling:
            if self._used_at_plan is None:
                self._used_at_plan = globally_used
            elif globally_used != self._used_at_plan:
                self._reprofile_requested = True  # every rank sees the same global set
            if same_layout and step >= self._profile_start + self.profile_steps:
                self._update_drift(timeline)

    def _update_drift(self, timeline: StepTimeline) -> None:
        assert self.plan is not None
        observed = timeline.bucket_launch
        if len(observed) != len(self.plan.time_points):
            return
        # positions relative to each backward's own length: a backward that is uniformly slower or
        # faster (a busy machine) keeps the same clusters and must not count as drift
        planned_span = max(self.plan.backward_seconds, self.plan.time_points[-1], 1e-9)
        observed_span = max(timeline.backward_seconds, max(observed), 1e-9)
        step_drift = max(
            abs(o / observed_span - t / planned_span) for o, t in zip(observed, self.plan.time_points)
        )
        self.drift = (1 - self.smoothing) * self.drift + self.smoothing * step_drift

    def after_step(self, globally_used: frozenset[int]) -> TimePlan | None:
        """Advance one step; returns a new plan when the engine should rebuild its buckets."""
        self._steps_since_start += 1
        step = self._steps_since_start
        if step == self._profile_start + self.profile_steps + self.lag:
            plan = self._decide_plan()
            self._used_at_plan = globally_used
            self.plan, self.drift = plan, 0.0
            self.plans_made += 1
            return plan
        # the condition before the collective is the same on every rank (step counts only)
        if (
            self.plan is not None
            and step % self.check_every == 0
            and not self.profiling
            and self._agree_to_reprofile()
        ):
            self._start_profiling()
        return None

    def _agree_to_reprofile(self) -> bool:
        flag = torch.tensor(
            [1.0 if (self.drift > self.reprofile_threshold or self._reprofile_requested) else 0.0]
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self._reprofile_requested = False
        return bool(flag.item() > 0)

    def _start_profiling(self) -> None:
        self._profile_start = self._steps_since_start
        self._ready.clear()

    def _decide_plan(self) -> TimePlan:
        """Average over steps and ranks; rank 0 clusters and broadcasts the plan."""
        stats = self._ready.packed()
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            dist.all_reduce(stats, group=self.group)
        ready, backward = ReadyTimes.means(stats)
        payload: list[TimePlan | None] = [None]
        if not distributed or dist.get_rank() == 0:
            payload[0] = plan_time_buckets(
                self.params, ready, backward, self.cap_bytes, self.min_bucket_bytes, self.gap_fraction
            )
        if distributed:
            dist.broadcast_object_list(payload, src=0, group=self.group)
        assert payload[0] is not None
        return payload[0]
