"""A real ``mlflow server`` on 127.0.0.1 for the bridge tests: start, stop, restart on the same port."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MlflowServer:
    """``mlflow server`` with a sqlite backend and proxied artifacts (so artifact uploads go over HTTP)."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> None:
        exe = shutil.which("mlflow")
        cmd = [exe] if exe else [sys.executable, "-m", "mlflow"]
        cmd += [
            "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--serve-artifacts", "--artifacts-destination", str(self.root / "art"),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1",
                                               # no background job runner (huey workers): faster, lighter
                                               "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer /health within {timeout}s")

    def stop(self) -> None:
        """Stop the server and its workers (its own process group), gracefully, then by force."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        deadline = time.monotonic() + 10  # wait for the port to be free again
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.1)

    def count_requests(self, path: str, status: int = 200, *, method: str = "[A-Z]+", prefix: bool = False) -> int:
        """How many requests to ``path`` (or paths starting with it) the server answered with ``status``."""
        tail = r"[^ \"]*" if prefix else ""
        pattern = re.compile(rf'"{method} {re.escape(path)}{tail}[ ?][^"]*" {status}\b')
        return len(pattern.findall(self.log_path.read_text(errors="replace")))
