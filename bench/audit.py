"""Benchmark the cost of guardtower's monitor() and audit() against plain training steps.

1. monitor(): step-time ratio of a training step (forward, backward, AdamW step) inside ``monitor()`` to the
   same step without it, interleaved round by round in one process (median of the per-round ratios). The
   naive design (a forward hook per module folding ``isfinite(out).all()`` into a device flag, no host sync)
   is measured alongside for comparison.
2. audit(): wall time and peak memory of one ``audit()`` call as ratios to one plain training step on the
   same model and batch. Time is interleaved in one process; peak memory is measured in a fresh subprocess
   per measurement (CPU: growth of the process high-water mark ``VmHWM`` over the resident size before the
   call, after resetting the mark through ``/proc/self/clear_refs``; CUDA: ``torch.cuda.max_memory_allocated``
   growth), both starting from the same state: model, batch and optimizer built, no step taken.

3. audit(steps=N): wall time of the audit with N overfitting steps on its batch (N = 10, 30, 100) on a tiny GPT
   and GPT-2-small, as seconds and as a multiple of one plain training step, with the verdict.

    python bench/audit.py --device cpu --repeats 15 --json bench-audit.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from guardtower.nonfinite_watch import monitor  # noqa: E402


# -- models and steps -------------------------------------------------------------------------------------
@dataclass
class Workload:
    """A model, its optimizer and one batch, plus the loss closure both steps and audit() use."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: Any
    loss_fn: Callable[[], torch.Tensor]
    device: torch.device
    autocast: bool

    def step(self) -> None:
        """One plain training step: forward, backward, optimizer step."""
        with self._autocast():
            loss = self.loss_fn()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def gpt_workload(kind: str, device: torch.device) -> Workload:
    """``gpt_tiny``: 0.2M-parameter GPT-2; ``gpt6m``: ~6M-parameter GPT-2 (CPU monitor benchmark); ``gpt2s``:
    GPT-2-small, 124M parameters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if kind == "gpt6m":
        config = GPT2Config(n_layer=5, n_embd=256, n_head=4, vocab_size=8000, n_positions=128)
        batch, seq = 8, 128
    elif kind == "gpt_tiny":
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
        batch, seq = 4, 32
    else:
        config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
        batch, seq = (8, 1024) if device.type == "cuda" else (2, 128)
    config.attn_implementation = "sdpa"
    torch.manual_seed(0)
    model: nn.Module = GPT2LMHeadModel(config)
    model.to(device).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return Workload(f"{kind} ({batch}x{seq})", model, optimizer, ids,
                    lambda: model(input_ids=ids, labels=ids).loss, device, autocast=device.type == "cuda")


def mlp_workload(device: torch.device) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    x = torch.randn(32, 64, device=device)
    y = torch.randint(0, 10, (32,), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Workload("mlp (32x64)", model, optimizer, x,
                    lambda: nn.functional.cross_entropy(model(x), y), device, autocast=False)


def build(kind: str, device: torch.device) -> Workload:
    return mlp_workload(device) if kind == "mlp" else gpt_workload(kind, device)


# -- the naive design, for comparison ----------------------------------------------------------------------
@contextlib.contextmanager
def naive_monitor(model: nn.Module) -> Iterator[torch.Tensor]:
    """A forward hook per module that folds ``isfinite(out).all()`` into a device flag (never read here)."""
    first = next(model.parameters())
    flag = torch.zeros((), dtype=torch.bool, device=first.device)

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for t in output if isinstance(output, (tuple, list)) else output.values() if isinstance(output, dict) else (output,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                with torch.no_grad():
                    flag.logical_or_(torch.isfinite(t).all().logical_not())

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield flag
    finally:
        for h in handles:
            h.remove()


# -- part 1: monitor step-time ratio ----------------------------------------------------------------------
def time_steps(work: Workload, steps: int) -> tuple[float, float]:
    """Median wall seconds and median process-CPU seconds per step over ``steps`` timed steps.

    On a shared, oversubscribed CPU machine wall time mostly measures the scheduler; the CPU time this
    process spent (``time.process_time``; run with one thread so no spin-waiting is counted) measures the work.
    """
    wall, cpu = [], []
    for _ in range(steps):
        work.sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        work.step()
        work.sync()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def bench_monitor(kind: str, device: torch.device, repeats: int, steps: int) -> dict[str, Any]:
    work = build(kind, device)
    variants: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "plain": contextlib.nullcontext,
        "monitor": lambda: monitor(work.model, on_nonfinite="raise"),
        "naive_hooks": lambda: naive_monitor(work.model),
    }
    for make in variants.values():  # warm-up: allocator, optimizer state, autotuning
        with make():
            time_steps(work, 2)
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    cpu_rounds: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            with variants[name]():
                wall, cpu = time_steps(work, steps)
            rounds[name].append(wall)
            cpu_rounds[name].append(cpu)
        print(f"  round {r + 1}/{repeats}: " + ", ".join(
            f"{k} {rounds[k][-1] * 1e3:.0f} ms wall / {cpu_rounds[k][-1] * 1e3:.0f} ms cpu" for k in variants),
            file=sys.stderr)
    result: dict[str, Any] = {"workload": work.name, "params": work.params, "device": str(device),
                              "repeats": repeats, "steps_per_round": steps,
                              "median_step_s": {k: statistics.median(v) for k, v in rounds.items()}}
    for name in ("monitor", "naive_hooks"):
        result[f"{name}_ratio"] = statistics.median(a / b for a, b in zip(rounds[name], rounds["plain"]))
    if device.type == "cpu":
        result["median_step_cpu_s"] = {k: statistics.median(v) for k, v in cpu_rounds.items()}
        for name in ("monitor", "naive_hooks"):
            result[f"{name}_cpu_ratio"] = statistics.median(
                a / b for a, b in zip(cpu_rounds[name], cpu_rounds["plain"]))
    return result


# -- part 2: audit cost -----------------------------------------------------------------------------------
def load_audit() -> Callable[..., Any] | None:
    try:
        from guardtower.preflight import audit
    except ImportError:
        return None
    return audit


def run_audit(audit: Callable[..., Any], work: Workload, steps: int = 0) -> Any:
    with work._autocast():
        return audit(work.model, work.loss_fn, optimizer=work.optimizer, inputs=work.inputs, steps=steps)


def bench_overfit(kind: str, device: torch.device, steps: list[int], repeats: int) -> list[dict[str, Any]]:
    """Wall time of ``audit(steps=N)`` (one audit plus N overfitting steps, then restored) and its ratio to one
    plain training step, interleaved with plain steps; the verdict (LOSS-009 or not) and the loss curve's ends."""
    audit = load_audit()
    assert audit is not None
    work = build(kind, device)
    work.step()
    rows = []
    for n in steps:
        plain: list[float] = []
        audited: list[float] = []
        report = None
        for _ in range(repeats):
            work.sync()
            start = time.perf_counter()
            work.step()
            work.sync()
            plain.append(time.perf_counter() - start)
            start = time.perf_counter()
            report = run_audit(audit, work, steps=n)
            work.sync()
            audited.append(time.perf_counter() - start)
        assert report is not None
        losses = next((f.details["losses"] for f in report.by_id("LOSS-009")), None)
        rows.append({"workload": work.name, "params": work.params, "steps": n,
                     "audit_s": statistics.median(audited), "plain_step_s": statistics.median(plain),
                     "time_ratio": statistics.median(audited) / statistics.median(plain),
                     "loss_009": bool(report.by_id("LOSS-009")), "losses_if_failed": losses})
    return rows


