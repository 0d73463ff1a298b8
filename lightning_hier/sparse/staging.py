"""Shared-memory mailboxes through which the processes of a node hand each other gradient rows.

The processes of a node already share the embedding table; handing each other the table's
per-id gradients through shared memory too saves the copies through the loopback network that a
message would take (on the click benchmark ~4 MB per step, a sixth of its CPU went to gloo's
socket loop). Each process owns one segment with up to two mailboxes of ``capacity`` packed rows
(:func:`lightning_hier.sparse.sync.pack_rows`: an int64 id and ``dim`` float32 values per row):

- the **inbox** (shared merge only), where it puts its own gradient rows, sorted by the process that
  merges them;
- the **outbox**, where it puts the rows the node's updater reads: its own (leader merge) or the
  ones it merged (shared merge).

A process writes only its own mailboxes and reads the others' only between a message that says
"written" and the node's release after the update, so no lock is needed
(:mod:`lightning_hier.sparse.sync`). A batch with more rows than fit goes by message instead.

The segments follow the tables' lifecycle (:mod:`lightning_hier.sparse.shared_store`): created in
``/dev/shm``, mapped by the node's other processes, then unlinked, so nothing outlives the job. A
node short of shared memory simply goes without (everything by message).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from lightning_hier.sparse.shared_store import REGISTRY, create_segment, new_segment_path
from lightning_hier.sparse.table_file import map_table

log = logging.getLogger(__name__)

MAILBOX_BYTES = 4 << 20
"""Default size of one mailbox (a process holds two under the shared merge, one under the leader's): at
most 8 MiB of ``/dev/shm`` per process and table, less for a table smaller than that."""
_MIN_ROWS = 256


def packed_row_bytes(dim: int) -> int:
    """Bytes of one packed gradient row: an int64 id and ``dim`` float32 values."""
    return 8 + 4 * dim


class NodeStaging:
    """Every process's inbox and outbox on this node, as ``uint8`` views ``[capacity, row bytes]``
    (``None`` for a process that has none)."""

    def __init__(self, inboxes: list[torch.Tensor | None], outboxes: list[torch.Tensor | None], rank: int):
        self.inboxes, self.outboxes, self.rank = inboxes, outboxes, rank

    @classmethod
    def attach(
        cls,
        group: dist.ProcessGroup,
        dim: int,
        label: str,
        mailbox_bytes: int = MAILBOX_BYTES,
        max_rows: int | None = None,
        inbox: bool = True,
    ) -> NodeStaging:
        """Create this process's segment, map everybody's (a collective over ``group``, the node).

        ``max_rows``: no mailbox holds more rows than this (a table's row count: a process never
        sends more unique ids than the table has), so small tables take small mailboxes; ``inbox``:
        whether to have one at all (only the shared merge uses it)."""
        width = packed_row_bytes(dim)
        capacity = max(_MIN_ROWS, mailbox_bytes // width)
        if max_rows is not None:
            capacity = max(1, min(capacity, max_rows))
        inbox_rows = capacity if inbox else 0
        path = None
        try:
            # float32 columns: 2 carry the id's bytes, dim the values; inbox rows, then outbox rows
            path = REGISTRY.track(new_segment_path(f"{label}.mailbox{dist.get_rank(group)}"))
            create_segment(path, inbox_rows + capacity, width // 4, torch.float32)
        except OSError as err:
            log.warning("HybridEmbedding %r: no shared-memory mailbox, rows go by message (%s)", label, err)
            path = None
        paths: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(paths, None if path is None else str(path), group=group)
        inboxes: list[torch.Tensor | None] = []
        outboxes: list[torch.Tensor | None] = []
        for other in paths:
            if other is None:
                inboxes.append(None)
                outboxes.append(None)
                continue
            boxes = map_table(other).view(torch.uint8)
            inboxes.append(boxes[:inbox_rows] if inbox_rows else None)
            outboxes.append(boxes[inbox_rows:])
        dist.barrier(group=group)  # everybody mapped every segment: the names can go
        if path is not None:
            path.unlink(missing_ok=True)
        return cls(inboxes, outboxes, dist.get_rank(group))

    def put(self, box: str, packed: torch.Tensor) -> bool:
        """Copy ``packed`` rows into this process's ``"inbox"`` or ``"outbox"``; ``False`` (and
        nothing copied) when it has none or they do not fit."""
        mine = (self.inboxes if box == "inbox" else self.outboxes)[self.rank]
        if mine is None or packed.shape[0] > mine.shape[0] or packed.shape[1] != mine.shape[1]:
            return False
        mine[: packed.shape[0]].copy_(packed)
        return True

    def rows(self, box: str, rank: int, start: int, end: int) -> torch.Tensor:
        """Packed rows ``start:end`` of process ``rank``'s ``"inbox"`` or ``"outbox"`` (a view)."""
        boxes = self.inboxes if box == "inbox" else self.outboxes
        mailbox = boxes[rank]
        assert mailbox is not None, f"process {rank} has no {box}"
        return mailbox[start:end]
