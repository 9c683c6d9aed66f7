"""Payload shapes, size limits, status classification and configuration, with ``responses`` (no server)."""

from __future__ import annotations

import json
import sys
import time

import pytest
import requests
import responses

from guardtower.alerts import (
    DeliveryError,
    DiscordAlert,
    GroupPolicy,
    Notification,
    PagerDutyAlert,
    RetryPolicy,
    SlackAlert,
    TeamsAlert,
    WebhookAlert,
    verify_signature,
)
from guardtower.alerts import discord, slack
from guardtower.alerts.pagerduty import MAX_SUMMARY
from guardtower.errors import ConfigError, MissingDependencyError
from guardtower.events import HaltEvent, PreflightEvent, RollbackEvent, SkipEvent, SpikeEvent, SummaryEvent

URL = "https://hooks.example.test/services/T000SECRET/B000SECRET/xyzsecrettoken"
KEY = "R0UTINGKEYsecret0123456789abcdef"
FAST = RetryPolicy(max_attempts=4, initial_backoff=0.001, max_backoff=0.002, deadline=5)


def spike(step: int = 7, layer: str = "transformer.h.3.mlp", **kw: object) -> SpikeEvent:
    fields: dict = dict(run="r1", step=step, layer=layer, reason="spike", norm=812.5, baseline=3.1, ratio=262.1,
                        threshold=10.0, action="skip", severity="WARN")
    fields.update(kw)
    return SpikeEvent(**fields)


def huge_spike() -> SpikeEvent:
    """Every text field far beyond any service's limit."""
    layer = "model.layers." + "x" * 20_000
    return spike(layer=layer, module=layer, top_layers=tuple((f"{layer}.{i}", 1.0, 2.0) for i in range(500)),
                 nonfinite_layers=tuple(f"{layer}.{i}" for i in range(500)), report_path="/tmp/" + "y" * 10_000)


def sink_kwargs(tmp_path, **kw: object) -> dict:
    return {"spool_path": tmp_path / "spool.jsonl", "retry": FAST, "rate_limit": 0, **kw}


def posted(call_index: int = -1) -> dict:
    return json.loads(responses.calls[call_index].request.body)


# -- payload shapes ------------------------------------------------------------------------------------------


@responses.activate
def test_slack_block_kit_with_fallback_and_run_link(tmp_path) -> None:
    responses.post(URL, body="ok")
    sink = SlackAlert(URL, run_url=lambda run: f"https://wandb.ai/team/proj/runs/{run}", **sink_kwargs(tmp_path))
    event = spike()
    sink.send_now(event)
    body = posted()
    assert "Gradient spike in transformer.h.3.mlp (262.1x baseline) at step 7" in body["text"]
    assert body["blocks"][0]["type"] == "header"
    buttons = [b for b in body["blocks"] if b["type"] == "actions"]
    assert buttons[0]["elements"][0]["url"] == "https://wandb.ai/team/proj/runs/r1"
    assert event.event_id in json.dumps(body["blocks"][-1])  # the context block carries the event id
    assert responses.calls[0].request.headers["Content-Type"] == "application/json"


@responses.activate
def test_slack_respects_block_kit_limits_for_huge_events(tmp_path) -> None:
    responses.post(URL, body="ok")
    SlackAlert(URL, **sink_kwargs(tmp_path)).send_now(huge_spike())
    body = posted()
    blocks = body["blocks"]
    assert len(blocks) <= slack.MAX_BLOCKS
    assert len(blocks[0]["text"]["text"]) <= slack.MAX_HEADER_TEXT
    for block in blocks:
        if block["type"] == "section" and "text" in block:
            assert len(block["text"]["text"]) <= slack.MAX_SECTION_TEXT
        for field in block.get("fields", []):
            assert len(field["text"]) <= slack.MAX_FIELD_TEXT
        assert len(block.get("fields", [])) <= slack.MAX_FIELDS
    assert len(body["text"]) <= 3000


def test_slack_escapes_markup_in_names(tmp_path) -> None:
    sink = SlackAlert(URL, **sink_kwargs(tmp_path))
    body = sink.render(Notification.single(spike(layer="<!channel> & co")))
    mrkdwn = json.dumps([body["text"], body["blocks"][1:]])  # the header is plain_text, never parsed
    assert "<!channel>" not in mrkdwn
    assert "&lt;!channel&gt; &amp; co" in mrkdwn


