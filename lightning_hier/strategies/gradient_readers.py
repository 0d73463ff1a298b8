"""Whether anything in a fit reads ``param.grad`` in Lightning's gradient hooks.

``hier_sliced`` leaves each rank only its slice of the averaged gradient; making every ``.grad`` the
averaged one (as under DDP) costs an intra-node all-gather per step, which only pays where a hook reads
the gradients: the module's or a callback's own ``on_after_backward`` / ``on_before_optimizer_step``
(Lightning's ``grad_norm`` logging idiom lives there), and the module's own ``configure_gradient_clipping``,
which Lightning calls after ``on_before_optimizer_step``, right before the step (Lightning's clipping tests
read the clipped ``.grad`` there after ``super()``). None of Lightning's own callbacks overrides these; a
callback that does without reading gradients says so with ``reads_gradients = False`` (``CommProfiler``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")
#: the LightningModule's hooks that run while ``.grad`` is set (callbacks have the first two only)
MODULE_GRADIENT_HOOKS = (*GRADIENT_HOOKS, "configure_gradient_clipping")


def hooks_read_gradients(module: Any, callbacks: list[Any]) -> bool:
    """Whether ``module`` or one of ``callbacks`` overrides a hook that runs while ``.grad`` is set."""
    if any(is_overridden(hook, module) for hook in MODULE_GRADIENT_HOOKS):
        return True
    return any(
        getattr(callback, "reads_gradients", True) and is_overridden(hook, callback, parent=Callback)
        for callback in callbacks
        for hook in GRADIENT_HOOKS
    )


def reads_clipped_gradients(module: Any) -> bool:
    """Whether ``module``'s own ``configure_gradient_clipping`` may read ``.grad`` after Lightning's clipping
    (a call of ``super()`` or of ``clip_gradients`` inside it), before the step."""
    return is_overridden("configure_gradient_clipping", module)
