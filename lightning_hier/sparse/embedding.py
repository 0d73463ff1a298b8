"""``HybridEmbedding``: an embedding table stored once per node, updated synchronously.

A drop-in for ``nn.Embedding`` (``mode=None``) and ``nn.EmbeddingBag`` (``mode="sum"|"mean"``):
the same forward arguments (``input``, ``offsets``, ``per_sample_weights``). ``.weight`` is a
tensor view of the node's shared table, not an ``nn.Parameter``: the table has its own row-wise
optimizer, so ``configure_optimizers`` covers the dense parameters only.

Under ``strategy="hier_sliced"`` the strategy attaches every ``HybridEmbedding`` at setup (local
rank 0 of each node creates the table in shared memory, the node's other processes map it) and,
after every synchronising backward, syncs the per-id gradients (frequency-averaged, see
:mod:`lightning_hier.sparse.sync`). When the optimizer steps, local rank 0 applies the row-wise
update and the node waits at a barrier, so every process reads the updated rows in the next step.
Under ``16-mixed`` the rows are unscaled by the loss scale first, a non-finite gradient makes the
loss scaler skip the step for the dense parameters and the table alike, and a skipped step leaves
the table as it was.

Without the strategy, on one process (Lightning's single-device strategy, a plain torch loop),
the first forward gives the module a private table and the table steps when an optimizer steps:
a ``torch.optim`` step hook applies the gradients gathered since the last step (summed over
accumulated backward passes, as a dense parameter's ``.grad``). :meth:`sync_and_update` does the
same by hand. Deliberate limits, each a clear error at the first training forward: several
processes without ``hier_sliced`` (no other strategy syncs the per-id gradients), and float16
autocast without ``hier_sliced`` (the loss scale is unknown to the table: use ``bf16-mixed``).
"""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from lightning_hier.checks import check_flag, check_integer, check_path, is_integer, is_real
from lightning_hier.sparse.background import TableJobs
from lightning_hier.sparse.id_index import SharedIdIndex, hashed_init
from lightning_hier.sparse.row_optim import ROW_OPTIMIZERS, RowOptimizer, state_names
from lightning_hier.sparse.shared_store import (
    REGISTRY,
    SharedMemoryFullError,
    create_segment,
    new_segment_path,
    remove_stale_segments,
)
from lightning_hier.sparse.staging import NodeStaging
from lightning_hier.sparse.sync import coalesce, hierarchical_frequency_average, release_from_leader
from lightning_hier.sparse.table_file import DTYPE_CODES, element_size, map_table, read_header, save_table

INITS = ("normal", "uniform", "zeros")
NODE_MERGES = ("leader", "shared")
_PENDING_WARNING = 64  # backward passes recorded without an update before the user is told
_INIT_ROWS_PER_CHUNK = 1 << 16
MAX_TABLE_BYTES = 2**62  # a table's bytes, plus a header, must fit the 64-bit sizes of files and tensors

# Tables trained without a strategy, stepped by any optimizer's step (see the module docstring).
_UNMANAGED: weakref.WeakSet[HybridEmbedding] = weakref.WeakSet()
_step_hook: Any = None


def _apply_unmanaged_updates(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for module in list(_UNMANAGED):
        if module._pending and module.steps_with_optimizers:  # a strategy may have taken it over
            module.sync_and_update()


def _follow_optimizer_steps(module: HybridEmbedding) -> None:
    # a global hook: the module never sees the optimizer (its table is not among its parameters)
    global _step_hook
    _UNMANAGED.add(module)
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_apply_unmanaged_updates)


