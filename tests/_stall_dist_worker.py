"""One rank of the 2-process gloo stall test: rank 1 hangs before step 4, rank 0 waits in the guard's collective.

Usage: python tests/_stall_dist_worker.py RANK WORLD INIT_FILE OUT_DIR. Events go to OUT_DIR/events.rank{RANK}.jsonl.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guardtower.guard import GuardedOptimizer  # noqa: E402
from guardtower.sinks import JsonlSink  # noqa: E402

HANG_AT, HANG_S, STALL_AFTER = 4, 3.0, 1.0


def main(rank: int, world: int, init_file: str, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, stall_after=STALL_AFTER,
                             sinks=[JsonlSink(out / "events.jsonl")], log_dir=out / "sg", verbose=False)
    for step in range(1, 6):
        if rank == 1 and step == HANG_AT:
            time.sleep(HANG_S)  # a stuck data loader on rank 1 only
        guard.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        guard.step()  # its decision all-reduce is where rank 0 waits for rank 1
    guard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
