"""Hierarchical sliced gradient reduction with an in-node sharded optimizer (no Lightning here).

Entry point: :class:`lightning_hier.sliced.engine.HierSlicedEngine`, which the ``hier_sliced``
strategy drives. One step: gradient hooks fill flat buckets (:mod:`.flat_buckets`); each bucket
is split by the slice plan (:mod:`.slicing`), reduce-scattered inside the node and all-reduced
across nodes (:mod:`.reducer`); the optimizer steps on this rank's slices only
(:mod:`.sharded_optim`, with :mod:`.sharded_grad_scaler` under ``16-mixed``); updated slices are
all-gathered in the node. :mod:`.checkpoints` decides what a checkpoint holds (consolidated or
sharded, plus the time plan); :mod:`.sharded_checkpoint` writes and reads the sliced state. What is
sent together and when comes from :mod:`lightning_hier.bucketing`.
"""