def _end_process_groups_at_exit() -> None:
    # under another strategy (ddp) the process groups meet the package here only, so the exit handler that
    # spares gloo's exit race is registered here (imported late: the strategies import this module)
    from lightning_hier.strategies.process_group_exit import destroy_process_group_at_exit

    destroy_process_group_at_exit()


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory (itself if it is there already).

    The table and its gradient exchange live in host memory, so a step on a GPU copies its ids here
    once in forward and its rows' gradient once in backward: each copy waits for the device to compute
    what it copies, the only waits a step makes for it and unavoidable with a host table. They are made
    with torch's sync debug mode off, which is there to find the waits that are not meant."""
    if tensor.device.type != "cuda":
        return tensor.to("cpu")
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return tensor.to("cpu")
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _match_file(
    path: str, num_embeddings: int | None, embedding_dim: int | None, dtype: torch.dtype | None
) -> tuple[int, int, torch.dtype]:
    """The file's ``(rows, dim, dtype)``, after checking the ones the caller gave against it."""
    rows, dim, file_dtype = read_header(path)
    given = {
        "num_embeddings": (num_embeddings, rows),
        "embedding_dim": (embedding_dim, dim),
        "dtype": (dtype, file_dtype),
    }
    wrong = [
        f"{name}={mine} but the file has {theirs}"
        for name, (mine, theirs) in given.items()
        if mine not in (None, theirs)
    ]
    if wrong:
        raise ValueError(
            f"HybridEmbedding(path={str(path)!r}): {'; '.join(wrong)}. Leave them None to take the file's, "
            "or point path= at a table of this shape."
        )
    return rows, dim, file_dtype


def _check_hyperparameters(
    lr: float, init_scale: float | None, eps: float | None, betas: tuple[float, float], seed: int
) -> None:
    """Raise ``ValueError`` naming the setting for a value the row optimizer or the initialisation
    cannot use (ranges as torch's optimizers check them)."""
    if not (is_real(lr) and 0 < lr < math.inf):
        raise ValueError(f"lr must be positive and finite, got {lr!r}.")
    if init_scale is not None and not (is_real(init_scale) and 0 <= init_scale < math.inf):
        raise ValueError(f"init_scale must be a finite number >= 0 or None, got {init_scale!r}.")
    if eps is not None and not (is_real(eps) and 0 <= eps < math.inf):
        raise ValueError(f"eps must be a finite number >= 0 or None, got {eps!r}.")
    if not (
        isinstance(betas, (tuple, list)) and len(betas) == 2 and all(is_real(b) and 0 <= b < 1 for b in betas)
    ):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}.")
    if not (is_integer(seed) and 0 <= seed < 2**64):  # what the hashed initialisation mixes as a uint64
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}.")


