"""Communication profiling: what each training step sent, over which link, and how much of it was hidden.

Entry point: :class:`CommStats` (no Lightning; :class:`lightning_hier.CommProfiler` is its Lightning
callback). It wraps the ``torch.distributed`` functions the way :mod:`lightning_hier.audit` does
(the helpers of :mod:`lightning_hier.audit.recorder`), measures every collective and point-to-point
operation, and accounts them per training step and per group kind (:data:`KINDS`).

- :mod:`~lightning_hier.profiling.comm_stats`: the wrapping, the byte rules, the timing (host clock
  on CPU, CUDA events for CUDA tensors) and the per-step accounting of exposed and hidden time.
- :mod:`~lightning_hier.profiling.report`: the CSV (one row per rank x step x kind, the format
  ``plan --calibrate-from`` reads), the summary table and the PNG figure.

See ``docs/comm_profiler.md`` for what each number means.
"""

from lightning_hier.profiling.comm_stats import KINDS, CommStats, KindStats, StepStats, sent_bytes
from lightning_hier.profiling.report import CSV_COLUMNS, read_csv, save_figure, summary_table, write_csv

__all__ = [
    "CSV_COLUMNS",
    "KINDS",
    "CommStats",
    "KindStats",
    "StepStats",
    "read_csv",
    "save_figure",
    "sent_bytes",
    "summary_table",
    "write_csv",
]
