"""Communication cost model: what ``ddp``, ``hier_sliced`` (and its compressed inter-node hops), time
buckets, ``hier_bsp`` and ``hier_pipeline`` move and how long it takes on a cluster, before a job runs (no
Lightning here).

Entry point: :func:`lightning_hier.plan.cost_model.plan`, returning a :class:`~.cost_model.Plan` of
:class:`~.cost_model.Estimate` dataclasses; ``python -m lightning_hier plan ...`` prints it
(:mod:`.cli`). Formulas: ``docs/cost_model.md``. :func:`~.calibrate.calibrate_from_csv` fits the
model's bandwidths and latency to a CommProfiler CSV (``plan --calibrate-from``).
"""

from lightning_hier.plan.calibrate import Calibration, LinkFit, calibrate_from_csv
from lightning_hier.plan.cost_model import Cluster, Estimate, Plan, plan
from lightning_hier.plan.pipeline_cost import pipeline_estimate

__all__ = [
    "Calibration", "Cluster", "Estimate", "LinkFit", "Plan",
    "calibrate_from_csv", "pipeline_estimate", "plan",
]  # fmt: skip
