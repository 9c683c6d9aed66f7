"""``guardtower demo``: the whole tour on a laptop CPU, with no server and no account.

1. Pre-flight: a LoRA fine-tune whose optimizer was built before ``get_peft_model`` (the adapters are not in
   it) fails the audit; rebuilt after, it passes.
2. A small GPT trains on synthetic text under a ``GuardedOptimizer``; a NaN batch and a gradient spike are
   injected and skipped (``--rollback`` adds a burst of bad batches that escalates to a rollback).
3. The same run without the guard, for comparison.

Everything lands in ``--out``: the JSONL event log, the spike reports, MLflow runs in a local SQLite store
(when mlflow is installed) and W&B offline runs (when wandb is installed), one run per part named for what
it shows (``1a-preflight-planted-bug`` ends FAIL, ``1b-preflight-fixed`` PASS, ``2-guarded-training`` holds
the incidents and both losses), and the plot ``guardtower report --plot`` draws (when matplotlib is installed).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from guardtower._argparse import ArgumentParser
from guardtower._progress import Progress

__all__ = ["main"]

_WORDS = {
    "subject": ["the cat", "a dog", "the model", "my gpu", "the loss", "an optimizer", "the team", "a layer"],
    "verb": ["sees", "wants", "eats", "trains", "guards", "skips", "finds", "keeps"],
    "object": ["the mat", "a bug", "the batch", "some fish", "a spike", "the weights", "a gradient", "the run"],
}
_SEQ_LEN = 32
_BATCH = 16


# --------------------------------------------------------------------------------------------- data & model
@dataclass
class Corpus:
    """Synthetic sentences, character-level tokens, and fixed batches so both runs see the same data."""

    vocab: list[str]
    batches: list[Any]

    @classmethod
    def make(cls, steps: int, seed: int) -> "Corpus":
        import torch

        rng = random.Random(seed)
        text = " ".join(
            f"{rng.choice(_WORDS['subject'])} {rng.choice(_WORDS['verb'])} {rng.choice(_WORDS['object'])}."
            for _ in range(4000)
        )
        vocab = sorted(set(text))
        ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(ids) - _SEQ_LEN - 1, (steps, _BATCH), generator=gen)
        batches = [torch.stack([ids[s:s + _SEQ_LEN] for s in row.tolist()]) for row in starts]
        return cls(vocab, batches)


def _gpt(vocab_size: int, seed: int) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=_SEQ_LEN, vocab_size=vocab_size,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


# ------------------------------------------------------------------------------------------------ faults
@dataclass
class Faults:
    """Steps at which the demo corrupts training, the same way in the guarded and the unguarded run."""

    nan_step: int
    spike_step: int
    burst: tuple[int, ...] = ()

    @classmethod
    def plan(cls, steps: int, rollback: bool) -> "Faults":
        burst = tuple(range(int(steps * 0.8), int(steps * 0.8) + 3)) if rollback else ()
        return cls(nan_step=max(12, int(steps * 0.4)), spike_step=max(20, int(steps * 0.6)), burst=burst)

    def describe(self) -> list[str]:
        lines = [f"step {self.nan_step}: a corrupted batch turns the embeddings into NaN",
                 f"step {self.spike_step}: a faulty activation is scaled 10,000x (a gradient spike)"]
        if self.burst:
            lines.append(f"steps {self.burst[0]}-{self.burst[-1]}: three bad batches in a row (escalates to a rollback)")
        return lines

    @contextlib.contextmanager
    def inject(self, model: Any, step: int) -> Iterator[None]:
        handles = []
        if step == self.nan_step or step in self.burst:
            handles.append(model.transformer.wte.register_forward_hook(lambda m, i, o: o * float("nan")))
        if step == self.spike_step:
            handles.append(model.transformer.ln_f.register_forward_hook(lambda m, i, o: o * 1e4))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


# -------------------------------------------------------------------------------------------------- runs
@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def _train(model: Any, optimizer: Any, corpus: Corpus, faults: Faults, *, label: str, progress: bool,
           guarded: bool, on_step: Callable[[Progress], None] | None = None) -> RunResult:
    result = RunResult()
    bar = Progress(len(corpus.batches), label, progress, stream=sys.stdout)
    start = time.perf_counter()
    model.train()
    try:
        for step, batch in enumerate(corpus.batches, start=1):
            with faults.inject(model, step):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            if guarded:
                optimizer.step(loss=loss)
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = float(loss.detach())
            result.losses.append(value)
            bar.update(f"loss {value:.3f}")
            if on_step is not None:
                on_step(bar)
    finally:
        bar.close()
    result.seconds = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------------------- pre-flight
@dataclass
class AuditCase:
    """One pre-flight of part 1: its tracker run's name, what it shows, and the model and optimizer audited."""

    run_name: str
    title: str
    model: Any
    optimizer: Any


