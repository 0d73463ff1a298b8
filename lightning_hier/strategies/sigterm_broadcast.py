"""Lightning's per-step SIGTERM broadcast, with rank 0 not waiting for the others to receive it.

Before every training step Lightning broadcasts rank 0's "received SIGTERM" flag, and every rank waits
for that broadcast to complete. Rank 0 has nothing to learn from it, but on gloo a send completes only
once the receiver has posted its receive, so rank 0 waits until the slowest rank reaches the same step.
Under ``hier_pipeline`` rank 0 holds the last stage, which finishes its step first, so that wait put the
other stages' last backward in front of its next step (about 2.5 ms per step on the CPU benchmark's
bottleneck stage). Here rank 0 issues the broadcast and goes on; it waits for it at the next step or
when the fit ends. The flag reaches every rank at the same step as Lightning's own broadcast, and a set
flag ends the fit on every rank the way Lightning does it (a barrier, then ``SIGTERMException``).

Lightning makes the flag on the root device, so on a GPU every receiver's read of it waited for the
device to finish its queued work, every step. The flag here is a host tensor sent over the control group
(:func:`lightning_hier.topology.control_group`, which has a CPU backend beside NCCL): no device work."""

from __future__ import annotations

import contextlib
from functools import partial

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_hier.strategies.lightning_patches import replace_sigterm_broadcast, restore_sigterm_broadcast
from lightning_hier.strategies.posted_broadcasts import PostedBroadcasts
from lightning_hier.topology import control_group


class SigtermBroadcast:
    """Installs the broadcast on a trainer's training loop; :meth:`remove` restores Lightning's own."""

    def __init__(self) -> None:
        self._sent = PostedBroadcasts()  # rank 0's flags

    def install(self, trainer: pl.Trainer) -> None:
        replace_sigterm_broadcast(trainer, partial(self._broadcast, trainer))

    def remove(self, trainer: pl.Trainer, wait: bool = True) -> None:
        """Restore Lightning's broadcast; ``wait``: first complete rank 0's last one (not after a failure,
        when the other ranks may be gone)."""
        restore_sigterm_broadcast(trainer)
        if wait:
            self._sent.wait()
        self._sent.forget()

    def _broadcast(self, trainer: pl.Trainer) -> None:
        self._sent.wait()
        received = bool(getattr(trainer, "received_sigterm", False))
        try:
            group = control_group()  # all ranks: global rank 0 is its rank 0
            flag = torch.tensor([int(received)])  # on the host: reading it never waits for the device
            if dist.get_rank() == 0:
                self._sent.post(flag, src=0, group=group)
            else:
                dist.broadcast(flag, src=0, group=group)
                received = bool(flag.item())
        except Exception:  # as Lightning: a failed broadcast reads as "no SIGTERM"
            received = False
        if received:
            with contextlib.suppress(Exception):
                # as Lightning: every rank meets before all of them exit; on the host, as the flag came
                dist.barrier(group=control_group())
            raise SIGTERMException()
