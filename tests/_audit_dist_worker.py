"""One rank of the distributed audit tests: runs every scenario on real torch.distributed (gloo) and writes the
catalog ids each audit found to ``<out>/rank<r>.json``. Launched twice by ``tests/test_audit_dist.py``.

usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/_audit_dist_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from _audit_lora_helpers import ids, run_audit  # noqa: E402
from _dist_launch import end_rank  # noqa: E402
from guardtower.preflight.lora import lora_summary  # noqa: E402


class Net(nn.Module):
    """A small classifier; ``spare`` is a layer the forward never uses (DDP-001), ``bn`` optional (DDP-002)."""

    def __init__(self, batchnorm: bool = False, spare: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.fc2 = nn.Linear(16, 3)
        self.spare = nn.Linear(16, 16) if spare else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


DATA = TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(7)), torch.arange(64) % 3)


def first_batch(sharded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The first batch a rank's DataLoader yields: with a DistributedSampler (sharded) or without one."""
    sampler = DistributedSampler(DATA, shuffle=False) if sharded else None
    x, y = next(iter(DataLoader(DATA, batch_size=8, sampler=sampler)))
    return x, y


def net(**kw: Any) -> Net:
    torch.manual_seed(0)
    return Net(**kw)


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Callable[[], torch.Tensor]:
    x, y = batch
    return lambda: nn.functional.cross_entropy(model(x), y)


def scenario_clean() -> dict[str, Any]:
    model = DDP(net())
    report = run_audit(model, step(model, first_batch(sharded=True)))
    # the audit step must leave DDP usable: a real synchronised step afterwards averages gradients
    loss = step(model, first_batch(sharded=True))()
    loss.backward()
    grad = model.module.fc1.weight.grad.detach().clone()
    gathered = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, grad)
    return {"ids": sorted(ids(report)), "synced_after": bool(torch.equal(gathered[0], gathered[1]))}


def scenario_unused() -> dict[str, Any]:
    model = DDP(net(spare=True))
    report = run_audit(model, step(model, first_batch(sharded=True)))
    finding = report.by_id("DDP-001")
    return {"ids": sorted(ids(report)), "params": finding[0].details["params"] if finding else []}


def scenario_unused_allowed() -> dict[str, Any]:
    model = DDP(net(spare=True), find_unused_parameters=True)
    return {"ids": sorted(ids(run_audit(model, step(model, first_batch(sharded=True)))))}


def scenario_batchnorm() -> dict[str, Any]:
    model = DDP(net(batchnorm=True))
    return {"ids": sorted(ids(run_audit(model, step(model, first_batch(sharded=True)))))}


def scenario_batchnorm_frozen() -> dict[str, Any]:
    model = DDP(net(batchnorm=True))
    model.module.bn.eval()  # frozen statistics, as when fine-tuning a pretrained backbone
    return {"ids": sorted(ids(run_audit(model, step(model, first_batch(sharded=True)))))}


def scenario_batchnorm_synced() -> dict[str, Any]:
    # SyncBatchNorm only runs under DDP on GPUs; the static checks still judge the converted model on CPU
    model = nn.SyncBatchNorm.convert_sync_batchnorm(net(batchnorm=True))
    return {"ids": sorted(ids(lora_summary(model)))}


def scenario_unwrapped() -> dict[str, Any]:
    model = net()
    return {"ids": sorted(ids(run_audit(model, step(model, first_batch(sharded=True)))))}


def scenario_bypass() -> dict[str, Any]:
    model = DDP(net())
    report = run_audit(model, step(model.module, first_batch(sharded=True)))  # calls ddp.module(x)
    return {"ids": sorted(ids(report))}


def scenario_diverged() -> dict[str, Any]:
    model = DDP(net())
    if dist.get_rank() == 0:  # "resume" on rank 0 only, after wrapping: DDP does not broadcast again
        with torch.no_grad():
            model.module.fc2.weight.add_(0.5)
    report = run_audit(model, step(model, first_batch(sharded=True)))
    finding = report.by_id("DDP-005")
    return {"ids": sorted(ids(report)), "params": finding[0].details["params"] if finding else []}


def scenario_different_models() -> dict[str, Any]:
    model = net(spare=dist.get_rank() == 1)  # e.g. a config read from a per-node file; DDP would refuse to wrap
    report = run_audit(model, step(model, first_batch(sharded=True)))
    finding = report.by_id("DDP-005")
    return {"ids": sorted(ids(report)), "counts": finding[0].details.get("param_counts") if finding else None}


def scenario_same_batch() -> dict[str, Any]:
    model = DDP(net())
    return {"ids": sorted(ids(run_audit(model, step(model, first_batch(sharded=False)))))}


def scenario_fsdp2() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    results: dict[str, Any] = {}
    for name, sharded in (("fsdp2_sharded", True), ("fsdp2_same_batch", False)):
        model = net()
        fully_shard(model.fc1)
        fully_shard(model)
        results[name] = sorted(ids(run_audit(model, step(model, first_batch(sharded=sharded)))))
    return results


def scenario_lora_ddp() -> dict[str, Any]:
    from _audit_lora_helpers import lm_batch, lora, tiny_gpt2
    from guardtower.preflight._peft import is_peft_model

    model = DDP(lora(tiny_gpt2(), target_modules=["c_attn"], fan_in_fan_out=True))
    x = lm_batch(seed=dist.get_rank())
    report = run_audit(model, lambda: model(input_ids=x, labels=x))
    return {"ids": sorted(ids(report)), "is_peft": is_peft_model(model)}


SCENARIOS = {name[len("scenario_") :]: fn for name, fn in globals().items() if name.startswith("scenario_")}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for name, fn in SCENARIOS.items():
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - reported to the test, which fails with the traceback
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    end_rank()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
