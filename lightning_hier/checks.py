"""Checks of constructor settings shared by the strategies, callbacks and ``HybridEmbedding``.

Each raises ``ValueError`` naming the setting, the value given and what is valid, before anything runs.
``bool`` is not a number here (``bucket_cap_mb=True`` is a mistake, not 1 MB).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any

#: the largest size in MB a bucket setting may ask for: its bytes must fit in a 64-bit size
MAX_MB = 2**43


def is_real(value: Any) -> bool:
    """A real number that is not a ``bool`` (ints, floats, numpy scalars)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """An integer that is not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_flag(name: str, value: Any, allow_none: bool = False) -> None:
    """``value`` is ``True`` or ``False`` (or ``None`` where that means "decide for me")."""
    if not (isinstance(value, bool) or (allow_none and value is None)):
        valid = "True, False or None" if allow_none else "True or False"
        raise ValueError(f"{name} must be {valid}, got {value!r}.")


def check_integer(name: str, value: Any, least: int, allow_none: bool = False) -> None:
    """``value`` is an integer ``>= least`` (or ``None``)."""
    if allow_none and value is None:
        return
    if not is_integer(value) or value < least:
        none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an integer >= {least}{none}, got {value!r}.")


def check_megabytes(name: str, value: Any, allow_zero: bool = False) -> None:
    """``value`` is a size in MB: a finite number, positive (or ``>= 0``), whose bytes fit in 64 bits."""
    if not (is_real(value) and (value >= 0 if allow_zero else value > 0) and value <= MAX_MB):
        low = ">= 0" if allow_zero else "positive"
        raise ValueError(f"{name} must be {low} and at most {MAX_MB} (MB), got {value!r}.")


def check_names(name: str, value: Any) -> tuple[str, ...]:
    """``value`` is a list of non-empty strings (a bare string is not: its characters are no names);
    returns it as a tuple."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list of names (strings), got {value!r}.")
    names = tuple(value)
    if not all(isinstance(item, str) and item for item in names):
        raise ValueError(f"{name} must be a list of non-empty names (strings), got {value!r}.")
    return names


def check_path(name: str, value: Any) -> None:
    """``value`` is ``None`` or a path (``str`` or ``os.PathLike``)."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name} must be a path (a str or os.PathLike) or None, got {value!r}.")
