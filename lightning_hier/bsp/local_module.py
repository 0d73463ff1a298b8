"""The local BSP module: one background thread per worker that does all of the worker's communication.

It ticks with the other ranks' modules (an all-gather of status rows on a CPU group), applies the
controller's decision (:mod:`.controller`), and at a close reads the worker's aggregate out of the
shared-memory module, pushes it to the server shards, steps them, pulls the new model and announces
it. The worker (main thread) never waits for any of this unless it is a whole model ahead.
Every collective of the run's training phase is issued by this thread, in one order on every rank.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from lightning_hier.bsp.controller import (
    ABORT,
    DEADLINE,
    EPOCH_END,
    FIT_END,
    INFLIGHT,
    READY,
    STEP_MS,
    decide,
    slowest_remaining_s,
)
from lightning_hier.bsp.liveness import Heartbeat, describe_loss, lost_ranks, new_run_key
from lightning_hier.bsp.server import ShardedParameterServer
from lightning_hier.bsp.settings import BSPSettings
from lightning_hier.bsp.shared_memory import SharedModelMemory
from lightning_hier.topology import Topology

MIN_TICK_S = 0.001
MAX_TICK_S = 0.016


@dataclass(frozen=True)
class SuperstepRecord:
    """What one superstep applied (the same on every rank)."""

    index: int  # the model version it produced
    micro_steps: tuple[int, ...]  # per worker (global rank order)
    max_staleness: int  # over the micro-steps it applied
    staleness_counts: dict[int, int] = field(default_factory=dict)  # this rank's: staleness -> micro-steps
    push_s: float = 0.0
    step_s: float = 0.0
    pull_s: float = 0.0
    push_bytes: int = 0
    pull_bytes: int = 0
    early_buckets: int = 0  # buckets pushed while the last micro-step's backward still ran (plain BSP)
    early_push_s: float = 0.0
    ready_buckets: int = 0  # buckets pushed as their workers reported them folded (the rest at the close)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LocalBSPModule(threading.Thread):
    """Ticks, closes supersteps and announces models for one worker until stopped."""

    def __init__(
        self,
        memory: SharedModelMemory,
        server: ShardedParameterServer,
        topology: Topology,
        settings: BSPSettings,
        timeout_s: float,
    ) -> None:
        super().__init__(name=f"hier-bsp-rank{topology.rank}", daemon=True)
        assert topology.world_group is not None
        self.memory = memory
        self.server = server
        self.topology = topology
        self.settings = settings
        self.timeout_s = timeout_s
        self.records: list[SuperstepRecord] = []
        self.opened_at = time.monotonic()
        self.run_key = new_run_key()
        self.heartbeat = Heartbeat(self.run_key, topology.rank)
        self._sent_hyper: list[dict] | None = None  # the optimizer settings the server steps with
        self._task: Callable[[], Any] | None = None
        self._result: Any = _NOTHING
        self._pushed = 0  # buckets of the open superstep pushed before its close
        self._early = 0  # of those, pushed while a worker's backward still ran
        self._early_push_s = 0.0
        self._early_bytes = 0

    def run(self) -> None:
        self.heartbeat.start()
        try:
            # paused until the first training step: setup and sanity checks are the main thread's
            with self.memory.handoff.module_stream():
                if self._paused():
                    self._loop()
        except BaseException as error:  # noqa: BLE001 - handed to the worker, which raises it
            lost = lost_ranks(self.run_key, self.topology.world_size)
            failure = RuntimeError(describe_loss(error, lost))
            failure.__cause__ = error  # the BSP thread's own traceback goes with it
            self.memory.fail(failure)
        finally:
            self.heartbeat.stop()

    def _loop(self) -> None:
        memory, world = self.memory, self.topology.world_group
        interval = MIN_TICK_S
        while True:
            with memory.cond:
                if not memory.event:
                    memory.cond.wait(interval)
                if memory.stopping and memory.paused:
                    return
                row = memory.status_row()
                version = memory.version
            if self.topology.rank == 0 and self.settings.superstep_seconds is not None:
                row[DEADLINE] = int(time.monotonic() - self.opened_at >= self.settings.superstep_seconds)
            rows = torch.tensor(row, dtype=torch.int64)
            gathered = [torch.empty_like(rows) for _ in range(self.topology.world_size)]
            dist.all_gather(gathered, rows, group=world)
            table = [g.tolist() for g in gathered]
            aborted = [rank for rank, r in enumerate(table) if r[ABORT]]
            if aborted:  # every module sees it in the same tick, so all stop here and none waits on another
                if not memory.aborted:
                    stopped = f"rank(s) {aborted} stopped: their training raised an error (see their log)."
                    memory.fail(RuntimeError(stopped))
                return
            decision = decide(table, self.settings, version)
            busy = any(r[INFLIGHT] >= 0 for r in table)
            interval = (
                MIN_TICK_S
                if (decision.close or decision.closing or not busy)
                else min(MAX_TICK_S, interval * 2)
            )
            with memory.cond:
                memory.peer_epoch_ended = memory.peer_epoch_ended or any(r[EPOCH_END] for r in table)
                memory.peer_fit_ended = memory.peer_fit_ended or any(r[FIT_END] for r in table)
                if decision.closing:
                    memory.closing = True
                if self.settings.fill_idle:  # a worker waiting at its quota may now start another
                    # (its own cycle time is in its row: the straggler test compares cycles)
                    own = table[self.topology.rank][STEP_MS]
                    window = slowest_remaining_s(table, self.settings, version, own)
                    memory.fill_until = time.monotonic() + window
                    memory.fill_version = version
                    memory.cond.notify_all()
            ready = min(r[READY] for r in table)  # -1 unless every worker is in its last micro-step
            if ready > self._pushed:
                self._push_early(ready, during_backward=busy)
            if decision.close:
                self._close(version + 1)
            if decision.pause and not self._pause():
                return

    def _push_early(self, upto: int, during_backward: bool) -> None:
        """Push buckets ``[pushed, upto)`` of the open superstep: every worker folded them in its last
        micro-step (the same rows on every rank, so the same buckets in the same order).
        ``during_backward``: some worker is still in that micro-step (what the record counts)."""
        started = perf_counter()
        with self.memory.cond:
            sums = list(self.memory.aggregate.sums)
            self.memory.handoff.module_takes_over()  # the folds of those buckets
        self._early_bytes += self.server.push(sums, range(self._pushed, upto))
        self.memory.handoff.module_synchronize()
        if during_backward:
            self._early += upto - self._pushed
            self._early_push_s += perf_counter() - started
        self._pushed = upto

    def _close(self, index: int) -> None:
        memory, world = self.memory, self.topology.world_group
        with memory.cond:
            out = memory.read_out()
            memory.handoff.module_takes_over()  # every fold in the read-out
            clip = memory.clip
            hyper = memory.hyper
        started = perf_counter()
        staleness = out.staleness(index)
        hyper_changed = self.topology.rank == 0 and _changed(hyper, self._sent_hyper)
        # one gather for what every rank needs before the push: counts (the mean's weights), the worst
        # staleness, and whether the controller's optimizer settings changed since it last sent them
        # and which parameters got a gradient (one that none did is left as it was)
        row = [out.count, max(staleness, default=0), int(hyper_changed), *out.used]
        mine = torch.tensor(row, dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.topology.world_size)]
        dist.all_gather(gathered, mine, group=world)
        per_worker = tuple(int(g[0]) for g in gathered)
        worst = max(int(g[1]) for g in gathered)
        used_anywhere = torch.stack(gathered)[:, 3:].amax(dim=0)
        unused = torch.nonzero(used_anywhere == 0).flatten().tolist()
        push_bytes = self._early_bytes + self.server.push(out.sums, range(self._pushed, len(out.sums)))
        self.server.scale(1.0 / self.settings.gradient_divisor(sum(per_worker), len(per_worker)))
        memory.handoff.module_synchronize()
        early, early_s, ready = self._early, self._early_push_s, self._pushed
        self._pushed, self._early, self._early_push_s, self._early_bytes = 0, 0, 0.0, 0
        pushed = perf_counter()
        with memory.cond:
            memory.aggregate.recycle(out)
        if int(gathered[0][2]):
            shared = [hyper]
            dist.broadcast_object_list(shared, src=0, group=world)  # the controller's optimizer settings
            self._sent_hyper = shared[0]
        self.server.step(clip, self._sent_hyper, unused)
        stepped = perf_counter()
        pull_bytes = self.server.pull()
        memory.handoff.module_synchronize()
        pulled = perf_counter()
        counts_by_staleness: dict[int, int] = {}
        for s in staleness:
            counts_by_staleness[s] = counts_by_staleness.get(s, 0) + 1
        self.records.append(
            SuperstepRecord(
                index, per_worker, worst, counts_by_staleness,
                pushed - started, stepped - pushed, pulled - stepped, push_bytes, pull_bytes,
                early, early_s, ready,
            )
        )  # fmt: skip
        with memory.cond:
            memory.announce(self.server.flat_params())
        self.opened_at = time.monotonic()

    def _pause(self) -> bool:
        """Pause until the worker resumes (True) or stops (False)."""
        with self.memory.cond:
            self.memory.paused = True
            self.memory.cond.notify_all()
        return self._paused()

    def _paused(self) -> bool:
        """Wait while paused (as a module starts); meanwhile run what the worker asks (:meth:`call`)."""
        memory = self.memory
        with memory.cond:
            while memory.paused and not memory.stopping:
                if self._task is not None:
                    task, self._task = self._task, None
                    memory.handoff.module_takes_over()
                    memory.cond.release()
                    try:
                        result: Any = task()
                    except BaseException as error:  # noqa: BLE001 - raised again in the caller
                        result = _Failed(error)
                    finally:
                        memory.cond.acquire()
                    memory.handoff.module_hands_over()
                    self._result = result
                    memory.cond.notify_all()
                    continue
                memory.cond.wait()
            memory.handoff.module_takes_over()  # resumed: what the worker wrote while the module paused
            return not memory.stopping

    def call(self, task: Callable[[], Any]) -> Any:
        """Run ``task`` on this thread while it is paused (main thread, after a drain): collectives on
        this module's groups then still come from one thread only."""
        memory = self.memory
        with memory.cond:
            if not memory.paused or not self.is_alive():
                raise RuntimeError("the local BSP module runs work for the worker only while paused.")
            self._task, self._result = task, _NOTHING
            memory.handoff.worker_hands_over()
            memory.cond.notify_all()
            while self._result is _NOTHING:
                memory.wait(self.timeout_s, "answer from the local BSP module")
            result, self._result = self._result, _NOTHING
            if isinstance(result, _Failed):
                raise result.error
            return memory.handoff.worker_takes_result(result)


_NOTHING = object()


@dataclass
class _Failed:
    error: BaseException


def _changed(hyper: list[dict] | None, sent: list[dict] | None) -> bool:
    """Whether ``hyper`` differs from the settings last sent (tensor-valued settings: always)."""
    if hyper is None:
        return False
    try:
        return bool(hyper != sent)
    except RuntimeError:  # a tensor setting compared elementwise
        return True
