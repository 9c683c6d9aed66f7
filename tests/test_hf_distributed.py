"""Both callbacks in a real 2-process torch.distributed (gloo, CPU) Trainer run on a PEFT model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "_hf_ddp_worker.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(out: Path) -> list[dict[str, dict[str, object]]]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out)], env=env, cwd=out,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_ddp_peft_runs_are_audited_and_guarded_identically_on_both_ranks(tmp_path: Path) -> None:
    ranks = _launch(tmp_path)
    for r in ranks:
        # a LoRA optimizer built before get_peft_model stops every rank, none hangs in a collective
        stale = r["stale_optimizer"]
        assert stale["outcome"] == "preflight_failed"
        assert "LORA-003" in stale["error_ids"]  # type: ignore[operator]
        assert stale["global_step"] == 0
        # the callback audits the Trainer's DDP wrapper, so DDP's unused-parameter hang is caught before step 1
        hang = r["unused_param"]
        assert hang["outcome"] == "preflight_failed" and "DDP-001" in hang["error_ids"]  # type: ignore[operator]
        assert hang["global_step"] == 0
        # the correct setup trains under DDP; the spike at step 5 is skipped on both ranks
        run = r["train"]
        assert run["world"] == 2 and run["wrapper"] == "DistributedDataParallel"
        assert run["outcome"] == "trained" and run["global_step"] == 8
        assert run["report_ok"] is True
        # the callback audited the Trainer's DDP wrapper, not the bare model: it names the wrapper (DDP-007, INFO)
        # and there is no "not wrapped" warning
        assert "DDP-007" in run["finding_ids"]  # type: ignore[operator]
        assert not [i for i in run["finding_ids"] if i.startswith("DDP") and i != "DDP-007"]  # type: ignore[union-attr]
        assert run["skips"] == [5]
    assert ranks[0]["train"]["weights_sha"] == ranks[1]["train"]["weights_sha"]
