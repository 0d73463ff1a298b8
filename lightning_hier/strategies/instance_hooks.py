"""``InstanceHooks``: a strategy's per-run replacements of methods on the user's objects (the
LightningModule's hooks, a prediction writer's), put back exactly as they were at the end of the run.

A replacement is an instance attribute that runs something before or after the original, or skips it;
``functools.update_wrapper`` keeps Lightning's ``is_overridden`` answering for the user's method, and a
module pickled in the middle of a run (``torch.save``, ``copy.deepcopy``) carries the user's method only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_ABSENT = object()


def _unwrapped(hook: Callable[..., Any]) -> Callable[..., Any]:
    return hook


class _RunHook:
    """``hook`` with something run before or after it, or skipped, its result passed through ``transform``
    when given. Pickles (``torch.save`` or
    ``copy.deepcopy`` of the module in the middle of a run) as the user's hook alone: the additions
    belong to one run."""

    def __init__(
        self,
        hook: Callable[..., Any],
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
        skip: bool = False,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        functools.update_wrapper(self, hook)  # Lightning's is_overridden follows __wrapped__ to the user's
        self.hook, self.before, self.after, self.skip = hook, before, after, skip
        self.transform = transform

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.before is not None:
            self.before()
        result = None if self.skip else self.hook(*args, **kwargs)
        if self.after is not None:
            self.after()
        return result if self.transform is None else self.transform(result)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unwrapped, (self.hook,))


class InstanceHooks:
    """Replaces methods of objects by instance attributes, and puts back exactly what was there (a user's
    own instance attribute, as Lightning's hook-recording test models set, or nothing)."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def wrap(
        self,
        owner: Any,
        name: str,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
        skip: bool = False,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        """``owner.name`` runs ``before``, itself (unless ``skip``), then ``after``, and returns its result
        through ``transform`` when given."""
        self._saved.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, _RunHook(getattr(owner, name), before, after, skip, transform))

    def restore(self) -> None:
        for owner, name, previous in reversed(self._saved):
            if previous is _ABSENT:
                owner.__dict__.pop(name, None)
            else:
                owner.__dict__[name] = previous
        self._saved = []
