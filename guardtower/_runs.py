"""Run identity: the name a run's events, alerts, tags and log folder share, and the folder each run writes to.

A guard or an audit given no ``run=`` takes ``GUARDTOWER_RUN``, else the active tracker run's name (MLflow,
W&B; only when the user's code already imported them), else ``"default"``. The integrations pass the
trainer's own name first (HF ``TrainingArguments.run_name``, the Lightning logger's). Each run writes under
``<root>/<run>-<YYYYmmdd-HHMMSS>/`` so runs never mix, and ``guardtower report|events ROOT`` pick the latest.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

__all__ = ["tracker_run_name", "run_name", "run_folder", "run_folders", "DEFAULT_ROOT"]

#: where runs write when the user names no log folder
DEFAULT_ROOT = Path("sg_logs")
_STAMP = "%Y%m%d-%H%M%S"
_FOLDER = re.compile(r".+-\d{8}-\d{6}(-\d+)?")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def tracker_run_name() -> str | None:
    """The name of this thread's active MLflow run, else of the active W&B run; None when there is none."""
    mlflow = sys.modules.get("mlflow")
    try:
        active = mlflow.active_run() if mlflow is not None and hasattr(mlflow, "active_run") else None
        name = getattr(getattr(active, "info", None), "run_name", None)
        if isinstance(name, str) and name:
            return name
    except Exception:  # a tracker in a bad state must not break a run's bookkeeping
        pass
    wandb = sys.modules.get("wandb")
    name = getattr(getattr(wandb, "run", None), "name", None) if wandb is not None else None
    return name if isinstance(name, str) and name else None


def run_name(given: str | None = None, trainer: str | None = None) -> str:
    """``given`` (``run=``), else ``GUARDTOWER_RUN``, else the trainer's name, else the tracker's, else ``default``."""
    if given:
        return given
    return os.environ.get("GUARDTOWER_RUN") or trainer or tracker_run_name() or "default"


def run_folder(root: Path, run: str, now: float | None = None) -> Path:
    """A new folder name under ``root`` for ``run`` (not created): ``<run>-<YYYYmmdd-HHMMSS>``, made unique."""
    stem = _UNSAFE.sub("_", run).strip("._") or "run"
    base = f"{stem[:80]}-{time.strftime(_STAMP, time.localtime(now))}"
    candidate, n = root / base, 1
    while candidate.exists():
        n += 1
        candidate = root / f"{base}-{n}"
    return candidate


def run_folders(root: Path) -> list[Path]:
    """The run folders directly under ``root``, oldest first (by their newest file, then name)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _FOLDER.fullmatch(p.name)]
    return sorted(found, key=lambda p: (_newest(p), p.name))


def _newest(folder: Path) -> float:
    times = [f.stat().st_mtime for f in folder.rglob("*") if f.is_file()]
    return max(times, default=folder.stat().st_mtime)


def pick_run(path: Path, *, listing: bool = False) -> tuple[Path, str | None]:
    """What ``guardtower report|events PATH`` reads: PATH itself, or the latest run folder when PATH is a root
    holding run folders; with a note for people (the folder chosen, or the list when ``listing``)."""
    folders = run_folders(path)
    if not folders:
        return path, ("no run folders in " + str(path) if listing else None)
    if listing:
        return path, "\n".join(str(f) for f in folders)
    latest = folders[-1]
    return latest, f"latest of {len(folders)} run(s) in {path}: {latest.name} (--list shows them all)"
