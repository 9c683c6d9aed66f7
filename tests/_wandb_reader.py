"""Read a W&B run back from its ``run-*.wandb`` transaction log, for tests.

The file is a LevelDB-style record log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB
blocks of chunks, each with a 7-byte header (CRC-32 of type byte + payload, little-endian length, type:
1 full, 2 first, 3 middle, 4 last). Reassembled records are ``wandb_internal_pb2.Record`` protobufs.
(Recent wandb no longer ships a Python reader for this format.)
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

_BLOCK = 32 * 1024
_HEADER = struct.Struct("<4sHB")
_CHUNK = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_records(path: str | Path) -> Iterator[Any]:
    """Every ``Record`` in the file, in order; raises ValueError on a bad header or CRC."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = _HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: not a W&B transaction log")
    offset, pending = _HEADER.size, b""
    while offset + _CHUNK.size <= len(data):
        left_in_block = _BLOCK - offset % _BLOCK
        if left_in_block < _CHUNK.size:  # block trailer padding
            offset += left_in_block
            continue
        crc, length, kind = _CHUNK.unpack_from(data, offset)
        if crc == 0 and length == 0 and kind == 0:  # zero padding to the end of the block
            offset += left_in_block
            continue
        payload = data[offset + _CHUNK.size: offset + _CHUNK.size + length]
        if zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: CRC mismatch at offset {offset}")
        offset += _CHUNK.size + length
        if kind == _FULL:
            chunks = [payload]
        elif kind == _FIRST:
            pending = payload
            continue
        elif kind == _MIDDLE:
            pending += payload
            continue
        elif kind == _LAST:
            chunks, pending = [pending + payload], b""
        else:
            raise ValueError(f"{path}: unknown chunk type {kind}")
        record = pb.Record()
        record.ParseFromString(chunks[0])
        yield record


def _complete_records(path: Path) -> Iterator[Any]:
    """Records of a file still being written: stop quietly at a torn tail."""
    try:
        yield from iter_records(path)
    except (ValueError, struct.error):
        return


def _items(items: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key = "/".join(item.nested_key) if item.nested_key else item.key
        out[key] = json.loads(item.value_json)
    return out


@dataclass
class OfflineRun:
    """What a run wrote: history rows, final summary, alerts and metric definitions."""

    directory: Path
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)

    def rows_with(self, key: str) -> list[dict[str, Any]]:
        return [row for row in self.history if key in row]

    def table(self, key: str) -> dict[str, Any]:
        """The JSON of a logged ``wandb.Table`` (columns, data), from the run's media folder."""
        rows = [row for row in self.history if f"{key}/path" in row]
        if not rows:
            raise KeyError(key)
        return json.loads((self.directory / "files" / rows[-1][f"{key}/path"]).read_text())


def read_run(run_dir: str | Path, *, timeout: float = 30.0) -> OfflineRun:
    """Parse the ``run-*.wandb`` file in a run directory (``wandb/offline-run-...``).

    ``run.finish()`` returns before wandb's service process has written everything, so this waits (up to
    ``timeout`` seconds) for the run's ``exit`` record.
    """
    run_dir = Path(run_dir)
    (log_file,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        records = list(_complete_records(log_file))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    run = OfflineRun(run_dir)
    for record in records:
        which = record.WhichOneof("record_type")
        if which == "history":
            run.history.append(_flatten(_items(record.history.item)))
        elif which == "summary":
            run.summary.update(_flatten(_items(record.summary.update)))
        elif which == "alert":
            a = record.alert
            run.alerts.append({"title": a.title, "text": a.text, "level": a.level,
                               "wait_duration_ms": a.wait_duration})
        elif which == "metric":
            m = record.metric
            run.metrics.append({"name": m.name, "glob_name": m.glob_name, "step_metric": m.step_metric})
    return run


def _flatten(values: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": {"c": 1}}`` -> ``{"a/b/c": 1}`` so nested media entries are addressable by one key."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            for sub, inner in _flatten(value).items():
                out[f"{key}/{sub}"] = inner
        else:
            out[key] = value
    return out


def find_run_dir(root: str | Path) -> Path:
    """The single run directory wandb made under ``root`` (``root/wandb/offline-run-*``)."""
    (run_dir,) = Path(root).glob("wandb/*run-*")
    return run_dir
