"""The ``16-mixed`` loss scaler when each rank holds part of the gradients.

Lightning's ``MixedPrecision`` plugin decides skip-or-step from the gradients its optimizer sees.
Under ``hier_sliced`` that is this rank's slices only, and the node-shared embedding tables'
gradients are not in the optimizer at all. :class:`HierGradScaler` is torch's
``ShardedGradScaler`` (the non-finite flag is all-reduced, so every rank decides alike) that also
folds in gradients held outside the optimizer and remembers, per step, the scale it unscaled by
and whether it skipped, so those gradients are unscaled and skipped the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

FiniteCheck = Callable[[], bool]


class HierGradScaler(ShardedGradScaler):
    """``ShardedGradScaler`` plus gradients outside the optimizer (``extra_finite`` checks).

    After :meth:`step`, ``last_inv_scale`` is the factor the step's gradients were unscaled by
    and ``last_step_skipped`` whether the step was skipped (on every rank alike).
    """

    def __init__(self, *args: Any, extra_finite: Sequence[FiniteCheck] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extra_finite = list(extra_finite)
        self.last_inv_scale = 1.0
        self.last_step_skipped = False

    @classmethod
    def replacing(
        cls,
        scaler: torch.amp.GradScaler,
        device: str,
        process_group: dist.ProcessGroup | None,
        extra_finite: Sequence[FiniteCheck] = (),
    ) -> HierGradScaler:
        """A scaler with ``scaler``'s settings and state: scale, growth factor and interval,
        backoff factor, growth tracker, enabled."""
        new = cls(
            device=device,
            init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
            enabled=scaler.is_enabled(),
            process_group=process_group,
            extra_finite=extra_finite,
        )
        state = scaler.state_dict()
        if state:
            new.load_state_dict(state)
        return new

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not all(check() for check in self.extra_finite):
            flag = per_device.setdefault(found_inf.device, found_inf)
            flag.fill_(1.0)  # all-reduced with the rest in unscale_: every rank skips
        return per_device

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self._enabled:
            self.last_inv_scale, self.last_step_skipped = 1.0, False
            return super().step(optimizer, *args, **kwargs)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        assert self._scale is not None
        self.last_inv_scale = float(self._scale.double().reciprocal())
        self.last_step_skipped = sum(v.item() for v in state["found_inf_per_device"].values()) > 0
        return super().step(optimizer, *args, **kwargs)
