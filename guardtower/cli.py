"""The ``guardtower`` command.

Small commands live here; the larger ones (``demo``, ``report``, ``replay``) are modules with their own
``main(argv)`` so they load their heavy imports only when used. A user error (a missing or unreadable file,
a bad option value) is one line on stderr and exit status 2, never a traceback; an unexpected error is one
line and status 1 (``GUARDTOWER_DEBUG=1`` shows its traceback); output cut short by a closed pipe
(``guardtower events ... | head``) ends quietly.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from guardtower import __version__
from guardtower._argparse import ArgumentParser
from guardtower.errors import ConfigError, GuardtowerError
from guardtower.severity import ACCEPTED_SEVERITIES

__all__ = ["main"]

#: subcommand -> (module with main(argv), one-line help)
_DELEGATED: dict[str, tuple[str, str]] = {
    "demo": ("guardtower.demo", "run the end-to-end demo on embedded defaults (no server, no account)"),
    "report": ("guardtower.incidents", "list the incidents in a log_dir or JSONL event file; --plot draws them"),
    "replay": ("guardtower.replay", "re-send events from a dead-letter spool"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = args_list[0] if args_list else ""
    try:
        return _dispatch(args_list)
    except BrokenPipeError:
        # the reader (head, less) has gone: stop writing, and keep the interpreter's exit flush quiet too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except UnicodeDecodeError as exc:
        print(f"guardtower {command}: an input file is not UTF-8 text ({exc.reason} at byte {exc.start})",
              file=sys.stderr)
        return 2
    except (GuardtowerError, OSError) as exc:
        print(f"guardtower {command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug, not a user error: still one line, unless asked for the traceback
        if os.environ.get("GUARDTOWER_DEBUG"):
            raise
        print(f"guardtower {command}: internal error {type(exc).__name__}: {exc} "
              "(run with GUARDTOWER_DEBUG=1 for the traceback, and please report it)", file=sys.stderr)
        return 1


def _dispatch(args_list: list[str]) -> int:
    if args_list and args_list[0] in _DELEGATED:
        module = importlib.import_module(_DELEGATED[args_list[0]][0])
        return int(module.main(args_list[1:]) or 0)

    from guardtower.events import EVENT_TYPES

    parser = ArgumentParser(prog="guardtower", description="Keep PyTorch training honest.")
    parser.add_argument("--version", action="version", version=f"guardtower {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    cat = sub.add_parser("catalog", help="print the catalog of silent training bugs (markdown)")
    cat.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    ev = sub.add_parser("events", help="pretty-print the events of a log_dir or JSONL event file")
    ev.add_argument("path", help="a log_dir (every *.jsonl under it) or a JSONL event file")
    ev.add_argument("--kind", action="append", metavar="KIND",
                    help=f"only these kinds (repeatable): {', '.join(sorted(EVENT_TYPES))}")
    ev.add_argument("--min-severity", default="INFO", help=f"the lowest severity shown: {ACCEPTED_SEVERITIES}")
    ev.add_argument("--list", action="store_true", help="list the run folders under a log root, newest last")
    for name, (_, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)

    args = parser.parse_args(args_list)
    if args.command == "catalog":
        return _catalog(as_json=args.json)
    if args.command == "events":
        return _events(args.path, kinds=args.kind, min_severity=args.min_severity, listing=args.list)
    parser.print_help()
    return 0


def _catalog(*, as_json: bool) -> int:
    from guardtower.failure_modes import catalog, catalog_markdown

    if as_json:
        entries = [
            {**vars(m), "severity": m.severity.label, "tags": list(m.tags)}
            for m in catalog()
        ]
        print(json.dumps(entries, indent=2))
    else:
        print(catalog_markdown(), end="")
    return 0


def _events(path: str, *, kinds: list[str] | None, min_severity: str, listing: bool = False) -> int:
    """Exit status: 0 printed, 2 bad usage or unreadable input (also after printing, when lines were skipped)."""
    from guardtower._eventlog import describe_malformed, read_event_log
    from guardtower.events import EVENT_TYPES
    from guardtower.severity import Severity
    from guardtower.sinks import render_event

    unknown = sorted(set(kinds or ()) - set(EVENT_TYPES))
    if unknown:
        raise ConfigError("--kind", f"unknown kind {', '.join(map(repr, unknown))}",
                          f"use one of {', '.join(sorted(EVENT_TYPES))}")
    threshold = Severity.parse(min_severity, "--min-severity")
    root = Path(path)
    if not root.exists():
        raise ConfigError("path", f"no such file or directory: {path!r}", "pass a log_dir or an events.jsonl path")
    from guardtower._runs import pick_run

    root, note = pick_run(root, listing=listing)
    if listing:
        print(note)
        return 0
    if note:
        print(note, file=sys.stderr)
    log = read_event_log(root)
    if not log.files:
        problem = f" ({describe_malformed(log.malformed)})" if log.malformed else ""
        raise ConfigError("path", f"no guardtower event in {path!r}{problem}", "pass a log_dir or an events.jsonl path")
    for event in log.events:
        if kinds and event.kind not in kinds:
            continue
        if event.severity >= threshold:
            print(render_event(event))
    for file in log.torn:
        print(f"guardtower events: {file}: skipped a torn last line (a write cut short by a crash or a full disk)",
              file=sys.stderr)
    if log.malformed:
        print(f"guardtower events: {describe_malformed(log.malformed)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