def bench_audit_time(kind: str, device: torch.device, repeats: int) -> dict[str, Any]:
    audit = load_audit()
    assert audit is not None
    work = build(kind, device)
    work.step()
    run_audit(audit, work)
    wall: dict[str, list[float]] = {"plain": [], "audit": []}
    cpu: dict[str, list[float]] = {"plain": [], "audit": []}
    for r in range(repeats):
        for name in (("plain", "audit") if r % 2 == 0 else ("audit", "plain")):
            work.sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            if name == "plain":
                work.step()
            else:
                run_audit(audit, work)
            work.sync()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    row = {"workload": work.name, "params": work.params, "plain_step_s": statistics.median(wall["plain"]),
           "audit_s": statistics.median(wall["audit"]),
           "time_ratio": statistics.median(a / p for a, p in zip(wall["audit"], wall["plain"]))}
    if device.type == "cpu":
        row["cpu_time_ratio"] = statistics.median(a / p for a, p in zip(cpu["audit"], cpu["plain"]))
    return row


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_peak_child(kind: str, device_name: str, action: str) -> int:
    """In this (fresh) process: peak bytes allocated by one ``action`` ("step" or "audit") above the start."""
    device = torch.device(device_name)
    work = build(kind, device)
    audit = load_audit() if action == "audit" else None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _rss_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset VmHWM to the current RSS
    if action == "step":
        work.step()
    else:
        assert audit is not None
        run_audit(audit, work)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    return _rss_kib("VmHWM") * 1024 - before


def bench_audit_memory(kind: str, device: torch.device, repeats: int) -> dict[str, Any]:
    peaks: dict[str, list[int]] = {"step": [], "audit": []}
    for r in range(repeats):
        for action in (("step", "audit") if r % 2 == 0 else ("audit", "step")):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_peak-child", kind, str(device),
                                  action], check=True, capture_output=True, text=True)
            peaks[action].append(int(out.stdout.strip().splitlines()[-1]))
    step, audited = statistics.median(peaks["step"]), statistics.median(peaks["audit"])
    return {"plain_step_peak_mib": step / 2**20, "audit_peak_mib": audited / 2**20,
            "memory_ratio": audited / step if step > 0 else float("nan")}


