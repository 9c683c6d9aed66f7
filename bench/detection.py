"""Detection benchmark: false alarms on healthy runs, recall on injected incidents, for every detector.

Healthy runs (``bench/_healthy.py``, ``bench/_trainer_runs.py``): transformers GPT-2 and Llama built from
configs, a GRU LM (all on the text of Python's standard library, bytes as tokens), deep LayerNorm MLPs on
three scikit-learn datasets, a deep non-residual LayerNorm MLP on random labels (loss nearly flat), BatchNorm
CNNs on digits, a peft LoRA GPT-2 in a plain loop and through the HF ``Trainer`` and a full BERT classifier
fine-tune through the real HF ``Trainer``; AdamW, SGD+momentum, RMSprop, Adagrad; constant LR from step 0
and warmup+cosine/linear; all from step 0.

Method: each configuration trains once unguarded while recording what the guard sees per step (per-tensor
gradient norms with the guard's own meter, global norm, loss) and, at 18 chosen steps (9 incident kinds,
once early in steps 15-49 and once in the last third), an incident observation that is *not* applied:
one gradient tensor x100/x1e3/x1e4 (the smallest and the largest tensor), NaN, Inf, and a corrupted batch
(every label replaced by the class the model finds least likely; a real forward/backward). Every detector
is replayed over the same traces as the guard runs it (judge, then update with accept = not rejected);
recall is the share of incident observations it rejects given its state at that step. Then the real
``GuardedOptimizer`` (defaults) trains every healthy configuration live, the HF configurations through
``StabilityGuardCallback()``, and a subset live with the incidents applied. Then genuine instability (LRs
that diverge unguarded) and sustained level shifts against repeated spikes.

The default detector's constants were chosen on seed-0 traces; the benchmark runs seed 1 by default.

    OMP_NUM_THREADS=1 python bench/detection.py [--seed 1] [--quick] [--held-out] [--out bench/results/detection]

``--held-out`` runs only the healthy runs of ``bench/_heldout.py`` (families never used to tune the default:
a CNN without normalisation, an LSTM, a BERT-tiny MLM, a ViT-tiny, a T5-tiny seq2seq), replayed and live.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _healthy import CONFIGS, Config, NormMLP, _digits, _loop, _sgd, gpt2, lm_batches  # noqa: E402
from _heldout import HELDOUT  # noqa: E402
from _rules import LightningSpikeRule, MegatronRule, OLMoCoreRule, ZClipRule  # noqa: E402
from _trace import KINDS, SCALES, Trace, live, plan, record, replay  # noqa: E402
from _trainer_runs import TRAINER_CONFIGS, live_trainer, record_trainer  # noqa: E402

from guardtower.errors import ConfigError  # noqa: E402
from guardtower.guard.detector import (  # noqa: E402
    AutoDetector,
    Detector,
    PreUpdateEMADetector,
    RatioDetector,
    ZScoreDetector,
)

DETECTORS: dict[str, Callable[[], Detector]] = {
    "auto (new default)": AutoDetector,
    "ratio (old default)": RatioDetector,
    "zscore": ZScoreDetector,
    "EMA updated before compare": PreUpdateEMADetector,
    "OLMo-core 6σ/128 (loss, norm)": OLMoCoreRule,
    "ZClip z=2.5 α=0.97": ZClipRule,
    "Lightning SpikeDetection": LightningSpikeRule,
    "Megatron 10x max(first 100)": MegatronRule,
}
LIVE_INJECTED = ("gpt2-adamw-const3e-3", "mlp-ln-digits-sgd-const", "cnn-bn-digits-adamw-const")


def kinds_of(config: Any) -> tuple[str, ...]:
    """The incident kinds a configuration is tested with: no corrupted batch where it has no ``corrupt``."""
    return KINDS if getattr(config, "corrupt", True) is not None else tuple(k for k in KINDS if k != "batch")


def _quiet() -> Any:
    """The HF Trainer prints its log dicts; keep the benchmark's output to the tables."""
    return contextlib.redirect_stdout(io.StringIO())