def _preflight_cases(corpus: Corpus, seed: int) -> list[AuditCase]:
    """The planted bug, then its fix: a LoRA optimizer built before ``get_peft_model`` (an optimizer that
    misses parameters when peft is not installed)."""
    import torch

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        print("peft is not installed (pip install \"guardtower[peft]\"): showing an optimizer-coverage bug instead.\n")
        model = _gpt(len(corpus.vocab), seed)
        stale = torch.optim.AdamW(model.transformer.h[0].parameters(), lr=1e-3)
        fixed = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return [AuditCase("1a-preflight-planted-bug", "planted bug: the optimizer only holds the first block",
                          model, stale),
                AuditCase("1b-preflight-fixed", "fixed: the optimizer holds every trainable parameter", model, fixed)]
    base = _gpt(len(corpus.vocab), seed)
    stale = torch.optim.AdamW(base.parameters(), lr=1e-3)  # the bug: built before get_peft_model
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True))
    fixed = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return [AuditCase("1a-preflight-planted-bug", "planted bug: the optimizer was built before get_peft_model",
                      model, stale),
            AuditCase("1b-preflight-fixed", "fixed: the optimizer is built from the PEFT model's trainable "
                      "parameters", model, fixed)]


def _show_audit(case: AuditCase, batch: Any, bus: Any) -> None:
    from guardtower import audit

    print(f"-> {case.title}")
    model = case.model
    print(audit(model, lambda: model(input_ids=batch, labels=batch), optimizer=case.optimizer, bus=bus))
    print()


# ------------------------------------------------------------------------------------------------ trackers
class _Trackers:
    """Optional MLflow and W&B runs, one per part of the tour and named for what it shows, so the failed
    pre-flight stays visible next to the passing one; each tracker fails soft."""

    def __init__(self, out: Path, *, use_mlflow: bool, use_wandb: bool) -> None:
        self.out = out
        self.notes: list[str] = []
        self.mlflow: Any = None
        self.wandb: Any = None
        self.uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self._wandb_run: Any = None
        if use_mlflow:
            self._setup_mlflow()
        if use_wandb:
            self._setup_wandb()

    def _setup_mlflow(self) -> None:
        try:
            import mlflow
        except ImportError:
            self.notes.append("MLflow: not installed (pip install \"guardtower[mlflow]\")")
            return
        # mlflow configures its loggers at import; its database set-up then logs at INFO on first use
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            mlflow.set_tracking_uri(self.uri)
            name = "guardtower-demo"
            if mlflow.get_experiment_by_name(name) is None:
                mlflow.create_experiment(name, artifact_location=(self.out / "mlruns").resolve().as_uri())
            mlflow.set_experiment(name)
            self.mlflow = mlflow
            self.notes.append(f"MLflow: one run per part; open with: mlflow ui --backend-store-uri {self.uri}")
        except Exception as exc:  # the demo goes on without a tracker that cannot start
            self.notes.append(f"MLflow: could not start ({type(exc).__name__}: {exc})")

    def _setup_wandb(self) -> None:
        try:
            import wandb
        except ImportError:
            self.notes.append("W&B: not installed (pip install \"guardtower[wandb]\")")
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb = wandb
        self.notes.append(f"W&B: one offline run per part in {self.out / 'wandb'}; upload with: "
                          f"wandb sync {self.out / 'wandb'}/offline-run-*")

    def start(self, run_name: str) -> list[Any]:
        """Open this part's runs; return the bridges that report to them."""
        sinks: list[Any] = []
        if self.mlflow is not None:
            try:
                from guardtower.bridges import MLflowBridge

                run = self.mlflow.start_run(run_name=run_name)
                sinks.append(MLflowBridge(run_id=run.info.run_id, tracking_uri=self.uri))
            except Exception as exc:
                self.notes.append(f"MLflow: could not start run {run_name} ({type(exc).__name__}: {exc})")
        if self.wandb is not None:
            try:
                from guardtower.bridges import WandBBridge

                self._wandb_run = self.wandb.init(project="guardtower-demo", name=run_name, mode="offline",
                                                  dir=str(self.out), reinit="finish_previous")
                sinks.append(WandBBridge(self._wandb_run))
            except Exception as exc:
                self.notes.append(f"W&B: could not start run {run_name} ({type(exc).__name__}: {exc})")
        return sinks

    def log_series(self, series: dict[str, list[float]]) -> None:
        """Per-step values (step 1, 2, ...) into this part's runs; non-finite values are left out."""
        if self.mlflow is not None and self.mlflow.active_run() is not None:
            try:
                from mlflow.entities import Metric

                now = int(time.time() * 1000)
                metrics = [Metric(key, v, now, i) for key, values in series.items()
                           for i, v in enumerate(values, start=1) if math.isfinite(v)]
                client = self.mlflow.MlflowClient()
                run_id = self.mlflow.active_run().info.run_id
                for i in range(0, len(metrics), 900):
                    client.log_batch(run_id, metrics=metrics[i:i + 900])
            except Exception as exc:
                self.notes.append(f"MLflow: could not log {', '.join(series)} ({type(exc).__name__})")
        if self._wandb_run is not None:
            try:
                for i, values in enumerate(zip(*series.values()), start=1):
                    self._wandb_run.log({k: v for k, v in zip(series, values) if math.isfinite(v)}, step=i)
            except Exception:
                self.notes.append(f"W&B: could not log {', '.join(series)}")

    def end(self) -> None:
        """Close this part's runs."""
        if self.mlflow is not None:
            with contextlib.suppress(Exception):
                self.mlflow.end_run()
        if self._wandb_run is not None:
            with contextlib.suppress(Exception):
                self._wandb_run.finish()
            self._wandb_run = None