@responses.activate
def test_discord_content_and_embed_within_limits(tmp_path) -> None:
    responses.post(URL, status=204)
    DiscordAlert(URL, **sink_kwargs(tmp_path)).send_now(huge_spike())
    body = posted()
    assert len(body["content"]) <= discord.MAX_CONTENT
    assert 1 <= len(body["embeds"]) <= discord.MAX_EMBEDS
    embed = body["embeds"][0]
    assert len(embed["title"]) <= discord.MAX_TITLE
    assert len(embed["description"]) <= discord.MAX_DESCRIPTION
    assert discord.embed_size(embed) <= discord.MAX_EMBED_TOTAL
    assert all(len(f["name"]) <= 256 and len(f["value"]) <= 1024 for f in embed["fields"])
    assert body["allowed_mentions"] == {"parse": []}


@responses.activate
def test_teams_adaptive_card_envelope(tmp_path) -> None:
    responses.post(URL, status=202)
    TeamsAlert(URL, run_url="https://mlflow.example/#/runs/abc", **sink_kwargs(tmp_path)).send_now(spike())
    body = posted()
    assert body["type"] == "message"
    (attachment,) = body["attachments"]
    assert attachment["contentType"] == "application/vnd.microsoft.card.adaptive"
    card = attachment["content"]
    assert card["type"] == "AdaptiveCard" and card["version"] == "1.4"
    assert card["body"][0]["text"].startswith("Gradient spike in transformer.h.3.mlp")
    assert card["actions"] == [{"type": "Action.OpenUrl", "title": "Open run", "url": "https://mlflow.example/#/runs/abc"}]


@responses.activate
def test_pagerduty_trigger_payload(tmp_path) -> None:
    responses.post("https://events.pagerduty.com/v2/enqueue", status=202, json={"status": "success"})
    sink = PagerDutyAlert(KEY, source="trainer-7", **sink_kwargs(tmp_path))
    event = HaltEvent(run="r1", step=9, layer="lm_head", reason="nonfinite", severity="ERROR")
    sink.send_now(event)
    body = posted()
    assert body["routing_key"] == KEY and body["event_action"] == "trigger"
    assert body["dedup_key"] == event.fingerprint
    payload = body["payload"]
    assert payload["severity"] == "critical" and payload["source"] == "trainer-7"
    assert payload["component"] == "lm_head" and payload["group"] == "r1" and payload["class"] == "halt"
    assert payload["custom_details"]["event_ids"] == [event.event_id]


def test_pagerduty_summary_length_severity_and_resolve(tmp_path) -> None:
    sink = PagerDutyAlert(KEY, **sink_kwargs(tmp_path))
    body = sink.render(Notification.single(huge_spike()))
    assert len(body["payload"]["summary"]) <= MAX_SUMMARY
    assert body["payload"]["severity"] == "warning"
    assert sink.render(Notification.single(spike(severity="ERROR")))["payload"]["severity"] == "error"
    assert sink.render(Notification.single(spike(severity="INFO")))["payload"]["severity"] == "info"
    resolved = Notification("resolved", "fp123", "spike", "r1", spike(), reason="quiet")
    assert sink.render(resolved) == {"routing_key": KEY, "dedup_key": "fp123", "event_action": "resolve"}


def test_webhook_carries_record_counts_and_all_event_ids(tmp_path) -> None:
    events = [spike(step=s) for s in range(3)]
    note = Notification("update", events[0].fingerprint, "spike", "r1", events[-1], tuple(events), 3, 10, 0, 2)
    body = WebhookAlert(URL, **sink_kwargs(tmp_path)).render(note)
    assert body["event"] == events[-1].to_record()
    assert body["event_ids"] == [e.event_id for e in events]
    assert (body["status"], body["count"], body["total"], body["first_step"], body["last_step"]) == (
        "update", 3, 10, 0, 2)


@responses.activate
def test_webhook_signature_verifies_and_rejects_tampering_and_old_timestamps(tmp_path) -> None:
    responses.post(URL)
    WebhookAlert(URL, secret="hmac-s3cret-value", **sink_kwargs(tmp_path)).send_now(spike())
    request = responses.calls[0].request
    body, headers = request.body, dict(request.headers)
    assert headers["X-Guardtower-Signature"].startswith("sha256=")
    assert verify_signature(body, headers, "hmac-s3cret-value")
    assert verify_signature(body, {k.lower(): v for k, v in headers.items()}, "hmac-s3cret-value")
    assert not verify_signature(body + b" ", headers, "hmac-s3cret-value")
    assert not verify_signature(body, headers, "other-secret")
    assert not verify_signature(body, headers, "hmac-s3cret-value", now=time.time() + 301)
    assert not verify_signature(body, {}, "hmac-s3cret-value")


