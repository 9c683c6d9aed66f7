"""Launch a worker script as real torch.distributed (gloo) ranks on 127.0.0.1 and read back what each rank wrote:
``launch`` starts the ranks itself (env:// rendezvous, RANK/WORLD_SIZE set by hand), ``torchrun`` through
``python -m torch.distributed.run`` as a user would; ``end_rank`` is how every worker ends. Shared by the
distributed tests and the corpus's cases."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

WORLD_SIZE = 2
#: the rendezvous variables a launcher sets; inherited ones (a test run under torchrun) would be wrong here
_RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def end_rank() -> NoReturn:
    """End a worker's rank once its results are on disk: wait for every rank (none tears gloo down while a peer
    still talks to it), destroy the process group once nothing holds it (a DDP reducer in a reference cycle
    does, until collected), and exit without interpreter finalisation. Finalisation destroys torch's gloo and
    TCPStore threads in no set order, and under load that can abort the process ("terminate called without an
    active exception", seen once in CI) after the rank has done all its work: the test judges the work."""
    import torch.distributed as dist

    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(env: dict[str, str] | None) -> dict[str, str]:
    """This environment without rendezvous variables, plus ``env``, with this checkout first on PYTHONPATH."""
    base = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS} | (env or {})
    base["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), base.get("PYTHONPATH", "")])
    return base


def launch(argv: list[str], world: int, *, timeout: float = 240, env: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """Run ``python *argv`` as ranks 0..world-1 (env:// rendezvous on 127.0.0.1), each killed after ``timeout``
    seconds; return (exit status, output) per rank."""
    base = _env(env) | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world)}
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


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc): torchrun starts each rank in a session of its own, so killing
    torchrun's process group alone would leave the ranks running."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # the process ended meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _kill_job(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL torchrun's process group and every rank below it at once, as a preemption does."""
    ranks = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def torchrun(argv: list[str], world: int, *, timeout: float = 240, env: dict[str, str] | None = None,
             kill_when: Path | None = None) -> list[tuple[int, str]]:
    """Run ``torchrun --nproc_per_node world ... *argv`` (one node, static rendezvous on 127.0.0.1, no restarts);
    return (torchrun's exit status, the rank's output) per rank: the job's status, 0 only if every rank exited 0.
    The whole job is killed with SIGKILL (status -9) once the file ``kill_when`` exists, or after ``timeout``
    seconds (then the status is -9 too, and torchrun's own output follows each rank's)."""
    with tempfile.TemporaryDirectory(prefix="torchrun-") as folder:
        logs = Path(folder)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--nnodes", "1",
                   "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "--max-restarts", "0",
                   "--log-dir", str(logs), "--redirects", "3", *argv]
        with open(logs / "torchrun.log", "wb") as agent_log:
            proc = subprocess.Popen(command, env=_env(env), stdout=agent_log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            deadline = time.monotonic() + timeout
            try:
                while (proc.poll() is None and time.monotonic() < deadline
                       and not (kill_when is not None and kill_when.exists())):
                    time.sleep(0.05)
            finally:
                if proc.poll() is None:
                    _kill_job(proc)
        agent = (logs / "torchrun.log").read_text(errors="replace")
        results = []
        for rank in range(world):
            outputs = sorted(logs.glob(f"*/attempt_0/{rank}/std*.log"), reverse=True)  # stdout.log, stderr.log
            log = "".join(p.read_text(errors="replace") for p in outputs)
            results.append((proc.returncode, log if proc.returncode == 0 else f"{log}\n[torchrun]\n{agent}"))
    return results


def run_two_ranks(worker: Path, out: Path, *, timeout: float = 240) -> list[dict[str, Any]]:
    """Run ``worker OUT`` as ranks 0 and 1, each killed after ``timeout`` seconds; assert both exited 0."""
    results = launch([str(worker), str(out)], WORLD_SIZE, timeout=timeout)
    for rank, (code, log) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
