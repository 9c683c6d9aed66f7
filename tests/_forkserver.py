"""A warm Python for the tests that run many short scripts (README blocks, examples).

Importing torch, transformers, lightning, mlflow... costs several CPU-seconds per process, more than most
of those scripts run. One server process imports them once; each script then runs in a fresh child forked
from it, with its own folder, environment, ``argv``, ``sys.path[0]`` and output files (the rest of
``sys.path`` is the server's: start it with the ``PYTHONPATH`` the scripts get), and it exits the way
``python script.py`` does (atexit handlers, non-daemon threads, exit status, a traceback on stderr). A
script still has to import what it uses: its globals start empty, only ``sys.modules`` is warm.

The server runs nothing but imports (no torch op, no thread), so forking it is safe; ``OMP_NUM_THREADS=1``
is fixed at its start because OpenMP reads it when torch is loaded.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: what the README blocks and examples import; each is imported once, in the server
PRELOAD = (
    "torch",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "transformers.trainer",
    "peft",
    "mlflow",
    "wandb",
    "lightning.pytorch",
)

_SERVER = r"""
import json, os, sys

for name in sys.argv[1:]:
    __import__(name)


def serve():
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            return json.loads(line)
        print(pid, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    return None


job = serve()
if job is not None:
    import runpy, tempfile

    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    tempfile.tempdir = None  # TMPDIR is read again
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, job["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, job["stderr"], os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = job["argv"]
    sys.path[0] = job["path0"]
    del job
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Forkserver:
    """One warm server process; ``run`` is ``subprocess.run([sys.executable, *argv], capture_output=True,
    text=True, ...)`` for a Python script, run one at a time."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = PRELOAD) -> None:
        self.env = {**env, "OMP_NUM_THREADS": "1"}
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, *preload], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=self.env, bufsize=0)
        self._buffer = b""

    def _line(self, deadline: float) -> str | None:
        """The server's next line, or None when ``deadline`` (monotonic) passes first."""
        assert self._proc.stdout is not None
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self._proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the forkserver exited ({self._proc.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def run(self, argv: list[str], *, cwd: Path, env: dict[str, str],
            timeout: float) -> subprocess.CompletedProcess[str]:
        """Run ``python *argv`` in ``cwd`` with exactly ``env``; kill it after ``timeout`` seconds
        (``subprocess.TimeoutExpired``, as ``subprocess.run`` raises)."""
        assert env.get("OMP_NUM_THREADS") == "1", "the server's OpenMP setting is fixed: OMP_NUM_THREADS=1"
        assert self._proc.stdin is not None
        out = Path(tempfile.mkdtemp(prefix="forkserver-"))
        try:
            script = Path(cwd, argv[0]).resolve()
            job = {"cwd": str(cwd), "env": env, "argv": [str(script), *argv[1:]], "path0": str(script.parent),
                   "stdout": str(out / "stdout"), "stderr": str(out / "stderr")}
            self._proc.stdin.write((json.dumps(job) + "\n").encode())
            started = time.monotonic()
            pid = self._line(started + 60)
            if pid is None:
                raise RuntimeError("the forkserver did not fork within 60 s")
            status = self._line(started + timeout)
            if status is None:
                os.kill(int(pid), signal.SIGKILL)
                self._line(time.monotonic() + 60)
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
            read = lambda name: (out / name).read_text(errors="replace") if (out / name).exists() else ""  # noqa: E731
            return subprocess.CompletedProcess([sys.executable, *argv], int(status), read("stdout"), read("stderr"))
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def close(self) -> None:
        """Stop the server (it only holds imports: its interpreter shutdown would cost seconds for nothing)."""
        self._proc.kill()
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()
