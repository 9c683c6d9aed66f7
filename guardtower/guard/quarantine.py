"""Which batch, remembered: the identity of each rejected step's batch, kept in a per-rank quarantine file.

A loop tells the guard what it is about to step on with ``guard.observe_batch(batch, index=i, epoch=e)``
(or ``indices=`` when its sampler exposes them). Nothing is computed then: the batch is only referenced
until its step's record is read. When the step is rejected, its identity — the sample indices, else the
loop's batch index, else a content fingerprint of the batch's tensors — goes into the SpikeEvent and into
``quarantine-rank{rank}.jsonl`` in the run folder, one whole line per rejected step (``_jsonl.write_whole``).

On resume, ``Quarantine.read(log_dir)`` (every rank's file) or the guard's restored state gives the batches
to leave out; ``Quarantine.skip(loader, epoch=e)`` yields ``(index, batch)`` for every other batch, so every
rank skips the same positions (the decision that rejected them was agreed by all ranks). Incidents triaged
``transient`` are recorded but never replayed: their batch was fine.

A step that accumulated several loader batches (gradient accumulation) is named by its first batch's
``index`` and ``micro_batches``, the number of consecutive batches it stepped on; all of them are quarantined.
Trainers that must take every step (the HF and Lightning callbacks) replay by whole steps instead:
``contains(first, epoch, micro_batches=n)`` says whether a step's batches are quarantined, and
``agreed()`` makes every rank replay the same set.

A position names the same samples only in the same layout: the same world size (how many ranks deal the data)
and the same per-rank batch size. Each entry records both (``world_size``; ``batch_size`` in its ``batch``),
and a resumed run in another layout keeps such entries but does not replay them (``unreplayable``, one
warning): skipping the position would skip good data and train on the bad batch. Gradient accumulation may
change: it does not change which loader batch an index names.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, TypeVar

import torch
from torch import Tensor

from guardtower._jsonl import read_json_lines, write_whole
from guardtower.errors import ConfigError
from guardtower.events import _encode

__all__ = ["QUARANTINE_FORMAT", "BatchRef", "Quarantine", "batch_ref", "batch_identity", "fingerprint", "leading_size",
           "quarantine_filename", "make_entry", "write_entry", "check_entries", "without_content"]

QUARANTINE_FORMAT = "guardtower.quarantine/1"
_MAX_INDICES = 4096  # sample indices kept per entry; a larger batch keeps its fingerprint too
T = TypeVar("T")


@dataclass(frozen=True)
class BatchRef:
    """What ``observe_batch`` was given, by reference (nothing read or copied until the step is rejected)."""

    batch: Any = None
    index: int | None = None
    epoch: int | None = None
    indices: Any = None
    micro_batches: int = 1


def _optional_int(argument: str, value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(argument, f"must be a non-negative int or None, got {value!r}",
                          f"pass the loop's {argument} (e.g. from enumerate(loader))")
    return value


def _layout_size(argument: str, value: Any) -> int | None:
    """A run's world size or per-rank batch size, to compare entries with (None: not compared)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        what = "samples in one loader batch on one rank" if argument == "batch_size" else "number of ranks"
        raise ConfigError(argument, f"must be a positive int or None, got {value!r}",
                          f"pass the resumed run's {argument} (its {what}), or None not to compare it")
    return value


def batch_ref(batch: Any, index: Any, epoch: Any, indices: Any, micro_batches: Any = 1) -> BatchRef:
    """Validate ``observe_batch``'s arguments cheaply (types only: a tensor of indices stays on its device)."""
    index = _optional_int("index", index)
    epoch = _optional_int("epoch", epoch)
    if indices is not None and not isinstance(indices, (Tensor, list, tuple, range)):
        raise ConfigError("indices", f"expected a tensor or a sequence of sample indices, got {type(indices).__name__}",
                          "pass the batch's sample indices (e.g. the list a batch sampler yielded) or None")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ConfigError("micro_batches", f"must be a positive int, got {micro_batches!r}",
                          "pass how many loader batches the step accumulated (1 without gradient accumulation)")
    return BatchRef(batch, index, epoch, indices, micro_batches)


def without_content(ref: BatchRef | None) -> BatchRef | None:
    """The position alone: a replayed step's batch is named, never hashed (it was not computed)."""
    return None if ref is None else replace(ref, batch=None)


