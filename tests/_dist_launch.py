"""Launch a worker script as real torch.distributed (gloo) ranks (two, or ``launch``: any number) on 127.0.0.1 and read back what each rank
wrote to ``<out>/rank<r>.json``. Shared by the distributed audit tests and the corpus's distributed cases."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(argv: list[str], world: int, *, timeout: float = 240, env: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """Run ``python *argv`` as ranks 0..world-1 (env:// rendezvous on 127.0.0.1), each killed after ``timeout``
    seconds; return (exit status, output) per rank."""
    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(world)}
    base["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), base.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(proc.returncode, log) for proc, log in zip(procs, logs)]


def run_two_ranks(worker: Path, out: Path, *, timeout: float = 240) -> list[dict[str, Any]]:
    """Run ``worker OUT`` as ranks 0 and 1, each killed after ``timeout`` seconds; assert both exited 0."""
    results = launch([str(worker), str(out)], WORLD_SIZE, timeout=timeout)
    for rank, (code, log) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