class HybridEmbedding(nn.Module):
    """An embedding table held once per node in shared host memory, with a row-wise optimizer.

    Args:
        num_embeddings: rows of the table. With ``path`` it may be left ``None`` (the file's header
            decides); given, it must match the file's.
        embedding_dim: columns of the table; ``None`` with ``path`` as for ``num_embeddings``.
        mode: ``None`` (like ``nn.Embedding``), ``"sum"`` or ``"mean"`` (like ``nn.EmbeddingBag``).
        optimizer: ``"sgd"``, ``"adagrad"`` or ``"adam"`` (``SparseAdam`` semantics), with ``lr``.
        init: ``"normal"`` (std ``init_scale``, default ``1/sqrt(dim)``), ``"uniform"``
            (``±init_scale``) or ``"zeros"``; seeded by ``seed`` so every node starts identical.
        path: a table file (see :mod:`lightning_hier.sparse.table_file`) to memory-map as the
            live table; updates are written into it (give each node its own copy).
        hashed_ids: ``input`` holds raw 64-bit feature ids, mapped to rows through a node-shared
            index (:mod:`lightning_hier.sparse.id_index`); new ids get the next free row, initialised
            from a hash of the id (uniform in ``±init_scale``, or zeros), up to ``num_embeddings``
            rows; a full table raises ``TableFullError`` (no eviction).
        dtype: storage dtype of a fresh table (default float32); with ``path``, ``None`` takes the
            file's and a given dtype must match it.
        node_merge: who merges a node's gradient rows under ``hier_sliced``: ``"leader"`` (local rank
            0, which also updates) or ``"shared"`` (each process merges the ids it owns, and the slow
            link's share is split over the node's processes; local rank 0 still updates). Both hand
            rows over through shared-memory mailboxes (per process 4 MiB with the leader's merge, 8
            shared, less for a smaller table). The same result to the bit; which is faster depends
            on the node (docs/hybrid_embedding.md).
        prefault: map every page of the node's shared table into each process when it attaches
            (the updater's optimizer state too), so that training never stops for a page fault on a
            row it touches first (on a 1 GB table about 0.7 ms per step and process after the first
            steps, 8-10 ms in them); costs 0.1-0.5 s per GB at attach and 2 MB of page tables per GB
            per process. A ``path=`` file (which may be larger than RAM) is never prefaulted.
    """

    def __init__(
        self,
        num_embeddings: int | None = None,
        embedding_dim: int | None = None,
        mode: str | None = None,
        optimizer: str = "sgd",
        lr: float = 0.01,
        init: str = "normal",
        init_scale: float | None = None,
        path: str | None = None,
        hashed_ids: bool = False,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        eps: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        node_merge: str = "leader",
        prefault: bool = True,
    ) -> None:
        super().__init__()
        if node_merge not in NODE_MERGES:
            raise ValueError(f"node_merge={node_merge!r} is not one of {list(NODE_MERGES)}.")
        if mode not in (None, "sum", "mean"):
            raise ValueError(f"mode={mode!r} is not one of [None, 'sum', 'mean'].")
        if optimizer not in ROW_OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is not one of {list(ROW_OPTIMIZERS)}.")
        if init not in INITS:
            raise ValueError(f"init={init!r} is not one of {list(INITS)}.")
        _check_hyperparameters(lr, init_scale, eps, betas, seed)
        check_flag("hashed_ids", hashed_ids)
        check_flag("prefault", prefault)
        check_path("path", path)
        for name, size in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            check_integer(name, size, 1, allow_none=True)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in DTYPE_CODES):
            raise ValueError(f"dtype={dtype!r} is not one of {list(DTYPE_CODES)} (None: float32).")
        if path is not None:
            num_embeddings, embedding_dim, dtype = _match_file(path, num_embeddings, embedding_dim, dtype)
        if num_embeddings is None or embedding_dim is None:
            raise ValueError("num_embeddings and embedding_dim are required unless path= names a table file.")
        dtype = torch.float32 if dtype is None else dtype
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(
                f"the table needs at least one row and one column, got {num_embeddings}x{embedding_dim}."
            )
        if num_embeddings * embedding_dim * element_size(dtype) > MAX_TABLE_BYTES:
            raise ValueError(
                f"num_embeddings x embedding_dim = {num_embeddings}x{embedding_dim} of {dtype} is beyond any "
                f"memory (more than 2**62 bytes); give the table's real size."
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.optimizer_name = optimizer
        self.lr = lr
        self.init = init
        self.init_scale = init_scale if init_scale is not None else embedding_dim**-0.5
        self.path = path
        self.hashed_ids = hashed_ids
        self.index: SharedIdIndex | None = None
        self.seed = seed
        self.dtype = dtype
        self.eps = eps
        self.betas = betas
        self.node_merge = node_merge
        self.prefault = prefault
        self._table: torch.Tensor | None = None  # the node's table; read it through .weight
        self.optimizer_state: dict[str, torch.Tensor] = {}
        self.row_optimizer: RowOptimizer | None = None
        self.is_updater = True
        self._intra_group: dist.ProcessGroup | None = None
        self._inter_group: dist.ProcessGroup | None = None
        # the groups the gradient exchange and the update's barrier use, and the thread they run on
        # (set by attach; None: the main thread, on the groups above)
        self._exchange_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] | None = None
        self._jobs: TableJobs | None = None
        self._staging: NodeStaging | None = None  # the node's gradient mailboxes in shared memory
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._synced: tuple[torch.Tensor, torch.Tensor] | None = None  # averaged, still loss-scaled
        self._mailbox_unreleased = False  # this process's mailbox may still be read by the node
        self._synced_step = False
        self._managed = False  # attached by hier_sliced, which syncs and applies the updates

    # ------------------------------------------------------------------ storage
    @property
    def weight(self) -> torch.Tensor | None:
        """The node's table (a view of its shared memory), as updated by every step so far: under
        ``hier_sliced`` a step's row update may still be running beside training, and reading this
        waits for it."""
        self.wait_for_updates()
        return self._table

    @weight.setter
    def weight(self, table: torch.Tensor | None) -> None:
        self._table = table

    @property
    def steps_with_optimizers(self) -> bool:
        """True for a private table (no strategy, no process groups): it steps when any optimizer
        steps. False when the strategy, or whoever attached it to process groups, syncs and updates."""
        return not self._managed and self._intra_group is None

    @property
    def attached(self) -> bool:
        return self._table is not None

    def attach(
        self,
        intra_group: dist.ProcessGroup | None = None,
        inter_group: dist.ProcessGroup | None = None,
        local_rank: int = 0,
        label: str = "table",
        managed: bool = False,
        exchange_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] | None = None,
        jobs: TableJobs | None = None,
    ) -> None:
        """Create (local rank 0) or map (the others) the node's table and optimizer state.

        A collective over ``intra_group``. Already attached tables are kept (e.g. ``trainer.test``
        after ``fit`` in the same processes reads the trained table). ``managed``: the caller (the
        ``hier_sliced`` strategy) syncs and applies the updates; otherwise optimizer steps do.
        ``jobs``: run the gradient exchange and the update on this thread, over ``exchange_groups``
        (``(intra, inter)`` groups of that thread's own), so they overlap the rest of the step; the
        next forward waits for them.
        """
        self._managed = managed
        self._exchange_groups, self._jobs = exchange_groups, jobs
        if intra_group is not None or inter_group is not None:
            _end_process_groups_at_exit()
        if self.attached:
            self._intra_group, self._inter_group = intra_group, inter_group
            return
        shared = intra_group is not None and dist.get_world_size(intra_group) > 1
        payload: list[dict | str | None] = [None]
        if local_rank == 0:
            remove_stale_segments()
            try:
                payload[0] = self._create(label)
            except OSError as err:  # e.g. /dev/shm too small: the node's other processes raise it too
                payload[0] = f"{type(err).__name__}: {err}"
        if shared:
            dist.broadcast_object_list(payload, group=intra_group, group_src=0)
        segments = payload[0]
        if isinstance(segments, str):
            REGISTRY.remove_all()
            raise SharedMemoryFullError(f"HybridEmbedding {label!r} on local rank 0: {segments}")
        assert segments is not None
        if local_rank != 0:
            # every process reads rows; only the updater (local rank 0) touches the optimizer state
            self._table = map_table(
                segments["table"], populate="read" if self.prefault and self.path is None else None
            )
            self.optimizer_state = {n: map_table(p) for n, p in segments["states"].items()}
            if segments["index"] is not None:
                self.index = SharedIdIndex(Path(segments["index"]), self.num_embeddings, create=False)
        if shared:
            dist.barrier(group=intra_group)  # every process has mapped the segments ...
            # both merges hand rows over through shared memory: by message, each row would cross the
            # loopback network twice (gloo's socket loop took a fifth of the click benchmark's CPU)
            self._staging = NodeStaging.attach(
                intra_group,
                self.embedding_dim,
                label,
                max_rows=self.num_embeddings,
                inbox=self.node_merge == "shared",
            )
        if local_rank == 0:
            owned = [*segments["states"].values(), segments["index"]]
            if self.path is None:
                owned.append(segments["table"])
            for path in owned:
                if path is not None:
                    Path(path).unlink(missing_ok=True)  # ... so the names can go: nothing outlives the job
        self._intra_group, self._inter_group = intra_group, inter_group
        self.is_updater = local_rank == 0
        self.row_optimizer = RowOptimizer(
            self.optimizer_name, self._table, self.optimizer_state, self.lr, self.eps, self.betas
        )

    def _create(self, label: str) -> dict:
        if self.path is not None:
            self._table = map_table(self.path)
            table_path = str(self.path)
        else:
            segment = REGISTRY.track(new_segment_path(f"{label}.weight"))
            self._table = create_segment(
                segment, self.num_embeddings, self.embedding_dim, self.dtype, populate=self.prefault
            )
            if not self.hashed_ids:  # hashed rows are initialised from their id when first handed out
                self._initialise(self._table)
            table_path = str(segment)
        states = {}
        for name in state_names(self.optimizer_name):
            segment = REGISTRY.track(new_segment_path(f"{label}.{name}"))
            self.optimizer_state[name] = create_segment(
                segment, self.num_embeddings, self.embedding_dim, torch.float32, populate=self.prefault
            )
            states[name] = str(segment)
        index_path = None
        if self.hashed_ids:
            index_path = REGISTRY.track(new_segment_path(f"{label}.index"))
            self.index = SharedIdIndex(index_path, self.num_embeddings, create=True)
            index_path = str(index_path)
        return {"table": table_path, "states": states, "index": index_path}

    def _rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Row numbers of (unique) ids: the ids themselves, or through the node's id index."""
        if self.index is None:
            return ids
        rows = self.index.lookup_or_insert(ids.numpy(), self._init_new_row)
        return torch.from_numpy(rows)

    @torch.no_grad()
    def _init_new_row(self, row: int, key: int) -> None:
        assert self._table is not None
        value = hashed_init(np.array([key], dtype=np.int64), self.embedding_dim, self.init_scale, self.seed)
        self._table[row] = (value[0] if self.init != "zeros" else torch.zeros(self.embedding_dim)).to(
            self._table.dtype
        )
        for state in self.optimizer_state.values():
            state[row] = 0.0

    @torch.no_grad()
    def _initialise(self, table: torch.Tensor) -> None:
        if self.init == "zeros":
            return
        generator = torch.Generator().manual_seed(self.seed)
        # float32 rows are drawn straight into the shared table, other dtypes through one float32 buffer
        # reused for every chunk: with a fresh buffer per chunk, the allocator keeps freed chunks it cannot
        # reuse, private memory of local rank 0 that grows with the table's rows (half the table's bytes)
        buffer = None
        if table.dtype != torch.float32:
            rows = min(table.shape[0], _INIT_ROWS_PER_CHUNK)
            buffer = torch.empty(rows, table.shape[1], dtype=torch.float32)
        for start in range(0, table.shape[0], _INIT_ROWS_PER_CHUNK):
            chunk = table[start : start + _INIT_ROWS_PER_CHUNK]
            values = chunk if buffer is None else buffer[: chunk.shape[0]]
            if self.init == "normal":
                values.normal_(0.0, self.init_scale, generator=generator)
            else:
                values.uniform_(-self.init_scale, self.init_scale, generator=generator)
            if buffer is not None:
                chunk.copy_(values)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.attached:
            self.attach()
        self.wait_for_updates()  # the rows read below must hold the last step's update
        assert self._table is not None
        # the one copy of the step's ids to the host: everything below reads that copy (a unique on the
        # device would wait for it too, for the size of its result)
        ids = _to_host(input.reshape(-1))
        unique, inverse = torch.unique(ids, return_inverse=True)  # sorted: the range is its two ends
        if self.index is None and unique.numel():
            low, high = int(unique[0]), int(unique[-1])
            if low < 0 or high >= self.num_embeddings:
                raise IndexError(f"ids must be in [0, {self.num_embeddings}); got ids from {low} to {high}.")
        # index_select copies whole rows; advanced indexing goes through the generic, slower kernel.
        # Host to device without waiting: the source is pageable memory, which the copy stages at once
        rows = self._table.index_select(0, self._rows_of(unique)).to(
            device=input.device, dtype=torch.float32, non_blocking=True
        )
        if self.training and torch.is_grad_enabled():
            self._check_synchronised(input.device.type)
            rows.requires_grad_(True)
            rows.register_hook(lambda grad, ids=unique: self._record(ids, grad))
        local = inverse.view(input.shape).to(input.device, non_blocking=True)
        if self.mode is None:
            return F.embedding(local, rows)
        return F.embedding_bag(local, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights)

    def _check_synchronised(self, device_type: str) -> None:
        """Training on several processes, or under a float16 loss scale, needs hier_sliced; on one
        process the table follows the optimizer steps."""
        if not self.steps_with_optimizers:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            _end_process_groups_at_exit()  # the run ends with this error, gloo's work maybe still in flight
            raise RuntimeError(
                "HybridEmbedding is training on several processes without strategy='hier_sliced': its table "
                "would never be updated (another strategy neither synchronises its per-id gradients nor "
                "applies its row-wise optimizer). Use Trainer(strategy='hier_sliced'), or "
                "nn.Embedding(sparse=True) under this strategy."
            )
        if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16:
            raise RuntimeError(
                "HybridEmbedding is training under float16 autocast without strategy='hier_sliced': its "
                "gradients carry the loss scaler's scale, which only hier_sliced undoes before the table "
                "steps. Use precision='bf16-mixed', or Trainer(strategy='hier_sliced')."
            )
        _follow_optimizer_steps(self)
        if len(self._pending) == _PENDING_WARNING:
            warnings.warn(
                f"HybridEmbedding has {_PENDING_WARNING} backward passes of gradients that were never "
                "applied: no optimizer has stepped since. The table steps when any torch optimizer "
                "steps (or call sync_and_update()).",
                stacklevel=3,
            )

    def _record(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        self._pending.append((ids, _to_host(grad.detach().float())))

    # ------------------------------------------------------------------ update
    def pending_gradient(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's gradient since the last update, one row per unique id."""
        return self._coalesced(self._pending)

    def _coalesced(self, pending: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        if not pending:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, self.embedding_dim)
        if len(pending) == 1:  # one forward: its ids are already unique and sorted (torch.unique)
            return pending[0][0], pending[0][1]
        unique, summed, _ = coalesce(torch.cat([p[0] for p in pending]), torch.cat([p[1] for p in pending]))
        return unique, summed

    def _groups_for_exchange(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        return self._exchange_groups or (self._intra_group, self._inter_group)

    def _run(self, job: Callable[[], None]) -> None:
        """Run a job that issues collectives now, or queue it on the tables' thread."""
        if self._jobs is None:
            job()
        else:
            self._jobs.submit(job)

    def run_exchanges_inline(self) -> None:
        """Forget the tables' thread and its groups (they are being shut down): later exchanges run on
        the calling thread over the attach groups."""
        self._exchange_groups, self._jobs = None, None

    def wait_for_updates(self) -> None:
        """Block until this process's queued exchanges and updates have run (raising their error)."""
        if self._jobs is not None and self._jobs.busy:
            self._jobs.wait()

    def sync_gradients(self) -> None:
        """Frequency-average the gradients of all trainers (a collective); kept until :meth:`apply_update`.

        With a jobs thread (under ``hier_sliced``) this returns at once and the exchange runs beside
        the rest of the step."""
        pending, self._pending = self._pending, []
        self._synced_step = True

        def exchange() -> None:
            ids, rows = self._coalesced(pending)
            intra, inter = self._groups_for_exchange()
            shared = self.node_merge == "shared"
            # a mailbox is rewritten only after the node's release (the update) says its last content
            # was read; a second sync before that (two synchronising backward passes before one
            # step under a loss scaler) goes by message
            staging = None if self._mailbox_unreleased else self._staging
            averaged = hierarchical_frequency_average(
                ids, rows, intra, inter, self.is_updater, staging, share_merge=shared
            )
            self._mailbox_unreleased = staging is not None
            if not self.is_updater or averaged is None:
                self._synced = None
            elif self._synced is None:
                self._synced = averaged
            else:  # several syncs before one update add up, as a dense parameter's .grad does
                unique, summed, _ = coalesce(torch.cat([self._synced[0], averaged[0]]),
                                             torch.cat([self._synced[1], averaged[1]]))  # fmt: skip
                self._synced = unique, summed

        self._run(exchange)

    def synced_gradients_finite(self) -> bool:
        """Whether the averaged gradient this process will apply is finite (``True`` off the updater)."""
        self.wait_for_updates()
        return self._synced is None or bool(torch.isfinite(self._synced[1]).all())

    @torch.no_grad()
    def apply_update(self, inv_scale: float = 1.0, skip: bool = False) -> None:
        """Local rank 0 applies the synced gradient times ``inv_scale`` unless ``skip``; node barrier.

        ``inv_scale`` undoes a loss scale (``16-mixed``); ``skip`` is the loss scaler's decision to
        skip this step (a non-finite gradient anywhere), which leaves the table untouched.
        """
        if not self._synced_step:
            return
        self._synced_step = False

        def update() -> None:
            if self._synced is not None and not skip:
                assert self.row_optimizer is not None
                ids, grads = self._synced
                if inv_scale != 1.0:
                    grads = grads * inv_scale
                self.row_optimizer.step(self._rows_of(ids), grads)
            self._synced = None
            intra, _ = self._groups_for_exchange()
            release_from_leader(intra)  # nobody reads a row before it is updated
            self._mailbox_unreleased = False

        self._run(update)

    def sync_and_update(self) -> None:
        """Frequency-average the gradients of all trainers; local rank 0 updates; node barrier."""
        self.sync_gradients()
        self.apply_update()

    def discard_pending(self) -> None:
        self.wait_for_updates()
        self._pending = []

    # ------------------------------------------------------------------ files
    def export(self, path: str | Path) -> None:
        """Write the table in the binary table format (loadable with ``HybridEmbedding(path=...)``)."""
        if not self.attached:
            self.attach()
        self.wait_for_updates()
        assert self._table is not None
        save_table(path, self._table)

    @torch.no_grad()
    def load_rows_from(self, path: str | Path, state_paths: dict[str, str] | None = None) -> None:
        """Copy a saved table (and optimizer state) into the live table; updater only."""
        self.wait_for_updates()
        assert self._table is not None
        state_paths = {name: p for name, p in (state_paths or {}).items() if name in self.optimizer_state}
        for file in (path, *state_paths.values()):  # every file, on every process, before any is read
            rows, dim, _ = read_header(file)
            if (rows, dim) != (self.num_embeddings, self.embedding_dim):
                raise ValueError(
                    f"{file} holds a {rows}x{dim} table but this HybridEmbedding is "
                    f"{self.num_embeddings}x{self.embedding_dim}."
                )
        if not self.is_updater:
            return
        self._table.copy_(map_table(path, writable=False))
        for name, state_path in state_paths.items():
            self.optimizer_state[name].copy_(map_table(state_path, writable=False))

    def __deepcopy__(self, memo: dict) -> HybridEmbedding:
        """A copy that reads the same node table (its shared memory is not duplicated) and syncs
        nothing: what a callback that copies the model after setup gets (an EMA of the weights made
        in ``on_fit_start``). Process groups, the tables' thread and the mailboxes stay with the
        original (they cannot be copied)."""
        for shared in (self._table, *self.optimizer_state.values(), self.index, self.row_optimizer):
            if shared is not None:
                memo[id(shared)] = shared
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        runtime = {
            "_intra_group": None, "_inter_group": None, "_exchange_groups": None, "_jobs": None,
            "_staging": None, "_managed": False, "_pending": [], "_synced": None, "_synced_step": False,
            "_mailbox_unreleased": False,
        }  # fmt: skip
        for key, value in self.__dict__.items():
            clone.__dict__[key] = runtime[key] if key in runtime else copy.deepcopy(value, memo)
        return clone

    def extra_repr(self) -> str:
        shape = f"{self.num_embeddings}, {self.embedding_dim}"
        merge = "" if self.node_merge == "leader" else f", node_merge={self.node_merge!r}"
        return f"{shape}, mode={self.mode!r}, optimizer={self.optimizer_name!r}, lr={self.lr}{merge}"
