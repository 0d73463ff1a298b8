"""A clear error where a step calls, outside ``self(...)``, a layer whose weights another stage holds.

Each stage keeps only its own layers' parameters and buffers; the others' are released (empty tensors), and
only ``self(...)`` runs the model across the stages. A ``training_step`` that calls a submodule itself, as
Lightning's own ``LitAutoEncoder`` does (``z = self.encoder(x)``, then ``self.decoder(z)``, with a
``forward`` that returns the encoding only), would otherwise fail deep inside torch on one rank (``mat2
must be a matrix, got 1-D tensor``) while the others wait for it. Each module whose own state this stage
released gets a forward pre-hook that raises with the reason and the fix; the hooks follow every release,
migration and restore, so the layers this stage holds (the only ones the engine calls) carry none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle


class LayerHeldElsewhereError(RuntimeError):
    """A module whose weights another pipeline stage holds was called on this one."""


class ForeignLayerGuard:
    """Forward pre-hooks on the submodules of ``root`` whose own state this stage does not hold."""

    def __init__(self, root: nn.Module, stage: int, num_stages: int, delegate: str | None = None) -> None:
        self.root, self.stage, self.num_stages = root, stage, num_stages
        # the child forward hands its inputs to: a step's call of it runs as self(...) (delegation.py)
        self.delegate = delegate
        self._handles: list[RemovableHandle] = []
        self._guarded: list[tuple[str, nn.Module]] = []

    @property
    def guarded(self) -> list[str]:
        """The qualified names of the modules that raise when called here."""
        return [name for name, _ in self._guarded]

    def refresh(self, foreign_names: Iterable[str]) -> None:
        """Guard exactly the modules all of whose own parameters and buffers are in ``foreign_names`` (the
        root and the child its ``forward`` delegates to excluded: ``self(...)`` is how the model runs)."""
        self.clear()
        foreign = set(foreign_names)
        for name, module in self.root.named_modules(remove_duplicate=False):
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            if module is self.root or name == self.delegate or not own:
                continue
            if all(f"{name}.{local}" in foreign for local, _ in own):
                self._guarded.append((name, module))
                self._handles.append(module.register_forward_pre_hook(self._refuse_call(name)))

    def clear(self) -> None:
        """Remove every hook (the whole model is on this rank again)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._guarded = [], []

    def _refuse_call(self, name: str) -> Any:
        stage, last = self.stage, self.num_stages - 1

        def refuse(module: nn.Module, args: Any) -> None:
            raise LayerHeldElsewhereError(
                f"hier_pipeline: `{name}` ({type(module).__name__}) was called outside `self(...)` on stage "
                f"{stage} of {last + 1}, which does not hold its weights: each stage keeps only its own "
                f"layers of `forward` (state no layer of `forward` uses lives on stage {last}), and only "
                "`self(...)` runs the model across the stages. Call `self(...)` exactly once in each "
                "`*_step` and let `forward` compute what the step needs: a `training_step` that runs "
                "`z = self.encoder(x)` and then `self.decoder(z)` needs a `forward` returning "
                "`self.decoder(self.encoder(x))`. Or train such a model with hier_sliced or ddp."
            )

        return refuse
