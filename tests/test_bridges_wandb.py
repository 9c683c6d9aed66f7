"""WandBBridge against real offline W&B runs, read back from their run-*.wandb transaction logs."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest

from _bridges_helpers import failing_report, preflight_event, rollback_event, skip_event, spike_event, summary_event
from _wandb_reader import OfflineRun, find_run_dir, read_run
from guardtower.bus import EventBus
from guardtower.errors import ConfigError, MissingDependencyError
from guardtower.events import HaltEvent, SpikeEvent
from guardtower.report import Report
from guardtower.severity import Severity

P = "guardtower"


@pytest.fixture(scope="module")
def wandb_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_API_KEY", "")
        yield


def _offline_run(root: Path, **bridge_kwargs: Any) -> tuple[Any, Any]:
    import wandb

    from guardtower.bridges import WandBBridge

    run = wandb.init(mode="offline", dir=str(root), project="guardtower-tests")
    return run, WandBBridge(**bridge_kwargs)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory: pytest.TempPathFactory, wandb_env: None) -> OfflineRun:
    """One offline run: the user logs their own metrics while a realistic incident sequence arrives."""
    root = tmp_path_factory.mktemp("wandb")
    spikes_dir = tmp_path_factory.mktemp("spikes")
    run, bridge = _offline_run(root)
    bus = EventBus([bridge])
    for step in range(3):
        run.log({"train/loss": 3.0 - step})
    bus.publish(preflight_event(failing_report()))
    bus.publish(summary_event(10, grad_norm=1.5))
    bus.publish(spike_event(12, log_dir=spikes_dir))
    bus.publish(skip_event(12, total=1))
    bus.publish(summary_event(20, grad_norm=1.75, spikes=1, skips=1))
    bus.publish(rollback_event(25, total=1))
    bus.publish(HaltEvent(run="test-run", step=30, severity=Severity.ERROR, layer="h.1.attn.c_attn.weight",
                          reason="spike", ratio=120.0, message="gradient spike at step 30"))
    assert bus.flush(10)
    for step in range(3, 5):
        run.log({"train/loss": 3.0 - step})
    run.finish()
    bus.close(5)
    assert bridge.stats() == {"delivered": 7, "failed": 0, "ignored": 0}
    return read_run(find_run_dir(root))


def test_metrics_are_defined_on_their_own_step_axis(logged_run: OfflineRun) -> None:
    assert {"name": "", "glob_name": f"{P}/*", "step_metric": f"{P}/step"} in logged_run.metrics
    for row in logged_run.history:
        if any(k.startswith(f"{P}/") for k in row):
            assert f"{P}/step" in row


def test_spike_row_carries_ratio_layer_norm_and_loss_at_the_training_step(logged_run: OfflineRun) -> None:
    (row,) = logged_run.rows_with(f"{P}/spike_ratio")
    assert row[f"{P}/step"] == 12
    assert row[f"{P}/spike_ratio"] == 42.0
    assert row[f"{P}/trigger_layer"] == "h.0.mlp.c_fc.weight"
    assert row[f"{P}/grad_norm"] == 11.25
    assert row[f"{P}/loss_at_spike"] == 3.5


def test_summary_events_give_a_grad_norm_series_and_counters(logged_run: OfflineRun) -> None:
    norms = [(r[f"{P}/step"], r[f"{P}/grad_norm"]) for r in logged_run.rows_with(f"{P}/grad_norm")]
    assert norms == [(10, 1.5), (12, 11.25), (20, 1.75)]
    skips = [(r[f"{P}/step"], r[f"{P}/skipped_steps"]) for r in logged_run.rows_with(f"{P}/skipped_steps")]
    assert skips == [(10, 0), (12, 1), (20, 1)]
    assert [(r[f"{P}/step"], r[f"{P}/rollbacks"]) for r in logged_run.rows_with(f"{P}/rollbacks")][-1] == (25, 1)


def test_users_own_metrics_are_all_kept(logged_run: OfflineRun) -> None:
    assert [r["train/loss"] for r in logged_run.rows_with("train/loss")] == [3.0, 2.0, 1.0, 0.0, -1.0]


def test_run_summary_has_preflight_status_catalog_ids_and_totals(logged_run: OfflineRun) -> None:
    s = logged_run.summary
    assert s[f"{P}/preflight"] == "FAIL"
    assert s[f"{P}/preflight_errors"] == "LOSS-001,OPT-001"
    assert s[f"{P}/preflight_warnings"] == "RELU-001"
    assert (s[f"{P}/total_spikes"], s[f"{P}/total_skips"], s[f"{P}/total_rollbacks"]) == (1, 1, 1)
    assert s[f"{P}/halted"] == "kind=halt step=30 layer=h.1.attn.c_attn.weight"


def test_findings_are_a_table_with_check_severity_catalog_id_and_message(logged_run: OfflineRun) -> None:
    table = logged_run.table(f"{P}/preflight_findings")
    assert table["columns"] == ["check", "severity", "catalog_id", "message"]
    expected = [[f.check, f.severity.label, f.catalog_id, f.message] for f in failing_report().findings]
    assert table["data"] == expected


def test_alerts_for_failed_preflight_spike_rollback_and_halt(logged_run: OfflineRun) -> None:
    titles = [a["title"] for a in logged_run.alerts]
    assert titles == ["guardtower: pre-flight failed", "guardtower: gradient spike",
                      "guardtower: rolled back to a snapshot", "guardtower: training halted"]
    assert all(len(t) < 64 for t in titles)
    assert [a["level"] for a in logged_run.alerts] == ["ERROR", "WARN", "WARN", "ERROR"]
    assert {a["wait_duration_ms"] for a in logged_run.alerts} == {300_000}
    assert "LOSS-001, OPT-001" in logged_run.alerts[0]["text"]
    assert "h.0.mlp.c_fc.weight" in logged_run.alerts[1]["text"] and "42" in logged_run.alerts[1]["text"]


def test_alerts_can_be_limited_to_some_kinds(tmp_path: Path, wandb_env: None) -> None:
    run, bridge = _offline_run(tmp_path, alerts={"halt"}, alert_wait=60)
    bus = EventBus([bridge])
    bus.publish(preflight_event(failing_report()))
    bus.publish(spike_event(3))
    bus.publish(HaltEvent(step=4, layer="fc", reason="spike", ratio=50.0))
    assert bus.flush(10)
    run.finish()
    bus.close(5)
    alerts = read_run(find_run_dir(tmp_path)).alerts
    assert [(a["title"], a["wait_duration_ms"]) for a in alerts] == [("guardtower: training halted", 60_000)]


def test_a_passing_preflight_sets_pass_and_raises_no_alert(tmp_path: Path, wandb_env: None) -> None:
    run, bridge = _offline_run(tmp_path)
    bus = EventBus([bridge])
    bus.publish(preflight_event(Report(checks_run=["loss"])))
    assert bus.flush(10)
    run.finish()
    bus.close(5)
    logged = read_run(find_run_dir(tmp_path))
    assert logged.summary[f"{P}/preflight"] == "PASS"
    assert logged.summary[f"{P}/preflight_errors"] == ""
    assert logged.alerts == []


def test_without_a_run_it_warns_once_and_ignores_events(monkeypatch: pytest.MonkeyPatch, wandb_env: None) -> None:
    import wandb

    from guardtower.bridges import WandBBridge
    from guardtower.bridges import _common as bridge_common

    assert wandb.run is None
    monkeypatch.setattr(bridge_common, "_warned", set())
    with pytest.warns(RuntimeWarning, match="no W&B run"):
        bridge = WandBBridge()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        WandBBridge()
    bus = EventBus([bridge])
    bus.publish(spike_event(1))
    assert bus.flush(5)
    bus.close(5)
    assert not bridge.active
    assert bridge.stats() == {"delivered": 0, "failed": 0, "ignored": 1}
    assert wandb.run is None  # never started one


def test_disabled_mode_runs_take_events_without_error(wandb_env: None) -> None:
    import wandb

    from guardtower.bridges import WandBBridge

    run = wandb.init(mode="disabled")
    try:
        bridge = WandBBridge()
        bus = EventBus([bridge])
        bus.publish(preflight_event(failing_report()))
        bus.publish(spike_event(2))
        bus.publish(rollback_event(9, total=1))
        assert bus.flush(5)
        bus.close(5)
    finally:
        run.finish()
    assert bridge.stats() == {"delivered": 3, "failed": 0, "ignored": 0}


def test_missing_wandb_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from guardtower.bridges import WandBBridge

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingDependencyError, match=r'pip install "guardtower\[wandb\]"'):
        WandBBridge()


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"prefix": ""}, "prefix"), ({"prefix": "a/b"}, "prefix"), ({"alerts": ["spike", "typo"]}, "alerts"),
     ({"alert_wait": -1}, "alert_wait"), ({"alert_wait": "5m"}, "alert_wait")],
)
def test_bad_arguments_raise_config_error_naming_them(kwargs: dict[str, Any], argument: str) -> None:
    from guardtower.bridges import WandBBridge

    with pytest.raises(ConfigError) as info:
        WandBBridge(**kwargs)
    assert info.value.argument == argument


def test_importing_the_bridges_does_not_import_wandb_or_mlflow() -> None:
    code = (
        "import sys, guardtower, guardtower.bridges\n"
        "from guardtower.bridges import WandBBridge, MLflowBridge\n"
        "import guardtower.replay\n"
        "assert 'wandb' not in sys.modules and 'mlflow' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


@pytest.mark.slow
def test_end_to_end_with_audit_and_guarded_optimizer(tmp_path: Path, wandb_env: None) -> None:
    from _bridges_helpers import SPIKE_STEP, audit_then_train

    from guardtower.bridges import WandBBridge

    run, _ = _offline_run(tmp_path / "wandb")
    report, guard = audit_then_train(tmp_path, audit_sinks=[WandBBridge()], guard_sinks=[WandBBridge()])
    run.finish()
    logged = read_run(find_run_dir(tmp_path / "wandb"))
    assert report.status == "FAIL" and "OPT-001" in logged.summary[f"{P}/preflight_errors"].split(",")
    assert logged.summary[f"{P}/total_spikes"] == guard.total_spikes == 1
    assert logged.summary[f"{P}/total_skips"] == guard.total_skips == 1
    (spike,) = logged.rows_with(f"{P}/spike_ratio")
    assert spike[f"{P}/step"] == SPIKE_STEP and spike[f"{P}/spike_ratio"] > 10
    assert spike[f"{P}/trigger_layer"].startswith("2.")
    assert [r[f"{P}/step"] for r in logged.rows_with(f"{P}/grad_norm") if f"{P}/spike_ratio" not in r] == [5, 10, 15, 20]
    assert [a["title"] for a in logged.alerts] == ["guardtower: pre-flight failed", "guardtower: gradient spike"]


def test_a_nan_step_logs_only_finite_numbers_and_says_nan_inf(tmp_path: Path, wandb_env: None) -> None:
    run, bridge = _offline_run(tmp_path)
    bus = EventBus([bridge])
    bus.publish(SpikeEvent(run="test-run", step=7, layer="h.0.mlp", reason="nonfinite", ratio=float("inf"),
                           global_norm=float("nan"), severity=Severity.ERROR))
    bus.publish(summary_event(10, grad_norm=float("inf")))
    assert bus.flush(10)
    run.finish()
    bus.close(5)
    logged = read_run(find_run_dir(tmp_path))
    values = [v for row in logged.rows_with(f"{P}/step") for v in row.values() if isinstance(v, float)]
    assert values and all(math.isfinite(v) for v in values)  # W&B would chart inf and nan
    assert [row[f"{P}/nonfinite"] for row in logged.rows_with(f"{P}/nonfinite")] == [1, 1]
    assert [a["title"] for a in logged.alerts] == ["guardtower: NaN/Inf gradient"]  # Slack's wording too
