"""PipelineEngine: one stage process of a rebalancing pipeline (plain torch, no Lightning).

Every process holds the whole model object, but only its stage's parameters, buffers and
optimizer state have storage; the rest are empty tensors that stay registered, so the module,
its ``state_dict`` names and the optimizer's parameter groups keep their structure. Stage ``s``
runs on global rank ``num_stages - 1 - s``: the last stage, which computes the loss and decides
repartitions, is rank 0, where Lightning logs and saves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_hier.pipeline.graph import LayerGraph
from lightning_hier.pipeline.migration import (
    MigrationReport,
    materialize_state,
    migrate,
    named_state,
    plan_moves,
    release_state,
)
from lightning_hier.pipeline.partition import StagePartition, imbalance
from lightning_hier.pipeline.rebalance import RebalanceDecision, decide_rebalance
from lightning_hier.pipeline.schedule import PipelineSchedule, StageLink
from lightning_hier.pipeline.settings import PipelineSettings
from lightning_hier.pipeline.stage import StageExecutor

log = logging.getLogger(__name__)


def rank_of_stage(num_stages: int, stage: int) -> int:
    return num_stages - 1 - stage


@dataclass
class RebalanceEvent:
    """One rebalance check that changed the partition, as seen from the last stage."""

    step: int
    decision: RebalanceDecision
    migration: list[dict[str, Any]] = field(default_factory=list)  # one report per stage
    pause_seconds: float = 0.0
    memory_plans: list[Any] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = self.decision
        return {
            "step": self.step,
            "reason": d.reason,
            "old": d.old.to_dict(),
            "new": d.new.to_dict() if d.new is not None else None,
            "stage_times": list(d.stage_times),
            "predicted_times": list(d.predicted_times),
            "imbalance_before": d.imbalance_before,
            "imbalance_after": d.imbalance_after,
            "migration": self.migration,
            "pause_seconds": self.pause_seconds,
            "memory_plans": self.memory_plans,
        }


class PipelineEngine:
    """Runs this process's stage: schedule, per-layer timing, rebalancing and migration.

    Args:
        graph: the traced model (shared submodules with ``graph.root``).
        partition: the initial split of ``graph``'s clusters, the same on every rank.
        stage: this process's stage; ``num_stages == partition.num_stages`` processes take part.
        device: where this stage computes.
        schedule: ``"1f1b"`` or ``"gpipe"``.
    """

    def __init__(
        self,
        graph: LayerGraph,
        partition: StagePartition,
        stage: int,
        device: torch.device,
        schedule: str = "1f1b",
        settings: PipelineSettings | None = None,
    ) -> None:
        self.settings = settings or PipelineSettings(schedule=schedule)
        self.graph = graph
        self.root = graph.root
        self.partition = partition
        self.stage = stage
        self.num_stages = partition.num_stages
        self.device = device
        self.optimizers: list[Optimizer] = []
        self.executor = StageExecutor(graph, partition, stage)
        self.link = StageLink(stage, self.num_stages, self._rank_of_stage, device)
        self.schedule = PipelineSchedule(self.link, schedule, on_backward_done=self.executor.finish_backward)
        self.history: list[RebalanceEvent] = []
        self.last_decision: RebalanceDecision | None = None
        self.steps = 0
        self._release_foreign_state()

    def _rank_of_stage(self, stage: int) -> int:
        return rank_of_stage(self.num_stages, stage)

    @property
    def _last_rank(self) -> int:
        return self._rank_of_stage(self.num_stages - 1)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def owned_state_names(self, partition: StagePartition | None = None) -> list[str]:
        partition = partition or self.partition
        first, last = partition.stage_ranges()[self.stage]
        return self.graph.state_names(first, last)

    def _release_foreign_state(self) -> None:
        owned = set(self.owned_state_names())
        foreign = [n for n in named_state(self.root) if n not in owned]
        release_state(self.root, foreign, self.optimizers)

    def set_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """The optimizers over the whole model; state of parameters elsewhere is dropped."""
        self.optimizers = list(optimizers)
        self._release_foreign_state()

    # ------------------------------------------------------------------ steps
    def train_step(self, num_micro: int, forward: Any) -> None:
        self.schedule.train_step(num_micro, forward)
        self.steps += 1

    def eval_step(self, num_micro: int, forward: Any) -> list[Any]:
        return self.schedule.eval_step(num_micro, forward)

    # ------------------------------------------------------------------ rebalancing
    def local_times(self) -> dict[str, Any]:
        times = self.executor.times
        return {
            "layers": times.summary(self.executor.layer_range),
            "exit_bytes": {c: times.exit_bytes[c] for c in self.executor.cluster_range},
        }

    def rebalance(self, threshold: float, tolerance: float = 0.02, force: bool = False) -> RebalanceDecision:
        """Gather per-layer times on the last stage, decide, broadcast, migrate (collective)."""
        gathered: list[Any] = [None] * self.num_stages if self.is_last else []
        dist.gather_object(self.local_times(), gathered if self.is_last else None, dst=self._last_rank)
        payload: list[Any] = [None]
        if self.is_last:
            layer_times: dict[int, tuple[float, float]] = {}
            exit_bytes = [0] * self.graph.num_clusters
            for item in gathered:
                layer_times.update(item["layers"])
                for c, b in item["exit_bytes"].items():
                    exit_bytes[c] = b
            decision = decide_rebalance(
                self.graph, self.partition, layer_times, exit_bytes, threshold, tolerance, force
            )
            payload = [decision]
        dist.broadcast_object_list(payload, src=self._last_rank)
        decision = payload[0]
        self.last_decision = decision
        self.executor.reset_times()
        if decision.new is None:
            return decision
        event = RebalanceEvent(self.steps, decision)
        report = self.apply_partition(decision.new)
        reports: list[Any] = [None] * self.num_stages if self.is_last else []
        dist.gather_object(report.to_dict(), reports if self.is_last else None, dst=self._last_rank)
        if self.is_last:
            event.migration = reports
            event.pause_seconds = max(r["seconds"] for r in reports)
        self.history.append(event)
        log.info(
            "hier_pipeline: stage times %s -> predicted %s; partition %s -> %s; pause %.3fs",
            [round(t, 4) for t in decision.stage_times],
            [round(t, 4) for t in decision.predicted_times],
            decision.old,
            decision.new,
            event.pause_seconds,
        )
        return decision

    def apply_partition(self, new: StagePartition) -> MigrationReport:
        """Move layers live so that ``new`` holds (collective over all stages)."""
        moves = plan_moves(self.graph, self.partition, new)
        report = migrate(moves, self.stage, self._rank_of_stage, self.root, self.optimizers, self.device)
        self.partition = new
        self.executor.set_partition(new)
        return report

    def adopt_partition(self, new: StagePartition, full_state: dict[str, torch.Tensor]) -> None:
        """Switch to ``new`` using a full state dict every rank holds (checkpoint resume)."""
        owned = set(self.owned_state_names(new))
        current = set(self.owned_state_names())
        state = named_state(self.root)
        release_state(self.root, [n for n in current - owned if n in state], self.optimizers)
        materialize_state(
            self.root, {n: full_state[n] for n in owned - current if n in full_state}, self.device
        )
        self.partition = new
        self.executor.set_partition(new)

    def stage_times(self) -> list[float]:
        if self.last_decision is None:
            return []
        return list(self.last_decision.stage_times)

    @property
    def imbalance(self) -> float:
        return imbalance(self.stage_times()) if self.last_decision is not None else 0.0

    # ------------------------------------------------------------------ checkpoints
    def _owned_tensors(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        owned = set(self.owned_state_names())
        return {k: v.detach().cpu() for k, v in state.items() if k in owned}

    def consolidated_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The module's full ``state_dict`` on the last stage (rank 0); others get their share."""
        gathered: list[Any] = [None] * self.num_stages if self.is_last else []
        mine = self._owned_tensors(state_dict)
        dist.gather_object(mine, gathered if self.is_last else None, dst=self._last_rank)
        if not self.is_last:
            return mine
        merged: dict[str, Any] = {}
        for part in gathered:
            merged.update(part)
        return {k: merged.get(k, v) for k, v in state_dict.items()}

    def consolidated_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` as one process training the whole model would write it."""
        local = optimizer.state_dict()
        states = {
            k: {n: v.cpu() if torch.is_tensor(v) else v for n, v in s.items()}
            for k, s in local["state"].items()
        }
        gathered: list[Any] = [None] * self.num_stages if self.is_last else []
        dist.gather_object(states, gathered if self.is_last else None, dst=self._last_rank)
        if not self.is_last:
            return local
        merged: dict[Any, Any] = {}
        for part in gathered:
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": local["param_groups"]}

    def drop_foreign_optimizer_state(self) -> None:
        """After loading a full optimizer state dict: keep only this stage's parameters' state."""
        owned = set(self.owned_state_names())
        for name, param in self.root.named_parameters(remove_duplicate=False):
            if name not in owned:
                for opt in self.optimizers:
                    opt.state.pop(param, None)

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint records besides the consolidated states: the split and its basis."""
        return {
            "partition": self.partition.to_dict(),
            "num_stages": self.num_stages,
            "layers": [layer.name for layer in self.graph.layers],
            "history": [event.to_dict() for event in self.history],
        }

    def load_full_state(
        self, state_dict: dict[str, Any], meta: dict[str, Any] | None, strict: bool = True
    ) -> None:
        """Resume from a consolidated state dict; keep the saved split if it fits this run."""
        if meta is not None:
            saved = StagePartition.from_dict(meta["partition"])
            same_model = meta.get("layers") == [layer.name for layer in self.graph.layers]
            if saved.num_stages == self.num_stages and same_model and saved != self.partition:
                self.adopt_partition(saved, state_dict)
            elif saved.num_stages != self.num_stages:
                log.info(
                    "hier_pipeline: checkpoint has %d stages, this run %d; keeping %s",
                    saved.num_stages,
                    self.num_stages,
                    self.partition,
                )
        state = named_state(self.root)
        owned = self.owned_state_names()
        expected = set(self.root.state_dict().keys())
        if strict:
            missing = sorted(expected - set(state_dict))
            unexpected = sorted(set(state_dict) - expected)
            if missing or unexpected:
                raise RuntimeError(
                    f"checkpoint state_dict does not match the model: missing {missing}, "
                    f"unexpected {unexpected}"
                )
        with torch.no_grad():
            for name in owned:
                if name in state_dict and name in expected:
                    value = state_dict[name]
                    if state[name].shape != value.shape:
                        raise RuntimeError(
                            f"checkpoint tensor {name} has shape {tuple(value.shape)}, "
                            f"the model {tuple(state[name].shape)}."
                        )
                    state[name].copy_(value)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient (summed over stages); returns that norm."""
        grads = [p.grad for p in self.root.parameters() if p.grad is not None and p.numel() > 0]
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            local += g.detach().double().pow(2).sum()
        dist.all_reduce(local)
        total = local.sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    # ------------------------------------------------------------------ memory policy
    def memory_plan_due(self, steps: int) -> bool:
        return False

    def decide_memory_plan(self) -> None:
        return None

    def timing_summary(self) -> str:
        times = self.stage_times()
        return f"stage times {[round(t * 1e3, 2) for t in times]} ms, imbalance {self.imbalance:.3f}"
