"""Typed events that guardtower publishes on the bus.

Every event is a frozen dataclass holding Python numbers and strings (never tensors), with a class-level
``kind``. ``to_record()`` gives a strict-JSON-safe dict (non-finite floats become ``{"$float": "nan"}``),
``from_record()`` rebuilds the exact event, and ``fingerprint`` identifies the incident (kind, run and the
labels that say where: layer, module, catalog id) without the step or the value, so alerts can group repeats.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, get_type_hints

from guardtower._dist import current_rank
from guardtower.errors import ConfigError
from guardtower.severity import Severity

__all__ = [
    "Event",
    "FindingEvent",
    "PreflightEvent",
    "SpikeEvent",
    "SkipEvent",
    "RollbackEvent",
    "NonFiniteEvent",
    "StallEvent",
    "HaltEvent",
    "SummaryEvent",
    "StartEvent",
    "SkipBudgetEvent",
    "LrBackoffEvent",
    "EVENT_TYPES",
    "event_from_record",
    "to_json",
    "from_json",
    "default_run_name",
]

_FLOAT_TAG = "$float"


def default_run_name() -> str:
    """The run name events carry when the producer was given none: ``GUARDTOWER_RUN``, else the active
    tracker run's name (MLflow, W&B), else ``"default"`` (``guardtower._runs``)."""
    from guardtower._runs import run_name

    return run_name()


@dataclass(frozen=True, kw_only=True)
class Event:
    """Fields common to every event. Subclasses set ``kind`` and ``fingerprint_labels``."""

    kind: ClassVar[str] = "event"
    #: names of the fields (besides kind and run) that identify the incident
    fingerprint_labels: ClassVar[tuple[str, ...]] = ()

    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    time: float = field(default_factory=time.time)
    run: str = field(default_factory=default_run_name)
    rank: int = field(default_factory=current_rank)
    step: int | None = None
    severity: Severity = Severity.INFO

    def __post_init__(self) -> None:
        if not isinstance(self.severity, Severity):
            try:
                object.__setattr__(self, "severity", Severity.parse(self.severity))
            except (KeyError, ValueError, TypeError):
                raise ConfigError("severity", f"{self.severity!r} is not a severity", "pass INFO, WARN or FAIL") from None
        for f in dataclasses.fields(self):
            if f.name != "severity":
                value = getattr(self, f.name)
                clean = _plain(value, f.name)
                if clean is not value:
                    object.__setattr__(self, f.name, clean)

    @property
    def fingerprint(self) -> str:
        """Stable hash of kind, run and the identifying labels; never the step or a measured value."""
        labels = [self.kind, self.run] + [str(getattr(self, name)) for name in self.fingerprint_labels]
        return hashlib.sha256("\x1f".join(labels).encode()).hexdigest()[:16]

    def to_record(self) -> dict[str, Any]:
        """A dict that ``json.dumps(..., allow_nan=False)`` accepts and ``from_record`` inverts."""
        record: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            record[f.name] = value.name if isinstance(value, Severity) else _encode(value)
        record["fingerprint"] = self.fingerprint
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "Event":
        """Rebuild an event from ``to_record()`` output; on ``Event`` itself, dispatch on ``kind``."""
        target = cls
        if cls is Event:
            kind = record.get("kind")
            if kind not in EVENT_TYPES:
                raise ConfigError("record", f"unknown event kind {kind!r}", f"use one of {sorted(EVENT_TYPES)}")
            target = EVENT_TYPES[kind]
        hints = _type_hints(target)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(target):
            if f.name not in record:
                continue
            value = _decode(record[f.name])
            if f.name == "severity":
                value = Severity.parse(value)
            elif "tuple" in str(hints.get(f.name, "")):
                value = _to_tuples(value)
            kwargs[f.name] = value
        return target(**kwargs)


