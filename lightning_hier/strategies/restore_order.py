"""Restore a checkpoint's module and callback states before ``on_fit_start``, in the order ``ddp`` uses.

These strategies can load a checkpoint only once they are set up: the flat buckets, the pipeline stages
and the server shards must exist first. A strategy that says so (``restore_checkpoint_after_setup``) gets a
different order from Lightning 2.6's ``Trainer._run``. The module and the callbacks are restored *after* the
``on_fit_start`` hooks, and without the ``weights_only`` passed to ``fit``. Callbacks that act on their
restored state in ``on_fit_start`` then go wrong:

- ``Timer`` takes one more step after its time budget is already spent;
- ``StochasticWeightAveraging`` loads its SWALR state into the user's scheduler (``KeyError``);
- a checkpoint holding custom objects fails to load although ``fit(..., weights_only=False)`` was passed.

So these strategies restore at the end of their own ``setup`` instead: set up, and still before
``on_fit_start``. They then answer ``False``, so Lightning does not restore a second time. The optimizer
and loop states are restored by Lightning after ``on_fit_start``, as for every strategy.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl


def _run_arguments(trainer: pl.Trainer) -> tuple[Any, bool | None] | None:
    """``(ckpt_path, weights_only)`` of the ``Trainer._run`` that is setting the strategy up.

    Returns ``None`` when there is no such call. Lightning keeps the checkpoint's path only as an argument of
    ``_run`` until it restores, and keeps ``weights_only`` nowhere else, so the path is read from that call's
    frame. If Lightning renames it, nothing is found and Lightning's own order applies."""
    run_code = pl.Trainer._run.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is run_code and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path"), frame.f_locals.get("weights_only")
        frame = frame.f_back
    return None


class RestoresBeforeFitStart:
    """Mixin for a strategy that loads checkpoints only after its ``setup``. The strategy calls
    :meth:`_restore_at_end_of_setup` as the last step of ``setup``."""

    _restored_in_setup: bool = False

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # read twice per run by Lightning: True before setup (nothing can be loaded yet); after setup,
        # False once this strategy has restored, so Lightning does not restore again
        return not self._restored_in_setup

    def _restore_at_end_of_setup(self, trainer: pl.Trainer) -> None:
        """Restore the module, the datamodule and the callbacks from the checkpoint this run was given."""
        self._restored_in_setup = False
        arguments = _run_arguments(trainer)
        if arguments is None or not arguments[0]:
            return
        ckpt_path, weights_only = arguments
        trainer._checkpoint_connector._restore_modules_and_callbacks(ckpt_path, weights_only)
        self._restored_in_setup = True

    def teardown(self) -> None:
        self._restored_in_setup = False  # the next run asks again before its setup
        super().teardown()  # type: ignore[misc]
