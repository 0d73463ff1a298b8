"""What is sent together and when: gradient buckets planned by size or by profiled time.

Entry point: :class:`lightning_hier.bucketing.time_bucketing.TimeBucketing` for ``bucketing="time"``
(profiles gradient-ready times with :mod:`.step_clock`, decides a
:class:`~lightning_hier.bucketing.time_plan.TimePlan` on one rank and broadcasts it, watches for
drift); :mod:`.size_plan` holds the size-capped :class:`~lightning_hier.bucketing.size_plan.BucketPlan`
both modes produce. No Lightning here; :mod:`lightning_hier.sliced` sends what these plans group.
"""
