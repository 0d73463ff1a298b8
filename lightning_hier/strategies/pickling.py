"""Pickling a strategy (``torch.save(trainer)``, ``copy.deepcopy``) without its live distributed state.

Lightning's ``DDPStrategy`` pickles: it keeps no process group of its own. These strategies hold process
groups, reducer threads and shared-memory views (topology, engines), none of which can be pickled or would
mean anything in another process. They are left out of the pickled copy and rebuilt by the next ``setup``,
as for a freshly constructed strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar


class PicklesWithoutRuntimeState:
    """Mixin: the attributes named in ``_runtime_state`` are replaced by a fresh value when pickled."""

    #: attribute name -> factory of the value a strategy has before ``setup_distributed``
    _runtime_state: ClassVar[dict[str, Callable[[], Any]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # type: ignore[misc]
        for name, fresh in self._runtime_state.items():
            if name in state:
                state[name] = fresh()
        return state
