"""MLflowBridge against a real ``mlflow server`` on 127.0.0.1 and the embedded sqlite store."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from _bridges_helpers import failing_report, preflight_event, rollback_event, skip_event, spike_event, summary_event
from _mlflow_server import MlflowServer, free_port
from _wandb_reader import find_run_dir, read_run
from guardtower.bus import EventBus
from guardtower.errors import ConfigError, MissingDependencyError
from guardtower.events import Event, HaltEvent
from guardtower.guard.reports import build_report
from guardtower.report import Report

P = "guardtower"


@pytest.fixture()
def tracking(mlflow_server: MlflowServer) -> Iterator[str]:
    """The server as the process-wide tracking URI for the test, restored afterwards."""
    import mlflow

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(mlflow_server.url)
    yield mlflow_server.url
    mlflow.set_tracking_uri(previous)


def _client(uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in _client(uri).get_metric_history(run_id, key))


def _publish_and_flush(bridge: Any, events: list[Event]) -> dict[str, Any]:
    bus = EventBus([bridge])
    for event in events:
        bus.publish(event)
    assert bus.flush(30)
    bus.close(10)
    return bus.stats()["sinks"][bridge.name]


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
def test_finished_audit_sets_tags_and_logs_the_report(tracking: str, tmp_path: Path) -> None:
    import mlflow

    from guardtower.bridges import MLflowBridge

    report = failing_report()
    with mlflow.start_run() as run:
        bridge = MLflowBridge(spool_path=tmp_path / "spool.jsonl")
        stats = _publish_and_flush(bridge, [preflight_event(report)])
    tags = _client(tracking).get_run(run.info.run_id).data.tags
    assert tags[f"{P}.preflight"] == "FAIL"
    assert tags[f"{P}.preflight.errors"] == "LOSS-001,OPT-001"
    assert tags[f"{P}.preflight.warnings"] == "RELU-001"
    local = _client(tracking).download_artifacts(run.info.run_id, f"{P}/preflight.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == report.to_dict()
    assert stats["delivered"] == 1 and stats["spooled"] == 0


@pytest.mark.slow
def test_incidents_become_metrics_spike_artifacts_and_a_last_incident_tag(tracking: str, tmp_path: Path) -> None:
    import mlflow

    from guardtower.bridges import MLflowBridge

    with mlflow.start_run() as run:
        bridge = MLflowBridge(spool_path=tmp_path / "spool.jsonl")
    with_file = spike_event(12, log_dir=tmp_path, ratio=42.0)
    without_file = spike_event(15, ratio=float("inf"))
    not_yet_written = spike_event(16, log_dir=tmp_path, write_report=False)
    _publish_and_flush(bridge, [
        summary_event(10, grad_norm=1.5), with_file, skip_event(12, total=1), without_file,
        skip_event(15, total=2), not_yet_written, rollback_event(20, total=1),
    ])
    rid = run.info.run_id
    ratios = _history(tracking, rid, f"{P}.spike_ratio")
    assert ratios == [(12, 42.0), (16, 42.0)]  # inf is never logged (MLflow would store 1.8e308) ...
    assert _history(tracking, rid, f"{P}.nonfinite") == [(12, 0.0), (15, 1.0), (16, 0.0)]  # ... it is flagged
    assert _history(tracking, rid, f"{P}.grad_norm") == [(10, 1.5), (12, 11.25), (15, 11.25), (16, 11.25)]
    assert _history(tracking, rid, f"{P}.skipped_steps") == [(10, 0.0), (12, 1.0), (15, 2.0)]
    assert _history(tracking, rid, f"{P}.rollbacks") == [(10, 0.0), (20, 1.0)]
    fallback_name = f"spike-step00000015-{without_file.event_id[:12]}.json"
    names = sorted(Path(a.path).name for a in _client(tracking).list_artifacts(rid, f"{P}/spikes"))
    assert names == sorted([Path(str(with_file.report_path)).name, fallback_name,
                            Path(str(not_yet_written.report_path)).name])
    copied = _client(tracking).download_artifacts(rid, f"{P}/spikes/{Path(str(with_file.report_path)).name}",
                                                  str(tmp_path / "dl"))
    assert Path(copied).read_text() == Path(str(with_file.report_path)).read_text()
    fallback = _client(tracking).download_artifacts(rid, f"{P}/spikes/{fallback_name}", str(tmp_path / "dl"))
    assert json.loads(Path(fallback).read_text())["event_id"] == without_file.event_id
    built = _client(tracking).download_artifacts(rid, f"{P}/spikes/{Path(str(not_yet_written.report_path)).name}",
                                                 str(tmp_path / "dl"))
    assert json.loads(Path(built).read_text()) == build_report(not_yet_written)  # what the guard would have written
    tags = _client(tracking).get_run(rid).data.tags
    assert tags[f"{P}.last_incident"] == "kind=rollback step=20 layer=h.1.attn.c_attn.weight"


@pytest.mark.slow
def test_explicit_run_id_works_without_an_active_run(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    from guardtower.bridges import MLflowBridge

    client = _client(mlflow_server.url)
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    bridge = MLflowBridge(run.info.run_id, tracking_uri=mlflow_server.url, spool_path=tmp_path / "spool.jsonl")
    _publish_and_flush(bridge, [HaltEvent(step=7, layer="fc1.weight", reason="spike", ratio=99.0)])
    tags = client.get_run(run.info.run_id).data.tags
    assert tags[f"{P}.halted"] == tags[f"{P}.last_incident"] == "kind=halt step=7 layer=fc1.weight"


@pytest.mark.slow
def test_embedded_sqlite_store_without_a_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow

    from guardtower.bridges import MLflowBridge

    monkeypatch.chdir(tmp_path)  # the default artifact root is ./mlruns
    monkeypatch.setenv("GUARDTOWER_SPOOL_DIR", str(tmp_path / "spool"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run() as run:
            bridge = MLflowBridge()
            spike = spike_event(3, log_dir=tmp_path)
            _publish_and_flush(bridge, [preflight_event(Report(checks_run=["loss"])), spike])
    finally:
        mlflow.set_tracking_uri(previous)
    assert bridge.tracking_uri == uri
    data = _client(uri).get_run(run.info.run_id).data
    assert data.tags[f"{P}.preflight"] == "PASS" and data.tags[f"{P}.preflight.errors"] == ""
    assert data.metrics[f"{P}.spike_ratio"] == 42.0
    assert [a.path for a in _client(uri).list_artifacts(run.info.run_id, f"{P}/spikes")] == [
        f"{P}/spikes/{Path(str(spike.report_path)).name}"]
    assert not (tmp_path / "spool").exists()  # nothing failed, so no spool was created


def _blackhole() -> socket.socket:
    """A TCP listener that never answers: connections are accepted by the kernel and then hang."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def test_a_hung_server_never_blocks_publish_and_events_go_to_the_spool(tmp_path: Path) -> None:
    import mlflow.environment_variables as env_vars

    from guardtower.bridges import MLflowBridge

    hole = _blackhole()
    try:
        url = f"http://127.0.0.1:{hole.getsockname()[1]}"
        bridge = MLflowBridge("0" * 32, tracking_uri=url, spool_path=tmp_path / "spool.jsonl",
                              request_timeout=1, request_retries=0, retry_interval=60)
        bus = EventBus([bridge])
        events = [spike_event(s) for s in range(1, 6)]
        latencies = []
        for event in events:
            start = time.perf_counter()
            bus.publish(event)
            latencies.append(time.perf_counter() - start)
        assert bridge.spool_path == tmp_path / "spool.jsonl"
        _wait_for(lambda: bus.stats()["sinks"][bridge.name]["spooled"] == 5, 20, "the events to be spooled")
        # the user's own MLflow settings are untouched on this thread while the worker used 1 s
        assert env_vars.MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 120
        bus.close(0.1)
    finally:
        hole.close()
    assert max(latencies) < 0.01
    from guardtower.spool import Spool

    assert [e.event.event_id for e in Spool(tmp_path / "spool.jsonl").entries()] == [e.event_id for e in events]
    assert all(e.sink.startswith("mlflow:" + "0" * 32 + "|guardtower|http://127.0.0.1:")
               for e in Spool(tmp_path / "spool.jsonl").entries())


