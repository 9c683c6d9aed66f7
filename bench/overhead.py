"""Step-time overhead of GuardedOptimizer, measured side by side in one process.

For each model, one set of weights and one fused AdamW take blocks of full training steps (zero_grad,
forward, backward, optimizer step) through each variant — plain ``base.step()``, the guard with
``nan_action="skip"`` (the default), ``"clip"`` with ``clip="global"`` and ``clip="per_tensor"``, and the skip guard with the old
default ``detector="ratio"`` (for comparison) —
interleaved (the order rotates every repeat, so machine load hits every variant alike; a device synchronize
ends each block on CUDA). Reported per variant: the median over repeats of (its block time / the plain block
of the same repeat) with its quartiles (the spread a loaded machine adds), and the guard's own cost isolated
(interleaved ``base.step()``/``guard.step()`` pairs on the same gradients). Then the cost of BatchNorm protection (a BatchNorm CNN: the guard with and without
``model=``), the tensor ops the guard adds to a step, counted with a ``TorchDispatchMode`` at 30 and 250
parameter tensors (must not grow), and on CUDA the host syncs per guarded step, counted with
``torch.cuda.set_sync_debug_mode("warn")``, then one step under ``"error"`` mode.

    python bench/overhead.py                       # CPU: ~7M and launch-bound ~0.2M GPT-2, BN CNN, op counts
    python bench/overhead.py --device cuda         # GPT-2 small (124M), bf16 autocast, fused AdamW, 8 x 1024
    python bench/overhead.py --models tiny --repeats 30 --variants skip   # the launch-bound model, default guard only
    python bench/overhead.py --clock cpu ...       # blocks timed by this process's CPU time (a shared machine)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guardtower.guard import GuardedOptimizer  # noqa: E402


class _OpCounter(TorchDispatchMode):
    """Counts every tensor op dispatched while active (what a step launches, before any kernel fusion);
    ``tagged`` counts those dispatched while ``tagging`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.tagged = 0
        self.tagging = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        self.tagged += self.tagging
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> int:
    with _OpCounter() as counter:
        fn()
    return counter.count


class OpCount(NamedTuple):
    total: int  # ops a guarded step adds to a plain one
    detector: int  # of which the detector's judge() and update()

    @property
    def mechanics(self) -> int:
        return self.total - self.detector


def added_ops(n_tensors: int, steps: int = 12, **guard_kwargs: Any) -> OpCount:
    """Tensor ops a guard adds to one fused-AdamW step (guarded step minus plain step, same gradients).

    The model is ``n_tensors // 2`` tiny linear layers, so the count shows what grows with the number of
    parameter tensors and nothing else. ``steps`` warm the guard up first (its baselines are then seeded).
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n_tensors // 2)])
    base = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard_kwargs.setdefault("log_dir", tempfile.mkdtemp(prefix="gt-ops-"))
    guard = GuardedOptimizer(base, model, verbose=False, log_every=10**9, **guard_kwargs)
    x = torch.randn(2, 4)
    for _ in range(steps):
        guard.zero_grad()
        model(x).sum().backward()
        guard.step()
    guard.zero_grad()
    model(x).sum().backward()
    plain = count_ops(base.step)
    counter = _OpCounter()
    detector = guard.detector
    for method in ("judge", "update"):
        setattr(detector, method, _tagged(counter, getattr(detector, method)))
    with counter:
        guard.step()
    guard.close()
    return OpCount(counter.count - plain, counter.tagged)


def _tagged(counter: _OpCounter, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        counter.tagging = True
        try:
            return fn(*args)
        finally:
            counter.tagging = False

    return run


MODELS: dict[str, dict[str, Any]] = {
    # name: GPT2Config overrides, batch, sequence length
    "cpu7m": {"config": {"n_layer": 6, "n_embd": 288, "n_head": 6, "vocab_size": 4096, "n_positions": 128},
              "batch": 4, "seq": 64},
    "tiny": {"config": {"n_layer": 3, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 64},
             "batch": 8, "seq": 64},
    "gpt2": {"config": {}, "batch": 8, "seq": 1024},
}
CPU_MODELS = ("cpu7m", "tiny")
VARIANTS: dict[str, dict[str, Any]] = {
    "skip": {},
    "clip_global": {"nan_action": "clip", "clip": "global"},
    "clip_per_tensor": {"nan_action": "clip", "clip": "per_tensor"},
    # the old default detector, for comparison (its false alarms only skip steps here: same cost)
    "skip_ratio_detector": {"detector": "ratio", "max_consecutive_skips": None},
}


def build(name: str, device: torch.device) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    spec = MODELS[name]
    torch.manual_seed(0)
    config = GPT2Config(**spec["config"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0, loss_type="ForCausalLM")
    model = GPT2LMHeadModel(config).to(device)
    tokens = torch.randint(0, config.vocab_size, (spec["batch"], spec["seq"]), device=device)
    return model, tokens


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# what a block is timed with: wall time, or with ``--clock cpu`` this process's CPU time, which leaves out the
# time other processes hold the cores (on an oversubscribed machine that is most of the wall-clock spread)
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def time_block(fn: Callable[[], Any], steps: int, device: torch.device) -> float:
    sync(device)
    start = clock()
    for _ in range(steps):
        fn()
    sync(device)
    return (clock() - start) / steps


def count_syncs(fn: Callable[[], None]) -> int:
    """Host syncs ``fn`` performs on CUDA, as reported by the sync debug mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def strict_sync_check(fn: Callable[[], None]) -> str:
    """Run ``fn`` under ``torch.cuda.set_sync_debug_mode("error")``: any host sync raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "passed (no host sync)"
    except RuntimeError as exc:
        return "FAILED: " + (str(exc).splitlines() or ["sync"])[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, steps: int, device: torch.device) -> dict[str, list[float]]:
    """Block times of every variant, the order rotated every repeat."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(time_block(fns[name], steps, device))
    return times


class Ratio(NamedTuple):
    """A variant's per-repeat ratios (its block time / the reference block of the same repeat), summarised."""

    median: float
    low: float  # first quartile
    high: float  # third quartile

    def __str__(self) -> str:
        return f"{self.median:.4f} (quartiles {self.low:.3f}-{self.high:.3f})"


def ratios(times: dict[str, list[float]], reference: str) -> dict[str, Ratio]:
    """Per variant: the median and quartiles over repeats of its block time / the reference block of the same repeat."""
    out: dict[str, Ratio] = {}
    for name, values in times.items():
        if name != reference:
            each = [t / p for t, p in zip(values, times[reference])]
            low, _, high = statistics.quantiles(each, n=4) if len(each) > 1 else (each[0],) * 3
            out[name] = Ratio(statistics.median(each), low, high)
    return out


def gpt_overhead(name: str, device: torch.device, repeats: int, steps: int, variants: list[str]) -> None:
    model, tokens = build(name, device)
    n_params = sum(p.numel() for p in model.parameters())
    base = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    guards = {variant: GuardedOptimizer(base, model, log_dir=tempfile.mkdtemp(prefix="gt-overhead-"),
                                        verbose=False, log_every=10**9, **VARIANTS[variant])
              for variant in variants}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def forward_backward() -> None:
        with autocast:
            loss = model(tokens, labels=tokens).loss
        loss.backward()

    def training_step(opt: torch.optim.Optimizer) -> Callable[[], None]:
        def run() -> None:
            opt.zero_grad(set_to_none=True)
            forward_backward()
            opt.step()

        return run

    fns = {"plain": training_step(base), **{v: training_step(g) for v, g in guards.items()}}
    for fn in fns.values():  # warm up every path (allocator, fused kernels, the guards' first steps)
        for _ in range(3):
            fn()
    times = interleaved(fns, repeats, steps, device)
    step_ratios = ratios(times, "plain")
    plain = statistics.median(times["plain"])

    # the guard's own cost, isolated: optimizer steps alone on the same gradients, interleaved in pairs
    base.zero_grad()
    forward_backward()
    own = {v: statistics.median(time_block(g.step, 1, device) - time_block(base.step, 1, device) for _ in range(30))
           for v, g in guards.items()}
    print(f"\n== {name}: GPT-2, {n_params / 1e6:.2f}M params, {device.type}, threads {torch.get_num_threads()}, "
          f"{'CPU time' if clock is CLOCKS['cpu'] else 'wall clock'}, "
          f"{repeats} repeats x {steps} steps; plain step {1e3 * plain:.2f} ms (median)")
    for variant in guards:
        print(f"  {variant:16s} step ratio {step_ratios[variant]} (median of per-repeat ratios)   guard's own "
              f"cost {1e3 * own[variant]:7.3f} ms -> {1 + own[variant] / plain:.4f}")
    if device.type == "cuda":
        for variant, guard in guards.items():
            per_step = []
            for _ in range(5):
                guard.zero_grad()
                forward_backward()
                per_step.append(count_syncs(guard.step))
            guard.zero_grad()
            forward_backward()
            print(f"  {variant:16s} host syncs per guarded step: {max(per_step)}; set_sync_debug_mode('error'): "
                  f"{strict_sync_check(guard.step)}")
    for guard in guards.values():
        guard.close()


def batchnorm_overhead(device: torch.device, repeats: int, steps: int) -> None:
    """What BatchNorm protection costs: a BN CNN guarded with ``model=`` (protected) and without."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    channels = 3
    for width in (16, 16, 32, 32, 64, 64):
        layers += [torch.nn.Conv2d(channels, width, 3, padding=1), torch.nn.BatchNorm2d(width), torch.nn.ReLU()]
        channels = width
    model = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(channels, 10)).to(device)
    x = torch.randn(16, 3, 8, 8, device=device)
    y = torch.randint(0, 10, (16,), device=device)
    base = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    protected = GuardedOptimizer(base, model, verbose=False, log_every=10**9,
                                 log_dir=tempfile.mkdtemp(prefix="gt-overhead-"))
    unprotected = GuardedOptimizer(base, None, verbose=False, log_every=10**9,
                                   log_dir=tempfile.mkdtemp(prefix="gt-overhead-"))

    def training_step(opt: torch.optim.Optimizer) -> Callable[[], None]:
        def run() -> None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        return run

    fns = {"plain": training_step(base), "guard_no_model": training_step(unprotected),
           "guard_bn_protected": training_step(protected)}
    for fn in fns.values():
        for _ in range(3):
            fn()
    times = interleaved(fns, repeats, steps, device)
    step_ratios = ratios(times, "plain")
    n_buffers = sum(1 for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)) * 3
    print(f"\n== BatchNorm CNN, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {n_buffers} BN "
          f"buffers; plain step {1e3 * statistics.median(times['plain']):.2f} ms")
    for name, value in step_ratios.items():
        print(f"  {name:20s} step ratio {value}")
    print(f"  BN protection alone: {step_ratios['guard_bn_protected'].median / step_ratios['guard_no_model'].median:.4f}; "
          f"ops it adds per step: {count_ops(training_step(protected)) - count_ops(training_step(unprotected))}")
    protected.close()
    unprotected.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per timed block")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="guard variants to time against the plain step (fewer: each repeat is shorter)")
    parser.add_argument("--clock", default="wall", choices=list(CLOCKS),
                        help="time blocks by wall clock or by this process's CPU time (CPU only: a shared machine)")
    parser.add_argument("--no-bn", action="store_true", help="skip the BatchNorm protection measurement")
    args = parser.parse_args(argv)
    global clock
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu times CPU work; on CUDA the step's time is the device's: use --clock wall")
    clock = CLOCKS[args.clock]
    device = torch.device(args.device)
    names = args.models or (["gpt2"] if device.type == "cuda" else list(CPU_MODELS))
    repeats = args.repeats or (20 if device.type == "cuda" else 12)
    steps = args.steps or (10 if device.type == "cuda" else 2)
    if args.threads:
        torch.set_num_threads(args.threads)

    print("tensor ops the guard adds to one fused-AdamW step (guarded minus plain; must not grow with tensors):")
    for variant in args.variants:
        kwargs = VARIANTS[variant]
        small, large = added_ops(30, **kwargs), added_ops(250, **kwargs)
        print(f"  {variant:16s} 30 tensors: {small.total:3d} ({small.detector} in the detector)   "
              f"250 tensors: {large.total:3d} ({large.detector} in the detector)")
    for name in names:
        gpt_overhead(name, device, repeats, steps, args.variants)
    if not args.no_bn:
        batchnorm_overhead(device, repeats, steps)


if __name__ == "__main__":
    main()
