"""Identical guard decisions on every rank: real torch.distributed with gloo, 2 processes (DDP, FSDP2) and 4 (HSDP)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

WORKER = Path(__file__).with_name("_guard_dist_worker.py")
TIMEOUT_S = 240


def run_world(mode: str, tmp_path: Path, world: int = 2, worker: Path = WORKER,
              result: str = "rank{rank}.pt") -> list[dict[str, Any]]:
    """Run ``worker MODE RANK WORLD INIT_FILE OUT`` as ``world`` gloo ranks; each rank's ``result`` file."""
    init_file = tmp_path / f"init-{mode}-{world}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GUARDTOWER_RUN": f"dist-{mode}"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    procs = [
        subprocess.Popen([sys.executable, str(worker), mode, str(rank), str(world), str(init_file), str(tmp_path)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-4000:]
    return [torch.load(tmp_path / result.format(rank=rank), weights_only=False) for rank in range(world)]


@pytest.mark.slow
def test_ddp_ranks_skip_together_and_stay_identical(tmp_path: Path) -> None:
    r0, r1 = run_world("ddp", tmp_path)
    # step 21: a spiking local batch on rank 1; 36: rank-local corruption on rank 1; 43: NaN on rank 0 only
    assert r0["skips"] == r1["skips"] == [21, 36, 43]
    assert r0["counters"] == r1["counters"] == (50, 3, 3, 0)
    assert dict(r0["spikes"])[36] == "peer-rank" and dict(r1["spikes"])[36] == "2.weight"
    assert dict(r0["spikes"])[43] == "0.weight" and dict(r1["spikes"])[43] == "peer-rank"
    assert r0["params"].keys() == r1["params"].keys()
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])
    assert all(torch.isfinite(v).all() for v in r0["params"].values())
    reports = sorted(p.name for p in (tmp_path / "logs").glob("spike_step*.json"))
    assert sum("-rank0-" in n for n in reports) == 3 and sum("-rank1-" in n for n in reports) == 3


@pytest.mark.slow
def test_ddp_clip_scales_a_shared_spike_alike_and_skips_a_rank_local_one(tmp_path: Path) -> None:
    r0, r1 = run_world("ddp_clip", tmp_path)
    # step 21: the spiking batch reaches every rank through the all-reduce: clipped by one agreed factor;
    # 36: only rank 1's gradients spike (no common factor can fix that): skipped; 43: NaN on rank 0: skipped
    assert r0["clips"] == r1["clips"] == [21]
    assert r0["skips"] == r1["skips"] == [36, 43]
    assert r0["counters"] == r1["counters"] == (50, 3, 2, 1)
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])
    assert all(torch.isfinite(v).all() for v in r0["params"].values())


def assert_sharded_run(results: list[dict[str, Any]]) -> None:
    """Same decisions and weights on every rank; the measured global norm is the unsharded one."""
    first = results[0]
    for result in results:
        assert result["skips"] == [21, 36, 43]
        assert result["counters"] == first["counters"] == (50, 3, 3, 0)
        assert result["summary_norms"].keys() == result["reference_norms"].keys() == {10, 20, 30, 40, 50}
        for step, norm in result["summary_norms"].items():  # vs one process's norm of the unsharded gradient
            assert norm == pytest.approx(result["reference_norms"][step], rel=1e-4)
        assert all(torch.equal(first["params"][k], result["params"][k]) for k in first["params"])
    assert all(torch.isfinite(v).all() for v in first["params"].values())


@pytest.mark.slow
def test_fsdp2_ranks_measure_full_norms_and_skip_together(tmp_path: Path) -> None:
    assert_sharded_run(run_world("fsdp2", tmp_path))


@pytest.mark.slow
def test_hsdp_sums_shards_over_the_shard_dimension_only(tmp_path: Path) -> None:
    """4 ranks, a (replicate 2) x (shard 2) mesh: a sum over all 4 ranks would report each norm x sqrt(2)."""
    assert_sharded_run(run_world("hsdp", tmp_path, world=4))
