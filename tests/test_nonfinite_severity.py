"""A non-finite step is one failure everywhere: events, console, alert facts; a finite spike stays a warning."""

from __future__ import annotations

import io
from pathlib import Path

from guardtower.alerts import PagerDutyAlert, WebhookAlert
from guardtower.alerts._format import facts
from guardtower.alerts.grouping import Notification
from guardtower.events import Event, SkipEvent, SpikeEvent
from guardtower.sinks import render_event
from guardtower.severity import Severity
from guardtower.testing import capture_events
from tests._guard_helpers import make, scale_grad, train


def _note(event: Event) -> Notification:
    return Notification("firing", event.fingerprint, event.kind, event.run, event, (event,), 1, 1)


def test_a_nan_step_is_a_failure_in_events_console_and_alerts(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    with capture_events() as events:
        train(model, guard, 3, corrupt=lambda i, m: m.out.bias.grad.fill_(float("nan")) if i == 2 else None)
        guard.flush()
    spike = next(e for e in events if isinstance(e, SpikeEvent))
    skip = next(e for e in events if isinstance(e, SkipEvent))
    assert (spike.reason, spike.severity, skip.severity) == ("nonfinite", Severity.ERROR, Severity.ERROR)
    assert "FAIL" in render_event(skip)
    box = render_event(spike)
    assert "NaN/Inf gradient" in box and "baseline" not in box.replace("whatever the baseline", "")
    shown = dict(facts(_note(spike)))
    assert (shown["severity"], shown["kind"]) == ("FAIL", "nonfinite")
    body = WebhookAlert(url="http://127.0.0.1:9/hook").render(_note(spike))
    assert (body["severity"], body["kind"], body["event"]["reason"]) == ("FAIL", "nonfinite", "nonfinite")
    page = PagerDutyAlert(routing_key="k" * 32).render(_note(spike))["payload"]
    assert (page["severity"], page["class"]) == ("error", "nonfinite")


def test_a_finite_spike_is_a_warning_whose_box_names_the_share_ratio(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    with capture_events() as events:
        train(model, guard, 31, corrupt=lambda i, m: scale_grad("out.weight", 1e4)(m) if i == 30 else None)
        guard.flush()
    spike = next(e for e in events if isinstance(e, SpikeEvent))
    assert (spike.reason, spike.severity, spike.share_ratios) == ("spike", Severity.WARN, True)
    assert dict(facts(_note(spike)))["kind"] == "spike"
    assert WebhookAlert(url="http://127.0.0.1:9/hook").render(_note(spike))["kind"] == "spike"
    box = render_event(spike)
    assert "its share of the gradient is" in box and "share of the gradient vs its usual share" in box
    assert f"  {spike.top_layers[0][0]}: grad norm" in box and "x usual" in box
