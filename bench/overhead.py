"""Step-time overhead of GuardedOptimizer, measured side by side in one process.

The same model and base optimizer take blocks of plain steps (``base.step()``) and guarded steps
(``guard.step()``), interleaved (the order alternates every repeat); each block is ``--steps`` full
training steps (zero_grad, forward, backward, optimizer step), timed end to end (with a device synchronize
at the block's end on CUDA). Reported: median step time of each, their ratio; the guard's own cost isolated
(30 interleaved pairs of ``base.step()``/``guard.step()`` on the same gradients; on a loaded machine the
end-to-end ratio drowns in noise, this one does not) and the ratio it implies; the cost of one
``clip_grad_norm_(foreach=True)`` for reference, and on CUDA the host syncs per guarded step, counted with
``torch.cuda.set_sync_debug_mode("warn")`` around ``guard.step()``, then one step under ``"error"`` mode.

    python bench/overhead.py                       # CPU: ~10M-parameter GPT-2, fused AdamW
    python bench/overhead.py --device cuda         # GPT-2 small (124M), bf16 autocast, fused AdamW, 8 x 1024
    python bench/overhead.py --device cuda --model small   # a launch-bound 2-layer model
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guardtower.guard import GuardedOptimizer  # noqa: E402


class _OpCounter(TorchDispatchMode):
    """Counts every tensor op dispatched while active (what a step launches, before any kernel fusion)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> int:
    with _OpCounter() as counter:
        fn()
    return counter.count


def added_ops(n_tensors: int, steps: int = 12, **guard_kwargs: Any) -> int:
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
    guarded = count_ops(guard.step)
    guard.close()
    return guarded - plain

MODELS: dict[str, dict[str, Any]] = {
    # name: GPT2Config overrides, batch, sequence length
    "cpu10m": {"config": {"n_layer": 6, "n_embd": 320, "n_head": 8, "vocab_size": 8192, "n_positions": 128},
               "batch": 4, "seq": 64},
    "gpt2": {"config": {}, "batch": 8, "seq": 1024},
    "small": {"config": {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 8192, "n_positions": 128},
              "batch": 8, "seq": 128},
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


def time_block(fn: Callable[[], None], steps: int, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / steps


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default=None, choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per timed block")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = args.model or ("gpt2" if device.type == "cuda" else "cpu10m")
    repeats = args.repeats or (20 if device.type == "cuda" else 10)
    steps = args.steps or (10 if device.type == "cuda" else 1)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokens = build(name, device)
    n_params = sum(p.numel() for p in model.parameters())
    base = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    guard = GuardedOptimizer(base, model, log_dir=tempfile.mkdtemp(prefix="gt-overhead-"), verbose=False,
                             log_every=10**9)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def forward_backward() -> None:
        with autocast:
            loss = model(tokens, labels=tokens).loss
        loss.backward()

    def plain() -> None:
        base.zero_grad(set_to_none=True)
        forward_backward()
        base.step()

    def guarded() -> None:
        guard.zero_grad(set_to_none=True)
        forward_backward()
        guard.step()

    for _ in range(3):  # warm up both paths (allocator, fused kernels, the guard's first steps)
        plain()
        guarded()
    plain_times: list[float] = []
    guarded_times: list[float] = []
    for r in range(repeats):
        order = [(plain, plain_times), (guarded, guarded_times)]
        for fn, out in order if r % 2 == 0 else reversed(order):
            out.append(time_block(fn, steps, device))
    # adjacent blocks see the same machine load: the median of their ratios is robust to drifting load
    paired = statistics.median(g / p for g, p in zip(guarded_times, plain_times))

    # the guard's own cost, isolated: optimizer steps alone on the same gradients, interleaved in pairs
    guard.zero_grad()
    forward_backward()
    opt_pairs = [(time_block(base.step, 1, device), time_block(guard.step, 1, device)) for _ in range(30)]
    guard_cost = statistics.median(g - p for p, g in opt_pairs)
    # and the clip_grad_norm_ reference, on the same gradients
    clip = statistics.median(
        time_block(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, foreach=True), 5, device)
        for _ in range(5))
    syncs = None
    strict = ""
    if device.type == "cuda":
        per_step = []
        for _ in range(5):
            guard.zero_grad()
            forward_backward()
            per_step.append(count_syncs(guard.step))
        syncs = max(per_step)
        guard.zero_grad()
        forward_backward()
        strict = strict_sync_check(guard.step)
    guard.close()

    p, g = statistics.median(plain_times), statistics.median(guarded_times)
    print(f"device {device.type}  model {name} ({n_params / 1e6:.1f}M params)  threads {torch.get_num_threads()}  "
          f"repeats {repeats} x {steps} steps")
    print(f"plain step    {1e3 * p:9.2f} ms (median)")
    print(f"guarded step  {1e3 * g:9.2f} ms (median)")
    print(f"ratio         {paired:9.4f}  (median of {repeats} adjacent-block ratios; ratio of medians {g / p:.4f})")
    print(f"guard cost    {1e3 * guard_cost:9.2f} ms per step (median of 30 interleaved base.step/guard.step "
          f"pairs) -> estimated ratio {1 + guard_cost / p:.4f}")
    print(f"clip_grad_norm_(foreach=True) {1e3 * clip:.2f} ms = {clip / p:.4f} of a plain step (reference)")
    if syncs is not None:
        print(f"host syncs per guarded step: {syncs}; set_sync_debug_mode('error') around guard.step(): {strict}")


if __name__ == "__main__":
    main()
