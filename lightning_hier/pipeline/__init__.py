"""Pipeline stages with live rebalancing and a per-layer keep / swap / recompute memory policy.

Entry point: :class:`lightning_hier.pipeline.engine.PipelineEngine`, which the ``hier_pipeline``
strategy drives. The model is traced into layers and single-entry/single-exit clusters
(:mod:`.graph`), split into stages (:mod:`.partition`, :mod:`.settings`), run stage by stage with
per-layer timing (:mod:`.stage`) under a GPipe or 1F1B schedule (:mod:`.schedule`, micro-batches
from :mod:`.batching`, per-layer random streams from :mod:`.layer_rng`); imbalanced splits are
recomputed (:mod:`.rebalance`) and layers migrate live (:mod:`.migration`); each stage fits its
activations into ``memory_limit`` (:mod:`.memory_policy` decides, :mod:`.activation_store`
applies and measures). No Lightning here.
"""
