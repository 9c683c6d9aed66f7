"""Local sinks: JSONL event log (per rank, fsync, torn lines) and the console."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from guardtower.bus import EventBus
from guardtower.errors import ConfigError
from guardtower.events import PreflightEvent, SkipEvent, SpikeEvent, SummaryEvent
from guardtower.severity import Severity
from guardtower.sinks import ConsoleSink, JsonlSink, read_events


def test_jsonl_sink_writes_one_strict_json_record_per_event(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    bus = EventBus([JsonlSink(path)])
    sent = [SpikeEvent(step=1, layer="h.0", ratio=float("inf"), severity=Severity.WARN), SkipEvent(step=1)]
    for event in sent:
        bus.publish(event)
    bus.close(timeout=5)
    assert [e.event_id for e in read_events(path)] == [e.event_id for e in sent]
    assert "Infinity" not in path.read_text()


def test_reader_tolerates_a_torn_last_line(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    bus = EventBus([JsonlSink(path)])
    bus.publish(SkipEvent(step=7))
    bus.close(timeout=5)
    with open(path, "a") as fh:
        fh.write('{"kind": "skip", "event_id": "ab')
    assert [e.step for e in read_events(path)] == [7]


def test_one_file_per_rank_when_distributed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    sink = JsonlSink(tmp_path / "events.jsonl")
    bus = EventBus([sink])
    bus.publish(SkipEvent(step=1))
    bus.close(timeout=5)
    assert (tmp_path / "events.rank1.jsonl").exists() and not (tmp_path / "events.jsonl").exists()


def test_fsynced_events_survive_kill_9_of_the_writer(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from guardtower.bus import EventBus
        from guardtower.events import SpikeEvent
        from guardtower.severity import Severity
        from guardtower.sinks import JsonlSink

        bus = EventBus([JsonlSink({str(path)!r})])
        for i in range(100):
            bus.publish(SpikeEvent(step=i, layer="h.0", severity=Severity.WARN))
        while bus.stats()["sinks"]["jsonl:events.jsonl"]["delivered"] < 100:
            time.sleep(0.001)
        print("written", flush=True)
        for i in range(100, 100000):  # keep writing until killed
            bus.publish(SpikeEvent(step=i, layer="h.0", severity=Severity.WARN))
        time.sleep(60)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    steps = [e.step for e in read_events(path)]
    assert steps[:100] == list(range(100))
    assert steps == list(range(len(steps)))  # nothing reordered or half-parsed


def test_the_parent_folder_is_created_so_the_readme_quickstart_runs_in_a_fresh_folder(tmp_path) -> None:
    path = tmp_path / "sg_logs" / "nested" / "events.jsonl"
    sink = JsonlSink(path)
    assert path.parent.is_dir() and not path.exists()  # the file itself appears with the first event
    bus = EventBus([sink])
    bus.publish(SummaryEvent(step=1))
    bus.close(5)
    assert [e.step for e in read_events(path)] == [1]


def test_a_write_that_fails_is_counted_and_later_events_still_arrive(tmp_path, monkeypatch) -> None:
    """A full disk for one batch (ENOSPC): counted as failed with the reason, never raised into training."""
    import errno

    sink = JsonlSink(tmp_path / "events.jsonl")
    bus = EventBus([sink])
    real_write = os.write
    full = {"on": True}

    def failing_write(fd: int, data: bytes) -> int:
        if full["on"] and fd == sink._fd:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing_write)
    bus.publish(SummaryEvent(step=1))
    assert bus.flush(5)
    full["on"] = False
    bus.publish(SummaryEvent(step=2))
    bus.close(5)
    stats = bus.stats()["sinks"]["jsonl:events.jsonl"]
    assert stats["failed"] == 1 and stats["delivered"] == 1 and stats["published"] == 2
    assert [e.step for e in read_events(tmp_path / "events.jsonl")] == [2]


def test_bad_paths_fail_at_construction(tmp_path) -> None:
    with pytest.raises(ConfigError, match="path.*not writable"):
        JsonlSink("/proc/1/events.jsonl")  # read-only for everyone, root included
    with pytest.raises(ConfigError, match="directory"):
        JsonlSink(tmp_path)


def test_console_sink_renders_the_spike_box_and_preflight_summary() -> None:
    out = io.StringIO()
    bus = EventBus([ConsoleSink(out)])
    bus.publish(
        SpikeEvent(step=40_000, layer="transformer.h.3.mlp.c_fc.weight", ratio=812.0, threshold=10.0,
                   severity=Severity.WARN, top_layers=(("transformer.h.3.mlp.c_fc.weight", 91.0, 812.0),))
    )
    bus.publish(PreflightEvent(status="FAIL", errors=1, error_ids=("LORA-003",), severity=Severity.ERROR))
    bus.publish(SummaryEvent(step=50, grad_norm=1.5))
    bus.close(timeout=5)
    text = out.getvalue()
    assert "gradient spike" in text and "step 40000" in text and "ratio 812" in text
    assert "pre-flight: FAIL" in text and "LORA-003" in text
    assert "summary step=50" in text


def test_console_sink_filters_by_severity() -> None:
    out = io.StringIO()
    bus = EventBus([ConsoleSink(out, min_severity=Severity.WARN)])
    bus.publish(SummaryEvent(step=1))
    bus.close(timeout=5)
    assert out.getvalue() == ""


class RecordingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_console_sink_writes_each_event_as_one_whole_line_write() -> None:
    """The worker's output never splits, so a user's print on another thread cannot glue onto it."""
    out = RecordingStream()
    bus = EventBus([ConsoleSink(out)])
    bus.publish(SpikeEvent(step=3, layer="h.0", reason="nonfinite", severity=Severity.ERROR))
    bus.publish(SummaryEvent(step=50, grad_norm=1.5))
    bus.close(timeout=5)
    assert len(out.writes) == 2 and all(w.endswith("\n") for w in out.writes)
    assert "guardtower: NaN/Inf gradient" in out.writes[0]  # one wording for a NaN step everywhere
    assert out.writes[1].startswith("[guardtower INFO] summary step=50")


# -- wrong types and values: every constructor of a sink, bridge or alert names the argument ---------------

def _bad_calls(tmp_path):  # type: ignore[no-untyped-def]
    from guardtower.alerts import DiscordAlert, PagerDutyAlert, SlackAlert, TeamsAlert, WebhookAlert
    from guardtower.bridges import MLflowBridge, WandBBridge

    url = "http://127.0.0.1:9/hook"
    ok = tmp_path / "ok.jsonl"
    calls = [
        ("sinks", lambda: EventBus(None)), ("sinks", lambda: EventBus(1.5)), ("sinks", lambda: EventBus("x")),
        ("main_process_only", lambda: EventBus([], main_process_only="yes")),
        ("path", lambda: JsonlSink(None)), ("path", lambda: JsonlSink(3)),
        ("fsync_severity", lambda: JsonlSink(ok, fsync_severity="WARNx")),
        ("fsync_severity", lambda: JsonlSink(ok, fsync_severity=None)),
        ("min_severity", lambda: ConsoleSink(min_severity="bogus")), ("stream", lambda: ConsoleSink(stream=3)),
        ("run", lambda: WandBBridge(run=1.5)), ("alert_wait", lambda: WandBBridge(alert_wait=float("nan"))),
        ("prefix", lambda: WandBBridge(prefix=3)), ("findings_table", lambda: WandBBridge(findings_table="no")),
        ("run_id", lambda: MLflowBridge(run_id=7)), ("spool_path", lambda: MLflowBridge("r", spool_path=123)),
        ("request_timeout", lambda: MLflowBridge("r", request_timeout=0)),
        ("artifacts", lambda: MLflowBridge("r", artifacts="yes")),
    ]
    for cls in (WebhookAlert, SlackAlert, DiscordAlert, TeamsAlert):
        calls += [
            ("url", lambda cls=cls: cls(3)), ("url", lambda cls=cls: cls("ftp://x")),
            ("spool_path", lambda cls=cls: cls(url, spool_path=123)),
            ("kinds", lambda cls=cls: cls(url, kinds=5)), ("kinds", lambda cls=cls: cls(url, kinds=["bogus"])),
            ("min_severity", lambda cls=cls: cls(url, min_severity="loud")),
            ("rate_limit", lambda cls=cls: cls(url, rate_limit=float("inf"))),
            ("retry", lambda cls=cls: cls(url, retry=float("nan"))),
            ("grouping", lambda cls=cls: cls(url, grouping=10)),
            ("max_pending", lambda cls=cls: cls(url, max_pending=0)),
            ("queue_size", lambda cls=cls: cls(url, queue_size=1.5)),
            ("name", lambda cls=cls: cls(url, name=3)), ("send_resolved", lambda cls=cls: cls(url, send_resolved=1)),
            ("webhook_url", lambda cls=cls: cls(webhook_url=url)), ("spool", lambda cls=cls: cls(url, spool="x")),
        ]
    calls += [("routing_key", lambda: PagerDutyAlert(5)),
              ("spool", lambda: PagerDutyAlert("key", spool=tmp_path / "s.jsonl"))]
    return calls


def test_every_constructor_rejects_wrong_types_and_values_naming_the_argument(tmp_path, monkeypatch) -> None:
    for env in ("GUARDTOWER_WEBHOOK_URL", "SLACK_WEBHOOK_URL", "DISCORD_WEBHOOK_URL", "TEAMS_WEBHOOK_URL"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    for argument, call in _bad_calls(tmp_path):
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == argument, (argument, str(info.value))
        assert "Fix:" in str(info.value)


def test_an_unknown_alert_keyword_suggests_the_right_one(tmp_path) -> None:
    from guardtower.alerts import WebhookAlert

    with pytest.raises(ConfigError, match=r"webhook_url.*did you mean url="):
        WebhookAlert(webhook_url="http://127.0.0.1:9/hook")
    sink = WebhookAlert("http://127.0.0.1:9/hook", spool_path=tmp_path / "s.jsonl")
    assert "spool_path=" in repr(sink) and "127.0.0.1" not in repr(sink)