def _tensors(value: Any, out: list[tuple[str, Tensor]], where: str = "", depth: int = 0) -> None:
    """The tensors inside a batch (tensors, mappings such as HF's BatchEncoding, lists, tuples), with paths."""
    if depth > 8:
        return
    if isinstance(value, Tensor):
        out.append((where, value))
    elif isinstance(value, Mapping) or (hasattr(value, "items") and hasattr(value, "keys")):
        for key in sorted(value.keys(), key=str):
            _tensors(value[key], out, f"{where}.{key}", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _tensors(item, out, f"{where}[{i}]", depth + 1)


def leading_size(batch: Any) -> int | None:
    """The leading dimension of the first tensor in ``batch`` (a shape: no host sync); None without one."""
    found: list[tuple[str, Tensor]] = []
    _tensors(batch, found)
    return int(found[0][1].shape[0]) if found and found[0][1].dim() > 0 else None


def fingerprint(batch: Any) -> str | None:
    """A content hash of the batch's tensors (dtype, shape and bytes); None when it holds no tensor.

    Computed only for a rejected step: it copies the tensors to the host.
    """
    found: list[tuple[str, Tensor]] = []
    _tensors(batch, found)
    if not found:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for where, tensor in found:
        t = tensor.detach()
        if t.is_sparse or t.layout != torch.strided:
            t = t.to_dense()
        t = t.cpu().contiguous().reshape(-1)
        digest.update(f"{where}:{t.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "blake2b:" + digest.hexdigest()


def batch_identity(ref: BatchRef | None, step: int) -> dict[str, Any]:
    """The identity of a rejected step's batch: ``step`` always; ``epoch``/``index`` when the loop said them;
    ``indices`` when known, else ``fingerprint`` (when the batch was given); ``batch_size``, the samples in one
    loader batch on this rank, when known (what a replay checks a position by).

    ``batch_size`` is the number of ``indices`` of a one-batch step, else the leading size of the first tensor
    in ``batch``: under accumulation ``indices`` name every micro-batch's samples, and ``batch`` is one of the
    step's batches or the list of them (the callbacks pass the list), whose first tensor is its first batch's."""
    identity: dict[str, Any] = {"step": step}
    if ref is None:
        return identity
    if ref.epoch is not None:
        identity["epoch"] = ref.epoch
    if ref.index is not None:
        identity["index"] = ref.index
        if ref.micro_batches > 1:
            identity["micro_batches"] = ref.micro_batches
    size = None
    if ref.indices is not None:
        values = ref.indices.reshape(-1).tolist() if isinstance(ref.indices, Tensor) else list(ref.indices)
        identity["indices"] = [int(v) for v in values[:_MAX_INDICES]]
        size = len(values) if ref.micro_batches == 1 else None
    if size is None and ref.batch is not None:
        size = leading_size(ref.batch)
    if size:
        identity["batch_size"] = size
    if ref.batch is not None and ("indices" not in identity or len(identity["indices"]) == _MAX_INDICES):
        found = fingerprint(ref.batch)
        if found is not None:
            identity["fingerprint"] = found
    return identity


def quarantine_filename(rank: int) -> str:
    return f"quarantine-rank{rank}.jsonl"


def write_entry(log_dir: Path, entry: Mapping[str, Any]) -> None:
    """Append one entry (a whole strict-JSON line, or nothing) to this rank's quarantine file."""
    log_dir.mkdir(parents=True, exist_ok=True)
    line = json.dumps(_encode(dict(entry)), allow_nan=False, separators=(",", ":")) + "\n"
    write_whole(log_dir / quarantine_filename(int(entry["rank"])), line.encode())


def make_entry(*, run: str, rank: int, world_size: int, step: int, reason: str, action: str, ranks: Iterable[int],
               batch: Mapping[str, Any], triage: str | None) -> dict[str, Any]:
    return {"format": QUARANTINE_FORMAT, "run": run, "rank": rank, "world_size": world_size, "step": step,
            "time": time.time(), "reason": reason, "action": action, "ranks": list(ranks), "batch": dict(batch),
            "triage": triage}


def check_entries(entries: Any, argument: str = "state_dict") -> list[dict[str, Any]]:
    """Validate quarantine entries (from a state dict or a file) before anything uses them."""
    fix = "load a state dict saved by GuardedOptimizer.state_dict(), or pass Quarantine.read(log_dir)"
    if not isinstance(entries, (list, tuple)):
        raise ConfigError(argument, f"the quarantine must be a list of entries, got {type(entries).__name__}", fix)
    out = []
    for entry in entries:
        batch = entry.get("batch") if isinstance(entry, Mapping) else None
        if not isinstance(batch, Mapping) or not isinstance(entry.get("step"), int):
            raise ConfigError(argument, f"quarantine entry {entry!r} has no 'step' and 'batch'", fix)
        out.append(dict(entry))
    return out


def _micro_batches(batch: Mapping[str, Any]) -> int:
    count = batch.get("micro_batches", 1)
    return count if isinstance(count, int) and not isinstance(count, bool) and 0 < count <= _MAX_INDICES else 1


def _recorded_size(batch: Mapping[str, Any]) -> int | None:
    size = batch.get("batch_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _layout(entry: Mapping[str, Any]) -> dict[str, int | None]:
    """The layout an entry was recorded in (None: an older entry that did not record it)."""
    world = entry.get("world_size")
    return {"world size": world if isinstance(world, int) and not isinstance(world, bool) else None,
            "batch size": _recorded_size(entry["batch"])}


def _unique(entries: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Entries in order, each once (the same incident is in a checkpoint's state and in the rank's file)."""
    seen: set[str] = set()
    out = []
    for entry in entries:
        key = json.dumps(_encode(dict(entry)), sort_keys=True, allow_nan=False)
        if key not in seen:
            seen.add(key)
            out.append(dict(entry))
    return out


class Quarantine:
    """Rejected batches to leave out on resume: ``(epoch, index)`` positions, agreed by every rank.

    Only entries with a batch ``index`` can be replayed (a loop that passed ``index=`` to ``observe_batch``,
    or the callbacks); entries triaged ``transient`` are kept for the record and never replayed. With
    ``world_size`` or ``batch_size`` (the current run's layout), an entry recorded in another layout is not
    replayed either (``unreplayable``): its ``(epoch, index)`` holds other samples there, so skipping that
    position would skip good data and train on the bad batch. An entry that did not record a size is replayed.
    One recorded at a smaller size than ``batch_size`` (the epoch's short last batch) is kept, and its position
    is matched by the size of the batch found there (``skip``, ``contains(batch_size=)``).
    """

    def __init__(self, entries: Iterable[Mapping[str, Any]] = (), *, world_size: int | None = None,
                 batch_size: int | None = None) -> None:
        self.entries: list[dict[str, Any]] = check_entries(list(entries), "entries")
        self.layout: dict[str, int | None] = {"world size": _layout_size("world_size", world_size),
                                              "batch size": _layout_size("batch_size", batch_size)}
        replayable = [e for e in self.entries if isinstance(e["batch"].get("index"), int)
                      and e.get("triage") != "transient"]
        self.unreplayable: list[dict[str, Any]] = []
        # each position with the batch sizes recorded there (None: unknown), which skip() checks batches by
        self._sizes: dict[tuple[int | None, int], set[int | None]] = {}
        for e in replayable:
            if self._differs(e):
                self.unreplayable.append(e)
                continue
            for k in range(_micro_batches(e["batch"])):
                key = (e["batch"].get("epoch"), e["batch"]["index"] + k)
                self._sizes.setdefault(key, set()).add(_recorded_size(e["batch"]))
        self._positions = frozenset(self._sizes)
        self._warned = False  # one warning for the positions that hold a batch of another size now

    def _differs(self, entry: Mapping[str, Any]) -> dict[str, int]:
        """What of the entry's recorded layout differs from this run's, as recorded (a size that either side does
        not know is not compared)."""
        differs = {}
        for name, value in _layout(entry).items():
            current = self.layout[name]
            if value is None or current in (None, value):
                continue
            if name == "batch size" and value < current:
                continue  # the epoch's short last batch, or a smaller layout: checked by size where it is replayed
            differs[name] = value
        return differs

    @classmethod
    def read(cls, log_dir: str | os.PathLike[str]) -> "Quarantine":
        """Every rank's quarantine file in ``log_dir`` (an absent folder or file is an empty quarantine)."""
        folder = Path(log_dir)
        if folder.exists() and not folder.is_dir():
            raise ConfigError("log_dir", f"{str(folder)!r} is not a directory", "pass the run's log folder")
        entries: list[dict[str, Any]] = []
        for path in sorted(folder.glob("quarantine-rank*.jsonl")) if folder.is_dir() else []:
            entries += [e for e in read_json_lines(path) if isinstance(e, dict) and isinstance(e.get("batch"), dict)
                        and isinstance(e.get("step"), int)]
        return cls(entries)

    def positions(self) -> frozenset[tuple[int | None, int]]:
        """The ``(epoch, index)`` of every batch to leave out (epoch None: the loop gave none)."""
        return self._positions

    def contains(self, index: int, epoch: int | None = None, *, micro_batches: int = 1,
                 batch_size: int | None = None) -> bool:
        """Whether a batch at ``index`` of ``epoch`` is quarantined; any of ``micro_batches`` batches from there
        (a step that accumulates them: the trainers replay whole steps). ``batch_size``, when known, is the
        leading size of the step's first batch at that position now: a position recorded at another size holds
        other samples and is not counted (a short last batch of an epoch is recorded, and matched, at its own
        size)."""
        for k in range(micro_batches):
            sizes = self._sizes.get((epoch, index + k))
            if sizes is None:
                continue
            if batch_size is None or None in sizes or batch_size in sizes:
                return True
            self._other_size(epoch, index + k, sizes, batch_size)
        return False

    def _other_size(self, epoch: int | None, index: int, sizes: set[int | None], size: int) -> None:
        """A quarantined position holds a batch of another size now: not skipped, with one warning."""
        if self._warned:
            return
        self._warned = True
        recorded = sorted(s for s in sizes if s is not None)
        warnings.warn(f"guardtower: the quarantined batch at epoch {epoch}, index {index} was recorded at batch size "
                      f"{recorded} and this one holds {size} samples: the position names other samples now, so it "
                      "is not skipped; resume at the recorded batch size to skip it", RuntimeWarning, stacklevel=3)

    def merged(self, other: "Quarantine") -> "Quarantine":
        """This quarantine and ``other`` (e.g. a checkpoint's and the run folder's files), each entry once."""
        return Quarantine(_unique([*self.entries, *other.entries]))

    def agreed(self, process_group: Any = None, *, batch_size: int | None = None) -> "Quarantine":
        """Every rank's entries, on every rank: one ``all_gather_object``, called on every rank once (at a resume),
        so that all ranks replay the same steps even when their files differ (a kill between two ranks' writes,
        a log folder per node); outside ``torch.distributed`` the entries themselves. Entries recorded at another
        world size, or at another ``batch_size`` (this run's per-rank loader batch, when known), are kept and not
        replayed, with a warning."""
        import torch.distributed as dist

        _layout_size("batch_size", batch_size)  # before the collective: a bad value fails on every rank alike
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) < 2:
            return self._in_layout(self.entries, world_size=1, batch_size=batch_size)
        world = dist.get_world_size(process_group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, self.entries, group=process_group)
        return self._in_layout(_unique([entry for entries in gathered for entry in entries or []]),
                               world_size=world, batch_size=batch_size)

    @staticmethod
    def _in_layout(entries: list[dict[str, Any]], *, world_size: int, batch_size: int | None) -> "Quarantine":
        agreed = Quarantine(entries, world_size=world_size, batch_size=batch_size)
        if agreed.unreplayable:
            differing: dict[str, set[int]] = {}
            for entry in agreed.unreplayable:
                for name, value in agreed._differs(entry).items():
                    differing.setdefault(name, set()).add(value)
            names = [name for name in agreed.layout if name in differing]
            recorded = ", ".join(f"{name} {sorted(differing[name])}" for name in names)
            current = ", ".join(f"{name} {agreed.layout[name]}" for name in names)
            warnings.warn(f"guardtower: {len(agreed.unreplayable)} quarantined batch(es) were recorded at {recorded} "
                          f"and are not replayed at {current}: a batch index names other samples there; resume at "
                          "the recorded layout to skip them", RuntimeWarning, stacklevel=3)
        return agreed

    def skip(self, batches: Iterable[T], *, epoch: int | None = None, start: int = 0) -> Iterator[tuple[int, T]]:
        """``(index, batch)`` for every batch of ``batches`` not quarantined, numbered from ``start``
        (the position the loop resumes at, when it skipped the batches already trained on itself).

        A quarantined position whose batch has another leading size than the one recorded there is not skipped
        (with one warning): the loader batches differently now, so the position holds other samples."""
        for index, batch in enumerate(batches, start):
            sizes = self._sizes.get((epoch, index))
            if sizes is None:
                yield index, batch
                continue
            size = leading_size(batch)
            if size is None or None in sizes or size in sizes:
                continue
            self._other_size(epoch, index, sizes, size)
            yield index, batch

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"Quarantine({len(self.entries)} entries, {len(self._positions)} batches to skip)"
