"""Short HTTP timeouts and retries for MLflow calls made by guardtower's worker threads only.

MLflow reads ``MLFLOW_HTTP_REQUEST_TIMEOUT``/``..._MAX_RETRIES``/``..._BACKOFF_FACTOR``/``..._BACKOFF_JITTER``
from the process environment on every request (defaults: 120 s, 7 retries with exponential backoff, i.e.
minutes per call). Setting the variables would change them for the user's own MLflow calls too, so instead
each variable object's ``get_raw`` is wrapped once to return guardtower's value while — and only while — the
calling thread is inside ``bounded_http()``. Other threads, and the user's environment, are untouched. The
block is also bounded in total time and bytes read (``guardtower._http.bounded``): a server trickling its
reply or sending a huge body cannot wedge the worker or ``guardtower replay``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Callable, Iterator

from guardtower._http import bounded

__all__ = ["bounded_http"]

logger = logging.getLogger("guardtower.bridges.mlflow")

_VARIABLES = (
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER",
)
_local = threading.local()
_install_lock = threading.Lock()
_installed: bool | None = None  # None: not tried yet; False: this mlflow has no hook, env fallback


def _install() -> bool:
    """Wrap the variables' ``get_raw`` once; False when this MLflow version does not have them."""
    global _installed
    with _install_lock:
        if _installed is None:
            try:
                import mlflow.environment_variables as env_vars

                variables = [getattr(env_vars, name) for name in _VARIABLES]
                if not all(callable(getattr(v, "get_raw", None)) for v in variables):
                    raise AttributeError("get_raw")
                for variable in variables:
                    variable.get_raw = _scoped(variable.name, variable.get_raw)
                _installed = True
            except (ImportError, AttributeError):
                logger.debug("guardtower: MLflow has no per-variable hook; using environment defaults")
                _installed = False
        return _installed


def _scoped(name: str, original: Callable[[], Any]) -> Callable[[], Any]:
    def get_raw() -> Any:
        overrides: dict[str, str] | None = getattr(_local, "overrides", None)
        if overrides is not None and name in overrides:
            return overrides[name]
        return original()

    return get_raw


@contextlib.contextmanager
def bounded_http(timeout_s: int, max_retries: int) -> Iterator[None]:
    """MLflow requests made by this thread inside the block time out after ``timeout_s`` and retry at most
    ``max_retries`` times without backoff (guardtower's spool does the patient retrying)."""
    with bounded(float(timeout_s) * (max_retries + 1) + 1.0):
        with _scoped_settings(timeout_s, max_retries):
            yield


@contextlib.contextmanager
def _scoped_settings(timeout_s: int, max_retries: int) -> Iterator[None]:
    values = {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s),
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(max_retries),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
        "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
    }
    if not _install():
        # Old MLflow: fill in only what the user has not set; their explicit settings win.
        for name, value in values.items():
            os.environ.setdefault(name, value)
        yield
        return
    previous = getattr(_local, "overrides", None)
    _local.overrides = values
    try:
        yield
    finally:
        _local.overrides = previous
