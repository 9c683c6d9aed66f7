"""Launch a worker script as two real torch.distributed (gloo) ranks on 127.0.0.1 and read back what each rank
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


def run_two_ranks(worker: Path, out: Path, *, timeout: float = 240) -> list[dict[str, Any]]:
    """Run ``worker OUT`` as ranks 0 and 1, each killed after ``timeout`` seconds; assert both exited 0."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(WORLD_SIZE)}
    env["PYTHONPATH"] = os.pathsep.join([str(worker.parents[1]), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(out)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD_SIZE)
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
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{logs[rank][-4000:] if rank < len(logs) else ''}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