# -- status classification and headers ------------------------------------------------------------------------


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503])
@responses.activate
def test_transient_statuses_are_retried(tmp_path, status: int) -> None:
    responses.post(URL, status=status)
    responses.post(URL, status=200)
    SlackAlert(URL, **sink_kwargs(tmp_path)).send_now(spike())
    assert len(responses.calls) == 2


@pytest.mark.parametrize("status", [301, 400, 401, 403, 404, 410, 413])
@responses.activate
def test_other_statuses_are_permanent(tmp_path, status: int) -> None:
    responses.post(URL, status=status, body="channel_is_archived")
    with pytest.raises(DeliveryError) as info:
        SlackAlert(URL, **sink_kwargs(tmp_path)).send_now(spike())
    assert len(responses.calls) == 1
    assert info.value.permanent and f"HTTP {status}" in info.value.reason


@responses.activate
def test_gives_up_after_max_attempts(tmp_path) -> None:
    responses.post(URL, status=503)
    with pytest.raises(DeliveryError) as info:
        SlackAlert(URL, **sink_kwargs(tmp_path)).send_now(spike())
    assert len(responses.calls) == FAST.max_attempts == info.value.attempts
    assert not info.value.permanent


@responses.activate
def test_retry_after_is_honoured_and_capped(tmp_path) -> None:
    import email.utils

    url = URL + "/retry-after"  # its own destination: the 429 pauses every sink posting there
    responses.post(url, status=503, headers={"Retry-After": "2"})
    responses.post(url, status=429, headers={"Retry-After": email.utils.formatdate(time.time() + 3600, usegmt=True)})
    responses.post(url, status=200)
    sleeps: list[float] = []
    retry = RetryPolicy(max_attempts=5, max_retry_after=7.0, deadline=100)
    sink = SlackAlert(url, **sink_kwargs(tmp_path, retry=retry, sleep=sleeps.append))
    with pytest.MonkeyPatch.context() as mp:  # the real 429 pause is asserted in the real-server test
        mp.setattr(sink.throttle, "reserve", lambda: 0.0)
        sink.send_now(spike())
    assert sleeps == [2.0, 7.0]
    assert 6.9 < sink.throttle.paused_for() <= 7.0


@responses.activate
def test_deadline_stops_retrying_before_a_long_wait(tmp_path) -> None:
    responses.post(URL, status=503, headers={"Retry-After": "30"})
    sleeps: list[float] = []
    sink = SlackAlert(URL, **sink_kwargs(tmp_path, retry=RetryPolicy(deadline=10), sleep=sleeps.append))
    with pytest.raises(DeliveryError):
        sink.send_now(spike())
    assert sleeps == [] and len(responses.calls) == 1


@responses.activate
def test_connection_errors_are_retried_and_redacted(tmp_path) -> None:
    leak = requests.ConnectionError(f"HTTPSConnectionPool(host='hooks.example.test'): Max retries exceeded with "
                                    f"url: /services/T000SECRET/B000SECRET/xyzsecrettoken ({URL})")
    responses.post(URL, body=leak)
    with pytest.raises(DeliveryError) as info:
        SlackAlert(URL, **sink_kwargs(tmp_path)).send_now(spike())
    assert len(responses.calls) == FAST.max_attempts
    text = str(info.value) + repr(info.value) + info.value.reason
    assert "connection error" in text
    assert "secret" not in text.lower() and "T000" not in text
    assert info.value.__cause__ is None and info.value.__suppress_context__


# -- configuration --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "argument", "env"), [
    (SlackAlert, "url", "SLACK_WEBHOOK_URL"),
    (WebhookAlert, "url", "GUARDTOWER_WEBHOOK_URL"),
    (DiscordAlert, "url", "DISCORD_WEBHOOK_URL"),
    (TeamsAlert, "url", "TEAMS_WEBHOOK_URL"),
    (PagerDutyAlert, "routing_key", "PAGERDUTY_ROUTING_KEY"),
])
def test_missing_destination_names_argument_and_env_var(monkeypatch, tmp_path, cls, argument, env) -> None:
    monkeypatch.delenv(env, raising=False)
    with pytest.raises(ConfigError) as info:
        cls(spool_path=tmp_path / "s.jsonl")
    assert info.value.argument == argument and env in str(info.value)
    assert not (tmp_path / "s.jsonl").exists()


def test_destination_from_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SLACK_WEBHOOK_URL", URL)
    monkeypatch.setenv("PAGERDUTY_ROUTING_KEY", KEY)
    assert SlackAlert(spool_path=tmp_path / "s.jsonl")._destination.reveal() == URL
    assert PagerDutyAlert(spool_path=tmp_path / "p.jsonl")._routing_key.reveal() == KEY  # type: ignore[union-attr]


