"""MLflow bridge: a pre-flight verdict becomes run tags + a report artifact, incidents become metrics.

The run is fixed when the bridge is built (``run_id=`` or the active run of the constructing thread: MLflow's
active run is thread-local and the bus delivers on a worker thread), and every call names it explicitly
through ``MlflowClient``. A tracking server that is down or slow never blocks training: requests made by the
worker time out after ``request_timeout`` seconds; the delivery engine retries, spools what cannot be
delivered and replays the spool in order once the server answers again (or ``guardtower replay <spool>``
does). Only finite numbers are logged: a NaN step sets ``{prefix}.nonfinite`` to 1 instead.

Writes are idempotent: metric points carry the event's own timestamp (MLflow ignores an identical point
logged twice), tags are overwritten and artifacts keep their names, so an event re-sent after a lost
response still shows up exactly once.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import urllib.parse
from pathlib import Path
from typing import Any, Callable

from guardtower.bridges._common import (
    INCIDENT_KINDS,
    check_prefix,
    incident_label,
    require,
    safe_error,
    warn_once,
)
from guardtower import _validate
from guardtower._delivery import PartialFailure, Refused, RetryPolicy, TransientError, check_spool_path
from guardtower.alerts._secret import Secret, has_credentials
from guardtower.bridges._mlflow_http import bounded_http
from guardtower.bus import BaseSink
from guardtower.errors import ConfigError
from guardtower.events import (
    Event,
    FindingEvent,
    HaltEvent,
    PreflightEvent,
    RollbackEvent,
    SkipEvent,
    SpikeEvent,
    StartEvent,
    SummaryEvent,
)
from guardtower.spool import Spool, default_spool_dir

__all__ = ["MLflowBridge", "MlflowWriter", "replayer", "sink_name", "is_permanent", "is_unreachable"]

logger = logging.getLogger("guardtower.bridges.mlflow")



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
        self._watch_ids: dict[str, None] = {}  # the loop watch's ids so far, in order: one tag lists them all

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
            values = {f"{p}.spike_ratio": event.ratio, f"{p}.grad_norm": event.global_norm,
                      f"{p}.nonfinite": float(event.reason == "nonfinite")}
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
        elif isinstance(event, FindingEvent) and event.check == "watch":
            self._watch_ids[event.catalog_id] = None
            tags = {f"{p}.watch": event.severity.label, f"{p}.watch.ids": ",".join(self._watch_ids)}
        if isinstance(event, HaltEvent):
            tags[f"{p}.halted"] = incident_label(event)
        if event.kind in INCIDENT_KINDS:
            tags[f"{p}.last_incident"] = incident_label(event)
        if tags or isinstance(event, StartEvent):  # the run name events and alerts carry, on the run itself
            tags[f"{p}.run"] = event.run
        # The event's own timestamp makes a re-sent point identical, so MLflow stores it once.
        stamp = int(event.time * 1000)
        step = event.step if event.step is not None else 0
        finite = {key: float(value) for key, value in values.items() if math.isfinite(value)}
        if len(finite) < len(values):  # MLflow charts squash around 1.8e308: say non-finite with a flag
            finite[f"{p}.nonfinite"] = 1.0
        metrics = [Metric(key, value, stamp, step) for key, value in finite.items()]
        return metrics, [RunTag(key, value) for key, value in tags.items()]

    def _artifacts(self, event: Event) -> None:
        p = self.prefix
        if isinstance(event, PreflightEvent):
            record = event.to_record()  # strict JSON: a NaN in the report is {"$float": "nan"}
            body = record["report"] or record
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


def _status(exc: BaseException) -> int | None:
    status: Any = None
    getter = getattr(exc, "get_http_status_code", None)
    if callable(getter):
        try:
            status = getter()
        except Exception:
            status = None
    response = getattr(exc, "response", None)
    if status is None and response is not None:
        status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def is_permanent(exc: BaseException) -> bool:
    """True when the server answered and refused (4xx but 408/429): resending the same event cannot help."""
    status = _status(exc)
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def is_unreachable(exc: BaseException) -> bool:
    """True when MLflow could not be reached or failed on its side (transport error, timeout, 5xx, 408,
    429): the event waits in the spool. Anything else (a 4xx, or a value MLflow's client cannot encode:
    ``time=inf``, ``step=10**20``, a malformed spool line) is a refusal of this one event."""
    if isinstance(exc, (OSError, TimeoutError)):
        return True
    try:
        import requests

        if isinstance(exc, requests.RequestException):
            return True
    except ImportError:
        pass
    status = _status(exc)
    return status is not None and (status >= 500 or status in (408, 429))


class MLflowBridge(BaseSink):
    """Forward guardtower events to an MLflow run, surviving tracking-server outages.

    ``spool_path``: the dead-letter file (default ``<spool dir>/mlflow-<run_id>.jsonl``, see
    ``default_spool_dir``; under the guard's ``log_dir/spool`` when a guard adopts the bridge); what a
    previous process left there is sent first. ``request_timeout``/``request_retries`` bound each MLflow
    request. While the server is down, the spool is retried every ``retry_interval`` seconds, doubling up
    to ``max_retry_interval``.
    """

    rank_zero_only = True
    replay_spool = True
    # one event per attempt: a retry never re-sends an event that already got through
    batch_max = 1
    replay_batch = 1

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
        _validate.text("run_id", run_id, allow_none=True, example="run.info.run_id or None")
        _validate.text("tracking_uri", tracking_uri, allow_none=True, example='"http://127.0.0.1:5000" or None')
        _validate.number("request_timeout", request_timeout, integer=True, minimum=1)
        _validate.number("request_retries", request_retries, integer=True, minimum=0)
        _validate.number("retry_interval", retry_interval, minimum=0.001)
        _validate.number("max_retry_interval", max_retry_interval, minimum=retry_interval)
        _validate.flag("artifacts", artifacts)
        explicit = _validate.path("spool_path", spool_path, allow_none=True)
        mlflow = require("mlflow", "mlflow")
        require("tenacity", "mlflow")  # the delivery engine retries with it
        if run_id is None:
            active = mlflow.active_run()
            run_id = active.info.run_id if active is not None else None
        self.run_id = run_id
        self.tracking_uri: str = tracking_uri or mlflow.get_tracking_uri()
        # a token or password in the URI is redacted from every log line, error, spool reason and repr
        self._uri_secret = Secret(self.tracking_uri) if has_credentials(self.tracking_uri) else None
        self.retry_interval = float(retry_interval)
        self.max_retry_interval = float(max_retry_interval)
        self.retry = RetryPolicy(max_attempts=2, initial_backoff=0.2, max_backoff=1.0,
                                 deadline=float(request_timeout) * (request_retries + 1) * 2 + 1.0)
        self._counts: collections.Counter[str] = collections.Counter()
        self._explicit_spool = explicit is not None
        self.spool_path = check_spool_path(explicit, default_spool_dir() / f"mlflow-{run_id}.jsonl")
        self._spool_obj: Spool | None = None
        if run_id is None:
            self.name = "mlflow"
            self._writer: MlflowWriter | None = None
            self.spool_path = Path(os.devnull)
            warn_once("mlflow-no-run", "guardtower MLflowBridge: no MLflow run (pass run_id= or build the bridge inside mlflow.start_run()); "
                      "guardtower events will not be sent to MLflow")
            return
        self.name = f"mlflow:{sink_name(run_id, self.prefix, self.tracking_uri)}"
        self._writer = MlflowWriter(self.tracking_uri, run_id, self.prefix, request_timeout=int(request_timeout),
                                    request_retries=int(request_retries), artifacts=artifacts)

    @property
    def active(self) -> bool:
        """False when there was no run to log to: events are then ignored (and counted in ``stats()``)."""
        return self._writer is not None

    @property
    def spool(self) -> Spool | None:
        """The dead-letter spool (None without a run: nothing to keep)."""
        if self._writer is None:
            return None
        if self._spool_obj is None or self._spool_obj.path != self.spool_path:
            self._spool_obj = Spool(self.spool_path)
        return self._spool_obj

    spool_sink = property(lambda self: self.name)

    def use_log_dir(self, log_dir: Path) -> None:
        """Attached to a guard: keep the spool under ``log_dir/spool`` unless one was given."""
        if self._writer is not None and not self._explicit_spool:
            self.spool_path = check_spool_path(None, Path(log_dir) / "spool" / f"mlflow-{self.run_id}.jsonl")

    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        """Send each event; ``TransientError`` when the server is unreachable, ``PartialFailure`` for events
        the server refused (resending them cannot help)."""
        if self._writer is None:
            self._counts["ignored"] += len(events)
            return
        refused: list[Event] = []
        reason = ""
        for event in events:
            try:
                self._writer.send(event)
            except Exception as exc:
                if is_unreachable(exc):
                    raise TransientError(f"MLflow at {_public_uri(self.tracking_uri)} unreachable: "
                                         f"{safe_error(exc)}") from None
                refused.append(event)
                reason = f"MLflow refused the event: {safe_error(exc)}"
            else:
                self._counts["sent"] += 1
        if refused:
            raise PartialFailure(refused, reason)

    def stats(self) -> dict[str, int]:
        """Events sent by this bridge and ignored (no run); the bus's ``stats()`` has the full accounting."""
        return {k: self._counts[k] for k in ("sent", "ignored")}

    def __repr__(self) -> str:
        return f"MLflowBridge(run_id={self.run_id!r}, tracking_uri={_public_uri(self.tracking_uri)!r})"


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

    secret = Secret(writer.tracking_uri) if has_credentials(writer.tracking_uri) else None

    def deliver(event: Event) -> None:
        assert secret is None or secret.reveal()  # keeps the URI's secret live (redacted) while replaying
        try:
            writer.send(event)
        except Exception as exc:  # MLflow's message quotes the full URL: redacted
            if is_unreachable(exc):
                raise TransientError(f"MLflow unreachable: {safe_error(exc)}") from None
            raise Refused(f"MLflow refused the event: {safe_error(exc)}") from None

    return deliver


def _public_uri(uri: str) -> str:
    """The URI without user:password and query (they may hold secrets), in a form replay can use again.

    ``sqlite:///rel.db`` becomes absolute (a replay may run from another folder); ``sqlite:////abs.db``
    and URIs without a scheme (a local ``mlruns`` path) stay as they are.
    """
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return uri.split("@")[-1]
    if not parts.scheme or len(parts.scheme) == 1:  # a plain path (or a Windows drive letter)
        return uri
    netloc = parts.netloc.rsplit("@", 1)[-1]
    path = parts.path
    if parts.scheme.startswith("sqlite") and not netloc and path.startswith("/") and not path.startswith("//"):
        path = "/" + os.path.abspath(path[1:])  # sqlite:///rel.db: the path after the third slash is relative
    return f"{parts.scheme}://{netloc}{path}"
