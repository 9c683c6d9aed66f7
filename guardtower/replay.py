"""``guardtower replay SPOOL_PATH``: re-send the events a sink dead-lettered.

Each spooled record names its sink as ``"<kind>:<name>"``; ``REPLAYERS[kind](args)`` builds the function
that delivers one event (raising on failure). Delivery stops at the first failure, and every success is
acknowledged in the spool as it happens, so an interrupted replay never re-sends an acknowledged event.
Destinations come from ``--url``/``--routing-key``/``--secret`` or the environment variables the sinks read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from guardtower.errors import GuardtowerError
from guardtower.events import Event
from guardtower.spool import Spool

__all__ = ["main", "REPLAYERS"]

Replayer = Callable[[argparse.Namespace], Callable[[Event], None]]


def _webhook(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.alerts import WebhookAlert

    return WebhookAlert(getattr(args, "url", None), secret=getattr(args, "secret", None)).send_now


def _slack(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.alerts import SlackAlert

    return SlackAlert(getattr(args, "url", None)).send_now


def _discord(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.alerts import DiscordAlert

    return DiscordAlert(getattr(args, "url", None)).send_now


def _teams(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.alerts import TeamsAlert

    return TeamsAlert(getattr(args, "url", None)).send_now


def _pagerduty(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.alerts.pagerduty import EVENTS_API_URL, PagerDutyAlert

    url = getattr(args, "url", None) or EVENTS_API_URL
    return PagerDutyAlert(getattr(args, "routing_key", None), url=url).send_now


#: sink kind -> factory of the function that re-sends one event
REPLAYERS: dict[str, Replayer] = {
    "webhook": _webhook,
    "slack": _slack,
    "discord": _discord,
    "teams": _teams,
    "pagerduty": _pagerduty,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="guardtower replay", description="Re-send events from a dead-letter spool.")
    parser.add_argument("spool", metavar="SPOOL_PATH", help="the sink's spool file (JSONL)")
    parser.add_argument("--url", help="destination URL (default: the sink's environment variable, "
                                      "e.g. SLACK_WEBHOOK_URL)")
    parser.add_argument("--routing-key", help="PagerDuty routing key (default: PAGERDUTY_ROUTING_KEY)")
    parser.add_argument("--secret", help="webhook HMAC secret (default: GUARDTOWER_WEBHOOK_SECRET)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be sent, send nothing")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    path = Path(args.spool)
    if not path.is_file():
        print(f"guardtower replay: no such spool file: {path}", file=sys.stderr)
        return 2
    spool = Spool(path)
    entries = list(spool.entries())
    if not entries:
        print("guardtower replay: nothing to replay")
        return 0
    kind_of = {entry.event.event_id: entry.sink.split(":", 1)[0] for entry in entries}
    unknown = sorted(set(kind_of.values()) - set(REPLAYERS))
    if unknown:
        print(f"guardtower replay: no replayer for sink kind(s) {unknown}; known: {sorted(REPLAYERS)}",
              file=sys.stderr)
        return 2
    if args.dry_run:
        for entry in entries:
            print(f"{entry.sink}\t{entry.event.kind}\t{entry.event.event_id}\t{entry.reason}")
        return 0
    try:
        senders = {kind: REPLAYERS[kind](args) for kind in sorted(set(kind_of.values()))}
    except GuardtowerError as exc:
        print(f"guardtower replay: {exc}", file=sys.stderr)
        return 2
    failure: list[str] = []

    def deliver(event: Event) -> None:
        try:
            senders[kind_of[event.event_id]](event)
        except Exception as exc:
            from guardtower.alerts._secret import redact  # the message may quote a destination URL

            failure.append(redact(str(exc)))
            raise

    sent, remaining = spool.replay(deliver)
    print(f"guardtower replay: sent {sent}, remaining {remaining}" + (f" (stopped: {failure[0]})" if failure else ""))
    return 0 if remaining == 0 else 1