@contextlib.contextmanager
def _part(run_name: str, trackers: _Trackers, events_path: Path, *sinks: Any) -> Iterator[Any]:
    """A bus for one part of the tour: the shared event log, ``sinks`` and this part's tracker runs."""
    from guardtower import EventBus, JsonlSink

    bus = EventBus([JsonlSink(events_path), *sinks, *trackers.start(run_name)])
    try:
        yield bus
    finally:
        bus.close(15)
        trackers.end()


# ---------------------------------------------------------------------------------------------------- main
def _section(title: str) -> None:
    print()
    print("=" * 100)
    print(title)
    print("=" * 100)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="guardtower demo", description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--out", default="./guardtower-demo", help="where the logs, runs and plot go")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--rollback", action="store_true", help="also show a burst of bad batches rolled back")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-mlflow", action="store_true", help="skip the MLflow run even if mlflow is installed")
    parser.add_argument("--no-wandb", action="store_true", help="skip the W&B run even if wandb is installed")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.steps < 30:
        parser.error("--steps must be at least 30 (the guard needs a few steps of baseline before the faults)")

    try:
        import torch
        import transformers
    except ImportError:
        print('guardtower demo needs transformers: pip install "guardtower[hf]"', file=sys.stderr)
        return 2
    from guardtower import GuardedOptimizer
    from guardtower.incidents import format_table, load_run_log
    from guardtower.testing import InMemorySink

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 2) // 2)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    events_path = out / "events.jsonl"
    spike_dir = out / "spike_reports"
    for old in [events_path, *spike_dir.glob("*.json")]:
        old.unlink(missing_ok=True)  # a second demo in the same folder starts a fresh log
    spike_dir.mkdir(exist_ok=True)
    corpus = Corpus.make(args.steps, args.seed)
    faults = Faults.plan(args.steps, args.rollback)
    started = time.perf_counter()
    trackers = _Trackers(out, use_mlflow=not args.no_mlflow, use_wandb=not args.no_wandb)

    _section("1/3  pre-flight: one instrumented step before launch")
    for case in _preflight_cases(corpus, args.seed):
        with _part(case.run_name, trackers, events_path) as bus:
            _show_audit(case, corpus.batches[0], bus)

    _section(f"2/3  guarded training: a small GPT, {args.steps} steps on synthetic text, with injected faults")
    for line in faults.describe():
        print("  - " + line)
    live = InMemorySink()
    with _part("2-guarded-training", trackers, events_path, live) as bus:
        model = _gpt(len(corpus.vocab), args.seed)
        guard_kwargs: dict[str, Any] = dict(spike_threshold=10.0, nan_action="skip", log_every=5,
                                            log_dir=str(spike_dir), warmup_steps=10, verbose=False, bus=bus)
        if args.rollback:
            guard_kwargs.update(max_consecutive_skips=2, escalate_to="rollback", rollback_every=10)
        guarded = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), model, **guard_kwargs)
        shown = 0

        def show_incidents(bar: Progress) -> None:
            nonlocal shown
            events = live.events
            for event in events[shown:]:
                if event.kind in ("spike", "rollback", "halt"):
                    bar.write(_one_line(event))
            shown = len(events)

        guarded_run = _train(model, guarded, corpus, faults, label="guarded  ", progress=not args.no_progress,
                             guarded=True, on_step=show_incidents)
        guarded.close()
        bus.flush(10)
        show_incidents(Progress(0, "", False, stream=sys.stdout))
        print(f"guard: {guarded.total_spikes} spike(s), {guarded.total_skips} skip(s), "
              f"{guarded.total_rollbacks} rollback(s) in {guarded_run.seconds:.1f}s")

        _section("3/3  the same run without the guard")
        plain_model = _gpt(len(corpus.vocab), args.seed)
        plain = torch.optim.AdamW(plain_model.parameters(), lr=3e-3)
        plain_run = _train(plain_model, plain, corpus, faults, label="unguarded", progress=not args.no_progress,
                           guarded=False)
        print(_side_by_side(guarded_run.losses, plain_run.losses, faults))
        trackers.log_series({"loss": guarded_run.losses, "unguarded_loss": plain_run.losses})

    _section("incidents (guardtower report)")
    log = load_run_log(out)
    print(format_table(log.incidents) if log.incidents else "no incidents")
    notes = [f"event log: {events_path}  (guardtower events {events_path})",
             f"spike reports: {spike_dir}  ({len(list(spike_dir.glob('*.json')))} file(s))",
             f"incident table: guardtower report {out}"]
    try:
        from guardtower._plot import plot_run_log

        plot = plot_run_log(log, out / "grad_norms.png")
        notes.append(f"plot: {plot}  (the same picture: guardtower report {out} --plot incidents.png)")
    except ImportError:
        notes.append('plot: matplotlib is not installed (pip install "guardtower[plot]")')
    notes += trackers.notes

    _section(f"done in {time.perf_counter() - started:.0f}s — what was written")
    for note in notes:
        print("  " + note)
    return 0


