"""One rank of the distributed resume tests (run as a script by tests/test_guard_resume_dist.py).

Usage: python tests/_guard_resume_worker.py {save|resume} OUT_DIR (RANK and WORLD_SIZE from the launcher:
tests/_dist_launch.launch)

``save`` (2 ranks): an uninterrupted DDP run of ``STEPS`` steps, then a run stopped at ``SAVE_AT`` that writes
``OUT_DIR/ckpt-rank{RANK}.pt`` (model, and this rank's ``guard.state_dict()``), then a fresh model, optimizer
and guard that load it and go on. ``resume`` (any world size): only the last part, from the checkpoint a
``save`` run left in OUT_DIR; a rank without a checkpoint of its own loads rank 0's.
Writes OUT_DIR/<mode>-world{WORLD}-rank{RANK}.pt with each part's decisions, counters and final parameters.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guardtower.events import SpikeEvent  # noqa: E402
from guardtower.guard import GuardedOptimizer  # noqa: E402
from guardtower.testing import InMemorySink  # noqa: E402
from tests._dist_launch import end_rank  # noqa: E402
from tests._guard_dist_worker import batch  # noqa: E402

STEPS = 50
SAVE_AT = 30


def build(seed: int, out: Path) -> tuple[nn.Module, nn.Module, GuardedOptimizer, InMemorySink]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    wrapped = nn.parallel.DistributedDataParallel(model)
    sink = InMemorySink()
    guard = GuardedOptimizer(torch.optim.AdamW(wrapped.parameters(), lr=1e-2, fused=True), wrapped,
                             log_dir=out / "logs", verbose=False, sinks=[sink], log_every=10)
    return model, wrapped, guard, sink


def train(wrapped: nn.Module, guard: GuardedOptimizer, start: int, stop: int) -> None:
    """Guarded steps ``start+1 .. stop``. Incidents: NaN on the last rank at step 30 (right before the save)
    and on rank 0 at 31 (right after the resume); a spiking batch on rank 0 at 34 (every rank sees it
    through the all-reduce); a rank-local spike on the last rank at 45."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    for i in range(start, stop):
        step = i + 1
        guard.zero_grad()
        x, y = batch(rank, i)
        loss = ((wrapped(x) - y) ** 2).mean()
        if step == 34 and rank == 0:
            loss = loss * 1e4
        loss.backward()
        first = next(iter(wrapped.parameters())).grad
        assert first is not None
        if (step == 30 and rank == last) or (step == 31 and rank == 0):
            first.fill_(float("nan"))
        if step == 45 and rank == last:
            first.mul_(1e4)
        guard.step(loss=loss)


def result(model: nn.Module, guard: GuardedOptimizer, sink: InMemorySink) -> dict[str, Any]:
    guard.flush()
    decisions = [(e.step, e.action, e.layer, e.reason, repr(e.norm), repr(e.ratio))
                 for e in sink.events if isinstance(e, SpikeEvent)]
    out = {"decisions": decisions, "skips": sorted({d[0] for d in decisions}),
           "counters": (guard.step_count, guard.total_spikes, guard.total_skips, guard.consecutive_rejections),
           "detector": guard.detector.state_dict()["state"],
           "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    guard.close()
    return out


def resume(out: Path, rank: int) -> tuple[dict[str, Any], int | None]:
    """Fresh weights (another seed), optimizer and guard; the checkpoint; the rest of the run."""
    model, wrapped, guard, sink = build(1, out)
    own = out / f"ckpt-rank{rank}.pt"
    saved = torch.load(own if own.exists() else out / "ckpt-rank0.pt", weights_only=True)
    model.load_state_dict(saved["model"])
    guard.load_state_dict(saved["optimizer"])
    train(wrapped, guard, SAVE_AT, STEPS)
    return result(model, guard, sink), saved["optimizer"]["guardtower"].get("world_size")


def main(mode: str, out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # env://: the launcher set it
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    if mode == "save":
        model, wrapped, guard, sink = build(0, out)
        train(wrapped, guard, 0, STEPS)
        results["full"] = result(model, guard, sink)
        model, wrapped, guard, sink = build(0, out)
        train(wrapped, guard, 0, SAVE_AT)
        torch.save({"model": model.state_dict(), "optimizer": guard.state_dict()}, out / f"ckpt-rank{rank}.pt")
        results["first"] = result(model, guard, sink)
        dist.barrier()
    results["resumed"], results["saved_world"] = resume(out, rank)
    torch.save(results, out / f"{mode}-world{world}-rank{rank}.pt")
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
