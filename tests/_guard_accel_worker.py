"""One rank of the 2-process Accelerate tests (run by tests/test_guard_accelerate.py via tests/_dist_launch.py).

Usage: python tests/_guard_accel_worker.py OUT_DIR (RANK/WORLD_SIZE/MASTER_* set by the launcher: Accelerate
builds its own gloo group and wraps the model in DDP). Every scenario trains the same tiny model under
``Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)``: the guard inside Accelerate's wrapper
(``accelerator.prepare(GuardedOptimizer(opt))``, "inside") and around it (``GuardedOptimizer(accelerator.prepare(
opt))``, "around"), each plain and with a real ``torch.amp.GradScaler("cpu")`` on the Accelerator (what fp16
gets on a GPU; Accelerate gives none on the CPU), each healthy and with incidents. Writes OUT_DIR/rank{RANK}.json.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guardtower.events import SkipEvent  # noqa: E402
from guardtower.guard import GuardedOptimizer  # noqa: E402
from guardtower.testing import InMemorySink  # noqa: E402
from tests._dist_launch import end_rank  # noqa: E402

STEPS = 30  # optimizer steps, of ACCUMULATION micro-batches each
ACCUMULATION = 2
SPIKE_STEP = 12  # rank 1's first micro-batch loss x1e4: reaches every rank through the accumulated all-reduce
NAN_STEP = 20  # NaN in rank 0's gradient after the all-reduce: only rank 0 sees it (not inside with a scaler:
# there only rank 0's scaler would lower its scale, which the guard inside the scaler's step cannot reach)
OVERFLOW_STEP = 16  # with a scaler: rank 1's loss x1e38 overflows the scaled gradients on every rank


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def scenario(order: str, scaler: bool, incidents: bool) -> str:
    return f"{order}{'-scaler' if scaler else ''}{'-incidents' if incidents else ''}"


def run(order: str, scaler: bool, incidents: bool, out: Path) -> dict[str, Any]:
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUMULATION)
    if scaler:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    rank = accelerator.process_index
    model = make_model()
    sink = InMemorySink()
    kw: dict[str, Any] = {"log_dir": out / "logs" / scenario(order, scaler, incidents), "verbose": False, "sinks": [sink]}
    # inside: a fused base (GradScaler hands the guard its tensors); around: a plain one (the guard decides on the host)
    if order == "inside":
        guard = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model, **kw)
        model, optimizer = accelerator.prepare(model, guard)
        assert type(optimizer).__name__ == "AcceleratedOptimizer" and optimizer.optimizer is guard
    else:
        model, prepared = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        guard = optimizer = GuardedOptimizer(prepared, model, **kw)
    unchanged: dict[int, bool] = {}
    for micro in range(STEPS * ACCUMULATION):
        step, last = micro // ACCUMULATION + 1, micro % ACCUMULATION == ACCUMULATION - 1
        gen = torch.Generator().manual_seed(1000 * rank + micro)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        with accelerator.accumulate(model):
            loss = ((model(x) - y) ** 2).mean()
            if incidents and rank == 1 and not last and step == SPIKE_STEP:
                loss = loss * 1e4
            if incidents and scaler and rank == 1 and last and step == OVERFLOW_STEP:
                loss = loss * 1e38
            accelerator.backward(loss)
            if incidents and rank == 0 and last and step == NAN_STEP and not (scaler and order == "inside"):
                model.module[2].weight.grad.fill_(float("nan"))
            before = digest(model) if last and step in (SPIKE_STEP, NAN_STEP) else None
            optimizer.step()
            if before is not None:
                unchanged[step] = digest(model) == before
            optimizer.zero_grad()
    state = optimizer.state_dict()  # through Accelerate's wrapper (inside) or the guard's own (around)
    result = {
        "skips": [e.step for e in sink.events if isinstance(e, SkipEvent)],
        "counters": [guard.step_count, guard.total_spikes, guard.total_skips, guard.total_overflows],
        "unchanged": unchanged,
        "scale": accelerator.scaler.get_scale() if scaler else None,
        "digest": digest(model),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "saved_skips": state["guardtower"]["total_skips"],
    }
    if order == "inside" and incidents and not scaler:
        result["resumed"] = resume(accelerator, model, guard, out / "ckpt", kw)
    guard.close()
    return result


def resume(accelerator: Any, model: nn.Module, guard: GuardedOptimizer, folder: Path, kw: dict[str, Any]) -> list[int]:
    """``accelerator.save_state`` then ``load_state`` into a fresh guard: its counters come back."""
    import accelerate

    accelerator.save_state(str(folder))
    fresh = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUMULATION)
    again = make_model()
    guard_again = GuardedOptimizer(torch.optim.AdamW(again.parameters(), lr=1e-2, fused=True), again,
                                   **{**kw, "sinks": None, "log_dir": folder / "logs"})
    fresh.prepare(again, guard_again)
    fresh.load_state(str(folder))
    counters = [guard_again.step_count, guard_again.total_spikes, guard_again.total_skips]
    guard_again.close()
    return counters


def main(out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = {scenario(order, scaler, incidents): run(order, scaler, incidents, out)
               for order in ("inside", "around") for scaler in (False, True) for incidents in (False, True)}
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    end_rank()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
