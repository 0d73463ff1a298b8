"""The strategies' constructors: a small surface of their own, and DDP's ignored arguments said out loud."""

from __future__ import annotations

import inspect
import warnings

import pytest
from helpers import DDP_PLUMBING

from lightning_hier import HierBSPStrategy, HierSlicedStrategy

IGNORED_DDP = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")
STRATEGIES = [
    pytest.param(HierSlicedStrategy, id="hier_sliced"),
    pytest.param(HierBSPStrategy, id="hier_bsp"),
]


@pytest.mark.parametrize("strategy_class", STRATEGIES)
def test_at_most_twelve_options_of_its_own(strategy_class: type) -> None:
    parameters = inspect.signature(strategy_class.__init__).parameters
    # DDP's arguments, used or accepted and ignored (warning, tested below), are not options of its own
    own = [name for name in parameters if name != "self" and name not in DDP_PLUMBING | set(IGNORED_DDP)]
    assert len(own) <= 12, own
    assert set(parameters) >= DDP_PLUMBING  # still a drop-in for DDPStrategy's arguments
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters.values())


@pytest.mark.parametrize("strategy_class", STRATEGIES)
@pytest.mark.parametrize("name", IGNORED_DDP)
def test_an_ignored_ddp_argument_warns_once_naming_it(strategy_class: type, name: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy_class(**{name: True})
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert f"ignores {name}=True" in messages[0], messages[0]
    assert "DistributedDataParallel" in messages[0], messages[0]


@pytest.mark.parametrize("strategy_class", STRATEGIES)
def test_several_ignored_ddp_arguments_share_one_warning(strategy_class: type) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy_class(find_unused_parameters=True, static_graph=True, gradient_as_bucket_view=True)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert all(f"{name}=True" in messages[0] for name in IGNORED_DDP), messages[0]


@pytest.mark.parametrize("strategy_class", STRATEGIES)
def test_ddp_defaults_do_not_warn(strategy_class: type) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy_class()
        strategy_class(find_unused_parameters=False, static_graph=False, gradient_as_bucket_view=False)