@dataclass(frozen=True, kw_only=True)
class FindingEvent(Event):
    """One pre-flight finding."""

    kind: ClassVar[str] = "finding"
    fingerprint_labels: ClassVar[tuple[str, ...]] = ("check", "catalog_id")

    check: str = ""
    catalog_id: str = ""
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class PreflightEvent(Event):
    """An audit finished. ``report`` is the full ``Report.to_dict()``."""

    kind: ClassVar[str] = "preflight"

    status: str = "PASS"
    errors: int = 0
    warnings: int = 0
    infos: int = 0
    error_ids: tuple[str, ...] = ()
    warning_ids: tuple[str, ...] = ()
    info_ids: tuple[str, ...] = ()
    report: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SpikeEvent(Event):
    """A guarded step's gradients were rejected (spike or non-finite)."""

    kind: ClassVar[str] = "spike"
    fingerprint_labels: ClassVar[tuple[str, ...]] = ("layer",)

    layer: str = ""
    module: str = ""
    reason: str = "spike"  # "spike" or "nonfinite"
    norm: float = 0.0
    baseline: float = 0.0
    ratio: float = 0.0
    threshold: float = 0.0
    global_norm: float = 0.0
    action: str = "skip"
    loss: float | None = None
    lr: float | None = None
    top_layers: tuple[tuple[str, float, float], ...] = ()  # (name, norm, ratio)
    # the tensors' ratios (top_layers, and ``ratio`` when ``layer`` is a tensor) compare each tensor's share
    # of the gradient with its usual share (the auto detector), not its norm with a baseline norm
    share_ratios: bool = False
    nonfinite_layers: tuple[str, ...] = ()
    report_path: str | None = None
    # the steps before and including this one: global grad norm and the trigger layer's norm
    history_steps: tuple[int, ...] = ()
    history_global_norms: tuple[float, ...] = ()
    history_layer_norms: tuple[float, ...] = ()
    # which ranks' local gradients (or loss) tripped, read from the decision's all-reduce only for an incident:
    # (rank, "nonfinite" | "spike", local global grad norm, local loss); all_ranks: every rank's values
    ranks: tuple[int, ...] = ()
    rank_values: tuple[tuple[int, str, float, float | None], ...] = ()
    all_ranks: tuple[dict[str, Any], ...] = ()
    # the batch: step, and epoch/index, sample indices or a content fingerprint (guardtower.guard.quarantine)
    batch: dict[str, Any] | None = None
    # triage=True: "transient" (the recompute was clean) or "deterministic", and the ranks that reproduced it
    triage: str | None = None
    triage_ranks: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class SkipEvent(Event):
    """The optimizer update of a step was skipped; weights and moments are untouched."""

    kind: ClassVar[str] = "skip"
    fingerprint_labels: ClassVar[tuple[str, ...]] = ("layer",)

    layer: str = ""
    reason: str = "spike"
    total_skips: int = 0
    consecutive_skips: int = 0
    ranks: tuple[int, ...] = ()  # the ranks whose local values tripped (see SpikeEvent)
    batch: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class RollbackEvent(Event):
    """Model and optimizer were restored to the snapshot taken at ``to_step``."""

    kind: ClassVar[str] = "rollback"
    fingerprint_labels: ClassVar[tuple[str, ...]] = ("layer",)

    layer: str = ""
    reason: str = "spike"
    from_step: int = 0
    to_step: int = 0
    total_rollbacks: int = 0


@dataclass(frozen=True, kw_only=True)
class NonFiniteEvent(Event):
    """A module's output (or a gradient) went NaN/Inf."""

    kind: ClassVar[str] = "nonfinite"
    fingerprint_labels: ClassVar[tuple[str, ...]] = ("module", "where")

    module: str = ""
    where: str = "forward"  # "forward" or "gradient"
    input_nonfinite: bool = False


@dataclass(frozen=True, kw_only=True)
class StallEvent(Event):
    """No optimizer step for ``seconds`` (a hung rank, data loader or collective); ``resolved`` when steps resume.

    ``step`` is the last step taken. ``resolved`` is a label, so the resumed event is its own incident.
    """

    kind: ClassVar[str] = "stall"
    fingerprint_labels: ClassVar[tuple[str, ...]] = ("resolved",)

    seconds: float = 0.0
    stall_after: float = 0.0
    resolved: bool = False


@dataclass(frozen=True, kw_only=True)
class HaltEvent(Event):
    """Training was stopped by a raise policy."""

    kind: ClassVar[str] = "halt"
    fingerprint_labels: ClassVar[tuple[str, ...]] = ("layer",)

    layer: str = ""
    reason: str = ""
    ratio: float = 0.0
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class SummaryEvent(Event):
    """Periodic step summary from the guard (every ``log_every`` steps)."""

    kind: ClassVar[str] = "summary"

    grad_norm: float = 0.0
    loss: float | None = None
    lr: float | None = None
    total_spikes: int = 0
    total_skips: int = 0
    total_rollbacks: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class StartEvent(Event):
    """A guard took its first step: its settings, so that even a clean run leaves a record."""

    kind: ClassVar[str] = "start"

    optimizer: str = ""
    detector: str = ""
    nan_action: str = "skip"
    spike_threshold: float = 0.0
    warmup_steps: int = 0
    tensors: int = 0
    parameters: int = 0
    device_decides: bool = False  # the skip reaches the optimizer on the device (zero host syncs)
    settings: dict[str, Any] = field(default_factory=dict)  # the other settings (strings and numbers)


