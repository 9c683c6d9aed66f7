"""Incidents under a real HF Trainer (tiny GPT-2 from a config, CPU): each step's batch named, triage through the
Trainer's own ``training_step``, and a run killed with SIGKILL that resumes past its quarantined batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _hf_incident_run import KILL_AT, SAVE_AT, run
from guardtower.events import SkipEvent, SpikeEvent
from guardtower.guard.quarantine import Quarantine

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def spikes(events: list[Any]) -> dict[int, SpikeEvent]:
    return {e.step: e for e in events if isinstance(e, SpikeEvent)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_triage_recomputes_the_steps_micro_batches_and_tells_a_one_off_from_a_bad_batch(tmp_path: Path) -> None:
    result = run(tmp_path, steps=8, transient_at=6, triage=True)
    found = spikes(result["events"])
    assert sorted(found) == [3, 6]
    bad, once = found[3], found[6]
    assert (bad.triage, bad.triage_ranks) == ("deterministic", (0,))  # the bad sample NaNs again
    assert (once.triage, once.triage_ranks) == ("transient", ())  # the recompute was clean
    assert bad.batch is not None and (bad.batch["epoch"], bad.batch["index"], bad.batch["micro_batches"]) == (0, 4, 2)
    # a recompute is forward + backward of both micro-batches, once per incident, and none for other steps
    assert result["forwards"] == {s: 4 if s in (3, 6) else 2 for s in range(1, 9)}
    assert Quarantine.read(tmp_path / "sg").positions() == {(0, 4), (0, 5)}  # the transient one is not replayed
    guard = result["callback"].guard
    assert guard.total_skips == 2 and all(torch.isfinite(w).all() for w in result["weights"].values())


def test_a_killed_trainer_run_resumes_past_its_quarantined_batch_as_if_never_stopped(tmp_path: Path) -> None:
    first = tmp_path / "first"
    first.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, str(Path(__file__).with_name("_hf_incident_run.py")), str(first)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-3000:]
    # the killed run quarantined steps 3 (before its checkpoint at 6) and 11 (after it): both micro-batches each
    assert Quarantine.read(first / "sg").positions() == {(0, 4), (0, 5), (1, 4), (1, 5)}

    full = run(tmp_path / "uninterrupted")
    assert sorted(spikes(full["events"])) == [3, 11]
    step3 = spikes(full["events"])[3].batch
    data = full["poison"]  # the batch is named by the Trainer's numbering and its content
    assert step3 == {"step": 3, "epoch": 0, "index": 4, "micro_batches": 2, "batch_size": 4,
                     "fingerprint": step3["fingerprint"]}
    assert data.bad_forwards == 2  # the bad sample ran in steps 3 and 11

    resumed = run(first, resume=str(first / f"checkpoint-{SAVE_AT}"))
    assert not spikes(resumed["events"])  # the bad batch never ran again
    assert resumed["poison"].bad_forwards == 0
    replays = [e for e in resumed["events"] if isinstance(e, SkipEvent)]
    assert [(e.step, e.reason, e.batch) for e in replays] == [
        (11, "quarantined", {"step": 11, "epoch": 1, "index": 4, "micro_batches": 2})]
    # its steps, scheduler and accumulation went on as in the run that never stopped: the same weights and guard
    assert same(resumed["weights"], full["weights"])
    a, b = full["callback"].guard, resumed["callback"].guard
    assert (a.step_count, a.total_skips) == (b.step_count, b.total_skips) == (16, 2)
    da, db = a.detector.state_dict()["state"], b.detector.state_dict()["state"]
    assert all(torch.equal(da[k].nan_to_num(1234.5), db[k].nan_to_num(1234.5)) for k in da)
    assert KILL_AT > 11 > SAVE_AT


def test_a_trainer_resumed_with_another_batch_size_does_not_replay_positions_that_name_other_samples(
        tmp_path: Path) -> None:
    first = run(tmp_path, steps=12)  # steps 3 and 11 hold the bad sample: (0, 4-5) and (1, 4-5) at batch size 4
    assert sorted(spikes(first["events"])) == [3, 11]
    assert {e["batch"]["batch_size"] for e in Quarantine.read(tmp_path / "sg").entries} == {4}
    # at 8 samples a micro-batch an epoch is 4 steps: step 7 is (1, 4-5) again, samples 32-47, all good
    with pytest.warns(RuntimeWarning, match="recorded at batch size \\[4\\] and this one holds 8 samples"):
        resumed = run(tmp_path, resume=str(tmp_path / f"checkpoint-{SAVE_AT}"), batch_size=8)
    assert not [e for e in resumed["events"] if isinstance(e, SkipEvent) and e.reason == "quarantined"]
    # the bad sample is in micro-batch 2 of each epoch now (steps 10 and 14): it is computed and rejected again
    assert sorted(spikes(resumed["events"])) == [10, 14] and resumed["poison"].bad_forwards == 2
    assert resumed["forwards"] == {s: 2 for s in range(SAVE_AT + 1, 17)}  # every step trained, step 7 too
