"""Severity levels shared by findings and events.

People read ``FAIL`` (``label``, also in ``Report.to_dict()``); an event record's ``severity`` in
``events.jsonl`` is the enum name ``ERROR``, as it always was, so existing files and dashboards keep
parsing. Every input (``Severity.parse``, ``--min-severity``, sink arguments, event records) accepts both
spellings, case-insensitively.
"""

from __future__ import annotations

import enum

from guardtower.errors import ConfigError

__all__ = ["Severity", "ACCEPTED_SEVERITIES"]

#: the spellings ``Severity.parse`` accepts, for help texts and error messages
ACCEPTED_SEVERITIES = "INFO, WARN (or WARNING), FAIL (or ERROR)"

_ALIASES = {"FAIL": "ERROR", "WARNING": "WARN"}


class Severity(enum.IntEnum):
    """How bad a finding or event is; ordered so thresholds compare with ``>=``."""

    INFO = 0
    WARN = 1
    ERROR = 2

    @property
    def label(self) -> str:
        """The word shown to people: INFO, WARN or FAIL."""
        return "FAIL" if self is Severity.ERROR else self.name

    @classmethod
    def parse(cls, value: "Severity | int | str", argument: str = "severity") -> "Severity":
        """Accept a Severity, its int value (0-2), its name or its label (``FAIL``), case-insensitively;
        anything else is a ConfigError naming ``argument``."""
        if isinstance(value, Severity):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1, 2):
            return cls(value)
        if isinstance(value, str):
            name = value.strip().upper()
            name = _ALIASES.get(name, name)
            if name in cls.__members__:
                return cls[name]
        raise ConfigError(argument, f"{value!r} is not a severity", f"use one of {ACCEPTED_SEVERITIES}")

    def __str__(self) -> str:
        return self.label
