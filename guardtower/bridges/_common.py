"""What both tracker bridges share: lazy imports, argument checks, incident wording."""

from __future__ import annotations

import importlib
import threading
import warnings
from types import ModuleType

from guardtower.errors import ConfigError, MissingDependencyError
from guardtower.events import Event, HaltEvent, RollbackEvent, SkipEvent, SpikeEvent

__all__ = ["require", "check_prefix", "incident_label", "safe_error", "warn_once", "INCIDENT_KINDS"]

#: event kinds that are incidents: they update ``last_incident`` and the incident totals
INCIDENT_KINDS = frozenset({SpikeEvent.kind, SkipEvent.kind, RollbackEvent.kind, HaltEvent.kind, "nonfinite", "stall",
                            "skip_budget", "lr_backoff"})


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """Warn the user (the caller of the bridge's constructor) once per process for ``key``."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def safe_error(exc: BaseException) -> str:
    """The first line of an error, redacted like every alert error (MLflow puts the full URL in it)."""
    from guardtower.alerts._secret import redact

    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return redact(text)[:300]


def require(package: str, extra: str) -> ModuleType:
    """Import an optional package, or raise ``MissingDependencyError`` naming the extra to install."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise MissingDependencyError(package, extra) from exc


def check_prefix(prefix: object) -> str:
    """The metric/tag namespace must be a plain non-empty name (it becomes a key prefix and a folder)."""
    if not isinstance(prefix, str) or not prefix.strip() or any(c in prefix for c in " /\\"):
        raise ConfigError("prefix", f"{prefix!r} is not a usable name", 'pass a short name such as "guardtower"')
    return prefix


def incident_label(event: Event) -> str:
    """``kind=spike step=120 layer=h.0.attn.c_attn.weight``: what and where, for a tag or an alert line."""
    parts = [f"kind={event.kind}", f"step={event.step if event.step is not None else '-'}"]
    where = getattr(event, "layer", "") or getattr(event, "module", "")
    if where:
        parts.append(f"layer={where}")
    return " ".join(parts)