def _kind_group(kind: str) -> str:
    if kind in ("nan", "inf"):
        return "NaN/Inf"
    if kind == "batch":
        return "corrupted batch"
    return kind.split("-")[0]


# ---------------------------------------------------------------- healthy runs + injected incidents
def _jump(config: str, trace: Any, t: int) -> dict[str, Any]:
    """What a rejected healthy step looked like: its global norm and its largest tensor's norm over their medians
    of the 10 steps before, and what that tensor's jump does to Adam's second moment (beta2 = 0.999): the factor
    by which it inflates v, and the steps v takes to decay back (its updates shrink by sqrt of that meanwhile)."""
    before = trace.norms[max(0, t - 10):t]
    if t == 0 or before.shape[0] == 0:
        return {"config": config, "step": t}
    ratios = trace.norms[t] / before.median(0).values.clamp_min(1e-30)
    worst = int(ratios.argmax())
    ratio = float(ratios[worst])
    inflation = 1.0 + 1e-3 * (ratio * ratio - 1.0)
    return {"config": config, "step": t,
            "global_ratio": round(float(trace.global_norm[t] / trace.global_norm[max(0, t - 10):t].median()), 1),
            "tensor": trace.names[worst], "tensor_ratio": round(ratio, 1), "adam_v_inflation": round(inflation, 1),
            "adam_recovery_steps": round(math.log(inflation) / -math.log(0.999)) if inflation > 1 else 0}


def healthy(seed: int, quick: bool, held_out: bool = False) -> dict[str, Any]:
    configs: list[Any] = list(HELDOUT if held_out else CONFIGS[:2] if quick else CONFIGS)
    trainer_configs = [] if quick or held_out else TRAINER_CONFIGS
    per_detector: dict[str, dict[str, Any]] = {name: {"steps": 0, "false_alarms": 0, "stopped": [], "caught": [],
                                                      "rejected_steps": []} for name in DETECTORS}
    runs: list[dict[str, Any]] = []
    for config in configs + trainer_configs:
        steps = 200 if quick else config.steps
        started = time.perf_counter()
        incidents = plan(steps, kinds_of(config))
        if isinstance(config, Config):
            trace = record(config, seed, incidents, steps=steps)
            live_run = live(config, seed, steps=steps)
            live_row = {"steps": live_run.steps, "false_alarms": live_run.rejected,
                        "stopped": live_run.stopped_at is not None, "final_loss": live_run.final_loss}
        else:
            with _quiet():
                trace = record_trainer(config, seed, incidents)
                trainer_live = live_trainer(config, seed)
            live_row = {"steps": trainer_live.steps, "false_alarms": trainer_live.rejected,
                        "stopped": trainer_live.stopped, "final_loss": trainer_live.final_loss}
        for name, factory in DETECTORS.items():
            result, rejected = replay(factory(), trace)
            row = per_detector[name]
            row["steps"] += result.steps
            row["false_alarms"] += result.false_alarms
            if result.stopped_at is not None:
                row["stopped"].append(f"{config.name}@{result.stopped_at}")
            row["caught"] += [(config.name, kind, phase, ok) for (kind, phase), ok in result.caught.items()]
            row["rejected_steps"] += [_jump(config.name, trace, t) for t, r in enumerate(rejected) if r][:20]
        runs.append({"config": config.name, "family": config.family, "optimizer": config.optimizer,
                     "schedule": config.schedule, "steps": trace.norms.shape[0], "tensors": trace.norms.shape[1],
                     "unguarded_final_loss": trace.final_loss, "first_loss": float(trace.loss[:5].nanmean()),
                     "live_default": live_row, "seconds": round(time.perf_counter() - started, 1)})
        print(f"  {config.name}: {trace.norms.shape[0]} steps, loss {runs[-1]['first_loss']:.3g} -> "
              f"{trace.final_loss:.3g}; live default: {live_row['false_alarms']} rejected, "
              f"stopped={live_row['stopped']} ({runs[-1]['seconds']}s)", flush=True)
    return {"runs": runs, "detectors": per_detector}


