"""One rank of the multi-GPU incident tests (tests/test_guard_incidents_dist.py): which rank, which batch, triage.

Usage: torchrun --nproc_per_node N tests/_incident_dist_worker.py SCENARIO OUT (tests/_dist_launch.torchrun;
RANK, LOCAL_RANK and WORLD_SIZE come from torchrun). Scenarios: ``ranks`` (DDP, NaN on rank 2 of 4); ``first``
(a run whose whole torchrun job is killed after a checkpoint) and ``resume`` (the same run resumed past its
quarantine, then the run uninterrupted, then ``triage``: a transient and a deterministic incident, recomputed;
in one launch, which costs more than the steps). Writes OUT/<scenario>-rank{RANK}.pt.
"""

from __future__ import annotations

import datetime
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guardtower.events import SkipEvent, SpikeEvent  # noqa: E402
from guardtower.guard import GuardedOptimizer, read_report  # noqa: E402
from guardtower.guard.quarantine import Quarantine  # noqa: E402
from guardtower.testing import InMemorySink  # noqa: E402
from tests._dist_launch import end_rank  # noqa: E402

BATCH = 4
BATCHES = 16  # per rank per epoch
CHECKPOINT_AT, KILL_AT = 8, 14  # steps of the run that is killed
KILLABLE = "killable"  # written into OUT at KILL_AT, once every rank's quarantine is on disk
BAD_POSITIONS = (3, 11)  # rank 1's batches at these positions hold an Inf sample (a bad batch: deterministic)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Deterministic samples; those that rank 1 (DistributedSampler, no shuffle) sees at BAD_POSITIONS hold Inf."""

    def __init__(self, world: int) -> None:
        self.n = world * BATCH * BATCHES
        # DistributedSampler(shuffle=False) gives rank r the samples r, r + world, ...
        self.bad = {1 + world * (BATCH * p) for p in BAD_POSITIONS}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, generator=gen), torch.randn(1, generator=gen)
        if i in self.bad:
            x[0] = float("inf")
        return x, y, i


def count_all_reduce_bytes() -> list[int]:
    """Wrap torch.distributed.all_reduce to count the bytes the guard reduces (DDP's reducer runs in C++)."""
    counted = [0, 0]  # bytes, calls
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counted[0] += tensor.numel() * tensor.element_size()
        counted[1] += 1
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    return counted


def spikes(sink: InMemorySink) -> dict[int, dict[str, Any]]:
    return {e.step: {"ranks": e.ranks, "rank_values": e.rank_values, "layer": e.layer, "reason": e.reason,
                     "batch": e.batch, "triage": e.triage, "triage_ranks": e.triage_ranks,
                     "report": read_report(e.report_path) if e.report_path else None}
            for e in sink.events if isinstance(e, SpikeEvent)}


def final_params(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def ranks(out: Path, rank: int, world: int) -> dict[str, Any]:
    """DDP on 4 ranks: step 12 a rank-local NaN gradient on rank 2 (after the all-reduce), step 20 a NaN input
    on rank 2 (its loss is NaN; the all-reduce spreads NaN gradients to every rank)."""
    net = nn.parallel.DistributedDataParallel(model())
    sink = InMemorySink()
    guard = GuardedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True), net, log_dir=out / "logs",
                             verbose=False, sinks=[sink])
    counted = count_all_reduce_bytes()
    steps = 30
    for step in range(1, steps + 1):
        guard.zero_grad()
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        if step == 20 and rank == 2:
            x[3, 0] = float("nan")
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        if step == 12 and rank == 2:
            next(net.parameters()).grad.fill_(float("nan"))
        guard.observe_batch(x, index=step - 1)
        guard.step(loss=loss)
    bytes_reduced, calls = counted
    guard.close()
    return {"spikes": spikes(sink), "skips": [e.step for e in sink.events if isinstance(e, SkipEvent)],
            "counters": (guard.step_count, guard.total_spikes, guard.total_skips), "params": final_params(net),
            "bytes_per_step": bytes_reduced / steps, "calls_per_step": calls / steps}


def loader(world: int, rank: int) -> DataLoader[Any]:
    sampler = DistributedSampler(Samples(world), num_replicas=world, rank=rank, shuffle=False)
    return DataLoader(Samples(world), batch_size=BATCH, sampler=sampler)


