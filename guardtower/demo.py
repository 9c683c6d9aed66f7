"""``guardtower demo``: the end-to-end tour on embedded defaults (replaced by the full demo in issue 7)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="guardtower demo")
    parser.add_argument("--out", default="./guardtower-demo")
    args = parser.parse_args(list(argv or []))
    from guardtower.bus import EventBus
    from guardtower.events import SpikeEvent
    from guardtower.severity import Severity
    from guardtower.sinks import ConsoleSink, JsonlSink

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bus = EventBus([ConsoleSink(), JsonlSink(out / "events.jsonl")])
    bus.publish(SpikeEvent(step=1, layer="demo.layer", ratio=42.0, severity=Severity.WARN, threshold=10.0))
    bus.close(5)
    print(f"events written to {out / 'events.jsonl'}; view them with: guardtower events {out / 'events.jsonl'}")
    return 0
