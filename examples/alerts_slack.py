"""Send guardtower alerts to Slack.

    export SLACK_WEBHOOK_URL=https://hooks.slack.com/services/...   # Slack: Apps > Incoming Webhooks
    python examples/alerts_slack.py            # posts a failed pre-flight and a grouped NaN storm
    python examples/alerts_slack.py --preview  # prints the Block Kit payload, sends nothing

Without SLACK_WEBHOOK_URL (and without --preview) it only explains what to do and exits 0. Runs on CPU.
In a real run, pass the sink to the producers instead of publishing by hand:

    from guardtower.alerts import SlackAlert
    slack = SlackAlert(run_url=lambda run: wandb.run.url)       # URL from SLACK_WEBHOOK_URL
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters()), model, sinks=[slack])
"""

from __future__ import annotations

import json
import os
import sys

from guardtower.alerts import GroupPolicy, Notification, SlackAlert
from guardtower.bus import EventBus
from guardtower.events import PreflightEvent, SpikeEvent

RUN = "example-run"


def events() -> list:
    failed = PreflightEvent(run=RUN, status="FAIL", errors=1, error_ids=("LORA-001",), severity="ERROR")
    storm = [SpikeEvent(run=RUN, step=1200 + i, layer="transformer.h.3.mlp", reason="nonfinite", severity="ERROR")
             for i in range(1000)]
    return [failed, *storm]


def main(argv: list[str]) -> int:
    if "--preview" in argv:
        sink = SlackAlert("https://hooks.slack.com/services/T000/B000/PREVIEW")  # never sends, never spools
        storm = events()[1:]
        note = Notification("firing", storm[0].fingerprint, "spike", RUN, storm[-1], tuple(storm), len(storm),
                            len(storm), storm[0].step, storm[-1].step)
        print(json.dumps(sink.render(note), indent=2))
        return 0
    if not os.environ.get("SLACK_WEBHOOK_URL"):
        print(__doc__)
        print("SLACK_WEBHOOK_URL is not set: nothing sent.")
        return 0
    # one message per incident: the failed pre-flight, and the 1,000 NaN steps as a single grouped message
    slack = SlackAlert(grouping=GroupPolicy(group_wait=2.0), run_url=os.environ.get("RUN_URL"))
    bus = EventBus([slack])
    for event in events():
        bus.publish(event)
    bus.close(timeout=30)
    print(f"sent {slack.stats().get('messages', 0)} message(s); undelivered events, if any, are in {slack.spool_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
