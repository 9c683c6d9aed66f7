"""Argument checks shared by the public constructors: each raises ``ConfigError`` naming the argument.

One style for every sink, bridge and alert, so a wrong type or value fails at the call site with the fix,
never later on a worker thread (or as a bare ``TypeError``/``KeyError``).
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from guardtower.errors import ConfigError
from guardtower.severity import Severity

__all__ = ["number", "flag", "text", "path", "severity", "choices", "no_unknown_kwargs"]


def number(argument: str, value: object, *, minimum: float | None = None, above: float | None = None,
           integer: bool = False, allow_none: bool = False) -> Any:
    """A finite int/float (not a bool) ``>= minimum`` or ``> above``; returned unchanged."""
    if value is None and allow_none:
        return None
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    kind = "an integer" if integer else "a finite number"
    bound = "" if minimum is None else f" >= {minimum:g}"
    bound += "" if above is None else f" > {above:g}"
    ok = not isinstance(value, bool) and isinstance(value, kinds) and math.isfinite(value)  # type: ignore[arg-type]
    if ok and minimum is not None:
        ok = value >= minimum  # type: ignore[operator]
    if ok and above is not None:
        ok = value > above  # type: ignore[operator]
    if not ok:
        none = " or None" if allow_none else ""
        raise ConfigError(argument, f"expected {kind}{bound}{none}, got {value!r}", f"pass {kind}{bound}")
    return value


def flag(argument: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(argument, f"expected True or False, got {value!r}", "pass a bool")
    return value


def text(argument: str, value: object, *, allow_none: bool = False, example: str = "a name") -> Any:
    """A non-empty string (or None when allowed)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(argument, f"expected a non-empty string, got {value!r}", f"pass {example}")
    return value


def path(argument: str, value: object, *, allow_none: bool = False) -> Path | None:
    """A str or os.PathLike as a ``Path``; never touches the disk."""
    if value is None and allow_none:
        return None
    if isinstance(value, (str, os.PathLike)) and str(os.fspath(value)).strip():
        if "\x00" in str(os.fspath(value)):
            raise ConfigError(argument, "the path contains a NUL byte", "pass a path without '\\x00'")
        return Path(value).expanduser()
    raise ConfigError(argument, f"expected a file path (str or os.PathLike), got {type(value).__name__}",
                      "pass a path such as 'sg_logs/events.jsonl'")


def severity(argument: str, value: object, *, allow_none: bool = False) -> Severity | None:
    """INFO, WARN or FAIL (also ERROR/WARNING, any case, a ``Severity`` or its int)."""
    if value is None and allow_none:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        return Severity.parse(value)  # type: ignore[arg-type]
    except (KeyError, ValueError, TypeError):
        raise ConfigError(argument, f"{value!r} is not a severity", "pass INFO, WARN or FAIL") from None


def choices(argument: str, value: object, allowed: Iterable[str]) -> frozenset[str]:
    """One name or an iterable of names, all in ``allowed``."""
    allowed = sorted(allowed)
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, Iterable) or isinstance(names, (bytes, Mapping)):
        raise ConfigError(argument, f"expected a name or a list of names, got {type(value).__name__}",
                          f"pass some of {allowed}")
    picked = list(names)
    bad = [n for n in picked if not isinstance(n, str) or n not in allowed]
    if bad:
        raise ConfigError(argument, f"unknown value(s) {bad!r}", f"use some of {allowed}")
    return frozenset(picked)


def no_unknown_kwargs(owner: str, kwargs: Mapping[str, object], known: Iterable[str],
                      aliases: Mapping[str, str] | None = None) -> None:
    """Reject keywords ``owner`` does not take, suggesting the one the user probably meant."""
    known = sorted(known)
    for name in kwargs:
        if name in known:
            continue
        guess = (aliases or {}).get(name) or next(iter(difflib.get_close_matches(name, known, n=1)), None)
        fix = f"did you mean {guess}=?" if guess else f"{owner} takes {', '.join(known)}"
        raise ConfigError(name, f"{owner}() got an unknown keyword argument", fix)
