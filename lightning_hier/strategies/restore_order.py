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

from typing import Any

import lightning.pytorch as pl

from lightning_hier.strategies.lightning_patches import (
    attached_trainer,
    restore_modules_and_callbacks,
    run_arguments,
)


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
        trainer = attached_trainer(getattr(self, "lightning_module", None))
        # if Lightning renames _run's arguments, nothing is found and Lightning's own order applies
        arguments = run_arguments(trainer) if trainer is not None else None
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
        arguments = run_arguments(trainer)
        if arguments is None or not arguments[0]:
            return
        ckpt_path, weights_only = arguments
        restore_modules_and_callbacks(trainer, ckpt_path, weights_only)
        self._restored_in_setup = True

    def teardown(self) -> None:
        # the next run asks again before its setup
        self._restored_in_setup = self._restores_before_setup = self._awaiting_setup = False
        super().teardown()  # type: ignore[misc]
