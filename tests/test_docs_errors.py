"""Every refusal a strategy raises is explained in ``docs/troubleshooting.md``.

The check reads the source with ``ast`` (no process, no import of the package). Each
``raise SomeError("...")`` or ``raise SomeError(f"...")`` in ``lightning_hier/strategies/*.py``,
``lightning_hier/sliced/sharded_optim.py`` and ``compressed_hop.py`` gives a *fragment*: the first five
words of the message's constant text, where a ``{...}`` field matches any short text (the page may quote a
real value or ``...``). The page must contain every fragment, so a new refusal cannot ship without a line
that says what it means and what to do.

A fragment grows a word at a time while it would also match another message or warning of those files, so
it names its own message. Raises users cannot meet are in :data:`ALLOW_LIST`, each with the reason.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "troubleshooting.md"
SOURCES = sorted((ROOT / "lightning_hier" / "strategies").glob("*.py")) + [
    ROOT / "lightning_hier" / "sliced" / "sharded_optim.py",
    ROOT / "lightning_hier" / "sliced" / "compressed_hop.py",  # hier_sliced's and hier_bsp's inter_node_dtype
]
WORDS = 5  # words of constant text a fragment starts with
PLACEHOLDER = "\x00"  # stands for a ``{...}`` field in a message's skeleton
ANY = r".{0,80}?"  # what a ``{...}`` field may be on the page (a value, ``...``, a class name)

#: raises users cannot meet, by the start of their message's constant text, and why
ALLOW_LIST = {
    # hier_bsp refuses manual optimization before any process group, and Lightning itself refuses several
    # optimizers under automatic optimization (``configure_optimizers`` is checked in setup_optimizers,
    # before the engine is built): only a bug could reach this guard
    "HierBSPStrategy needs exactly one optimizer": "unreachable: Lightning and the setup refusals come first",
}

WARNING_CALLS = {"rank_zero_warn", "warn", "warning"}


@dataclass(frozen=True)
class Message:
    """One raise (or warning) with a literal message: where it is, its class, and its text with each
    ``{...}`` field replaced by :data:`PLACEHOLDER`."""

    where: str
    kind: str
    skeleton: str


def _skeleton(node: ast.expr) -> str | None:
    """The message's text with every formatted field as :data:`PLACEHOLDER`; ``None`` where the message is
    not a literal (a variable, a call)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                parts.append(value.value)
            else:
                parts.append(PLACEHOLDER)
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "..." + f"..."
        left, right = _skeleton(node.left), _skeleton(node.right)
        return None if left is None or right is None else left + right
    return None


def messages(path: Path, source: str | None = None) -> tuple[list[Message], list[Message]]:
    """``(raises, warnings)`` with literal messages in ``path`` (or in ``source``, read as that file)."""
    tree = ast.parse(path.read_text() if source is None else source)
    raises: list[Message] = []
    warns: list[Message] = []
    name = path.relative_to(ROOT).as_posix() if path.is_absolute() else str(path)
    for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):  # in source order
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            skeleton = _skeleton(node.exc.args[0])
            if skeleton is not None:
                kind = ast.unparse(node.exc.func).rsplit(".", 1)[-1]
                raises.append(Message(f"{name}:{node.lineno}", kind, skeleton))
        elif isinstance(node, ast.Call) and node.args:
            function = ast.unparse(node.func).rsplit(".", 1)[-1]
            if function in WARNING_CALLS:
                skeleton = _skeleton(node.args[0])
                if skeleton is not None:
                    warns.append(Message(f"{name}:{node.lineno}", "warning", skeleton))
    return raises, warns


def _normal(text: str) -> str:
    """Whitespace collapsed, markdown's backticks gone: a quote may wrap lines or sit in a code span."""
    return " ".join(text.replace("`", "").split())


def fragment(skeleton: str, words: int) -> str:
    """A regular expression for the first ``words`` words of ``skeleton``'s constant text, without leading
    fields and punctuation or the last word's trailing punctuation; a field inside matches :data:`ANY`."""
    text = _normal(skeleton).lstrip(PLACEHOLDER + " ,.;:")
    pattern, count = [], 0
    for index, piece in enumerate(re.split(f"({PLACEHOLDER})", text)):
        if index % 2:
            pattern.append(ANY)
            continue
        tokens = re.split(r"(\s+)", piece)
        for token in tokens:
            if count >= words:
                break
            if token.isspace():
                pattern.append(r"\s+")
            elif token:
                pattern.append(re.escape(token))
                count += any(character.isalnum() for character in token)
        if count >= words:
            break
    while pattern:  # no field, space or punctuation at the end: the quote may stop after the last word
        if pattern[-1] in (ANY, r"\s+"):
            pattern.pop()
            continue
        word = re.sub(r"[.,;:!?]+$", "", re.sub(r"\\(.)", r"\1", pattern[-1]))  # unescaped, trimmed
        if word:
            pattern[-1] = re.escape(word)
            break
        pattern.pop()
    return "".join(pattern)


