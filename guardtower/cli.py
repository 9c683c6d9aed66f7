"""The ``guardtower`` command.

Small commands live here; the larger ones (``demo``, ``report``, ``replay``) are modules with their own
``main(argv)`` so they load their heavy imports only when used.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Sequence

from guardtower import __version__

__all__ = ["main"]

#: subcommand -> (module with main(argv), one-line help)
_DELEGATED: dict[str, tuple[str, str]] = {
    "demo": ("guardtower.demo", "run the end-to-end demo on embedded defaults (no server, no account)"),
    "report": ("guardtower.incidents", "list the incidents in a log_dir or JSONL event file; --plot draws them"),
    "replay": ("guardtower.replay", "re-send events from a dead-letter spool"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in _DELEGATED:
        module = importlib.import_module(_DELEGATED[args_list[0]][0])
        return int(module.main(args_list[1:]) or 0)

    parser = argparse.ArgumentParser(prog="guardtower", description="Keep PyTorch training honest.")
    parser.add_argument("--version", action="version", version=f"guardtower {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    cat = sub.add_parser("catalog", help="print the catalog of silent training bugs (markdown)")
    cat.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    ev = sub.add_parser("events", help="pretty-print a JSONL event file")
    ev.add_argument("path")
    ev.add_argument("--kind", action="append", help="only these kinds (repeatable)")
    ev.add_argument("--min-severity", default="INFO", help="INFO, WARN or FAIL")
    for name, (_, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)

    args = parser.parse_args(args_list)
    if args.command == "catalog":
        return _catalog(as_json=args.json)
    if args.command == "events":
        return _events(args.path, kinds=args.kind, min_severity=args.min_severity)
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


def _events(path: str, *, kinds: list[str] | None, min_severity: str) -> int:
    from pathlib import Path

    from guardtower.severity import Severity
    from guardtower.sinks import read_events, render_event

    if not Path(path).is_file():
        print(f"guardtower events: no such file: {path}", file=sys.stderr)
        return 2
    try:
        threshold = Severity.parse(min_severity)
    except KeyError:
        print(f"guardtower events: --min-severity must be INFO, WARN or FAIL, not {min_severity!r}", file=sys.stderr)
        return 2
    for event in read_events(path):
        if kinds and event.kind not in kinds:
            continue
        if event.severity >= threshold:
            print(render_event(event))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