def live_injected(seed: int, quick: bool) -> list[dict[str, Any]]:
    """The real guard (defaults) with the incidents applied to the gradients / batches."""
    out = []
    for config in CONFIGS:
        if config.name not in LIVE_INJECTED or (quick and config.name != LIVE_INJECTED[0]):
            continue
        steps = 200 if quick else config.steps
        incidents = plan(steps, kinds_of(config))
        result = live(config, seed, incidents, steps=steps)
        caught = sum(result.caught.values())
        out.append({"config": config.name, "incidents": len(result.caught), "caught": caught,
                    "missed": sorted(f"{k}/{p}" for (k, p), ok in result.caught.items() if not ok),
                    "false_alarms": result.rejected - caught, "stopped": result.stopped_at is not None,
                    "final_loss": result.final_loss})
        print(f"  live with incidents, {config.name}: caught {caught}/{len(result.caught)}, "
              f"{result.rejected - caught} other rejections, final loss {result.final_loss:.3g}", flush=True)
    return out


# ---------------------------------------------------------------- genuine instability
UNSTABLE = [
    Config("gpt2-sgd-lr1", "gpt2", "SGD+momentum 1.0", "constant", 300,
           _loop(gpt2, _sgd(1.0), "constant", 300, lm_batches)),
    Config("mlp-ln-digits-sgd-lr3", "mlp-layernorm", "SGD+momentum 3.0", "constant", 300,
           _loop(lambda: NormMLP(64, 10), _sgd(3.0), "constant", 300, _digits)),
]
UNSTABLE[0].loss = CONFIGS[0].loss
UNSTABLE[0].corrupt = CONFIGS[0].corrupt


def instability(seed: int, quick: bool) -> list[dict[str, Any]]:
    out = []
    for config in UNSTABLE[:1] if quick else UNSTABLE:
        steps = 150 if quick else config.steps
        trace = record(config, seed, steps=steps)
        row: dict[str, Any] = {"config": config.name, "unguarded": _outcome(trace.loss)}
        for action in ("skip", "clip"):
            try:
                result = live(config, seed, steps=steps, nan_action=action)
            except ConfigError as exc:  # nan_action="clip" arrives with the guard-mechanics branch
                row[action] = f"n/a ({exc})"
                continue
            row[action] = (f"{'stopped by escalation at step ' + str(result.stopped_at) if result.stopped_at is not None else 'ran ' + str(result.steps) + ' steps'}, "
                           f"{result.rejected} rejected, final loss {result.final_loss:.3g}")
        out.append(row)
        print(f"  {config.name}: unguarded {row['unguarded']}; skip: {row['skip']}; clip: {row['clip']}", flush=True)
    return out


def _outcome(loss: torch.Tensor) -> str:
    finite = torch.isfinite(loss)
    if not bool(finite.all()):
        return f"loss NaN/Inf at step {int((~finite).nonzero()[0])}"
    return f"final loss {float(loss[-20:].mean()):.3g} (min {float(loss.min()):.3g})"


