"""``DDPStrategy``'s arguments that the strategies accept, so a ``DDPStrategy(...)`` call or config runs
unchanged, and that change nothing there: no ``DistributedDataParallel`` wraps the model."""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

IGNORED_DDP_DEFAULTS = {
    "find_unused_parameters": False,
    "static_graph": False,
    "gradient_as_bucket_view": False,
}


def warn_ignored_ddp_arguments(strategy: str, reason: str, **given: object) -> None:
    """One warning (rank 0) naming each of ``given`` that differs from ``DDPStrategy``'s default; ``reason``
    says why the strategy needs none of them."""
    changed = [f"{name}={value!r}" for name, value in given.items() if value != IGNORED_DDP_DEFAULTS[name]]
    if changed:
        rank_zero_warn(
            f"{strategy} ignores {', '.join(changed)}: these DDPStrategy arguments are accepted so that a "
            "DDPStrategy call or config runs unchanged, but no DistributedDataParallel wraps the model "
            f"here: {reason}"
        )
