"""Detection quality: a tiny GPT trained 1,000 steps on CPU with 20 injected incidents.

Incidents (fixed seed): 10 x one random layer's gradient scaled by 10^2..10^4, 5 x NaN/Inf in one gradient
tensor, 5 x a corrupted batch (one token repeated, labelled with the token the model finds least likely). Compared:
the default detector and the alternatives in ``guardtower.guard.detector`` (a pre-update EMA, a rolling
128-step mean + 6 sigma rule, and the z-score detector), plus a clean run (no incidents, no guard) and an
unguarded run (incidents, no guard). Reported: recall over incidents, false-positive steps per 1,000 clean
steps, and the final held-out loss.

    python bench/detection.py [--steps 1000] [--scenario mixed|burst] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guardtower.events import SpikeEvent  # noqa: E402
from guardtower.guard import GuardedOptimizer  # noqa: E402
from guardtower.testing import capture_events  # noqa: E402

VOCAB, SEQ, BATCH = 64, 32, 8
DETECTORS = ("ratio", "zscore", "pre_update_ema", "rolling_sigma")


def make_model(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        loss_type="ForCausalLM")
    return GPT2LMHeadModel(config)


class MarkovData:
    """Sequences from a fixed sparse Markov chain: learnable, so the loss falls steadily.

    Batches are generated once, vectorised, and shared by every run, so all runs see the same data.
    """

    def __init__(self, train_batches: int, eval_batches: int = 16, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        probs = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 3.0, dim=-1)
        rows = (train_batches + eval_batches) * BATCH
        tokens = torch.empty(rows, SEQ, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (rows,), generator=gen)
        for t in range(1, SEQ):
            tokens[:, t] = torch.multinomial(probs[tokens[:, t - 1]], 1, generator=gen).squeeze(1)
        batches = tokens.view(-1, BATCH, SEQ)
        self.train = batches[:train_batches]
        self.eval = batches[train_batches:]


def plan_incidents(steps: int, seed: int = 1) -> dict[int, tuple[str, float]]:
    """20 incidents at distinct steps after warmup: (kind, parameter)."""
    rng = random.Random(seed)
    at = sorted(rng.sample(range(50, steps), 20))
    kinds = ["scale"] * 10 + ["nonfinite"] * 5 + ["batch"] * 5
    rng.shuffle(kinds)
    plan: dict[int, tuple[str, float]] = {}
    for step, kind in zip(at, kinds):
        plan[step] = (kind, 10 ** rng.uniform(2, 4) if kind == "scale" else rng.random())
    return plan


def plan_bursts(steps: int, seed: int = 2) -> dict[int, tuple[str, float]]:
    """4 bursts of 5 consecutive steps on one layer (a layer going unstable): x1000, then x100 four times.

    ``BURST_LAYERS[step]`` picks the burst's layer (modulo the number of parameters).
    """
    rng = random.Random(seed)
    plan: dict[int, tuple[str, float]] = {}
    for start in sorted(rng.sample(range(50, steps - 5, 25), 4)):
        layer = rng.randrange(1_000_000)
        for k, step in enumerate(range(start, start + 5)):
            plan[step] = ("scale", 1000.0 if k == 0 else 100.0)
            BURST_LAYERS[step] = layer
    return plan


BURST_LAYERS: dict[int, int] = {}


def corrupt_batch(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A degenerate batch (one token repeated) labelled with what the model finds least likely: loss ~5x."""
    inputs = torch.full_like(tokens, int(tokens[0, 0]))
    with torch.no_grad():
        labels = model(inputs).logits.argmin(dim=-1)
    return inputs, labels


def train(steps: int, plan: dict[int, tuple[str, float]], detector: str | None, data: MarkovData) -> dict[str, Any]:
    model = make_model()
    base = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    log_dir = tempfile.mkdtemp(prefix="gt-detect-")
    optimizer: torch.optim.Optimizer = base
    if detector is not None:
        optimizer = GuardedOptimizer(base, model, detector=detector, log_dir=log_dir, verbose=False,
                                     max_consecutive_skips=None, log_every=10_000)
    names = [n for n, _ in model.named_parameters()]
    rng = random.Random(7)
    started = time.perf_counter()
    with capture_events() as events:
        for step in range(steps):
            optimizer.zero_grad()
            tokens = labels = data.train[step]
            kind, param = plan.get(step, ("", 0.0))
            if kind == "batch":
                tokens, labels = corrupt_batch(model, tokens)
            out = model(tokens, labels=labels)
            out.loss.backward()
            if kind in ("scale", "nonfinite"):
                pick = rng.randrange(len(names))
                name = names[BURST_LAYERS[step] % len(names)] if step in BURST_LAYERS else names[pick]
                grad = dict(model.named_parameters())[name].grad
                assert grad is not None
                if kind == "scale":
                    grad.mul_(param)
                else:
                    grad.view(-1)[0] = float("nan") if param < 0.5 else float("inf")
            if isinstance(optimizer, GuardedOptimizer):
                optimizer.step(loss=out.loss.detach())
            else:
                optimizer.step()
        if isinstance(optimizer, GuardedOptimizer):
            optimizer.close()
    elapsed = time.perf_counter() - started
    rejected = {e.step - 1 for e in events if isinstance(e, SpikeEvent)}  # guard steps are 1-based
    incidents = set(plan)
    clean_steps = steps - len(incidents)
    result: dict[str, Any] = {
        "detector": detector or ("unguarded" if plan else "clean"),
        "final_loss": evaluate(model, data),
        "seconds": round(elapsed, 1),
    }
    if detector is not None:
        caught = incidents & rejected
        result["recall"] = len(caught) / len(incidents)
        result["missed"] = sorted((s, plan[s][0], round(plan[s][1], 1)) for s in incidents - rejected)
        result["false_positives"] = len(rejected - incidents)
        result["fp_per_1000_clean"] = 1000 * len(rejected - incidents) / clean_steps
    return result


def evaluate(model: torch.nn.Module, data: MarkovData) -> float:
    """Mean loss over the held-out batches."""
    model.eval()
    with torch.no_grad():
        losses = [model(t, labels=t).loss.item() for t in data.eval]
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--detectors", default=",".join(DETECTORS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--scenario", default="mixed", choices=["mixed", "burst"],
                        help="mixed: the 20 incidents above; burst: 4 x (x1000 then 4 x x100) on one layer")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    plan = plan_incidents(args.steps) if args.scenario == "mixed" else plan_bursts(args.steps)
    data = MarkovData(args.steps)
    results = [train(args.steps, {}, None, data), train(args.steps, plan, None, data)]
    for detector in args.detectors.split(","):
        results.append(train(args.steps, plan, detector, data))
    clean_loss = results[0]["final_loss"]
    print(f"{'run':<16} {'recall':>7} {'FP/1k clean':>12} {'final loss':>11} {'vs clean':>9} {'s':>6}")
    for r in results:
        recall = f"{100 * r['recall']:.0f}%" if "recall" in r else "-"
        fp = f"{r['fp_per_1000_clean']:.2f}" if "fp_per_1000_clean" in r else "-"
        loss = r["final_loss"]
        delta = f"{100 * (loss - clean_loss) / clean_loss:+.1f}%" if math.isfinite(loss) else "nan"
        print(f"{r['detector']:<16} {recall:>7} {fp:>12} {loss:>11.4f} {delta:>9} {r['seconds']:>6}")
        if r.get("missed"):
            print(f"{'':<16} missed: {r['missed']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
