"""MLflow bridge: a pre-flight verdict becomes run tags + a report artifact, incidents become metrics.

The run is fixed when the bridge is built (``run_id=`` or the active run of the constructing thread: MLflow's
active run is thread-local and the bus delivers on a worker thread), and every call names it explicitly
through ``MlflowClient``. A tracking server that is down or slow never blocks training: requests made by the
worker time out after ``request_timeout`` seconds; what cannot be delivered goes to a spool file and is
replayed in order by a retry thread once the server answers again (or by ``guardtower replay <spool>``).

Writes are idempotent: metric points carry the event's own timestamp (MLflow ignores an identical point
logged twice), tags are overwritten and artifacts keep their names, so an event re-sent after a lost
response still shows up exactly once.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import urllib.parse
import warnings
from pathlib import Path
from typing import Any, Callable

from guardtower.bridges._common import INCIDENT_KINDS, check_prefix, incident_label, require
from guardtower.bridges._mlflow_http import bounded_http
from guardtower.bus import BaseSink
from guardtower.errors import ConfigError
from guardtower.events import (
    Event,
    HaltEvent,
    PreflightEvent,
    RollbackEvent,
    SkipEvent,
    SpikeEvent,
    SummaryEvent,
)
from guardtower.spool import Spool

__all__ = ["MLflowBridge", "MlflowWriter", "default_spool_dir"]

logger = logging.getLogger("guardtower.bridges.mlflow")

_warned_no_run = False
_warn_lock = threading.Lock()


def default_spool_dir() -> Path:
    """Where undelivered events wait: ``GUARDTOWER_SPOOL_DIR`` or ``./sg_logs/spool``."""
    return Path(os.environ.get("GUARDTOWER_SPOOL_DIR", os.path.join("sg_logs", "spool")))


class MlflowWriter:
    """Turns one event into MLflow calls on an explicit run. Used by the bridge's worker and by replay."""

    def __init__(self, tracking_uri: str, run_id: str, prefix: str, *, request_timeout: int = 5,
                 request_retries: int = 1, artifacts: bool = True) -> None:
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.prefix = prefix
        self.request_timeout = request_timeout
        self.request_retries = request_retries
        self.artifacts = artifacts
        self._client: Any = None

    def send(self, event: Event) -> None:
        """Deliver ``event``; raises whatever MLflow raises (see ``is_permanent``)."""
        with bounded_http(self.request_timeout, self.request_retries):
            if self._client is None:
                from mlflow import MlflowClient

                self._client = MlflowClient(tracking_uri=self.tracking_uri)
            metrics, tags = self._metrics_and_tags(event)
            if metrics or tags:
                self._client.log_batch(self.run_id, metrics=metrics, tags=tags)
            if self.artifacts:
                self._artifacts(event)

    def _metrics_and_tags(self, event: Event) -> tuple[list[Any], list[Any]]:
        from mlflow.entities import Metric, RunTag

        p = self.prefix
        values: dict[str, float] = {}
        tags: dict[str, str] = {}
        if isinstance(event, SpikeEvent):
            values = {f"{p}.spike_ratio": event.ratio, f"{p}.grad_norm": event.global_norm}
        elif isinstance(event, SkipEvent):
            values = {f"{p}.skipped_steps": event.total_skips}
        elif isinstance(event, RollbackEvent):
            values = {f"{p}.rollbacks": event.total_rollbacks}
        elif isinstance(event, SummaryEvent):
            values = {f"{p}.grad_norm": event.grad_norm, f"{p}.skipped_steps": event.total_skips,
                      f"{p}.rollbacks": event.total_rollbacks}
        elif isinstance(event, PreflightEvent):
            tags = {f"{p}.preflight": event.status,
                    f"{p}.preflight.errors": ",".join(dict.fromkeys(event.error_ids)),
                    f"{p}.preflight.warnings": ",".join(dict.fromkeys(event.warning_ids))}
        if isinstance(event, HaltEvent):
            tags[f"{p}.halted"] = incident_label(event)
        if event.kind in INCIDENT_KINDS:
            tags[f"{p}.last_incident"] = incident_label(event)
        # The event's own timestamp makes a re-sent point identical, so MLflow stores it once.
        stamp = int(event.time * 1000)
        step = event.step if event.step is not None else 0
        metrics = [Metric(key, float(value), stamp, step) for key, value in values.items()]
        return metrics, [RunTag(key, value) for key, value in tags.items()]

    def _artifacts(self, event: Event) -> None:
        p = self.prefix
        if isinstance(event, PreflightEvent):
            body = event.report or event.to_record()
            self._client.log_text(self.run_id, json.dumps(body, indent=2, allow_nan=False), f"{p}/preflight.json")
        elif isinstance(event, SpikeEvent):
            if event.report_path and os.path.isfile(event.report_path):
                self._client.log_artifact(self.run_id, event.report_path, f"{p}/spikes")
                return
            # The guard writes its report on another sink's thread, so the file may not exist yet (or was
            # never asked for): log the same report, built from the event, under the same name.
            from guardtower.guard.reports import build_report

            if event.report_path:
                name = os.path.basename(event.report_path)
            else:
                name = f"spike-step{event.step if event.step is not None else 0:08d}-{event.event_id[:12]}.json"
            text = json.dumps(build_report(event), indent=2, allow_nan=False)
            self._client.log_text(self.run_id, text, f"{p}/spikes/{name}")


