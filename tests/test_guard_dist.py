"""Identical guard decisions on every rank: real torch.distributed with gloo under torchrun, 2 processes (DDP,
FSDP2) and 4 (HSDP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist_launch import torchrun

WORKER = Path(__file__).with_name("_guard_dist_worker.py")
Ranks = list[dict[str, Any]]


def run_world(modes: list[str], out: Path, world: int) -> dict[str, Ranks]:
    """``torchrun --nproc_per_node world`` the worker once, for every mode in turn; each mode's result per rank."""
    results = torchrun([str(WORKER), ",".join(modes), str(out)], world, timeout=300,
                       env={"OMP_NUM_THREADS": "1", "GUARDTOWER_RUN": "dist"})
    for rank, (code, log) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{log[-4000:]}"
    return {mode: [torch.load(out / f"{mode}-rank{r}.pt", weights_only=False) for r in range(world)] for mode in modes}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Ranks]]:
    """One 2-rank launch for DDP, DDP with ``nan_action="clip"`` and FSDP2 (a launch costs more than the steps)."""
    out = tmp_path_factory.mktemp("guard-dist")
    return out, run_world(["ddp", "ddp_clip", "fsdp2"], out, 2)


@pytest.mark.slow
def test_ddp_ranks_skip_together_and_stay_identical(two_ranks: tuple[Path, dict[str, Ranks]]) -> None:
    out, modes = two_ranks
    r0, r1 = modes["ddp"]
    # step 21: a spiking local batch on rank 1; 36: rank-local corruption on rank 1; 43: NaN on rank 0 only
    assert r0["skips"] == r1["skips"] == [21, 36, 43]
    assert r0["counters"] == r1["counters"] == (50, 3, 3, 0)
    assert dict(r0["spikes"])[36] == "peer-rank" and dict(r1["spikes"])[36] == "2.weight"
    assert dict(r0["spikes"])[43] == "0.weight" and dict(r1["spikes"])[43] == "peer-rank"
    assert r0["params"].keys() == r1["params"].keys()
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])
    assert all(torch.isfinite(v).all() for v in r0["params"].values())
    reports = sorted(p.name for p in (out / "ddp-logs").glob("spike_step*.json"))
    assert sum("-rank0-" in n for n in reports) == 3 and sum("-rank1-" in n for n in reports) == 3


@pytest.mark.slow
def test_ddp_clip_scales_a_shared_spike_alike_and_skips_a_rank_local_one(
        two_ranks: tuple[Path, dict[str, Ranks]]) -> None:
    r0, r1 = two_ranks[1]["ddp_clip"]
    # step 21: the spiking batch reaches every rank through the all-reduce: clipped by one agreed factor;
    # 36: only rank 1's gradients spike (no common factor can fix that): skipped; 43: NaN on rank 0: skipped
    assert r0["clips"] == r1["clips"] == [21]
    assert r0["skips"] == r1["skips"] == [36, 43]
    assert r0["counters"] == r1["counters"] == (50, 3, 2, 1)
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])
    assert all(torch.isfinite(v).all() for v in r0["params"].values())


def assert_sharded_run(results: Ranks) -> None:
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
def test_fsdp2_ranks_measure_full_norms_and_skip_together(two_ranks: tuple[Path, dict[str, Ranks]]) -> None:
    assert_sharded_run(two_ranks[1]["fsdp2"])


@pytest.mark.slow
def test_hsdp_sums_shards_over_the_shard_dimension_only(tmp_path: Path) -> None:
    """4 ranks, a (replicate 2) x (shard 2) mesh: a sum over all 4 ranks would report each norm x sqrt(2)."""
    assert_sharded_run(run_world(["hsdp"], tmp_path, 4)["hsdp"])
