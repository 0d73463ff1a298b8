"""What Lightning calls on an optimizer whose param groups hold flat slices, routed to the strategy.

- ``zero_grad`` (:func:`route_zero_grad`): the sharded optimizer's own clears its slices only, not the
  engine's local gradients; ``hier_sliced`` (manual optimization) and ``hier_bsp`` route it.
- ``toggle_optimizer`` / ``untoggle_optimizer`` (:func:`install_optimizer_toggle`): Lightning's versions
  switch ``requires_grad`` on the tensors in each optimizer's ``param_groups``. Under ``hier_sliced``
  those are the sharded slices, not the module's parameters, so toggling would change nothing and a
  GAN's generator backward would still leave gradients on the discriminator. The strategy installs
  these on the LightningModule (instance attributes, removed at teardown); they do what Lightning's
  do, on the module parameters each optimizer was built over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import _MockOptimizer
from torch import nn
from torch.optim import Optimizer

ParamsOf = Callable[[Optimizer], Sequence[nn.Parameter]]


def without_optimizer(optimizers: Sequence[Optimizer]) -> bool:
    """``configure_optimizers`` returned ``None`` (or is not defined): Lightning then fits with a no-op
    ``_MockOptimizer`` and the model is never updated, so there is nothing to shard or to serve. The
    strategies then train like Lightning does (the parameters stay as they are) instead of refusing an
    unknown optimizer (before 2026-11-27 they did, and ``hier_pipeline`` failed to checkpoint)."""
    # a LightningOptimizer wraps the optimizer in _optimizer
    unwrapped = [getattr(optimizer, "_optimizer", optimizer) for optimizer in optimizers]
    return bool(unwrapped) and all(isinstance(optimizer, _MockOptimizer) for optimizer in unwrapped)


def route_zero_grad(strategy: Any, index: int, zero_grad: Callable[..., None]) -> None:
    """Make ``zero_grad`` what the strategy's optimizer ``index`` does on ``zero_grad()``, whether the caller
    holds the optimizer (Lightning's training loop) or the LightningOptimizer that ``self.optimizers()``
    returns, whose class inherits the optimizer's own ``zero_grad`` and so needs the attribute too. Call it
    after the precision plugin's setup, which recreates those wrappers."""
    strategy.optimizers[index].zero_grad = zero_grad
    strategy._lightning_optimizers[index].zero_grad = zero_grad


def install_optimizer_toggle(
    module: pl.LightningModule, params_of: ParamsOf, all_params: Sequence[nn.Parameter]
) -> None:
    """Route ``module.toggle_optimizer(opt)`` (and ``toggled_optimizer``, ``LightningOptimizer.toggle_model``,
    which call it) to the module parameters ``params_of(opt)``; ``all_params`` are every optimizer's."""

    def toggle_optimizer(optimizer: Any) -> None:
        state = {param: param.requires_grad for param in all_params}
        for param in all_params:
            param.requires_grad = False
        for param in params_of(optimizer):
            param.requires_grad = state[param]
        module._param_requires_grad_state = state

    def untoggle_optimizer(optimizer: Any) -> None:
        for param, requires_grad in module._param_requires_grad_state.items():
            param.requires_grad = requires_grad
        module._param_requires_grad_state = {}

    module.toggle_optimizer = toggle_optimizer  # type: ignore[method-assign]
    module.untoggle_optimizer = untoggle_optimizer  # type: ignore[method-assign]


def remove_optimizer_toggle(module: pl.LightningModule | None) -> None:
    """Give the module Lightning's own methods back."""
    if module is None:
        return
    for name in ("toggle_optimizer", "untoggle_optimizer"):
        module.__dict__.pop(name, None)
