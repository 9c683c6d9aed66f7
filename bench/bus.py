"""Bus benchmark: publish latency on the training thread and sustained JSONL throughput.

    python bench/bus.py [--events 200000] [--json out.json]

1. publish() latency p50/p99/max on the calling thread with 4 sinks attached (JSONL, console to /dev/null,
   in-memory, and one that blocks forever), over ``--events`` publishes in bursts of 100 with a short pause
   between bursts (a training loop publishes a few events per step, not a firehose).
2. Events/s accepted by publish() and events/s written by a JSONL sink, sustained.
3. Peak memory: the queues are bounded, so RSS growth stays bounded whatever the blocked sink does.
4. close(2) time with the blocked sink, and events unaccounted for after it (must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guardtower.bus import BaseSink, EventBus  # noqa: E402
from guardtower.events import Event, SpikeEvent, SummaryEvent  # noqa: E402
from guardtower.sinks import ConsoleSink, JsonlSink  # noqa: E402
from guardtower.testing import InMemorySink  # noqa: E402


class BlockedSink(BaseSink):
    name = "blocked"

    def __init__(self) -> None:
        self.release = threading.Event()

    def handle(self, event: Event) -> None:
        self.release.wait()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def publish_latency(n: int, tmp: Path) -> dict[str, float]:
    blocked = BlockedSink()
    bus = EventBus([JsonlSink(tmp / "lat.jsonl"), ConsoleSink(open(os.devnull, "w")), InMemorySink(), blocked])
    events = [SummaryEvent(step=i, grad_norm=1.0) for i in range(n)]
    samples: list[float] = []
    rss_before = _rss_mib()
    clock = time.perf_counter_ns
    for start in range(0, n, 100):
        for event in events[start:start + 100]:
            t0 = clock()
            bus.publish(event)
            samples.append((clock() - t0) / 1000)
        time.sleep(0.0005)
    rss_after = _rss_mib()
    samples.sort()
    started = time.perf_counter()
    bus.close(timeout=2)  # the blocked sink never finishes: close is bounded by its timeout anyway
    close_s = time.perf_counter() - started
    stats = bus.stats()["sinks"]
    blocked.release.set()
    return {
        "p50_us": statistics.median(samples),
        "p99_us": samples[int(0.99 * len(samples))],
        "max_us": samples[-1],
        "blocked_sink_dropped": stats["blocked"]["dropped"],
        "close_s": close_s,
        "lost": sum(s["pending"] for s in stats.values()),  # unaccounted for after close: must be 0
        "rss_growth_mib": rss_after - rss_before,
    }


def throughput(n: int, tmp: Path) -> dict[str, float]:
    path = tmp / "throughput.jsonl"
    sink = JsonlSink(path)
    sink.queue_size = n  # measure the writer, not overflow
    bus = EventBus([sink])
    events = [SpikeEvent(step=i, layer="transformer.h.0.mlp.c_fc.weight", ratio=12.5) for i in range(n)]
    t0 = time.perf_counter()
    for event in events:
        bus.publish(event)
    accepted_s = time.perf_counter() - t0
    assert bus.flush(timeout=120)
    written_s = time.perf_counter() - t0
    bus.close(timeout=10)
    lines = sum(1 for _ in open(path))
    return {"accepted_per_s": n / accepted_s, "written_per_s": n / written_s, "lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        latency = publish_latency(args.events, tmp)
        rate = throughput(args.events, tmp)
    print(f"publish latency, 4 sinks (one blocked): p50 {latency['p50_us']:.2f} us  p99 {latency['p99_us']:.2f} us"
          f"  max {latency['max_us']:.0f} us  (target p99 <= 50 us)")
    print(f"blocked sink: {latency['blocked_sink_dropped']:.0f} events counted as dropped with a reason (queue "
          f"bound 10,000); close(2) took {latency['close_s']:.2f} s; {latency['lost']:.0f} events unaccounted for; "
          f"RSS growth during the run {latency['rss_growth_mib']:.1f} MiB")
    print(f"JSONL sink: {rate['accepted_per_s']:,.0f} events/s accepted by publish, "
          f"{rate['written_per_s']:,.0f} events/s written end to end ({rate['lines']:.0f} lines; target >= 100,000/s accepted)")
    if args.json:
        Path(args.json).write_text(json.dumps({"latency": latency, "throughput": rate}, indent=2))


if __name__ == "__main__":
    main()
