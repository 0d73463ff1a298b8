"""The docs cannot drift from the code: every public class and function has an entry in docs/reference.md,
every option a strategy adds to ``DDPStrategy`` is documented in its docstring (which the reference
renders), every ``plan`` option is in the reference, and every relative link in docs/*.md names a file
that exists. Plain text checks: no MkDocs needed."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

import lightning_hier
from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy
from lightning_hier.plan.cli import parser as plan_parser
from lightning_hier.strategies.base import IGNORED_DDP_DEFAULTS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference.md"
STRATEGIES = (HierSlicedStrategy, HierBSPStrategy, HierPipelineStrategy)


# ---------------------------------------------------------------------- the checker
def ddp_argument_names() -> set[str]:
    """``DDPStrategy``'s arguments: its own parameters, and the ``DistributedDataParallel`` arguments its
    ``**kwargs`` forward that the strategies accept so that a ``DDPStrategy`` config runs unchanged
    (``find_unused_parameters``, ...; they change nothing here and warn when set)."""
    forwarded = set(IGNORED_DDP_DEFAULTS)
    assert forwarded <= set(inspect.signature(DistributedDataParallel.__init__).parameters), forwarded
    return (set(inspect.signature(DDPStrategy.__init__).parameters) | forwarded) - {"self", "kwargs"}


def own_arguments(cls: type) -> list[str]:
    """The ``__init__`` arguments of ``cls`` that are not ``DDPStrategy``'s, in signature order."""
    ddp = ddp_argument_names()
    parameters = inspect.signature(cls.__init__).parameters.values()
    return [
        p.name
        for p in parameters
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in ddp
    ]


def documented_arguments(cls: type) -> set[str]:
    """The names in the ``Args:`` section of the class docstring (Google style; an entry may name several
    arguments, ``a, b: ...``)."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    names: set[str] = set()
    entry_indent: int | None = None
    inside = False
    for line in lines:
        if not inside:
            inside = line.strip() == "Args:"
            section_indent = len(line) - len(line.lstrip())
            continue
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= section_indent:
            break  # the next section or paragraph
        if entry_indent is None:
            entry_indent = indent
        if indent == entry_indent:
            match = re.match(r"\s*(\w+(?:\s*,\s*\w+)*)\s*(?:\([^)]*\))?\s*:", line)
            if match:
                names.update(name.strip() for name in match.group(1).split(","))
    return names


def argument_doc_problems(cls: type) -> dict[str, list[str]]:
    """``{"undocumented": [...], "unknown": [...]}``: own arguments missing from the docstring's ``Args``
    section, and names documented there that the signature does not have."""
    own = own_arguments(cls)
    documented = documented_arguments(cls)
    signature = set(inspect.signature(cls.__init__).parameters)
    return {
        "undocumented": [name for name in own if name not in documented],
        "unknown": sorted(documented - signature),
    }


# ---------------------------------------------------------------------- the reference
def reference_text() -> str:
    return REFERENCE.read_text()


def public_objects() -> list[str]:
    return [
        name
        for name in lightning_hier.__all__
        if inspect.isclass(getattr(lightning_hier, name)) or inspect.isfunction(getattr(lightning_hier, name))
    ]


@pytest.mark.parametrize("name", public_objects())
def test_every_public_class_and_function_has_a_reference_entry(name: str) -> None:
    assert re.search(rf"^::: lightning_hier\.{name}\s*$", reference_text(), re.MULTILINE), (
        f"docs/reference.md has no `::: lightning_hier.{name}` entry; add one for the public name {name}"
    )


def test_the_public_names_are_the_ones_the_reference_expects() -> None:
    # a guard on the test itself: the strategies are public and in __all__
    assert {cls.__name__ for cls in STRATEGIES} <= set(public_objects())


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda cls: cls.__name__)
def test_every_own_argument_of_a_strategy_is_documented(strategy: type) -> None:
    assert own_arguments(strategy), "the strategy adds options to DDPStrategy's"
    problems = argument_doc_problems(strategy)
    assert problems == {"undocumented": [], "unknown": []}, (
        f"{strategy.__name__}'s docstring (Args:) and its __init__ disagree: {problems}"
    )


def test_the_strategies_take_ddps_arguments_and_their_own() -> None:
    own = own_arguments(HierSlicedStrategy)
    assert "devices_per_node" in own and "bucket_cap_mb" in own
    for ddp_name in ("timeout", "process_group_backend", "find_unused_parameters", "static_graph"):
        assert ddp_name not in own
    # DistributedDataParallel has arguments of these names too, but here they are the strategy's own
    assert "broadcast_buffers" in own


def test_the_checker_finds_an_undocumented_and_a_stale_argument() -> None:
    class WithNewOption(HierSlicedStrategy):
        __doc__ = HierSlicedStrategy.__doc__

        def __init__(self, new_option: int = 0, **kwargs: object) -> None:
            super().__init__(**kwargs)

    class WithoutAnOption(HierSlicedStrategy):
        __doc__ = HierSlicedStrategy.__doc__

        def __init__(self, devices_per_node: int | None = None, **kwargs: object) -> None:
            super().__init__(devices_per_node=devices_per_node, **kwargs)

    class Documented(DDPStrategy):
        """A strategy.

        Args:
            alpha: the first.
            beta, gamma (int): two at once, with a type and a description that goes on
                over a second line: not_an_argument: still the description.

        Returns nothing: the section ended.
        """

        def __init__(self, alpha: int = 0, beta: int = 0, gamma: int = 0, timeout: object = None) -> None:
            super().__init__()

    assert argument_doc_problems(WithNewOption)["undocumented"] == ["new_option"]
    stale = argument_doc_problems(WithoutAnOption)["unknown"]
    assert "bucket_cap_mb" in stale and "devices_per_node" not in stale
    assert documented_arguments(Documented) == {"alpha", "beta", "gamma"}
    assert argument_doc_problems(Documented) == {"undocumented": [], "unknown": []}


# ---------------------------------------------------------------------- the plan command
def test_every_plan_option_is_in_the_reference() -> None:
    text = reference_text()
    options = [
        option
        for action in plan_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    ]
    assert options, "the plan parser has options"
    missing = [option for option in options if f"`{option}" not in text]
    assert not missing, f"docs/reference.md does not list the plan options {missing}"


# ---------------------------------------------------------------------- links
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    """The targets of the page's Markdown links and images that are relative paths (no URL, no anchor
    of the page itself), fenced code left out."""
    text = FENCE.sub("", page.read_text())
    return [target for target in LINK.findall(text) if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", target)]


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda page: page.name)
def test_relative_links_in_the_docs_name_files_that_exist(page: Path) -> None:
    broken = [
        target
        for target in relative_links(page)
        if not (page.parent / target.split("#", 1)[0]).resolve().exists()
    ]
    assert not broken, f"docs/{page.name} links to missing files: {broken}"


def test_the_link_check_sees_a_missing_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# there\n")
    page.write_text(
        "[a](there.md#part) [b](missing.md) [c](https://example.org/x.md) [d](#local)\n"
        "```\n[e](in_code.md)\n```\n"
    )
    assert relative_links(page) == ["there.md#part", "missing.md"]