def test_credentials_in_the_tracking_uri_never_reach_logs_reprs_or_the_spool(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from guardtower.bridges import MLflowBridge

    uri = f"http://alice:s3cret-token@127.0.0.1:{free_port()}"
    bridge = MLflowBridge("1" * 32, tracking_uri=uri, spool_path=tmp_path / "spool.jsonl", request_retries=0,
                          retry_interval=60)
    with caplog.at_level("INFO", logger="guardtower"):
        stats = _publish_and_flush_expect_backlog(bridge, [spike_event(1)])
    assert stats["spooled"] == 1
    seen = repr(bridge) + bridge.name + caplog.text + (tmp_path / "spool.jsonl").read_text()
    assert "127.0.0.1" in seen and "s3cret" not in seen and "alice" not in seen


@pytest.mark.slow
def test_replay_command_sends_spooled_events_once(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    from guardtower.bridges import MLflowBridge
    from guardtower.cli import main as cli

    client = _client(mlflow_server.url)
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    dead = f"http://127.0.0.1:{free_port()}"
    spool = tmp_path / "spool.jsonl"
    bridge = MLflowBridge(run.info.run_id, tracking_uri=dead, spool_path=spool, retry_interval=60,
                          request_retries=0)
    assert _publish_and_flush_expect_backlog(bridge, [spike_event(s) for s in (5, 6, 7)])["spooled"] == 3
    before = mlflow_server.count_requests("/api/2.0/mlflow/runs/log-batch")
    assert cli(["replay", str(spool), "--tracking-uri", mlflow_server.url]) == 0
    assert cli(["replay", str(spool), "--tracking-uri", mlflow_server.url]) == 0  # nothing left: sends nothing
    assert mlflow_server.count_requests("/api/2.0/mlflow/runs/log-batch") - before == 3
    assert _history(mlflow_server.url, run.info.run_id, f"{P}.spike_ratio") == [(5, 42.0), (6, 42.0), (7, 42.0)]


@pytest.mark.slow
def test_a_new_bridge_first_replays_what_a_previous_process_left_in_the_spool(mlflow_server: MlflowServer,
                                                                             tmp_path: Path) -> None:
    from guardtower.bridges import MLflowBridge

    client = _client(mlflow_server.url)
    run_id = client.create_run(client.get_experiment_by_name("Default").experiment_id).info.run_id
    spool = tmp_path / "spool.jsonl"
    crashed = MLflowBridge(run_id, tracking_uri=f"http://127.0.0.1:{free_port()}", spool_path=spool,
                           request_retries=0, retry_interval=60)
    _publish_and_flush_expect_backlog(crashed, [spike_event(1), spike_event(2)])
    restarted = MLflowBridge(run_id, tracking_uri=mlflow_server.url, spool_path=spool, retry_interval=0.1)
    bus = EventBus([restarted])  # one bus: a second one around the same sink would replay the spool again
    assert bus.stats()["sinks"][restarted.name]["backlog"]  # the leftovers go first
    bus.publish(spike_event(3))
    assert bus.flush(30)
    bus.close(10)
    stats = bus.stats()["sinks"][restarted.name]
    assert stats["replayed"] >= 2 and stats["replayed"] + stats["delivered"] == 3 and not stats["backlog"]
    assert [s for s, _ in _history(mlflow_server.url, run_id, f"{P}.spike_ratio")] == [1, 2, 3]
    assert client.get_run(run_id).data.tags[f"{P}.last_incident"].startswith("kind=spike step=3 ")


def _publish_and_flush_expect_backlog(bridge: Any, events: list[Event]) -> dict[str, Any]:
    bus = EventBus([bridge])
    for event in events:
        bus.publish(event)
    bus.flush(10)
    bus.close(5)
    stats = bus.stats()["sinks"][bridge.name]
    assert stats["delivered"] == 0  # the server is down
    return stats


def test_without_a_run_it_warns_once_and_ignores_events(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import mlflow

    from guardtower.bridges import MLflowBridge
    from guardtower.bridges import _common as bridge_common

    assert mlflow.active_run() is None
    monkeypatch.setattr(bridge_common, "_warned", set())
    with pytest.warns(RuntimeWarning, match="no MLflow run"):
        bridge = MLflowBridge(tracking_uri=f"sqlite:///{tmp_path / 'x.db'}")
    _publish_and_flush(bridge, [spike_event(1)])
    assert not bridge.active and bridge.stats()["ignored"] == 1


@pytest.mark.slow
def test_the_active_run_is_captured_on_the_constructing_thread(tracking: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's active run is per thread: a bridge built on a thread without one sees no run."""
    import mlflow

    from guardtower.bridges import MLflowBridge
    from guardtower.bridges import _common as bridge_common

    monkeypatch.setattr(bridge_common, "_warned", set())
    with mlflow.start_run() as run:
        here = MLflowBridge(spool_path=tmp_path / "a.jsonl")
        there: list[Any] = []
        with pytest.warns(RuntimeWarning):
            thread = threading.Thread(target=lambda: there.append(MLflowBridge(spool_path=tmp_path / "b.jsonl")))
            thread.start()
            thread.join()
    assert here.run_id == run.info.run_id and here.tracking_uri == tracking
    assert there[0].run_id is None


def test_missing_mlflow_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from guardtower.bridges import MLflowBridge

    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(MissingDependencyError, match=r'pip install "guardtower\[mlflow\]"'):
        MLflowBridge(run_id="abc")


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"prefix": ""}, "prefix"), ({"run_id": ""}, "run_id"), ({"tracking_uri": 5}, "tracking_uri"),
     ({"request_timeout": 0}, "request_timeout"), ({"request_timeout": 2.5}, "request_timeout"),
     ({"request_retries": -1}, "request_retries"), ({"retry_interval": 0}, "retry_interval"),
     ({"retry_interval": 10, "max_retry_interval": 5}, "max_retry_interval"),
     ({"spool_path": "/proc/1/spool/spool.jsonl"}, "spool_path"), ({"spool_path": 123}, "spool_path")],
)
def test_bad_arguments_raise_config_error_naming_them(kwargs: dict[str, Any], argument: str) -> None:
    from guardtower.bridges import MLflowBridge

    with pytest.raises(ConfigError) as info:
        MLflowBridge(**kwargs)
    assert info.value.argument == argument


