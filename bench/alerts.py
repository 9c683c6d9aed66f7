"""Alert sink reliability benchmark: 2,000 mixed events against a receiver failing 30% of requests.

    python bench/alerts.py [--events 2000] [--failure-rate 0.3] [--repeats 1]

Reports, per run: events delivered (acknowledged by the receiver), spooled (dead-lettered), lost,
acknowledged twice or both acknowledged and spooled (only after a client timeout on a reply sent in time:
delivery is at-least-once), close time, and what ``publish()`` costs the training thread (CPU time, wall clock), next to the
same publish loop with an in-memory sink measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _alerts_helpers import mixed_events, reliability_run  # noqa: E402

from guardtower.bus import EventBus  # noqa: E402
from guardtower.testing import InMemorySink  # noqa: E402


def baseline(n_events: int, pace_s: float) -> dict[str, float]:
    """The same paced publish loop into an in-memory sink: publish's cost without any network sink."""
    bus = EventBus([InMemorySink()])
    latencies = []
    for event in mixed_events(n_events):
        t0 = time.perf_counter()
        bus.publish(event)
        latencies.append(time.perf_counter() - t0)
        time.sleep(pace_s)
    bus.close(10)
    latencies.sort()
    return {"median_publish_us": latencies[len(latencies) // 2] * 1e6, "max_publish_ms": latencies[-1] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--failure-rate", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    runs = []
    for seed in range(args.repeats):
        with tempfile.TemporaryDirectory() as spool_dir:
            result = reliability_run(spool_dir, n_events=args.events, failure_rate=args.failure_rate, seed=seed)
        result["baseline"] = baseline(args.events, 0.0005)
        runs.append(result)
        print(json.dumps(result, indent=1, default=str), file=sys.stderr)
    keys = ["delivered", "spooled", "lost", "duplicates", "both", "timeouts_on_acknowledged", "requests",
            "max_publish_cpu_ms", "median_publish_us", "p99_publish_ms", "max_publish_ms", "publishes_over_1ms",
            "close_s", "elapsed_s"]
    print(f"alerts reliability: {args.events} events, {args.failure_rate:.0%} of requests fail "
          f"(500 / 429 / timeout), median of {args.repeats} run(s)")
    for key in keys:
        print(f"  {key:22s} {statistics.median(float(r[key]) for r in runs):12.3f}")
    base = statistics.median(r["baseline"]["median_publish_us"] for r in runs)
    alert = statistics.median(r["median_publish_us"] for r in runs)
    print(f"  publish median with an in-memory sink: {base:.1f} us; with the webhook sink: {alert:.1f} us "
          f"(ratio {alert / base:.2f})")


if __name__ == "__main__":
    main()
