"""``guardtower replay SPOOL...``: re-send the events a sink could not deliver.

Each spool entry records its sink as ``"<kind>:<name>"`` (e.g. ``slack:alerts`` or
``mlflow:<run_id>|guardtower|http://host``). ``REPLAYERS`` maps a kind to a factory that gets the parsed
command line (with ``sink``, ``sink_kind`` and ``sink_name`` filled in) and returns ``deliver(event)``, which
raises when the event could not be sent. Entries are re-sent in order and each is acknowledged in the spool
as it succeeds, so running the command again never sends an event twice. An event the destination refuses
(``Refused``, a permanent ``DeliveryError``) is quarantined in ``<spool>.refused`` with its reason and the
rest flows; a sink stops at its first unreachable failure. A spool whose acknowledgements cannot be written
(a read-only folder) is not replayed: it would resend the same events on every run.
Destinations come from ``--url``/``--routing-key``/``--secret``/``--tracking-uri`` or the environment
variables the sinks read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from guardtower._argparse import ArgumentParser
from guardtower._delivery import is_refusal
from guardtower.alerts._secret import redact
from guardtower._progress import Progress
from guardtower.errors import GuardtowerError
from guardtower.events import Event
from guardtower.spool import Spool, SpoolEntry

__all__ = ["main", "REPLAYERS", "Replayer"]

#: spools at least this long show progress
_PROGRESS_FROM = 100

Replayer = Callable[[argparse.Namespace], Callable[[Event], None]]


def _mlflow(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.bridges.mlflow import replayer

    return replayer(args.sink_name, tracking_uri=args.tracking_uri, request_timeout=args.timeout)


def _webhook(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.alerts import WebhookAlert

    return WebhookAlert(args.url, secret=args.secret).send_now


def _slack(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.alerts import SlackAlert

    return SlackAlert(args.url).send_now


def _discord(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.alerts import DiscordAlert

    return DiscordAlert(args.url).send_now


def _teams(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.alerts import TeamsAlert

    return TeamsAlert(args.url).send_now


def _pagerduty(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.alerts.pagerduty import EVENTS_API_URL, PagerDutyAlert

    return PagerDutyAlert(args.routing_key, url=args.url or EVENTS_API_URL).send_now


#: sink kind (the part of a spool entry's ``sink`` before the first ``:``) -> deliver factory
REPLAYERS: dict[str, Replayer] = {
    "mlflow": _mlflow,
    "webhook": _webhook,
    "slack": _slack,
    "discord": _discord,
    "teams": _teams,
    "pagerduty": _pagerduty,
}


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="guardtower replay", description=__doc__.splitlines()[0])
    parser.add_argument("spools", nargs="+", metavar="SPOOL", help="spool file(s) (*.jsonl) written by a sink")
    parser.add_argument("--list", action="store_true", help="only list the pending entries, send nothing")
    parser.add_argument("--url", help="alert destination URL (default: the sink's environment variable, "
                                      "e.g. SLACK_WEBHOOK_URL)")
    parser.add_argument("--routing-key", help="PagerDuty routing key (default: PAGERDUTY_ROUTING_KEY)")
    parser.add_argument("--secret", help="webhook HMAC secret (default: GUARDTOWER_WEBHOOK_SECRET)")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI (default: the one recorded in the spool)")
    parser.add_argument("--timeout", type=int, default=10, help="seconds per MLflow request (default: 10)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 everything sent, 1 entries remain, 2 bad usage, no destination or damaged lines."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    missing = [p for p in args.spools if not Path(p).is_file()]
    if missing:
        print(f"guardtower replay: no such spool file: {', '.join(missing)}", file=sys.stderr)
        return 2
    remaining = 0
    status = 0
    for path in args.spools:
        spool = Spool(path)
        pending = list(spool.entries())
        if spool.skipped:
            print(f"{path}: skipped {spool.skipped} unreadable line(s) (damaged, or from another version)",
                  file=sys.stderr)
            status = 2  # a damaged spool is never silently "fine"
        if not pending:
            if not spool.skipped:
                print(f"{path}: nothing to replay")
            continue
        if args.list:
            for entry in pending:
                print(f"{entry.sink}\t{entry.event.kind}\tstep={entry.event.step}\t{entry.event.event_id}\t"
                      f"{redact(entry.reason)}")
            continue
        if not spool.ackable():
            print(f"guardtower replay: {path}: cannot write {spool.acked_path.name} (read-only?); not replaying, "
                  "or the same events would be sent again next time. Copy the spool to a writable folder.",
                  file=sys.stderr)
            remaining += len(pending)
            status = 2
            continue
        sent, refused, left, usage_error = _replay_file(spool, pending, args)
        remaining += left
        status = max(status, 2 if usage_error else 0)
        note = f", refused {refused} (quarantined in {spool.refused_path.name})" if refused else ""
        print(f"{path}: sent {sent}{note}, remaining {left}")
    return status or (1 if remaining else 0)


def _replay_file(spool: Spool, pending: list[SpoolEntry],
                 args: argparse.Namespace) -> tuple[int, int, int, bool]:
    """Replay one spool, sink by sink; returns (sent, refused, remaining, whether a destination was unusable)."""
    by_sink: dict[str, list[SpoolEntry]] = {}
    for entry in pending:
        by_sink.setdefault(entry.sink, []).append(entry)
    sent = 0
    refused = 0
    usage_error = False
    # a large spool takes a while: a progress line (tqdm when installed) with the count and the time left
    progress = Progress(len(pending), f"guardtower replay {spool.path.name}: sent", len(pending) >= _PROGRESS_FROM)
    for sink, entries in by_sink.items():
        kind, _, name = sink.partition(":")
        factory = REPLAYERS.get(kind)
        if factory is None:
            print(f"guardtower replay: no replayer for sink kind {kind!r} (known: {sorted(REPLAYERS)})",
                  file=sys.stderr)
            usage_error = True
            continue
        try:
            deliver = factory(argparse.Namespace(**vars(args), sink=sink, sink_kind=kind, sink_name=name))
        except GuardtowerError as exc:
            print(f"guardtower replay: cannot replay to {kind}: {exc}", file=sys.stderr)
            usage_error = True
            continue
        for entry in entries:
            try:
                deliver(entry.event)
            except Exception as exc:
                text = str(getattr(exc, "reason", "") or exc)  # the message may quote a destination URL
                reason = redact(text).splitlines()[0] if text else type(exc).__name__
                if is_refusal(exc):
                    spool.quarantine_many([entry.event], reason, entry.sink)
                    spool.ack(entry.event.event_id)
                    refused += 1
                    print(f"guardtower replay: {kind} refused {entry.event.kind} step {entry.event.step}: {reason}",
                          file=sys.stderr)
                    continue
                print(f"guardtower replay: {kind} failed at {entry.event.kind} step {entry.event.step}: {reason}",
                      file=sys.stderr)
                break
            spool.ack(entry.event.event_id)
            sent += 1
            progress.update()
    progress.close()
    return sent, refused, len(pending) - sent - refused, usage_error
