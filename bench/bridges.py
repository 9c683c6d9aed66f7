"""What a tracker bridge costs the training thread: ``bus.publish`` latency, side by side.

Configurations, measured in one run with the same event stream (one summary event per step, a spike + skip
every 25th step, ~0.5 ms of "training" between steps):

  baseline       EventBus with no sink
  wandb          WandBBridge on an offline W&B run
  mlflow-up      MLflowBridge to a healthy ``mlflow server`` on 127.0.0.1
  mlflow-down    MLflowBridge to a port nobody listens on (connection refused -> spool)
  mlflow-hung    MLflowBridge to a listener that never answers (request timeout -> spool)

For each: p50/p99/max of publish() in microseconds, median over ``--repeats``, the p99 added over
baseline, the time ``close(2)`` took, and events spooled, dropped/failed and lost (unaccounted for: 0). Run from the repository root:

    python bench/bridges.py --steps 400 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from guardtower.bus import EventBus  # noqa: E402
from guardtower.events import Event, SkipEvent, SpikeEvent, SummaryEvent  # noqa: E402
from guardtower.severity import Severity  # noqa: E402


def _events(step: int) -> list[Event]:
    events: list[Event] = [SummaryEvent(step=step, grad_norm=1.0 + step * 1e-3, total_spikes=step // 25)]
    if step % 25 == 0:
        events += [SpikeEvent(step=step, severity=Severity.WARN, layer="h.0.mlp.c_fc.weight", ratio=42.0,
                              norm=9.5, baseline=0.2, threshold=10.0, global_norm=11.0, loss=3.2),
                   SkipEvent(step=step, severity=Severity.WARN, layer="h.0.mlp.c_fc.weight", total_skips=step // 25)]
    return events


def _measure(make_sinks: Callable[[], list[Any]], steps: int) -> dict[str, float]:
    bus = EventBus(make_sinks())
    samples: list[float] = []
    for step in range(1, steps + 1):
        for event in _events(step):
            start = time.perf_counter_ns()
            bus.publish(event)
            samples.append((time.perf_counter_ns() - start) / 1000)
        deadline = time.perf_counter() + 0.0005  # the "training step"
        while time.perf_counter() < deadline:
            pass
    bus.flush(5)
    started = time.perf_counter()
    bus.close(2)
    close_s = time.perf_counter() - started
    sinks = bus.stats()["sinks"].values()
    samples.sort()
    return {"p50": samples[len(samples) // 2], "p99": samples[int(len(samples) * 0.99)], "max": samples[-1],
            "n": len(samples), "close_s": close_s,
            "spooled": sum(s["spooled"] for s in sinks), "dropped": sum(s["dropped"] + s["failed"] for s in sinks),
            "lost": sum(s["pending"] for s in sinks)}  # unaccounted for after close: must be 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_BASE_URL="http://127.0.0.1:9")
    import mlflow
    import wandb
    from _mlflow_server import MlflowServer, free_port

    from guardtower.bridges import MLflowBridge, WandBBridge

    root = Path(tempfile.mkdtemp(prefix="guardtower-bench-"))
    server = MlflowServer(root / "server")
    (root / "server").mkdir()
    server.start()
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(1024)
    dead = f"http://127.0.0.1:{free_port()}"
    hung = f"http://127.0.0.1:{hole.getsockname()[1]}"
    client = mlflow.MlflowClient(tracking_uri=server.url)
    run_id = client.create_run("0").info.run_id
    wandb_run = wandb.init(mode="offline", dir=str(root), project="guardtower-bench")
    counter = iter(range(10**6))

    def mlflow_bridge(uri: str, **kw: Any) -> list[Any]:
        return [MLflowBridge(run_id, tracking_uri=uri, spool_path=root / f"spool{next(counter)}.jsonl", **kw)]

    configs: dict[str, Callable[[], list[Any]]] = {
        "baseline": lambda: [],
        "wandb": lambda: [WandBBridge(wandb_run, alerts=False)],
        "mlflow-up": lambda: mlflow_bridge(server.url),
        "mlflow-down": lambda: mlflow_bridge(dead, request_retries=0),
        "mlflow-hung": lambda: mlflow_bridge(hung, request_timeout=1, request_retries=0),
    }
    results: dict[str, dict[str, float]] = {}
    try:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for _ in range(args.repeats):
            for name, make in configs.items():  # interleaved, so load changes hit every config alike
                runs[name].append(_measure(make, args.steps))
        for name, measured in runs.items():
            results[name] = {k: statistics.median(m[k] for m in measured)
                             for k in ("p50", "p99", "max", "close_s", "spooled", "dropped", "lost")}
            results[name]["n"] = measured[0]["n"]
    finally:
        wandb_run.finish()
        server.stop()
        hole.close()

    base = results["baseline"]["p99"]
    print(f"publish() latency in µs, median of {args.repeats} repeats, {args.steps} steps "
          f"({results['baseline']['n']:.0f} events) each")
    print(f"{'config':<13}{'p50':>9}{'p99':>9}{'max':>10}{'p99 added':>11}{'close s':>9}{'spooled':>9}"
          f"{'dropped':>9}{'lost':>6}")
    for name, r in results.items():
        print(f"{name:<13}{r['p50']:>9.1f}{r['p99']:>9.1f}{r['max']:>10.1f}{r['p99'] - base:>11.1f}"
              f"{r['close_s']:>9.2f}{r['spooled']:>9.0f}{r['dropped']:>9.0f}{r['lost']:>6.0f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
