"""Boxed text rendering shared by the console sink, reports and the CLI."""

from __future__ import annotations

import textwrap
from typing import Iterable

__all__ = ["box"]

_WIDTH = 100


def box(title: str, lines: Iterable[str], width: int = _WIDTH) -> str:
    """Draw ``lines`` inside a box with ``title`` in the top border; long lines wrap."""
    inner = width - 4
    body: list[str] = []
    for line in lines:
        body.extend(textwrap.wrap(line, inner, subsequent_indent="    ") or [""])
    top = f"┌─ {title} " + "─" * max(0, width - len(title) - 5) + "┐"
    rows = [f"│ {row:<{inner}} │" for row in body]
    bottom = "└" + "─" * (width - 2) + "┘"
    return "\n".join([top, *rows, bottom])