def distinctive_fragment(message: Message, others: list[Message]) -> str:
    """:func:`fragment` of ``message``, a word longer at a time while it also matches another message or
    warning (its skeleton, where :data:`ANY` matches a field); at most the whole message."""
    rivals = {_normal(other.skeleton) for other in others} - {_normal(message.skeleton)}
    total = len(_normal(message.skeleton).split())
    words = WORDS
    while True:
        pattern = fragment(message.skeleton, words)
        if words >= total or not any(re.search(pattern, rival) for rival in rivals):
            return pattern
        words += 1


def allowed(message: Message) -> str | None:
    """The allow-list entry that covers ``message``, if any."""
    text = _normal(message.skeleton)
    return next((start for start in ALLOW_LIST if text.startswith(start)), None)


def collect() -> tuple[list[Message], list[Message]]:
    raises: list[Message] = []
    warns: list[Message] = []
    for path in SOURCES:
        found_raises, found_warns = messages(path)
        raises += found_raises
        warns += found_warns
    return raises, warns


def undocumented(page: str, raises: list[Message], warns: list[Message]) -> list[str]:
    """``where: Kind: fragment`` for each raise of ``raises`` that ``page`` does not quote."""
    text = _normal(page)
    missing = []
    for message in raises:
        if allowed(message):
            continue
        pattern = distinctive_fragment(message, raises + warns)
        if not re.search(pattern, text):
            missing.append(f"{message.where}: {message.kind}: /{pattern}/")
    return missing


# ---------------------------------------------------------------------------------------------- the checks
def test_every_strategy_refusal_is_explained_on_the_troubleshooting_page() -> None:
    raises, warns = collect()
    assert len(raises) >= 30, "the collector found too few raises: is it still reading the right files?"
    missing = undocumented(PAGE.read_text(), raises, warns)
    assert not missing, (
        "docs/troubleshooting.md does not quote these refusals (add the start of each message, what it "
        "means and what to do; or, for a raise users cannot meet, an ALLOW_LIST entry saying why):\n  "
        + "\n  ".join(missing)
    )


def test_each_error_class_of_a_quoted_refusal_is_named_on_the_page() -> None:
    raises, _ = collect()
    page = PAGE.read_text()
    kinds = {message.kind for message in raises if not allowed(message)}
    assert kinds, raises
    assert not [kind for kind in sorted(kinds) if kind not in page]


def test_every_allow_list_entry_still_covers_a_raise() -> None:
    """A stale entry would let a new message with the same start through unexplained."""
    raises, _ = collect()
    covered = {allowed(message) for message in raises}
    assert not [start for start in ALLOW_LIST if start not in covered]


# ------------------------------------------------------------------------------------ the collector itself
SAMPLE = """
def f(x, name):
    if x:
        raise ValueError(f"{name} cannot run on flat parameter slices: its update is not elementwise.")
    if name:
        raise TypeError("bucket_cap_mb must be positive, got nothing.")
    raise RuntimeError(f"optimizers {x} and {name} both hold parameter {x!r}: give it to one optimizer.")
    raise RuntimeError(message)  # not a literal: skipped
    rank_zero_warn(f"{name} cannot run on flat parameter slices here, as ddp does.")
"""


def test_fragments_skip_leading_fields_stop_after_five_words_and_let_fields_match_any_value() -> None:
    raises, warns = messages(Path("sample.py"), SAMPLE)
    assert [m.kind for m in raises] == ["ValueError", "TypeError", "RuntimeError"]
    assert len(warns) == 1
    first, second, third = (distinctive_fragment(m, raises + warns) for m in raises)
    # the warning shares the first five words, so the error's fragment goes on until it differs
    assert re.search(first, "ValueError: Adafactor cannot run on flat parameter slices: its update")
    assert not re.search(first, "Adafactor cannot run on flat parameter slices here, as ddp does")
    assert re.search(second, "`bucket_cap_mb must be positive, got 0`")
    assert re.search(third, "optimizers 0 and 1 both hold parameter 'shared.weight'")
    assert re.search(third, "optimizers ... and ... both hold parameter ...")


def test_a_page_without_a_refusal_is_reported_with_where_it_is_raised() -> None:
    raises, warns = messages(Path("sample.py"), SAMPLE)
    page = "`bucket_cap_mb must be positive, got 0`; `optimizers 0 and 1 both hold parameter 'w'`"
    missing = undocumented(page, raises, warns)
    assert len(missing) == 1 and missing[0].startswith("sample.py:4: ValueError: /cannot"), missing
