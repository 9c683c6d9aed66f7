"""Resuming a guard under torch.distributed (real gloo processes, DDP): saved by 2 ranks at step 30, resumed
by 2 (exactly the uninterrupted decisions), by 4 and by 1 (the baselines carry: no new warmup, no false
alarm, every rank agrees)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist_launch import launch as launch_ranks
from tests._guard_resume_worker import SAVE_AT, STEPS

WORKER = Path(__file__).with_name("_guard_resume_worker.py")
#: the injected incidents after the save: NaN right after the resume, a shared spike, a rank-local spike
AFTER = [31, 34, 45]


def launch(mode: str, out: Path, world: int) -> list[dict[str, Any]]:
    results = launch_ranks([str(WORKER), mode, str(out)], world,
                           env={"OMP_NUM_THREADS": "1", "GUARDTOWER_RUN": f"dist-{mode}"})
    for rank, (code, log) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{log[-4000:]}"
    return [torch.load(out / f"{mode}-world{world}-rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One 2-rank launch: the uninterrupted run, the run stopped at step 30 (checkpoints), its 2-rank resume."""
    out = tmp_path_factory.mktemp("resume-dist")
    return out, launch("save", out, 2)


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].nan_to_num(1234.5), b[k].nan_to_num(1234.5)) for k in a)


@pytest.mark.slow
def test_two_ranks_resume_exactly_where_the_uninterrupted_run_would_be(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = saved
    for r in ranks:
        full, resumed = r["full"], r["resumed"]
        assert [d for d in full["decisions"] if d[0] > SAVE_AT] == resumed["decisions"]
        assert [s for s in full["skips"] if s > SAVE_AT] == AFTER
        assert SAVE_AT in r["first"]["skips"]  # the NaN right before the save
        assert full["counters"] == resumed["counters"]
        assert same_tensors(full["detector"], resumed["detector"])  # this rank's loss slot included
        assert same_tensors(full["params"], resumed["params"])
        assert r["saved_world"] == 2
    assert same_tensors(ranks[0]["resumed"]["params"], ranks[1]["resumed"]["params"])
    # the loss slot is each rank's own (its local loss); the gradient slots are the same on every rank
    d0, d1 = ranks[0]["full"]["detector"]["state"], ranks[1]["full"]["detector"]["state"]
    assert torch.equal(d0[:, :-1], d1[:, :-1]) and not torch.equal(d0[:, -1], d1[:, -1])


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 1])
def test_a_checkpoint_of_two_ranks_resumes_under_another_world_size(saved: tuple[Path, list[dict[str, Any]]],
                                                                    world: int) -> None:
    out, two = saved
    ranks = launch("resume", out, world)
    for r in ranks:
        resumed = r["resumed"]
        # the baselines carried: the incidents right after the resume are caught (a fresh guard would still be
        # warming up at 31 and 34), and no healthy step is rejected
        assert resumed["skips"] == AFTER
        assert resumed["counters"][0] == STEPS
        assert resumed["counters"][2] == two[0]["first"]["counters"][2] + len(AFTER)
        assert r["saved_world"] == 2
        assert all(torch.isfinite(v).all() for v in resumed["params"].values())
    assert all(r["resumed"]["decisions"] and [d[:2] for d in r["resumed"]["decisions"]]
               == [d[:2] for d in ranks[0]["resumed"]["decisions"]] for r in ranks)
    assert all(same_tensors(r["resumed"]["params"], ranks[0]["resumed"]["params"]) for r in ranks)
