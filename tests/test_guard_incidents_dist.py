"""Incidents at scale with real processes under torchrun (gloo, 127.0.0.1): which rank, which batch (the whole
job killed and resumed), triage."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist_launch import torchrun
from tests._incident_dist_worker import KILLABLE

WORKER = Path(__file__).with_name("_incident_dist_worker.py")


def run(scenario: str, out: Path, world: int, *, killed: bool = False) -> list[dict[str, Any]]:
    """``torchrun --nproc_per_node world`` the worker; ``killed``: SIGKILL the whole job once it is killable."""
    results = torchrun([str(WORKER), scenario, str(out)], world, timeout=300,
                       kill_when=out / KILLABLE if killed else None,
                       env={"OMP_NUM_THREADS": "1", "GUARDTOWER_RUN": f"incident-{scenario}"})
    for rank, (code, log) in enumerate(results):
        assert code == (-9 if killed else 0), f"rank {rank} exited {code}:\n{log[-4000:]}"
    if killed:
        assert (out / KILLABLE).exists(), "killed by the timeout, not at KILL_AT"
        return []
    loaded = [torch.load(out / f"{scenario}-rank{r}.pt", weights_only=False) for r in range(world)]
    # RANK, LOCAL_RANK, WORLD_SIZE (and LOCAL_WORLD_SIZE, which only torchrun sets) came from torchrun
    assert [r["env"] for r in loaded] == [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                           "LOCAL_WORLD_SIZE": str(world)} for r in range(world)]
    return loaded


def same_params(results: list[dict[str, Any]]) -> bool:
    first = results[0]["params"]
    return all(torch.equal(first[k], r["params"][k]) for r in results[1:] for k in first)


@pytest.mark.slow
def test_a_nan_on_rank_2_of_4_is_named_on_every_rank(tmp_path: Path) -> None:
    results = run("ranks", tmp_path, 4)
    assert all(r["skips"] == [12, 20] for r in results)  # the same decision everywhere
    assert all(r["counters"] == (30, 2, 2) for r in results)
    assert same_params(results)
    for r in results:
        local = r["spikes"][12]  # rank 2's own gradient went NaN after the all-reduce
        assert local["ranks"] == (2,)
        (rank, reason, norm, loss), = local["rank_values"]
        assert (rank, reason) == (2, "nonfinite") and math.isinf(norm) and math.isfinite(loss)
        spread = r["spikes"][20]  # rank 2's input was NaN: every rank's gradients are, only rank 2's loss is
        assert spread["ranks"] == (2,)
        assert spread["rank_values"][0][:2] == (2, "nonfinite") and math.isinf(spread["rank_values"][0][3])
        report = spread["report"]
        assert report["ranks"] == [2] and len(report["rank_values"]) == 4
        healthy = [v for v in report["rank_values"] if v["rank"] != 2]
        assert all(v["loss"] is not None and math.isfinite(v["loss"]) for v in healthy)
        assert local["batch"] == {"step": 12, "index": 11, "batch_size": 16,
                                  "fingerprint": local["batch"]["fingerprint"]}
    # rank 2 alone names its own layer; the others see a peer rank's verdict
    assert results[2]["spikes"][12]["layer"] == "0.weight" and results[0]["spikes"][12]["layer"] == "peer-rank"
    # the per-step collective: [reject, skip] + 4 float32 slots per rank, in the one decision all-reduce
    assert all(r["calls_per_step"] == 1 and r["bytes_per_step"] == (2 + 4 * 4) * 4 for r in results)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Two torchrun launches of 2 ranks: a run whose whole job is SIGKILLed after its checkpoint (position 8),
    incidents at 3 and 11 and the step at 14; then its resume, the uninterrupted run and triage in one launch.
    Returns each rank's quarantine file as the kill left it, and the second launch's results."""
    out = tmp_path_factory.mktemp("incidents-two-ranks")
    run("first", out, 2, killed=True)
    quarantined = {p.name: p.read_text() for p in sorted((out / "logs").glob("quarantine-rank*.jsonl"))}
    return quarantined, run("resume", out, 2)