def quarantine_run(out: Path, rank: int, world: int, mode: str) -> dict[str, Any]:
    """A plain DDP loop: ``first`` checkpoints at CHECKPOINT_AT and is killed at KILL_AT; ``resume`` loads the
    checkpoint, reads every rank's quarantine file and skips those batches; ``uninterrupted`` runs every batch
    (in a folder of its own)."""
    resume = mode == "resume"
    net = nn.parallel.DistributedDataParallel(model())
    sink = InMemorySink()
    log_dir = out / ("uninterrupted-logs" if mode == "uninterrupted" else "logs")
    guard = GuardedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), net, log_dir=log_dir, verbose=False,
                             sinks=[sink])
    checkpoint = out / "checkpoint.pt"
    start = 0
    replay = Quarantine()
    restored: list[Any] = []
    if resume:
        saved = torch.load(checkpoint, weights_only=False)
        net.load_state_dict(saved["model"])
        guard.load_state_dict(saved["optimizer"])
        restored = sorted(guard.quarantine.positions())  # what the checkpoint carried
        replay = Quarantine.read(out / "logs")  # every rank's file: also what happened after the checkpoint
        start = saved["position"]
    trained, skipped = [], []
    batches = itertools.islice(loader(world, rank), start, None)
    replayed = replay.skip(batches, epoch=0, start=start)
    for position, (x, y, idx) in replayed:
        trained.append(position)
        guard.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        guard.observe_batch((x, y), index=position, epoch=0, indices=idx)
        guard.step(loss=loss)
        if mode == "first" and position + 1 == CHECKPOINT_AT:
            if rank == 0:
                torch.save({"model": net.state_dict(), "optimizer": guard.state_dict(), "position": position + 1},
                           checkpoint)
            dist.barrier()
        if mode == "first" and position + 1 == KILL_AT:
            dist.barrier()  # every rank's quarantine is written: the test SIGKILLs the whole job now
            if rank == 0:
                (out / KILLABLE).touch()
            time.sleep(120)  # a real kill: no close(), no flush (and a bound if the kill never came)
            raise SystemExit(f"rank {rank} was not killed")
    skipped = sorted(set(range(start, BATCHES)) - set(trained))
    guard.close()
    return {"trained": trained, "skipped": skipped, "restored": restored,
            "replay": sorted(replay.positions(), key=lambda p: p[1]),
            "spikes": spikes(sink), "counters": (guard.step_count, guard.total_spikes, guard.total_skips),
            "params": final_params(net), "detector": guard.detector.state_dict()["state"]}


def triage_run(log_dir: Path, rank: int) -> dict[str, Any]:
    """Closure steps with triage=True: step 5's first computation gets a NaN gradient on rank 1 only (transient);
    step 9's batch holds Inf on rank 1 (deterministic: the recompute reproduces it)."""
    net = nn.parallel.DistributedDataParallel(model())
    sink = InMemorySink()
    guard = GuardedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), net, log_dir=log_dir,
                             verbose=False, sinks=[sink], triage=True)
    calls: dict[int, int] = {}
    for step in range(1, 16):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        if step == 9 and rank == 1:
            x[0, 0] = float("inf")

        def closure(step: int = step, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            calls[step] = calls.get(step, 0) + 1
            guard.zero_grad()
            loss = ((nn.functional.dropout(net(x), 0.1) - y) ** 2).mean()
            loss.backward()
            if step == 5 and rank == 1 and calls[step] == 1:  # a flipped bit on the first computation only
                next(net.parameters()).grad.fill_(float("nan"))
            return loss

        guard.observe_batch(x, index=step - 1)
        guard.step(closure)
    guard.close()
    entries = Quarantine.read(log_dir).entries
    return {"spikes": spikes(sink), "calls": calls, "counters": (guard.step_count, guard.total_spikes, guard.total_skips),
            "params": final_params(net), "entries": [e for e in entries if e["rank"] == rank],
            "positions": sorted(guard.quarantine.positions(), key=lambda p: p[1])}


def main(scenario: str, out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # env://, as torchrun set it
    torch.set_num_threads(1)
    if scenario == "ranks":
        result = ranks(out, rank, world)
    elif scenario == "first":
        result = quarantine_run(out, rank, world, "first")
    else:
        result = {"resumed": quarantine_run(out, rank, world, "resume"),
                  "uninterrupted": quarantine_run(out, rank, world, "uninterrupted"),
                  "triage": triage_run(out / "triage-logs", rank)}
    result["env"] = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    torch.save(result, out / f"{scenario}-rank{rank}.pt")
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
