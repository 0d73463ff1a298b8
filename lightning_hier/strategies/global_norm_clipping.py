"""Lightning's gradient-norm clipping over the global norm when each rank holds part of the model.

Lightning clips through the precision plugin, which only sees this rank's gradients (a slice
under ``hier_sliced``, a stage under ``hier_pipeline``). Subclassing the plugin's own class
(instead of wrapping it) keeps every ``isinstance`` check Lightning makes on the plugin true,
and unscaling in AMP plugins still runs before the norm. The strategy's ``engine`` provides
``clip_grad_norm_(max_norm)``, which all-reduces the squared norm.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer


def _clip_grad_by_norm(self: Precision, optimizer: Optimizer, clip_val: int | float) -> None:
    strategy: Any = self._hier_strategy  # type: ignore[attr-defined]
    engine_for = getattr(strategy, "engine_for", None)  # several optimizers: the one being clipped
    engine = engine_for(optimizer) if engine_for is not None else strategy.engine
    assert engine is not None
    engine.clip_grad_norm_(float(clip_val))


def _after_closure(self: Precision, model: Any, optimizer: Optimizer) -> None:
    hook = getattr(self._hier_strategy, "before_optimizer_step_hooks", None)  # type: ignore[attr-defined]
    if hook is not None:
        hook()
    type(self)._hier_base._after_closure(self, model, optimizer)  # type: ignore[attr-defined]


def _post_backward(self: Precision, tensor: Any, module: Any) -> Any:
    hook = getattr(self._hier_strategy, "backward_pass_done", None)  # type: ignore[attr-defined]
    if hook is not None:
        hook()
    return type(self)._hier_base.post_backward(self, tensor, module)  # type: ignore[attr-defined]


def install_global_norm_clipping(plugin: Precision, strategy: Any) -> None:
    """Route ``clip_grad_by_norm`` of ``plugin`` to ``strategy.engine.clip_grad_norm_``, and give the
    strategy a call right before ``on_before_optimizer_step`` (``before_optimizer_step_hooks``) and one
    right after the backward pass, before ``on_after_backward`` (``backward_pass_done``): Lightning's
    own ``Strategy.backward`` then runs unchanged (tests and tools patch it on the base class)."""
    base = type(plugin)
    if not getattr(base, "_hier_global_norm", False):
        methods = {
            "clip_grad_by_norm": _clip_grad_by_norm,
            "_after_closure": _after_closure,
            "post_backward": _post_backward,
        }
        patched = type(f"GlobalNorm{base.__name__}", (base,), methods)
        patched._hier_global_norm = True  # type: ignore[attr-defined]
        patched._hier_base = base  # type: ignore[attr-defined]
        plugin.__class__ = patched
    plugin._hier_strategy = strategy  # type: ignore[attr-defined]


def remove_global_norm_clipping(plugin: Precision) -> None:
    """Give the plugin its own class back (at teardown)."""
    base = getattr(type(plugin), "_hier_base", None)
    if base is not None:
        plugin.__class__ = base
        plugin.__dict__.pop("_hier_strategy", None)
