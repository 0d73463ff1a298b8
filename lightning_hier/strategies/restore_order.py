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

Where the module and callbacks can be loaded before the strategy's setup (``hier_sliced`` and ``hier_bsp``
with a consolidated checkpoint file: only the optimizers need the shards, and Lightning restores those
after setup anyway), the strategy answers ``False`` before its setup and Lightning restores exactly where
it does for ``ddp``: before ``configure_optimizers``, so ``on_load_checkpoint`` runs first and a module
that builds its optimizer from restored state gets what it gets under ``ddp`` (until 2026-11-27 it ran
after ``configure_optimizers``; Lightning's hook-order tests found it).
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
    """Mixin for a strategy that loads checkpoints only after its ``setup``, unless
    :meth:`_can_restore_before_setup` says this checkpoint can be loaded before it. The strategy calls
    :meth:`_restore_at_end_of_setup` as the last step of ``setup``."""

    _restored_in_setup: bool = False
    _restores_before_setup: bool = False  # Lightning restores this run's module and callbacks before setup
    _awaiting_setup: bool = False  # ... and the strategy's setup has not run yet

    def _can_restore_before_setup(self, ckpt_path: Any) -> bool:
        """Whether the module and callbacks of ``ckpt_path`` load into the module before this strategy's
        setup (as under ``ddp``); the optimizer states are always restored after it."""
        return False

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # read twice per run by Lightning, before and after setup: False before it where the checkpoint can
        # be loaded then (Lightning restores as for ddp); after setup, False once restored (no second time)
        if self._restored_in_setup or self._restores_before_setup:
            return False
        module = getattr(self, "lightning_module", None)
        trainer = getattr(module, "_trainer", None) if module is not None else None
        arguments = _run_arguments(trainer) if trainer is not None else None
        if arguments is not None and arguments[0] and self._can_restore_before_setup(arguments[0]):
            self._restores_before_setup = self._awaiting_setup = True
            return False
        return True

    def _restore_at_end_of_setup(self, trainer: pl.Trainer) -> None:
        """Restore the module, the datamodule and the callbacks from the checkpoint this run was given
        (unless Lightning did before the setup)."""
        self._restored_in_setup = self._awaiting_setup = False
        if self._restores_before_setup:
            return
        arguments = _run_arguments(trainer)
        if arguments is None or not arguments[0]:
            return
        ckpt_path, weights_only = arguments
        trainer._checkpoint_connector._restore_modules_and_callbacks(ckpt_path, weights_only)
        self._restored_in_setup = True

    def teardown(self) -> None:
        # the next run asks again before its setup
        self._restored_in_setup = self._restores_before_setup = self._awaiting_setup = False
        super().teardown()  # type: ignore[misc]
