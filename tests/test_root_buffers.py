"""``RootBuffers``: the source rank's buffers reach the other ranks at the first forward of every fit."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import init_gloo, run_spawned


def _two_fits(rank: int, world: int, store: str) -> list[float]:
    """Rank 0's buffer holds ``10 * fit``, rank 1's its own; each fit runs one step that does not
    synchronise (the next forward is not due), then the next fit starts. What rank 1 held after each."""
    import torch.distributed as dist

    from lightning_hier.buffer_broadcast import RootBuffers

    init_gloo(rank, world, store)
    buffers = RootBuffers(0, dist.group.WORLD, torch.device("cpu"))
    buffer = torch.zeros(3)
    seen = []
    for fit in (1, 2):
        if fit > 1:
            buffers.new_fit()
        buffer.fill_(10.0 * fit if rank == 0 else -1.0)
        buffers.before_forward([buffer], synchronises=False)
        seen.append(buffer.tolist())
        buffer.fill_(-2.0 if rank else 99.0)  # a later forward of the fit: not due, nothing is sent
        buffers.before_forward([buffer], synchronises=False)
        seen.append(buffer.tolist())
    dist.destroy_process_group()
    return seen


def test_new_fit_broadcasts_at_the_first_forward(tmp_path: Path) -> None:
    """The first forward of each fit gets rank 0's buffer (an accumulating step before it left nothing due);
    later forwards of the fit keep each rank's own."""
    results = run_spawned(_two_fits, 2, tmp_path)
    assert results[1] == [[10.0] * 3, [-2.0] * 3, [20.0] * 3, [-2.0] * 3], results[1]
    assert results[0] == [[10.0] * 3, [99.0] * 3, [20.0] * 3, [99.0] * 3], results[0]
