"""What Lightning's own tests patch still reaches our strategies (tests/scripts/lightning_patch_checks.py).

- Stochastic-weight-averaging tests count ``Strategy.backward`` patched on the base class; an override
  of ``backward`` would leave the count at 0. hier_sliced reduces the gradients from the precision plugin
  between the backward pass and ``on_after_backward``, and Lightning's ``backward`` runs unchanged.
- ThroughputMonitor tests patch ``time.perf_counter`` with a fixed list of readings; the strategies' own
  timing, calling it (66 times in 6 steps under hier_sliced), would use the readings up. Their clocks
  hold their own reference to ``perf_counter``.
The reference is the same fit under Lightning's default strategy.
"""

from __future__ import annotations

import json

import pytest
from helpers import run_torchrun


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("patching") / "counts.json"
    run_torchrun("lightning_patch_checks.py", 1, str(out), timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("strategy", ["hier_sliced", "hier_bsp"])
def test_patched_backward_and_clock_see_what_lightning_alone_sees(counts: dict, strategy: str) -> None:
    reference = counts["reference"]
    assert reference["backward"] == 6  # one per step: the patch itself works
    assert counts[strategy] == reference
