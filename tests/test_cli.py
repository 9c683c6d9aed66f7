"""The ``guardtower`` command on good and bad input: one clear line and exit status 2 for every user error."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guardtower.bus import EventBus
from guardtower.cli import main
from guardtower.events import EVENT_TYPES, PreflightEvent, SpikeEvent, SummaryEvent
from guardtower.severity import Severity
from guardtower.sinks import JsonlSink

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> tuple[int, str, str]:
    """``main(argv)`` in-process, with stdout and stderr captured; argparse's own exits become their code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


def _write_events(path: Path) -> None:
    bus = EventBus([JsonlSink(path)])
    bus.publish(PreflightEvent(step=0, status="FAIL", errors=1, error_ids=("LORA-003",), severity=Severity.ERROR))
    for step in (5, 10):
        bus.publish(SummaryEvent(step=step, grad_norm=1.0))
    bus.publish(SpikeEvent(step=7, layer="h.0.attn", norm=50.0, baseline=1.0, ratio=50.0, threshold=10.0,
                           global_norm=60.0, action="skip", severity=Severity.WARN))
    bus.close(5)


def test_events_accepts_the_log_dir_that_report_accepts(tmp_path: Path) -> None:
    _write_events(tmp_path / "events.jsonl")
    code, by_dir, err = _run("events", str(tmp_path))
    assert code == 0 and err == ""
    assert _run("events", str(tmp_path / "events.jsonl"))[1] == by_dir
    assert "pre-flight: FAIL" in by_dir and "action: SKIP" in by_dir and "summary step=10" in by_dir


def test_min_severity_takes_both_spellings_and_help_lists_them(tmp_path: Path) -> None:
    _write_events(tmp_path / "events.jsonl")
    outputs = {spelling: _run("events", str(tmp_path), "--min-severity", spelling)
               for spelling in ("FAIL", "error", "Error")}
    assert len({out for _code, out, _err in outputs.values()}) == 1
    code, out, _err = outputs["FAIL"]
    assert code == 0 and "pre-flight: FAIL" in out and "spike" not in out
    assert "summary" not in _run("events", str(tmp_path), "--min-severity", "warning")[1]
    code, help_text, _ = _run("events", "--help")
    assert code == 0 and "FAIL (or ERROR)" in " ".join(help_text.split())
    assert Severity.parse("ERROR") is Severity.parse("fail") is Severity.ERROR


def test_kind_filters_and_an_unknown_kind_is_an_error_listing_the_kinds(tmp_path: Path) -> None:
    _write_events(tmp_path / "events.jsonl")
    code, out, _ = _run("events", str(tmp_path), "--kind", "summary")
    assert code == 0 and out.count("summary step=") == 2 and "gradient spike" not in out
    code, out, err = _run("events", str(tmp_path), "--kind", "bogus")
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "'bogus'" in err
    assert all(kind in err for kind in EVENT_TYPES)


