"""``guardtower replay SPOOL...``: re-send the events a sink could not deliver.

Each spool entry records its sink as ``"<kind>:<name>"`` (e.g. ``mlflow:<run_id>|guardtower|http://host``).
``REPLAYERS`` maps a kind to a factory that gets the parsed command line (with ``sink``, ``sink_kind`` and
``sink_name`` filled in, and unparsed options in ``extra_args``) and returns ``deliver(event)``, which
raises when the event could not be sent. Entries are re-sent in order, each acknowledged as it succeeds,
so running the command again never sends an event twice; a sink stops at its first failure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from guardtower.bridges._common import safe_error
from guardtower.events import Event
from guardtower.spool import Spool, SpoolEntry

__all__ = ["main", "REPLAYERS", "Replayer"]

Replayer = Callable[[argparse.Namespace], Callable[[Event], None]]


def _mlflow(args: argparse.Namespace) -> Callable[[Event], None]:
    from guardtower.bridges.mlflow import replayer

    return replayer(args.sink_name, tracking_uri=args.tracking_uri, request_timeout=args.timeout)


#: sink kind (the part of a spool entry's ``sink`` before the first ``:``) -> deliver factory
REPLAYERS: dict[str, Replayer] = {
    "mlflow": _mlflow,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="guardtower replay", description=__doc__.splitlines()[0])
    parser.add_argument("spools", nargs="+", metavar="SPOOL", help="spool file(s) (*.jsonl) written by a sink")
    parser.add_argument("--list", action="store_true", help="only list the pending entries")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI (default: the one recorded in the spool)")
    parser.add_argument("--timeout", type=int, default=10, help="seconds per request (default: 10)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 everything sent, 1 entries remain, 2 bad usage."""
    args, extra = _parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    args.extra_args = extra
    missing = [p for p in args.spools if not Path(p).is_file()]
    if missing:
        print(f"guardtower replay: no such spool file: {', '.join(missing)}", file=sys.stderr)
        return 2
    remaining = 0
    for path in args.spools:
        spool = Spool(path)
        pending = list(spool.entries())
        if args.list:
            for entry in pending:
                print(f"{entry.sink}\t{entry.event.kind}\tstep={entry.event.step}\t{entry.reason}")
            remaining += len(pending)
            continue
        sent, left = _replay_file(spool, pending, args)
        remaining += left
        print(f"{path}: sent {sent}, remaining {left}")
    return 1 if remaining else 0


def _replay_file(spool: Spool, pending: list[SpoolEntry], args: argparse.Namespace) -> tuple[int, int]:
    by_sink: dict[str, list[SpoolEntry]] = {}
    for entry in pending:
        by_sink.setdefault(entry.sink, []).append(entry)
    sent = 0
    for sink, entries in by_sink.items():
        kind, _, name = sink.partition(":")
        factory = REPLAYERS.get(kind)
        if factory is None:
            print(f"guardtower replay: no replayer for sink kind {kind!r} (known: {sorted(REPLAYERS)})",
                  file=sys.stderr)
            continue
        try:
            deliver = factory(argparse.Namespace(**vars(args), sink=sink, sink_kind=kind, sink_name=name))
        except Exception as exc:
            print(f"guardtower replay: cannot replay to {kind}: {safe_error(exc)}", file=sys.stderr)
            continue
        for entry in entries:
            try:
                deliver(entry.event)
            except Exception as exc:
                print(f"guardtower replay: {kind} failed at {entry.event.kind} step {entry.event.step}: "
                      f"{safe_error(exc)}", file=sys.stderr)
                break
            spool.ack(entry.event.event_id)
            sent += 1
    return sent, len(pending) - sent