@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"url": "ftp://example.test/x"}, "url"),
    ({"url": URL, "kinds": ["spike", "nope"]}, "kinds"),
    ({"url": URL, "min_severity": "LOUD"}, "min_severity"),
    ({"url": URL, "rate_limit": -1}, "rate_limit"),
    ({"url": URL, "grouping": 5}, "grouping"),
    ({"url": URL, "spool_path": "{tmp}/a-file/x.jsonl"}, "spool_path"),
    ({"url": URL, "spool_path": "{tmp}"}, "spool_path"),
])
def test_bad_arguments_raise_config_error(tmp_path, kwargs, argument) -> None:
    (tmp_path / "a-file").write_text("")
    if "spool_path" in kwargs:
        kwargs = {**kwargs, "spool_path": kwargs["spool_path"].format(tmp=tmp_path)}
    with pytest.raises(ConfigError) as info:
        SlackAlert(**kwargs)
    assert info.value.argument == argument
    assert "secret" not in str(info.value).lower()


def test_missing_requests_names_the_extra(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "requests", None)
    with pytest.raises(MissingDependencyError) as info:
        SlackAlert(URL, spool_path=tmp_path / "s.jsonl")
    assert 'pip install "guardtower[alerts]"' in str(info.value)


def test_default_filter_alerts_failed_preflights_spikes_rollbacks_halts(tmp_path) -> None:
    sink = SlackAlert(URL, **sink_kwargs(tmp_path))
    assert sink.accepts(PreflightEvent(status="FAIL", severity="ERROR"))
    assert not sink.accepts(PreflightEvent(status="WARN", severity="WARN"))
    assert not sink.accepts(PreflightEvent(status="PASS"))
    assert sink.accepts(spike(severity="INFO")) and sink.accepts(RollbackEvent()) and sink.accepts(HaltEvent())
    assert not sink.accepts(SkipEvent()) and not sink.accepts(SummaryEvent())
    strict = SlackAlert(URL, **sink_kwargs(tmp_path, kinds=["spike", "preflight"], min_severity="WARN"))
    assert strict.accepts(PreflightEvent(status="WARN", severity="WARN"))
    assert not strict.accepts(spike(severity="INFO")) and not strict.accepts(HaltEvent(severity="ERROR"))


def test_secret_never_in_repr(tmp_path) -> None:
    sink = WebhookAlert(URL, secret="hmac-s3cret-value", **sink_kwargs(tmp_path, grouping=GroupPolicy()))
    text = repr(sink) + str(sink) + repr(sink._destination) + f"{sink._destination}" + repr(vars(sink))
    assert "secret" not in text.lower().replace("_secret", "") and "T000" not in text


def test_example_explains_without_url_and_previews_without_network(monkeypatch, capsys) -> None:
    import runpy
    from pathlib import Path

    example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "alerts_slack.py"), run_name="example")
    monkeypatch.delenv("SLACK_WEBHOOK_URL", raising=False)
    assert example["main"]([]) == 0
    assert "SLACK_WEBHOOK_URL is not set" in capsys.readouterr().out
    assert example["main"](["--preview"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert "1,000 occurrences, steps 1,200-2,199" in payload["blocks"][1]["text"]["text"]


def test_redaction_survives_a_dead_twin_secret() -> None:
    import gc

    from guardtower.alerts._secret import Secret, redact

    first = Secret(URL)
    second = Secret(URL)
    del first
    gc.collect()
    assert "T000SECRET" not in redact(f"error at {URL} and /services/T000SECRET/B000SECRET/xyzsecrettoken")
    assert repr(second) == str(second) == f"{second}" == "<redacted>"
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(second)


def test_default_spool_path_is_created_only_when_needed(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GUARDTOWER_SPOOL_DIR", raising=False)
    sink = SlackAlert(URL, rate_limit=0, name="alerts")
    assert sink.spool_path == tmp_path / "sg_logs" / "spool" / "slack-alerts.jsonl"
    assert not (tmp_path / "sg_logs").exists()
    monkeypatch.setenv("GUARDTOWER_SPOOL_DIR", str(tmp_path / "elsewhere"))
    pd = PagerDutyAlert(KEY)
    assert pd.spool_path == tmp_path / "elsewhere" / "pagerduty.jsonl"
    pd.spool.append(spike(), "test", pd.sink_id)
    assert pd.spool_path.is_file()
