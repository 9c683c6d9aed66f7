"""The catalog of silent training bugs: what each is, why it is silent, how to fix it, where to read more.

Ids are public (users have them in scripts and dashboards): an id never changes meaning. Every entry is
emitted by some audit check. ``CATALOG.md`` is generated from this module (``catalog_markdown()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from guardtower.severity import Severity

__all__ = ["FailureMode", "CATALOG", "catalog", "catalog_markdown"]


@dataclass(frozen=True)
class FailureMode:
    """One catalog entry."""

    id: str
    title: str
    severity: Severity
    summary: str
    why: str
    fix: str
    reference: str
    tags: tuple[str, ...] = ()


# --- core wiring, loss, inputs, optimizer, mode, numerics, mixed precision (LOSS-, INPUT-, GRAD-, OPT-,
# NAN-, RELU-, TIE-, MODE-, AMP-, DATA-, ...) ---------------------------------------------------------------
_CORE: tuple[FailureMode, ...] = ()

# --- LoRA / PEFT (LORA-) --------------------------------------------------------------------------------------
_LORA: tuple[FailureMode, ...] = ()

# --- distributed (DDP-) ---------------------------------------------------------------------------------------
_DIST: tuple[FailureMode, ...] = ()


CATALOG: Mapping[str, FailureMode] = MappingProxyType({m.id: m for m in (*_CORE, *_LORA, *_DIST)})


def catalog() -> list[FailureMode]:
    """Every entry, sorted by id."""
    return sorted(CATALOG.values(), key=lambda m: m.id)


def catalog_markdown() -> str:
    """The text of ``CATALOG.md``."""
    lines = [
        "# guardtower catalog of silent training bugs",
        "",
        "Generated from `guardtower/catalog.py` by `guardtower catalog`; do not edit by hand.",
        "",
        "| id | severity | title |",
        "| --- | --- | --- |",
    ]
    entries = catalog()
    lines += [f"| [{m.id}](#{m.id.lower()}) | {m.severity.label} | {m.title} |" for m in entries]
    for m in entries:
        lines += [
            "",
            f"## {m.id}",
            "",
            f"**{m.title}** ({m.severity.label}; tags: {', '.join(m.tags) or '-'})",
            "",
            m.summary,
            "",
            f"- **Why it is silent:** {m.why}",
            f"- **Fix:** {m.fix}",
            f"- **Reference:** {m.reference}",
        ]
    return "\n".join(lines) + "\n"
