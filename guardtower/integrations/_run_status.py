"""When guardtower stops training, the MLflow run says so: status FAILED and a ``guardtower.failure_reason`` tag.

A halt (``GradientSpikeError``) or a failed pre-flight (``PreflightFailed``) unwinds out of ``train()``/``fit()``;
without this, the run the Trainer's MLflow integration started stays RUNNING until the process exits, and
is then closed as FINISHED. MLflow is only touched when the user's code already imported it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterable

from guardtower._dist import current_rank
from guardtower.errors import GradientSpikeError, PreflightFailed

__all__ = ["FAILURE_TAG", "failure_reason", "fail_mlflow_runs", "failing_runs_on_halt"]

logger = logging.getLogger("guardtower.integrations")

FAILURE_TAG = "guardtower.failure_reason"
#: MLflow's limit on a tag value (5000 in older servers)
_MAX_TAG = 5000


def failure_reason(error: BaseException) -> str:
    """The catalog ids of a failed pre-flight (``LORA-003,OPT-001``), else the halt message."""
    if isinstance(error, PreflightFailed):
        return ",".join(sorted({f.catalog_id for f in error.report.errors})) or "pre-flight failed"
    return str(error).splitlines()[0][:_MAX_TAG] if str(error) else type(error).__name__


def fail_mlflow_runs(error: BaseException, runs: Iterable[tuple[Any, str]] = ()) -> list[str]:
    """Tag and end as FAILED this thread's active MLflow run and every ``(MlflowClient, run_id)`` in ``runs``.

    Rank 0 only (the other ranks' trackers are placeholders). Returns the run ids it marked; never raises,
    because it runs while an exception is already on its way out of training.
    """
    if current_rank() != 0:
        return []
    reason = failure_reason(error)
    marked: list[str] = []
    mlflow = sys.modules.get("mlflow")
    try:
        active = mlflow.active_run() if mlflow is not None else None
        if mlflow is not None and active is not None:
            mlflow.set_tag(FAILURE_TAG, reason)
            mlflow.end_run(status="FAILED")  # pops it, so an exit hook cannot close it as FINISHED
            marked.append(active.info.run_id)
    except Exception:
        logger.warning("guardtower: could not mark the active MLflow run FAILED", exc_info=True)
    for client, run_id in runs:
        if run_id in marked:
            continue
        try:
            client.set_tag(run_id, FAILURE_TAG, reason)
            client.set_terminated(run_id, status="FAILED")
            marked.append(run_id)
        except Exception:
            logger.warning("guardtower: could not mark MLflow run %s FAILED", run_id, exc_info=True)
    return marked


def failing_runs_on_halt(
    user_hook: Callable[[GradientSpikeError], Any] | None,
) -> Callable[[GradientSpikeError], None]:
    """An ``on_halt`` for ``GuardedOptimizer`` that marks the active MLflow run, then calls the user's hook."""

    def on_halt(error: GradientSpikeError) -> None:
        fail_mlflow_runs(error)
        if user_hook is not None:
            user_hook(error)

    return on_halt
