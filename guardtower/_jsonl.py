"""Small file helpers shared by the sinks, the spool, the guard's reports and ``guardtower report``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from guardtower.errors import ConfigError

__all__ = ["read_json_lines", "write_whole", "append_fd", "check_writable_dir", "check_creatable_dir"]


def read_json_lines(path: Path, on_bad_line: Callable[[], None] | None = None) -> Iterator[Any]:
    """The JSON value of each non-empty line; a line that does not parse (a torn last line after a crash,
    another tool's garbage, bytes that are not UTF-8) is skipped, and ``on_bad_line()`` is called."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                value = json.loads(line)
            except (ValueError, RecursionError):  # JSONDecodeError, or nesting deeper than Python recurses
                if on_bad_line is not None:
                    on_bad_line()
                continue
            yield value


def append_fd(path: Path) -> int:
    """An ``O_APPEND`` descriptor: every ``write_whole`` lands at the end, with no buffer in this process
    (so a forked child never flushes its parent's half-written bytes)."""
    return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)


def write_whole(target: Path | int, data: bytes) -> None:
    """Append ``data`` (whole lines) completely or not at all: on a full disk or a size limit the bytes
    that did get written are cut off again, so the file never holds a torn line; then ``OSError``. A file
    whose last line is unterminated (an older crash, another tool) gets a newline first, so that line alone
    stays unreadable."""
    fd = append_fd(target) if isinstance(target, Path) else target
    try:
        start = os.fstat(fd).st_size
        if start and os.pread(fd, 1, start - 1) != b"\n":
            data = b"\n" + data
        written = 0
        try:
            while written < len(data):
                n = os.write(fd, data[written:])
                if n <= 0:
                    raise OSError(28, "No space left on device")
                written += n
        except OSError:
            if written and os.fstat(fd).st_size == start + written:  # nobody else appended meanwhile
                os.ftruncate(fd, start)
            raise
    finally:
        if isinstance(target, Path):
            os.close(fd)


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
