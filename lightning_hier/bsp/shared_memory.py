"""The shared-memory module between a worker and its local BSP module.

It holds the newest announced model (one flat tensor per bucket, with its version) and the worker's
aggregated gradient with its micro-step count, plus the few flags the two sides exchange. The worker
is the training loop on the main thread, the local BSP module a background thread of the same
process, so "shared memory" is this process's memory behind one lock: a thread instead of a helper
process keeps the model and gradients on the worker's own device (a CUDA tensor cannot be shared
with another process without IPC handles and a second CUDA context per GPU).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from lightning_hier.bsp.aggregate import GradientAggregate, ReadOut
from lightning_hier.bsp.controller import (
    ABORT,
    BLOCKED,
    BUSY_MS,
    DRAIN,
    ELAPSED_MS,
    EPOCH_END,
    FIT_END,
    FOLDED,
    INFLIGHT,
    READY,
    ROW,
    STEP_MS,
    STUCK,
)
from lightning_hier.bsp.settings import BSPSettings
from lightning_hier.bsp.stream_handoff import StreamHandoff


class BSPStopped(RuntimeError):
    """The local BSP module ended (a peer died or the job is shutting down)."""


class SharedModelMemory:
    """Model, aggregate and flags shared by one worker and its local BSP module (all under one lock)."""

    def __init__(
        self, flat_params: Sequence[torch.Tensor], settings: BSPSettings, num_params: int = 0
    ) -> None:
        self.settings = settings
        self.cond = threading.Condition()
        # on CUDA the local BSP module's own stream, and the events ordering it against the worker's
        self.handoff = StreamHandoff(flat_params[0].device)
        self.published = [t.detach().clone() for t in flat_params]
        self.version = 0  # models announced so far (the initial one is version 0)
        self.aggregate = GradientAggregate(flat_params, num_params)
        self.in_flight = -1  # version the worker computes from, -1 between micro-steps
        self.started_since_pickup = 0
        self.picked_up = 0  # version the worker last copied
        self.closing = False
        self.draining = False
        self.paused = True  # the local BSP module starts paused; the first begin_step resumes it
        self.stopping = False
        self.aborted = False  # the worker's training raised: stop with the others, without a drain
        self.epoch_ended = False  # this worker ran out of batches (set with draining)
        self.peer_epoch_ended = False  # some worker ran out of batches: end this epoch too
        self.fit_ended = False  # this worker reached max_steps (set with draining)
        self.peer_fit_ended = False  # some worker reached max_steps: end the fit too
        self.error: BaseException | None = None
        self.event = False  # the worker changed something the controller should hear about soon
        self.clip: tuple[str, float] | None = None
        self.hyper: list[dict] | None = None  # the optimizer's settings (lr, ...) at the last fold
        # buckets of the superstep's last micro-step already folded, while the worker is in it (the
        # local module may push those before the close); -1 otherwise
        self.ready_buckets = -1
        # the worker's micro-step cycle (start to next start, waits excluded) and of that the part from
        # start to fold, each an average of the recent ones; when its current cycle started
        # (time.monotonic(); None while it waits)
        self.step_s = 0.0
        self.busy_s = 0.0
        self.started_at: float | None = None
        # fill_idle: until when (time.monotonic()) a slower worker is expected to compute from model
        # fill_version, as the local module last heard
        self.fill_until = 0.0
        self.fill_version = -1

    # ------------------------------------------------------------------ worker side (main thread)
    def blocked(self) -> bool:
        """Whether the worker must wait for the next model (or a resume) before another micro-step."""
        quota = self.settings.quota
        return (
            self.draining
            or (quota is not None and self.started_since_pickup >= quota and not self._may_fill())
            or (self.settings.max_staleness == 0 and self.closing)
        )

    def _may_fill(self) -> bool:
        """``fill_idle``: another micro-step from the newest model is allowed and would end before a
        slower worker's."""
        return (
            self.started_since_pickup < (self.settings.quota or 0) + self.settings.fill_idle
            and self.busy_s > 0
            and self.picked_up == self.version == self.fill_version
            and time.monotonic() + self.busy_s <= self.fill_until
        )

    def cycle_ends(self, now: float) -> None:
        """At the start of ``begin_step``: the cycle that started with the previous micro-step ends
        (not counted when the worker was paused in between: validation, a checkpoint)."""
        if self.started_at is not None and not self.paused:
            self.step_s = _recent_mean(self.step_s, now - self.started_at)
        self.started_at = None

    def cycle_starts(self, now: float) -> None:
        """A micro-step starts (after any wait for a model)."""
        self.started_at = now

    def micro_step_folded(self, now: float) -> None:
        """The micro-step's gradients are folded: its start-to-fold time joins the average."""
        if self.started_at is not None:
            self.busy_s = _recent_mean(self.busy_s, now - self.started_at)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise BSPStopped(f"hier_bsp stopped: {self.error}") from self.error

    def wait(self, timeout: float, what: str) -> None:
        """Wait (lock held) for a notification; raise after ``timeout`` seconds without one."""
        start = time.monotonic()
        if not self.cond.wait(timeout):
            raise BSPStopped(f"hier_bsp: no {what} after {time.monotonic() - start:.0f} s (timeout).")
        self.raise_if_failed()

    def notify(self) -> None:
        self.event = True
        self.cond.notify_all()

    # ------------------------------------------------------------------ module side (BSP thread)
    def status_row(self) -> list[int]:
        row = [0] * ROW
        row[FOLDED] = self.aggregate.count
        row[INFLIGHT] = self.in_flight
        row[BLOCKED] = int(self.in_flight < 0 and self.blocked())
        row[STUCK] = int(row[BLOCKED] and (self.draining or self.picked_up == self.version))
        row[DRAIN] = int(self.draining)
        row[EPOCH_END] = int(self.epoch_ended)
        row[FIT_END] = int(self.fit_ended)
        row[READY] = self.ready_buckets
        row[STEP_MS] = round(self.step_s * 1000)
        row[BUSY_MS] = round(self.busy_s * 1000)
        started = self.started_at
        row[ELAPSED_MS] = -1 if started is None else round((time.monotonic() - started) * 1000)
        row[ABORT] = int(self.aborted)
        self.event = False
        return row

    def read_out(self) -> ReadOut:
        return self.aggregate.read_out()

    @torch.no_grad()
    def announce(self, flat_params: Sequence[torch.Tensor]) -> None:
        """Publish a new model version (called by the local BSP module after a pull)."""
        self.handoff.module_takes_over()  # the worker's copy of the previous version is done
        for target, source in zip(self.published, flat_params):
            target.copy_(source)
        self.handoff.module_hands_over()
        self.version += 1
        self.closing = False
        self.ready_buckets = -1  # a new superstep opens: nothing of it is ready to push
        self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()


def _recent_mean(mean: float, sample: float) -> float:
    """An exponential average over about the last ten micro-steps: a persistent straggler shows, a
    process the OS held back for one step (4 processes on 2 cores) does not."""
    return sample if mean == 0 else 0.9 * mean + 0.1 * sample
