"""One rank of the gloo tests for GuardedOptimizer (run under torchrun by tests/test_guard_dist.py).

Usage: torchrun --nproc_per_node N tests/_guard_dist_worker.py MODE[,MODE...] OUT_DIR, modes ddp, ddp_clip,
fsdp2, hsdp (RANK and WORLD_SIZE come from the launcher). Runs the modes one after another and writes
OUT_DIR/<mode>-rank{RANK}.pt with the skip steps, spike layers, counters and final parameters (the spike
reports go to OUT_DIR/<mode>-logs). ``hsdp`` needs 4 ranks: a (replicate 2) x (shard 2) mesh.
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

from guardtower.events import SkipEvent, SpikeEvent, SummaryEvent  # noqa: E402
from guardtower.guard import GuardedOptimizer  # noqa: E402
from guardtower.testing import InMemorySink  # noqa: E402
from tests._dist_launch import end_rank  # noqa: E402

STEPS = 50


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)


def local_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    assert g is not None
    return g.to_local() if hasattr(g, "to_local") else g


def unsharded_norm(wrapped: nn.Module, world: int, step: int) -> float:
    """The global gradient norm of this step computed by one process on an unsharded copy: the mean loss over
    every rank's batch (what DDP's and FSDP's averaged gradients are the gradient of)."""
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
               for n, p in wrapped.named_parameters()}
    plain = make_model()
    plain.load_state_dict({n.removeprefix("module."): w for n, w in weights.items()})
    loss = sum(((plain(x) - y) ** 2).mean() for x, y in (batch(r, step) for r in range(world))) / world
    loss.backward()
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in plain.parameters()])))


def run(mode: str, rank: int, world: int, out: Path) -> dict[str, Any]:
    model = make_model()
    if mode.startswith("ddp"):
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
        base = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, fused=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        shape = (2, world // 2) if mode == "hsdp" else (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        base = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    sink = InMemorySink()
    guard = GuardedOptimizer(base, wrapped, log_dir=out / f"{mode}-logs", verbose=False, sinks=[sink], log_every=10,
                             nan_action="clip" if mode == "ddp_clip" else "skip")
    reference_norms: dict[int, float] = {}
    for step in range(STEPS):
        guard.zero_grad()
        x, y = batch(rank, step)
        loss = ((wrapped(x) - y) ** 2).mean()
        if step == 20 and rank == 1:
            loss = loss * 1e4  # a corrupted local batch: after the gradient all-reduce every rank sees it
        loss.backward()
        params = list(wrapped.parameters())
        if step == 35 and rank == 1:
            local_grad(params[2]).mul_(1e4)  # a rank-local corruption after the all-reduce: only rank 1 sees it
        if step == 42 and rank == 0:
            local_grad(params[0]).fill_(float("nan"))
        if (step + 1) % 10 == 0:
            reference_norms[step + 1] = unsharded_norm(wrapped, world, step)
        guard.step(loss=loss)
    guard.close()
    final = {}
    for name, p in wrapped.named_parameters():
        final[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return {
        "skips": [e.step for e in sink.events if isinstance(e, SkipEvent)],
        "spikes": [(e.step, e.layer) for e in sink.events if isinstance(e, SpikeEvent)],
        "clips": [e.step for e in sink.events if isinstance(e, SpikeEvent) and e.action == "clip"],
        "summary_norms": {e.step: e.grad_norm for e in sink.events if isinstance(e, SummaryEvent)},
        "reference_norms": reference_norms,
        "counters": (guard.step_count, guard.total_spikes, guard.total_skips, guard.total_clips),
        "params": final,
    }


def main(modes: list[str], out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # env://: the launcher set it
    torch.set_num_threads(1)
    for mode in modes:
        torch.save(run(mode, rank, world, out), out / f"{mode}-rank{rank}.pt")
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1].split(","), Path(sys.argv[2]))