def test_replay_without_files_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from guardtower.replay import main

    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "no such spool file" in capsys.readouterr().err


@pytest.mark.slow
def test_end_to_end_with_audit_and_guarded_optimizer(tracking: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow

    from _bridges_helpers import SPIKE_STEP, audit_then_train
    from guardtower.bridges import MLflowBridge

    monkeypatch.setenv("GUARDTOWER_SPOOL_DIR", str(tmp_path / "spool"))
    with mlflow.start_run() as run:
        report, guard = audit_then_train(tmp_path, audit_sinks=[MLflowBridge()], guard_sinks=[MLflowBridge()])
    rid = run.info.run_id
    tags = _client(tracking).get_run(rid).data.tags
    assert report.status == tags[f"{P}.preflight"] == "FAIL"
    assert tags[f"{P}.preflight.errors"] == ",".join(dict.fromkeys(f.catalog_id for f in report.errors))
    assert "OPT-001" in tags[f"{P}.preflight.errors"].split(",")
    assert tags[f"{P}.last_incident"].startswith(f"kind=skip step={SPIKE_STEP} layer=2.")
    assert [s for s, _ in _history(tracking, rid, f"{P}.spike_ratio")] == [SPIKE_STEP]
    assert _history(tracking, rid, f"{P}.skipped_steps")[-1] == (20, 1.0)
    (written,) = (tmp_path).glob("spike_step*.json")  # the guard's own report file ...
    local = _client(tracking).download_artifacts(rid, f"{P}/spikes/{written.name}", str(tmp_path / "dl"))
    assert json.loads(Path(local).read_text()) == json.loads(written.read_text())  # ... is the artifact
    assert guard.total_spikes == 1 and not (tmp_path / "spool").exists()


# -- 2-process gloo DDP: both bridges, only rank 0 writes ------------------------------------------------

WORLD = 2
STEPS = 4


def _steps(rank: int) -> list[int]:
    return [100 * rank + s for s in range(STEPS)]


def _worker(rank: int, port: int, root: str, run_id: str, uri: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WANDB_MODE="offline", WANDB_SILENT="true",
                      WANDB_BASE_URL="http://127.0.0.1:9", WANDB_API_KEY="")
    import torch
    import torch.distributed as dist
    import wandb
    from torch.nn.parallel import DistributedDataParallel as DDP

    from guardtower.bridges import MLflowBridge, WandBBridge
    from guardtower.bus import EventBus

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    # Every rank has a W&B run and the MLflow run id: without rank filtering both would write.
    run = wandb.init(mode="offline", dir=os.path.join(root, f"rank{rank}"), project="guardtower-ddp")
    bus = EventBus([WandBBridge(), MLflowBridge(run_id, tracking_uri=uri,
                                                spool_path=Path(root) / f"spool{rank}.jsonl")])
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in _steps(rank):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        run.log({"train/loss": float(loss)})
        bus.publish(spike_event(step, rank=rank))
        bus.publish(skip_event(step, total=step % 100 + 1, rank=rank))
    assert bus.flush(60)
    bus.close(10)
    run.finish()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_under_two_process_ddp_only_rank_zero_writes_to_wandb_and_mlflow(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    uri = mlflow_server.url
    client = _client(uri)
    run_id = client.create_run(client.get_experiment_by_name("Default").experiment_id).info.run_id
    ctx = mp.start_processes(_worker, args=(free_port(), str(tmp_path), run_id, uri), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("distributed workers did not finish in 240 s")

    spikes = sorted(m.step for m in client.get_metric_history(run_id, "guardtower.spike_ratio"))
    assert spikes == _steps(0)
    rank0 = read_run(find_run_dir(tmp_path / "rank0"))
    rank1 = read_run(find_run_dir(tmp_path / "rank1"))
    assert [r["guardtower/step"] for r in rank0.rows_with("guardtower/spike_ratio")] == _steps(0)
    assert len(rank0.alerts) == STEPS
    assert len(rank1.rows_with("train/loss")) == STEPS  # rank 1's run works ...
    assert not [k for row in rank1.history for k in row if k.startswith("guardtower/")]  # ... but gets nothing
    assert rank1.alerts == [] and not any(k.startswith("guardtower/") for k in rank1.summary)


# -- outage: it stops the shared server and starts it again (same port) -------------------------------------


@pytest.mark.slow
def test_server_outage_never_delays_training_and_every_event_arrives_exactly_once(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    import torch

    from guardtower.bridges import MLflowBridge

    client = _client(mlflow_server.url)
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    rid = run.info.run_id
    batches_before = mlflow_server.count_requests("/api/2.0/mlflow/runs/log-batch", method="POST")
    uploads_before = mlflow_server.count_requests("/api/2.0/mlflow-artifacts/artifacts/", method="PUT", prefix=True)
    # a stopped server refuses connections at once, so the outage shows without a short timeout; a short one
    # (2 s) made a loaded host's slow-but-successful request time out and be sent again: a duplicate
    bridge = MLflowBridge(rid, tracking_uri=mlflow_server.url, spool_path=tmp_path / "spool.jsonl",
                          request_timeout=30, request_retries=0, retry_interval=0.25, max_retry_interval=1.0)
    bus = EventBus([bridge])
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = torch.randn(64, 16)
    published: list[Event] = []
    publish_s: list[float] = []
    reports = tmp_path / "reports"
    reports.mkdir()
    step = 0

    def train(steps: int, every: int = 2) -> None:
        nonlocal step
        for _ in range(steps):
            opt.zero_grad()
            model(data).pow(2).mean().backward()
            opt.step()
            if step % every == 0:
                events: list[Event] = [spike_event(step, log_dir=reports), skip_event(step, total=len(published) // 2 + 1)]
                start = time.perf_counter()
                for event in events:
                    bus.publish(event)
                publish_s.append(time.perf_counter() - start)
                published.extend(events)
            step += 1
            time.sleep(0.005)

    train(20)  # healthy
    assert bus.flush(30)
    stats = lambda: bus.stats()["sinks"][bridge.name]  # noqa: E731
    assert stats()["spooled"] == 0
    mlflow_server.stop()
    train(20)  # server down
    _wait_for(lambda: stats()["backlog"], 30, "the bridge to notice the outage")
    restarter = threading.Thread(target=mlflow_server.start)
    restarter.start()
    while restarter.is_alive():  # training goes on while the server comes back
        train(1, every=10)
    restarter.join()
    train(20)  # server back
    _wait_for(lambda: not stats()["backlog"], 60, "the spool to be replayed")
    assert bus.flush(30)
    bus.close(10)

    assert max(publish_s) < 0.1, f"a training step waited {max(publish_s) * 1000:.1f} ms in publish"
    final = stats()
    assert final["spooled"] > 0 and final["failed"] == 0 and final["dropped"] == 0
    assert final["delivered"] + final["replayed"] == len(published)
    spike_steps = [e.step for e in published if e.kind == "spike"]
    skips = [(e.step, float(e.total_skips)) for e in published if e.kind == "skip"]  # type: ignore[attr-defined]
    # every event exactly once, in the tracker ...
    assert _history(mlflow_server.url, rid, f"{P}.spike_ratio") == [(s, 42.0) for s in spike_steps]
    assert _history(mlflow_server.url, rid, f"{P}.skipped_steps") == skips
    names = sorted(Path(a.path).name for a in client.list_artifacts(rid, f"{P}/spikes"))
    assert names == sorted(Path(str(e.report_path)).name for e in published if e.kind == "spike")  # type: ignore[attr-defined]
    assert client.get_run(rid).data.tags[f"{P}.last_incident"] == f"kind=skip step={published[-1].step} layer=h.0.mlp.c_fc.weight"
    # ... and on the wire: one successful log-batch per event, one artifact upload per spike, over both lifetimes
    batches = mlflow_server.count_requests("/api/2.0/mlflow/runs/log-batch", method="POST") - batches_before
    uploads = mlflow_server.count_requests("/api/2.0/mlflow-artifacts/artifacts/", method="PUT", prefix=True) - uploads_before
    assert (batches, uploads) == (len(published), len(spike_steps))


def test_replay_keeps_entries_while_the_server_is_down_and_lists_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from guardtower.bridges.mlflow import sink_name
    from guardtower.replay import main
    from guardtower.spool import Spool

    spool = Spool(tmp_path / "spool.jsonl")
    dead = f"http://127.0.0.1:{free_port()}"
    events = [spike_event(1), skip_event(1, total=1)]
    for event in events:
        spool.append(event, "undelivered", "mlflow:" + sink_name("2" * 32, "guardtower", dead))
    spool.append(spike_event(2), "undelivered", "carrier-pigeon:coo")
    assert main([str(spool.path), "--timeout", "1"]) == 2  # an unknown sink kind is a usage error
    out, err = capsys.readouterr()
    assert "sent 0, remaining 3" in out
    assert "no replayer for sink kind 'carrier-pigeon'" in err and "mlflow failed at spike step 1" in err
    port = dead.rsplit(":", 1)[1]
    assert main([str(spool.path), "--tracking-uri", f"http://alice:s3cret@127.0.0.1:{port}", "--timeout", "1"]) == 2
    out, err = capsys.readouterr()
    assert "mlflow failed at spike step 1" in err and "s3cret" not in out + err
    assert main([str(spool.path), "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[1] for line in listed] == ["spike", "skip", "spike"]
    assert len(spool) == 3


@pytest.mark.parametrize(("uri", "stored"), [
    ("sqlite:///rel.db", "sqlite:///{cwd}/rel.db"), ("sqlite:////abs/x.db", "sqlite:////abs/x.db"),
    ("http://alice:pw@127.0.0.1:5000/", "http://127.0.0.1:5000/"), ("file:///tmp/mlruns", "file:///tmp/mlruns"),
])
def test_the_spool_records_a_tracking_uri_that_replays(uri: str, stored: str, tmp_path: Path) -> None:
    from guardtower.bridges import MLflowBridge

    bridge = MLflowBridge("r" * 32, tracking_uri=uri, spool_path=tmp_path / "s.jsonl")
    assert bridge.name.split("|", 2)[2] == stored.format(cwd=os.getcwd())


def _new_run(uri: str) -> str:
    client = _client(uri)
    experiment = client.create_experiment(f"refusals-{time.time_ns()}")
    return str(client.create_run(experiment).info.run_id)


@pytest.mark.slow
def test_an_event_mlflow_refuses_is_quarantined_and_the_rest_flows(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    """time=inf and step=10**20 cannot be stored: refused (quarantined with the reason), not "server down"."""
    import math

    from guardtower.bridges import MLflowBridge
    from guardtower.events import PreflightEvent, SummaryEvent

    run_id = _new_run(mlflow_server.url)
    bridge = MLflowBridge(run_id, tracking_uri=mlflow_server.url, spool_path=tmp_path / "spool.jsonl", retry_interval=0.05)
    poison = [SummaryEvent(step=1, time=math.inf, grad_norm=1.0), SummaryEvent(step=10**20, grad_norm=1.0)]
    report = PreflightEvent(report={"score": math.nan, "nested": {"x": [math.inf]}})  # strict JSON as $float tags
    healthy = [SummaryEvent(step=i, grad_norm=float(i)) for i in range(10, 20)]
    stats = _publish_and_flush(bridge, poison + [report] + healthy)
    assert stats["delivered"] == 11 and stats["failed"] == stats["quarantined"] == 2 and stats["spooled"] == 0
    assert [s for s, _ in _history(mlflow_server.url, run_id, f"{P}.grad_norm")] == list(range(10, 20))
    assert _client(mlflow_server.url).get_run(run_id).data.tags[f"{P}.preflight"] == "PASS"
    spool = bridge.spool
    assert spool is not None and list(spool.entries()) == []
    refused = spool.refused()
    assert sorted(e.event.event_id for e in refused) == sorted(e.event_id for e in poison)
    assert all(e.reason.startswith("MLflow refused the event") for e in refused)


@pytest.mark.slow
def test_replay_quarantines_a_bad_spool_line_at_the_head_and_sends_the_rest(mlflow_server: MlflowServer,
                                                                          tmp_path: Path) -> None:
    from guardtower.bridges.mlflow import sink_name
    from guardtower.events import SummaryEvent
    from guardtower.spool import Spool

    run_id = _new_run(mlflow_server.url)
    spool = Spool(tmp_path / "spool.jsonl")
    sink = f"mlflow:{sink_name(run_id, P, mlflow_server.url)}"
    bad = SummaryEvent(step=0, grad_norm=1.0).to_record()
    bad["step"] = "abc"
    spool.path.write_text(json.dumps({"reason": "x", "sink": sink, "time": 0, "event": bad}) + "\n")
    spool.append_many([SummaryEvent(step=i, grad_norm=float(i)) for i in range(1, 11)], "down", sink)
    replay = subprocess.run([sys.executable, "-m", "guardtower", "replay", str(spool.path)], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert replay.returncode == 0, replay.stderr
    assert "sent 10, refused 1" in replay.stdout and "remaining 0" in replay.stdout
    assert [s for s, _ in _history(mlflow_server.url, run_id, f"{P}.grad_norm")] == list(range(1, 11))
    assert [e.event.event_id for e in spool.refused()] == [bad["event_id"]]


@pytest.mark.slow
def test_loop_watch_findings_become_a_watch_tag_with_every_id(tracking: str, tmp_path: Path) -> None:
    import mlflow

    from guardtower.bridges import MLflowBridge
    from guardtower.events import FindingEvent
    from guardtower.severity import Severity

    findings = [FindingEvent(severity=Severity.WARN, check="watch", catalog_id=cid, message="seen by the watch",
                             details={}) for cid in ("OPT-011", "DRIFT-001", "OPT-011")]
    audit_finding = FindingEvent(severity=Severity.WARN, check="supervision", catalog_id="DATA-005",
                                 message="from the pre-flight", details={})
    with mlflow.start_run() as run:
        bridge = MLflowBridge(spool_path=tmp_path / "spool.jsonl")
        _publish_and_flush(bridge, [*findings, audit_finding])
    tags = _client(tracking).get_run(run.info.run_id).data.tags
    assert tags[f"{P}.watch"] == "WARN"
    assert tags[f"{P}.watch.ids"] == "OPT-011,DRIFT-001"