def is_permanent(exc: BaseException) -> bool:
    """True when the server answered and refused (4xx but 408/429): resending the same event cannot help."""
    status: Any = None
    getter = getattr(exc, "get_http_status_code", None)
    if callable(getter) and type(exc).__name__ == "RestException":
        status = getter()
    response = getattr(exc, "response", None)
    if status is None and response is not None:
        status = getattr(response, "status_code", None)
    return isinstance(status, int) and 400 <= status < 500 and status not in (408, 429)


class MLflowBridge(BaseSink):
    """Forward guardtower events to an MLflow run, surviving tracking-server outages.

    ``spool_path``: the dead-letter file (default ``<spool dir>/mlflow-<run_id>.jsonl``, see
    ``default_spool_dir``). ``request_timeout``/``request_retries`` bound each MLflow request made by the
    worker. ``retry_interval`` (doubling up to ``max_retry_interval``) paces replays of the spool.
    """

    rank_zero_only = True

    def __init__(
        self,
        run_id: str | None = None,
        *,
        tracking_uri: str | None = None,
        prefix: str = "guardtower",
        spool_path: str | os.PathLike[str] | None = None,
        request_timeout: int = 5,
        request_retries: int = 1,
        retry_interval: float = 5.0,
        max_retry_interval: float = 60.0,
        artifacts: bool = True,
    ) -> None:
        self.prefix = check_prefix(prefix)
        if run_id is not None and (not isinstance(run_id, str) or not run_id.strip()):
            raise ConfigError("run_id", f"{run_id!r} is not a run id", "pass run.info.run_id or leave it None")
        if tracking_uri is not None and (not isinstance(tracking_uri, str) or not tracking_uri.strip()):
            raise ConfigError("tracking_uri", f"{tracking_uri!r} is not a URI",
                              'pass e.g. "http://127.0.0.1:5000" or leave it None')
        _check_number("request_timeout", request_timeout, integer=True, minimum=1)
        _check_number("request_retries", request_retries, integer=True, minimum=0)
        _check_number("retry_interval", retry_interval, minimum=0.001)
        _check_number("max_retry_interval", max_retry_interval, minimum=retry_interval)
        explicit_spool = Spool(spool_path) if spool_path is not None else None  # ConfigError now, not later
        mlflow = require("mlflow", "mlflow")
        if run_id is None:
            active = mlflow.active_run()
            run_id = active.info.run_id if active is not None else None
        self.run_id = run_id
        self.tracking_uri: str = tracking_uri or mlflow.get_tracking_uri()
        self.retry_interval = float(retry_interval)
        self.max_retry_interval = float(max_retry_interval)
        self._counts: collections.Counter[str] = collections.Counter()
        self._state_lock = threading.Lock()  # guards _backlog and spool appends in backlog mode
        self._deliver_lock = threading.Lock()  # one MLflow conversation at a time, in event order
        self._stop = threading.Event()
        self._retry_thread: threading.Thread | None = None
        self._backlog = False
        self._spool: Spool | None = explicit_spool
        if run_id is None:
            self.name = "mlflow"
            self._writer: MlflowWriter | None = None
            self._spool_path = Path(os.devnull)
            _warn_no_run_once()
            return
        self.name = f"mlflow:{sink_name(run_id, self.prefix, self.tracking_uri)}"
        self._writer = MlflowWriter(self.tracking_uri, run_id, self.prefix, request_timeout=int(request_timeout),
                                    request_retries=int(request_retries), artifacts=artifacts)
        self._spool_path = explicit_spool.path if explicit_spool else default_spool_dir() / f"mlflow-{run_id}.jsonl"
        if self._spool_path.exists():  # events a previous process could not deliver go first
            self._backlog = next(self._get_spool().entries(), None) is not None
            if self._backlog:
                self._start_retry_thread()

    # -- sink protocol ---------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """False when there was no run to log to: events are then ignored (and counted in ``stats()``)."""
        return self._writer is not None

    @property
    def spool_path(self) -> Path:
        return self._spool_path

    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        if self._writer is None:
            self._counts["ignored"] += len(events)
            return
        for index, event in enumerate(events):
            with self._state_lock:
                if self._backlog:
                    self._spool_all(events[index:], "backlog")
                    return
            try:
                with self._deliver_lock:
                    self._send_or_reject(event)
                self._counts["delivered"] += 1
            except Exception as exc:
                with self._state_lock:
                    self._backlog = True
                    self._spool_all(events[index:], f"undelivered: {type(exc).__name__}")
                logger.warning("guardtower: MLflow at %s is unreachable (%s); spooling events to %s",
                               _public_uri(self.tracking_uri), _short(exc), self._spool_path)
                self._start_retry_thread()
                return

    def spill(self, event: Event) -> bool:
        """The bus queue is full: keep the event in the spool (replayed after what is queued)."""
        if self._writer is None:
            return False
        try:
            with self._state_lock:
                self._backlog = True
                self._spool_all([event], "queue full")
            self._start_retry_thread()
            return True
        except Exception:
            return False

    def flush(self, timeout: float | None = None) -> bool:
        """Try the spool once more; True when nothing is left undelivered."""
        if self._backlog:
            self._drain()
        return not self._backlog

    def close(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._backlog:
            self._drain()
        if self._backlog:
            logger.warning("guardtower: undelivered MLflow events remain in %s; send them with: guardtower replay %s",
                           self._spool_path, self._spool_path)

    def stats(self) -> dict[str, int]:
        """Events delivered live, spooled, replayed from the spool, rejected by the server, ignored (no run)."""
        counts = {k: self._counts[k] for k in ("delivered", "spooled", "replayed", "rejected", "ignored")}
        counts["backlog"] = int(self._backlog)
        return counts

    def __repr__(self) -> str:
        return f"MLflowBridge(run_id={self.run_id!r}, tracking_uri={_public_uri(self.tracking_uri)!r})"

    # -- delivery and spool ----------------------------------------------------------------------------

    def _send_or_reject(self, event: Event) -> None:
        """Send; a permanent refusal is counted and logged instead of raised (retrying cannot fix it)."""
        assert self._writer is not None
        try:
            self._writer.send(event)
        except Exception as exc:
            if not is_permanent(exc):
                raise
            self._counts["rejected"] += 1
            if self._counts["rejected"] <= 3:
                logger.warning("guardtower: MLflow refused a %s event: %s", event.kind, _short(exc))

    def _get_spool(self) -> Spool:
        if self._spool is None:
            self._spool_path.parent.mkdir(parents=True, exist_ok=True)
            self._spool = Spool(self._spool_path)
        return self._spool

    def _spool_all(self, events: list[Event], reason: str) -> None:
        spool = self._get_spool()
        for event in events:
            spool.append(event, reason, self.name)
        self._counts["spooled"] += len(events)

    def _drain(self) -> bool:
        """Replay the spool in order; leave backlog mode once it is empty. False if the server still fails."""
        with self._deliver_lock:
            sent, remaining = self._get_spool().replay(self._send_or_reject)
        self._counts["replayed"] += sent
        if remaining:
            return False
        with self._state_lock:  # nothing can be appended while we decide
            if next(self._get_spool().entries(), None) is None:
                self._backlog = False
                logger.info("guardtower: MLflow reachable again; %d spooled event(s) replayed", sent)
        return True

    def _start_retry_thread(self) -> None:
        if self._retry_thread is not None and self._retry_thread.is_alive():
            return
        self._stop.clear()  # a bridge closed by one bus (e.g. audit's) may be reused on another
        self._retry_thread = threading.Thread(target=self._retry_loop, name=f"guardtower-retry-{self.name}",
                                              daemon=True)
        self._retry_thread.start()

    def _retry_loop(self) -> None:
        interval = self.retry_interval
        while not self._stop.wait(interval):
            if not self._backlog:
                interval = self.retry_interval
                continue
            try:
                ok = self._drain()
            except Exception:
                logger.debug("guardtower: spool replay failed", exc_info=True)
                ok = False
            interval = self.retry_interval if ok else min(interval * 2, self.max_retry_interval)


def sink_name(run_id: str, prefix: str, tracking_uri: str) -> str:
    """``<run_id>|<prefix>|<tracking uri without credentials>``: all ``guardtower replay`` needs."""
    return f"{run_id}|{prefix}|{_public_uri(tracking_uri)}"


def replayer(sink: str, *, tracking_uri: str | None = None, request_timeout: int = 10) -> Callable[[Event], None]:
    """A deliver function for the spool entries of the MLflow sink named ``sink`` (see ``sink_name``)."""
    require("mlflow", "mlflow")
    run_id, prefix, recorded_uri = (sink.split("|", 2) + ["", ""])[:3]
    if not run_id or not (tracking_uri or recorded_uri):
        raise ConfigError("sink", f"cannot read run id and tracking URI from {sink!r}", "pass --tracking-uri")
    writer = MlflowWriter(tracking_uri or recorded_uri, run_id, prefix or "guardtower",
                          request_timeout=request_timeout, request_retries=1)

    def deliver(event: Event) -> None:
        try:
            writer.send(event)
        except Exception as exc:
            if not is_permanent(exc):
                raise
            logger.warning("guardtower replay: MLflow refused a %s event (%s); dropping it", event.kind, _short(exc))

    return deliver


def _public_uri(uri: str) -> str:
    """The URI without user:password and query (they may hold secrets)."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return uri.split("@")[-1]
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


def _check_number(argument: str, value: object, *, minimum: float, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value >= minimum:
        kind = "an integer" if integer else "a number"
        raise ConfigError(argument, f"{value!r} is not {kind} >= {minimum:g}", f"pass {kind} >= {minimum:g}")


def _warn_no_run_once() -> None:
    global _warned_no_run
    with _warn_lock:
        if _warned_no_run:
            return
        _warned_no_run = True
    warnings.warn(
        "guardtower MLflowBridge: no MLflow run (pass run_id= or build the bridge inside mlflow.start_run()); "
        "guardtower events will not be sent to MLflow",
        RuntimeWarning,
        stacklevel=3,
    )