def test_malformed_lines_are_counted_in_one_line_after_the_good_events(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    _write_events(events)
    with events.open("a") as fh:
        fh.write('{"kind": "summary", "step": "abc"}\nnot json\n{"kind": "spike", "step": 9}\n[1, 2]\n')
    code, out, err = _run("events", str(events))
    assert code == 2
    assert out.count("summary step=") == 2
    assert err.splitlines() == [err.strip()]
    assert "skipped 3 malformed line(s)" in err and "events.jsonl:5" in err and "'step'" in err


def test_a_spike_without_an_action_is_not_shown_as_skip(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({"kind": "spike", "step": 3, "layer": "fc", "ratio": 40.0}) + "\n")
    code, out, _ = _run("events", str(events))
    assert code == 0 and "SKIP" not in out and "action: UNKNOWN" in out
    code, out, _ = _run("report", str(events))
    assert code == 0 and "skip" not in out and "unknown" in out


def test_a_damaged_rollback_record_cannot_make_report_hang(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    record = {"kind": "rollback", "step": 2**62, "from_step": 2**62, "to_step": 0, "layer": "fc"}
    events.write_text(json.dumps(record) + "\n")
    code, out, _ = _run("report", str(events))
    assert code == 0 and "rollback" in out


def test_a_torn_last_line_is_skipped_with_a_notice_not_an_error(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    _write_events(events)
    with events.open("a") as fh:
        fh.write('{"kind": "summary", "st')
    code, _out, err = _run("events", str(events))
    assert code == 0 and err.strip() == (f"guardtower events: {events}: skipped a torn last line "
                                         "(a write cut short by a crash or a full disk)")


_BAD_FILES = {
    "binary": b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary",
    "latin-1": "{\"kind\": \"summary\", \"run\": \"caf\xe9\"}\n".encode("latin-1"),
    "step-abc": b'{"kind": "spike", "step": "abc"}\n',
    "unknown-kind": b'{"kind": "no-such-kind", "step": 1}\n',
    "no-kind": b'{"step": 1}\n',
    "event-null": b'{"event": null}\n',
    "event-list": b'{"event": [1, 2]}\n',
    "list": b'[{"kind": "summary"}]\n',
    "severity": b'{"kind": "summary", "severity": "CRITICAL"}\n',
    "kind-null": b'{"kind": null}\n',
}
@pytest.mark.parametrize("name", sorted(_BAD_FILES))
@pytest.mark.parametrize("command", [["events"], ["report"], ["report", "--json"], ["replay", "--list"]],
                         ids=["events", "report", "report-json", "replay"])
def test_bad_files_are_one_line_and_exit_2(tmp_path: Path, name: str, command: list[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_BAD_FILES[name])
    code, out, err = _run(command[0], str(bad), *command[1:])
    assert "Traceback" not in err and "Traceback" not in out
    assert len(err.strip().splitlines()) == 1, err
    assert code == 2, (code, out, err)


def test_missing_path_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for command in ("events", "report", "replay"):
        code, _out, err = _run(command, str(tmp_path / "missing.jsonl"))
        assert code == 2 and len(err.splitlines()) == 1 and "missing.jsonl" in err


def test_report_on_a_clean_run_says_how_many_steps(tmp_path: Path) -> None:
    bus = EventBus([JsonlSink(tmp_path / "events.jsonl")])
    for step in (50, 100, 120):
        bus.publish(SummaryEvent(step=step, grad_norm=1.0))
    bus.close(5)
    code, out, err = _run("report", str(tmp_path))
    assert code == 0 and err == ""
    assert out.startswith("120 steps, 0 incidents in ")


def test_events_piped_into_head_ends_without_a_traceback(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    lines = (json.dumps(SummaryEvent(step=i, grad_norm=1.0).to_record()) + "\n" for i in range(20_000))
    events.write_text("".join(lines))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "guardtower", "events", str(events)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    assert b"summary step=0" in proc.stdout.readline()
    proc.stdout.close()  # what head does after its first lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err


# ------------------------------------------------------------------------------------------------ fuzz
_FIELDS = sorted({f for cls in EVENT_TYPES.values() for f in cls.__dataclass_fields__} | {"kind", "event"})
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                       st.sampled_from(["ERROR", "FAIL", "warn", "spike", "nonfinite"]))
_json = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(_FIELDS + ["$float"]), inner, max_size=3), max_leaves=8)
_record = st.fixed_dictionaries({"kind": st.sampled_from(sorted(EVENT_TYPES) + ["bogus"]) | _json},
                                optional={name: _json for name in _FIELDS if name != "kind"})


def _line(value: object) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


_lines = st.lists(st.one_of(_record.map(_line), _record.map(lambda r: _line({"event": r})), _json.map(_line),
                            st.binary(max_size=24)), max_size=6)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=_lines, kind=st.sampled_from(["", "spike", "bogus", "-x"]),
       severity=st.sampled_from(["INFO", "FAIL", "error", "bogus", ""]))
def test_fuzz_the_cli_never_tracebacks(lines: list[bytes], kind: str, severity: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        runs = [["events", str(path), "--min-severity", severity] + (["--kind", kind] if kind else []),
                ["events", tmp], ["report", tmp], ["report", str(path), "--json"]]
        for argv in runs:
            code, out, err = _run(*argv)
            assert code in (0, 2), (argv, code, err)
            assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, (argv, err)
            if "--json" in argv:
                for row in out.splitlines():
                    json.loads(row, parse_constant=_reject)


def _reject(token: str) -> float:
    raise AssertionError(f"non-strict JSON token {token} in report --json")
