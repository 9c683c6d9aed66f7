"""Small file helpers shared by the sinks, the spool, the guard's reports and ``guardtower report``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from guardtower.errors import ConfigError

__all__ = ["read_json_lines", "check_writable_dir", "check_creatable_dir"]


def read_json_lines(path: Path) -> Iterator[Any]:
    """The JSON value of each non-empty line; a line that does not parse (a torn last line after a crash,
    another tool's garbage) is skipped."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def check_writable_dir(directory: Path, argument: str) -> None:
    """Raise ConfigError now, not later on a worker thread, when ``directory`` cannot take files."""
    if not directory.is_dir():
        raise ConfigError(argument, f"directory {str(directory)!r} does not exist", "create it or pass another path")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(argument, f"directory {str(directory)!r} is not writable", "pass a writable path")


def check_creatable_dir(directory: Path, argument: str) -> None:
    """Raise ConfigError now when ``directory`` could not be created (or written) later; creates nothing.

    The nearest existing ancestor must be a writable directory, and ``directory`` itself, if it exists, too.
    """
    existing = directory.absolute()
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if existing == directory.absolute():
        check_writable_dir(directory, argument)
        return
    if not existing.is_dir():
        raise ConfigError(argument, f"{str(existing)!r} is not a directory, so {str(directory)!r} cannot be created",
                          "pass a directory path under a writable directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(argument, f"cannot create {str(directory)!r}: {str(existing)!r} is not writable",
                          "pass a writable path")