@pytest.mark.slow
def test_a_killed_run_resumes_past_its_quarantined_batches(
        two_ranks: tuple[dict[str, str], list[dict[str, Any]]]) -> None:
    quarantined, results = two_ranks
    assert list(quarantined) == ["quarantine-rank0.jsonl", "quarantine-rank1.jsonl"]
    lines = [json.loads(line) for line in quarantined["quarantine-rank1.jsonl"].splitlines()]
    assert [(e["step"], e["batch"]["index"], e["ranks"], e["reason"]) for e in lines] == [
        (4, 3, [1], "nonfinite"), (12, 11, [1], "nonfinite")]
    assert all(len(e["batch"]["indices"]) == e["batch"]["batch_size"] == 4 and "fingerprint" not in e["batch"]
               for e in lines)
    assert 1 + 2 * 4 * 3 in lines[0]["batch"]["indices"]  # the sample that holds the Inf

    for rank, r in enumerate(results):
        resumed, full = r["resumed"], r["uninterrupted"]
        assert resumed["restored"] == [(0, 3)]  # the checkpoint's own quarantine
        assert resumed["replay"] == [(0, 3), (0, 11)]  # every rank's file, also after the checkpoint
        assert resumed["skipped"] == [11]  # exactly the quarantined batch after the resume point
        assert resumed["trained"] == [p for p in range(8, 16) if p != 11]
        assert resumed["spikes"] == {}  # the bad batch was never computed again
        assert resumed["counters"][1:] == (1, 1)  # the counters carried over from the checkpoint
        # the uninterrupted run computed every batch and rejected the same two; after the resume point the
        # resumed run left out exactly the one it rejected, and ends with the same detector and weights
        assert full["trained"] == list(range(16)) and full["counters"] == (16, 2, 2)
        assert [(s["batch"]["index"], s["reason"]) for s in full["spikes"].values()] == [
            (3, "nonfinite"), (11, "nonfinite")]
        # the baselines (the rejected step left them); the last slot is the rank's own loss, and every rank
        # resumed from rank 0's checkpoint
        slots = slice(None) if rank == 0 else slice(None, -1)
        assert full["detector"].keys() == resumed["detector"].keys() == {"state", "ring"}
        assert all(torch.equal(full["detector"][k][:, slots].nan_to_num(1234.5),
                               resumed["detector"][k][:, slots].nan_to_num(1234.5)) for k in full["detector"])
        assert same_params([full, resumed])
    assert same_params([r["resumed"] for r in results])


@pytest.mark.slow
def test_triage_labels_transient_and_deterministic_incidents_on_two_ranks(
        two_ranks: tuple[dict[str, str], list[dict[str, Any]]]) -> None:
    results = [r["triage"] for r in two_ranks[1]]
    for r in results:
        assert r["counters"] == (15, 2, 2)
        assert r["calls"][5] == 2 and r["calls"][9] == 2 and r["calls"][1] == 1  # one recompute per incident
        transient, deterministic = r["spikes"][5], r["spikes"][9]
        assert (transient["triage"], transient["ranks"], transient["triage_ranks"]) == ("transient", (1,), ())
        assert deterministic["triage"] == "deterministic" and deterministic["ranks"] == (1,)
        assert deterministic["triage_ranks"] == (0, 1)  # the all-reduce spreads the reproduced NaN to both
        assert deterministic["report"]["triage"] == "deterministic"
        assert r["positions"] == [(None, 8)]  # only the deterministic batch is replayed
        assert [(e["step"], e["triage"]) for e in r["entries"]] == [(5, "transient"), (9, "deterministic")]
        assert all(e["triage_s"] >= 0 for e in r["entries"])
    assert same_params(results)