def _one_line(event: Any) -> str:
    if event.kind == "spike":
        ratio = "non-finite" if event.reason == "nonfinite" else f"ratio {event.ratio:.3g}"
        return f"  ! step {event.step}: {event.reason} in {event.layer} ({ratio}) -> {event.action.upper()}"
    if event.kind == "rollback":
        return f"  ! step {event.step}: ROLLBACK to the snapshot of step {event.to_step}"
    return f"  ! step {event.step}: {event.kind}"


def _side_by_side(guarded: list[float], plain: list[float], faults: Faults) -> str:
    """Losses at six evenly spaced steps, moved off the injected bad batches (whose loss is NaN by design)."""
    n = len(guarded)
    bad = {faults.nan_step, faults.spike_step, *faults.burst}
    marks = []
    for k in range(1, 7):
        step = max(1, n * k // 6)
        while step in bad and step > 1:
            step -= 1
        marks.append(step)
    marks = sorted(set(marks))
    lines = ["", f"{'step':>6}  {'guarded loss':>13}  {'unguarded loss':>15}"]
    for step in marks:
        lines.append(f"{step:>6}  {guarded[step - 1]:>13.4f}  {plain[step - 1]:>15.4f}")
    lines.append(f"final loss: guarded {guarded[-1]:.4f} vs unguarded {plain[-1]:.4f}")
    return "\n".join(lines)
