"""Severity levels shared by findings and events."""

from __future__ import annotations

import enum

__all__ = ["Severity"]


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
    def parse(cls, value: "Severity | int | str") -> "Severity":
        """Accept a Severity, its int value, its name or its label (``FAIL``), case-insensitively."""
        if isinstance(value, Severity):
            return value
        if isinstance(value, int):
            return cls(value)
        name = str(value).strip().upper()
        if name == "FAIL":
            return cls.ERROR
        if name == "WARNING":
            return cls.WARN
        return cls[name]

    def __str__(self) -> str:
        return self.label
