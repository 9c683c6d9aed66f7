"""One rank of the corpus's distributed cases (``tests/test_audit_corpus.py``): for every case, its bug and its
fixed twin on real torch.distributed (gloo), each with the proof that the bug is there (a collective over both
ranks) and one ``audit()``. Writes ``{"<case>/bug" | "<case>/twin": {"proof", "loud"}}`` to ``<out>/rank<r>.json``.

usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/_audit_corpus_dist_worker.py OUT_DIR
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from _audit_dist_worker import first_batch, net, step  # noqa: E402
from _dist_launch import end_rank  # noqa: E402
from guardtower.preflight import audit  # noqa: E402
from guardtower.severity import Severity  # noqa: E402


@dataclass
class Setup:
    """A DDP model, the rank's first batch, and the module the training step calls (the wrapper, normally)."""

    model: DDP
    batch: tuple[torch.Tensor, torch.Tensor]
    forward: nn.Module

    def step(self) -> Callable[[], torch.Tensor]:
        return step(self.forward, self.batch)


def _setup(model: nn.Module, *, sharded: bool = True) -> Setup:
    ddp = DDP(model)
    return Setup(ddp, first_batch(sharded=sharded), ddp)


def _on_any_rank(flag: bool) -> bool:
    """The proof holds if it holds on some rank; every rank returns the same answer."""
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _batchnorm_per_rank(bug: bool) -> Setup:
    model = net(batchnorm=True)
    if not bug:
        # SyncBatchNorm, the thread's fix, runs under DDP on GPUs only; on CPU ranks the rank-independent fix is a
        # per-sample normalisation (GroupNorm), which computes the same thing whatever the sharding
        model.bn = nn.GroupNorm(4, 16)
    return _setup(model)


def _not_what_one_process_computes(bug: bool) -> bool:
    """Each rank normalises its shard with its own statistics: a sample's output differs from the output the
    same model gives it inside the global batch (what single-process training on that batch computes)."""
    setup = _batchnorm_per_rank(bug)
    ddp, (x, _) = setup.model, setup.batch
    reference = copy.deepcopy(ddp.module)
    everything = torch.cat(_gathered(x))
    rank, n = dist.get_rank(), x.shape[0]
    with torch.no_grad():
        local = ddp(x)
        expected = reference(everything)[rank * n:(rank + 1) * n]
    return _on_any_rank(not torch.allclose(local, expected, atol=1e-5))


def _same_batch(bug: bool) -> Setup:
    return _setup(net(), sharded=not bug)  # bug: a DataLoader without DistributedSampler


def _ranks_compute_the_same_gradients(bug: bool) -> bool:
    """Every rank's own gradient (before DDP averages them) is the same: the second rank adds no data."""
    setup = _same_batch(bug)
    with setup.model.no_sync():
        setup.step()().backward()
    grads = _gathered(setup.model.module.fc1.weight.grad)
    return _on_any_rank(all(torch.equal(grads[0], g) for g in grads[1:]))


def _bypassed(bug: bool) -> Setup:
    setup = _setup(net())
    if bug:  # the loss-bearing forward calls the unwrapped module
        setup.forward = setup.model.module
    return setup


def _replicas_diverge(bug: bool) -> bool:
    """After one real optimizer step the ranks hold different weights: no gradient was all-reduced."""
    setup = _bypassed(bug)
    opt = torch.optim.SGD(setup.model.parameters(), lr=0.1)
    setup.step()().backward()
    opt.step()
    weights = _gathered(setup.model.module.fc1.weight.detach())
    return _on_any_rank(not all(torch.equal(weights[0], w) for w in weights[1:]))


CASES: dict[str, tuple[Callable[[bool], Setup], Callable[[bool], bool]]] = {
    "ddp-batchnorm-per-rank": (_batchnorm_per_rank, _not_what_one_process_computes),
    "ddp-same-batch-every-rank": (_same_batch, _ranks_compute_the_same_gradients),
    "ddp-forward-bypasses-wrapper": (_bypassed, _replicas_diverge),
}


def _run(key: str, bug: bool) -> dict[str, Any]:
    build, proof = CASES[key]
    shown = proof(bug)
    setup = build(bug)
    report = audit(setup.model, setup.step())
    return {"proof": shown, "loud": [[f.catalog_id, f.severity.label] for f in report if f.severity >= Severity.WARN]}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    for key in CASES:
        for bug in (True, False):
            name = f"{key}/{'bug' if bug else 'twin'}"
            try:
                results[name] = _run(key, bug)
            except Exception:  # noqa: BLE001 - reported to the test, which fails with the traceback
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    end_rank()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