@dataclass(frozen=True, kw_only=True)
class SkipBudgetEvent(Event):
    """More than ``share`` of the last ``window`` steps were rejected: a run that skips quietly (WARN).

    ``rejected`` of the ``steps`` looked at (the window, or the steps so far when fewer), by action. Published
    at most once per ``window`` steps while the run stays over budget.
    """

    kind: ClassVar[str] = "skip_budget"

    rejected: int = 0
    steps: int = 0
    window: int = 0
    share: float = 0.0
    skipped: int = 0
    clipped: int = 0
    rolled_back: int = 0
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class LrBackoffEvent(Event):
    """A repeated rollback (to the snapshot of ``to_step`` again) lowered the learning rate (``on_repeat``).

    ``scale``: the multiple of the scheduled learning rate now applied; ``lr``: the first group's, scaled.
    """

    kind: ClassVar[str] = "lr_backoff"

    scale: float = 1.0
    factor: float = 0.0
    floor: float = 0.0
    backoffs: int = 0
    to_step: int = 0
    repeats: int = 0
    lr: float | None = None
    message: str = ""


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        FindingEvent,
        PreflightEvent,
        SpikeEvent,
        SkipEvent,
        RollbackEvent,
        NonFiniteEvent,
        StallEvent,
        HaltEvent,
        SummaryEvent,
        StartEvent,
        SkipBudgetEvent,
        LrBackoffEvent,
    )
}


def event_from_record(record: Mapping[str, Any]) -> Event:
    """Rebuild any event from its record, dispatching on ``record["kind"]``."""
    return Event.from_record(record)


def to_json(event: Event) -> str:
    """One line of strict JSON for the event."""
    return json.dumps(event.to_record(), allow_nan=False, separators=(",", ":"))


def from_json(line: str) -> Event:
    """Inverse of ``to_json``."""
    return event_from_record(json.loads(line))


_HINTS: dict[type[Event], dict[str, Any]] = {}


def _type_hints(cls: type[Event]) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


_ATOMS = (int, float, type(None))
#: deeper nesting than this in an event field is a ``ConfigError`` (JSON readers and writers recurse)
MAX_DEPTH = 64


def _text(value: str) -> str:
    """``value`` as valid UTF-8: a lone surrogate (``os.environ`` and file names decode undecodable bytes
    to them) becomes U+FFFD, so the fingerprint, JSON and every destination can encode it."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in value)
    return value


def _plain(value: Any, name: str, depth: int = 0, seen: frozenset[int] = frozenset()) -> Any:
    """``value`` with numpy/torch scalars turned into Python numbers and strings made valid UTF-8;
    ``ConfigError`` if not JSON-able (also when cyclic or nested deeper than ``MAX_DEPTH``).

    Runs when an event is built, so a bad value fails at the producer's call site instead of taking a
    whole batch down on a sink's worker thread later.
    """
    kind = type(value)
    if kind is str:
        return _text(value)
    if kind in _ATOMS or isinstance(value, bool):
        return value
    for atom in (float, int, str):  # a subclass such as numpy.float64 or an IntEnum: its plain value
        if isinstance(value, atom):
            return _text(str(value)) if atom is str else atom(value)
    if isinstance(value, (list, tuple, Mapping)):
        if depth >= MAX_DEPTH:
            raise ConfigError(name, f"nested deeper than {MAX_DEPTH} levels", "pass a flatter structure")
        if id(value) in seen:
            raise ConfigError(name, "the value contains itself (a cycle) and cannot become JSON",
                              "pass a copy without the reference cycle")
        seen = seen | {id(value)}
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        item = value.item()  # numpy scalar or 0-d tensor (events are built off the hot path)
        if isinstance(item, _ATOMS):
            return item
    elif isinstance(value, (list, tuple)):
        items = [_plain(v, name, depth + 1, seen) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return tuple(items) if isinstance(value, tuple) else items
    elif isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {_text(k): _plain(v, f"{name}.{k}" if depth < 2 else name, depth + 1, seen)
                    for k, v in value.items()}
        raise ConfigError(name, "a dict with non-string keys cannot become strict JSON", "use string keys")
    raise ConfigError(name, f"a {type(value).__name__} cannot become strict JSON",
                      "pass Python numbers, strings, lists or dicts (convert tensors with .item() or .tolist())")


def _encode(value: Any) -> Any:
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:  # most fields: no ABC checks
        return value
    if kind is float and math.isfinite(value):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT_TAG: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and _FLOAT_TAG in value:
            return float(value[_FLOAT_TAG])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _to_tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_to_tuples(v) for v in value)
    return value