# -- driver -----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds per measurement")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (monitor benchmark)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--skip", choices=("monitor", "audit", "overfit"), action="append", default=[])
    parser.add_argument("--overfit-models", default="gpt_tiny,gpt2s", help="comma-separated: gpt_tiny, gpt2s")
    parser.add_argument("--overfit-steps", default="10,30,100", help="comma-separated N for audit(steps=N)")
    parser.add_argument("--audit-models", default="mlp,gpt2s", help="comma-separated: mlp, gpt2s")
    parser.add_argument("--no-audit-memory", action="store_true", help="measure audit() time only")
    parser.add_argument("--_peak-child", nargs=3, metavar=("MODEL", "DEVICE", "ACTION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._peak_child:
        print(measure_peak_child(*args._peak_child))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")

    results: dict[str, Any] = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                               "torch": torch.__version__, "threads": torch.get_num_threads(),
                               "machine": platform.processor() or platform.machine(),
                               "monitor": [], "audit": [], "overfit": []}
    if "monitor" not in args.skip:
        kind, target = ("gpt2s", 1.05) if device.type == "cuda" else ("gpt6m", 1.10)
        row = bench_monitor(kind, device, args.repeats, args.steps)
        row["target"] = target
        results["monitor"].append(row)
        print(f"monitor() step-time ratio on {row['workload']}, {row['params'] / 1e6:.1f}M params, {device}:")
        cpu_clock = "median_step_cpu_s" in row
        print(f"  {'variant':<14}{'wall/step':>12}{'ratio':>8}" + (f"{'cpu/step':>12}{'ratio':>8}" if cpu_clock else ""))
        for name in ("plain", "monitor", "naive_hooks"):
            line = f"  {name:<14}{row['median_step_s'][name] * 1e3:>9.1f} ms"
            line += f"{1.0 if name == 'plain' else row[f'{name}_ratio']:>8.3f}"
            if cpu_clock:
                line += f"{row['median_step_cpu_s'][name] * 1e3:>9.1f} ms"
                line += f"{1.0 if name == 'plain' else row[f'{name}_cpu_ratio']:>8.3f}"
            print(line)
        print(f"  target for monitor: <= {target:.2f}\n")
    if "audit" not in args.skip:
        if load_audit() is None:
            print("audit(): guardtower.preflight.audit is not available in this checkout - not measured")
            results["audit"] = "not measured: guardtower.preflight.audit missing"
        else:
            print(f"audit() cost as a ratio to one plain training step ({device}; targets: time <= 3x, "
                  "peak memory <= 1.5x):")
            print(f"  {'workload':<22}{'params':>9}{'step':>10}{'audit':>10}{'time x':>8}"
                  f"{'step peak':>12}{'audit peak':>12}{'mem x':>7}")
            for kind in args.audit_models.split(","):
                reps = args.repeats if kind == "mlp" else max(3, args.repeats // 5)
                row = bench_audit_time(kind, device, reps)
                if args.no_audit_memory:
                    row.update({"plain_step_peak_mib": float("nan"), "audit_peak_mib": float("nan"),
                                "memory_ratio": float("nan")})
                else:
                    row.update(bench_audit_memory(kind, device, max(3, reps // 2)))
                results["audit"].append(row)
                print(f"  {row['workload']:<22}{row['params'] / 1e6:>8.2f}M{row['plain_step_s']:>9.3f}s"
                      f"{row['audit_s']:>9.3f}s{row['time_ratio']:>8.2f}{row['plain_step_peak_mib']:>8.0f} MiB"
                      f"{row['audit_peak_mib']:>8.0f} MiB{row['memory_ratio']:>7.2f}"
                      + (f"   (CPU-time ratio {row['cpu_time_ratio']:.2f})" if "cpu_time_ratio" in row else ""))
    if "overfit" not in args.skip and load_audit() is not None:
        print(f"\naudit(steps=N): one audit plus N overfitting steps on the batch, restored ({device}):")
        print(f"  {'workload':<22}{'params':>9}{'N':>5}{'audit':>10}{'step':>10}{'x step':>8}  verdict")
        for kind in args.overfit_models.split(","):
            reps = 3 if kind == "gpt_tiny" else 1
            for row in bench_overfit(kind, device, [int(n) for n in args.overfit_steps.split(",")], reps):
                results["overfit"].append(row)
                print(f"  {row['workload']:<22}{row['params'] / 1e6:>8.2f}M{row['steps']:>5}{row['audit_s']:>9.2f}s"
                      f"{row['plain_step_s']:>9.3f}s{row['time_ratio']:>8.1f}  "
                      + ("LOSS-009 (loss did not fall)" if row["loss_009"] else "loss falls: pass"), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
