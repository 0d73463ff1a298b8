"""Communication cost model: what ``ddp``, ``hier_sliced``, time buckets and ``hier_bsp`` move and how
long it takes on a cluster, before a job runs (no Lightning here).

Entry point: :func:`lightning_hier.plan.cost_model.plan`, returning a :class:`~.cost_model.Plan` of
:class:`~.cost_model.Estimate` dataclasses; ``python -m lightning_hier plan ...`` prints it
(:mod:`.cli`). Formulas: ``docs/cost_model.md``.
"""

from lightning_hier.plan.cost_model import Cluster, Estimate, Plan, plan

__all__ = ["Cluster", "Estimate", "Plan", "plan"]