# ---------------------------------------------------------------- sustained shifts vs repeated spikes
def _scaled(trace: Trace, steps: range, factor: float, tensor: int | None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    override = {}
    for t in steps:
        norms = trace.norms[t].clone()
        if tensor is None:
            norms *= factor
        else:
            norms[tensor] *= factor
        override[t] = (norms, torch.linalg.vector_norm(norms))
    return override


def shifts(seed: int, quick: bool) -> list[dict[str, Any]]:
    """Replays of a healthy trace with a legitimate sustained shift, or with repeated real spikes."""
    config = CONFIGS[1]  # llama, warmup + cosine
    steps = 200 if quick else config.steps
    trace = record(config, seed, steps=steps)
    large = max(range(trace.norms.shape[1]), key=lambda i: trace.norms[:, i].mean().item())
    start = steps // 2
    scenarios = {
        "shift: every gradient x30 from mid-run (loss reduction mean -> sum)": (_scaled(trace, range(start, steps), 30.0, None), True),
        "shift: the largest tensor x30 from mid-run (a layer unfrozen / re-scaled)": (_scaled(trace, range(start, steps), 30.0, large), True),
        "spikes: x1000 on the largest tensor every 50 steps": (_scaled(trace, range(60, steps, 50), 1e3, large), False),
        "spikes: 3 in a row, x1000": (_scaled(trace, range(start, start + 3), 1e3, large), False),
        "spikes: 6 in a row, x100..x1e4": ({**_scaled(trace, range(start, start + 2), 1e2, large),
                                            **_scaled(trace, range(start + 2, start + 4), 1e4, large),
                                            **_scaled(trace, range(start + 4, start + 6), 1e3, large)}, False),
        "spikes: 12 in a row, x1000 (longer than absorb_after=8)": (_scaled(trace, range(start, start + 12), 1e3, large), False),
    }
    out = []
    for label, (override, legit) in scenarios.items():
        row: dict[str, Any] = {"scenario": label, "legitimate": legit, "injected_steps": len(override)}
        for name, factory in DETECTORS.items():
            result, rejected = replay(factory(), trace, override=override)
            hit = sum(rejected[t] for t in override)
            last = max(override)
            tail = [rejected[t] for t in override if t > last - 20] if legit else []
            row[name] = {"rejected": hit, "absorbed": result.absorbed, "stopped": result.stopped_at is not None,
                         "rejected_in_last_20_shifted_steps": sum(tail)}
        out.append(row)
        auto = row["auto (new default)"]
        print(f"  {label}: default rejects {auto['rejected']}/{len(override)}, absorbed {auto['absorbed']}, "
              f"stopped={auto['stopped']}", flush=True)
    return out


# ---------------------------------------------------------------- tables
def _pct(caught: list[tuple[str, str, str, bool]], keep: Callable[[str, str], bool]) -> str:
    chosen = [ok for _, kind, phase, ok in caught if keep(kind, phase)]
    return f"{100 * sum(chosen) / len(chosen):.1f}%" if chosen else "-"


def tables(result: dict[str, Any]) -> str:
    h = result["healthy"]
    n_runs = len(h["runs"])
    total_steps = sum(r["steps"] for r in h["runs"])
    groups = ["x100", "x1e3", "x1e4", "NaN/Inf", "corrupted batch"]
    lines = [f"Healthy runs: {n_runs} configurations, {total_steps} steps, seed {result['seed']}. "
             f"Incidents: {len(h['detectors']['auto (new default)']['caught'])} observations (replayed).", "",
             "| detector | healthy false alarms / 1,000 steps | healthy runs stopped | recall | recall early | "
             "recall late | " + " | ".join(groups) + " |",
             "|---" * (6 + len(groups)) + "|"]
    for name, row in h["detectors"].items():
        caught = row["caught"]
        cells = [_pct(caught, lambda k, p, g=g: _kind_group(k) == g) for g in groups]
        lines.append(f"| {name} | {1000 * row['false_alarms'] / max(1, row['steps']):.2f} ({row['false_alarms']}) | "
                     f"{len(row['stopped'])}/{n_runs} | {_pct(caught, lambda k, p: True)} | "
                     f"{_pct(caught, lambda k, p: p == 'early')} | {_pct(caught, lambda k, p: p == 'late')} | "
                     + " | ".join(cells) + " |")
    default = next(iter(h["detectors"].values()))
    if default["rejected_steps"]:
        lines += ["", "What the default rejected on the healthy runs (norms over their median of the 10 steps before; "
                  "Adam's v inflated by 1 + 0.001 (r^2 - 1) had the step been taken, and the steps it takes to decay "
                  "back at beta2 = 0.999):", "",
                  "| configuration | step | global norm | largest tensor jump | Adam v of that tensor |", "|---|---|---|---|---|"]
        for j in default["rejected_steps"]:
            lines.append(f"| {j['config']} | {j['step']} | x{j.get('global_ratio', '-')} | "
                         f"x{j.get('tensor_ratio', '-')} ({j.get('tensor', '-')}) | "
                         f"x{j.get('adam_v_inflation', '-')}, {j.get('adam_recovery_steps', '-')} steps to recover |")
    lines += ["", "Live, real `GuardedOptimizer` / `StabilityGuardCallback()` at defaults, no incidents:", "",
              "| configuration | family | optimizer | LR schedule | steps | rejected | stopped | final loss (unguarded) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in h["runs"]:
        live_row = r["live_default"]
        lines.append(f"| {r['config']} | {r['family']} | {r['optimizer']} | {r['schedule']} | {live_row['steps']} | "
                     f"{live_row['false_alarms']} | {'yes' if live_row['stopped'] else 'no'} | "
                     f"{live_row['final_loss']:.3g} ({r['unguarded_final_loss']:.3g}) |")
    if result.get("live_injected"):
        lines += ["", "Live with the incidents applied (default guard):", "",
                  "| configuration | caught | other rejections | stopped | final loss |", "|---|---|---|---|---|"]
        for r in result["live_injected"]:
            lines.append(f"| {r['config']} | {r['caught']}/{r['incidents']} | {r['false_alarms']} | "
                         f"{'yes' if r['stopped'] else 'no'} | {r['final_loss']:.3g} |")
    if result.get("instability"):
        lines += ["", "Genuine instability (LR too high; default guard):", "",
                  "| run | unguarded | nan_action=\"skip\" | nan_action=\"clip\" |", "|---|---|---|---|"]
        for r in result["instability"]:
            lines.append(f"| {r['config']} | {r['unguarded']} | {r['skip']} | {r['clip']} |")
    if result.get("shifts"):
        names = list(DETECTORS)
        lines += ["", "Sustained shifts and repeated spikes (replayed on a healthy Llama trace; rejected / injected "
                  "steps, a = absorbed, S = run stopped by escalation):", "",
                  "| scenario | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
        for r in result["shifts"]:
            cells = []
            for name in names:
                c = r[name]
                cells.append(f"{c['rejected']}/{r['injected_steps']}" + (f" a{c['absorbed']}" if c["absorbed"] else "")
                             + (" S" if c["stopped"] else ""))
            lines.append(f"| {r['scenario']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 configurations x 200 steps, for a smoke test")
    parser.add_argument("--held-out", action="store_true",
                        help="only the held-out healthy runs (bench/_heldout.py), never used to tune the default")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.out is None:
        name = "detection_heldout" if args.held_out else "detection"
        args.out = Path(__file__).resolve().parent / "results" / name
    started = time.perf_counter()
    result: dict[str, Any] = {"seed": args.seed, "date": datetime.date.today().isoformat(),
                              "command": f"OMP_NUM_THREADS=1 python bench/detection.py --seed {args.seed}"
                                         + (" --quick" if args.quick else "") + (" --held-out" if args.held_out else ""),
                              "torch": torch.__version__, "kinds": list(KINDS), "scales": SCALES}
    print("healthy runs:", flush=True)
    result["healthy"] = healthy(args.seed, args.quick, args.held_out)
    if not args.held_out:
        print("live with incidents:", flush=True)
        result["live_injected"] = live_injected(args.seed, args.quick)
        print("genuine instability:", flush=True)
        result["instability"] = instability(args.seed, args.quick)
        print("sustained shifts and repeated spikes:", flush=True)
        result["shifts"] = shifts(args.seed, args.quick)
    result["seconds"] = round(time.perf_counter() - started, 1)
    table = tables(result)
    print()
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    args.out.with_suffix(".md").write_text(f"# Detection benchmark ({result['date']}, `{result['command']}`, "
                                           f"{result['seconds']} s)\n\n{table}\n")
    print(f"\nwritten to {args.out}.json/.md in {result['seconds']} s")


if __name__ == "__main__":
    main()
