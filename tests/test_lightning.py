"""The Lightning callbacks in a real ``lightning`` Trainer on CPU: pre-flight, skipped spikes, logged counters."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from _lightning_helpers import TinyModule, lightning_trainer, same, snapshot
from guardtower.errors import ConfigError, PreflightFailed
from guardtower.events import PreflightEvent, SkipEvent
from guardtower.integrations.lightning import GuardtowerGuard, GuardtowerPreflight
from guardtower.testing import capture_events

pytestmark = pytest.mark.slow


def guard_callback(tmp_path: Path, **kwargs: object) -> GuardtowerGuard:
    settings: dict = dict(warmup_steps=2, log_dir=str(tmp_path / "sg"), verbose=False)
    settings.update(kwargs)
    return GuardtowerGuard(**settings)


def test_a_layer_missing_from_the_optimizer_aborts_fit_with_weights_unchanged(tmp_path: Path) -> None:
    module = TinyModule(forget_layer=True)
    before = snapshot(module)
    preflight = GuardtowerPreflight(raise_on_error=True, verbose=False)
    with capture_events() as events, pytest.raises(PreflightFailed) as failed:
        lightning_trainer(tmp_path, callbacks=[preflight]).fit(module)
    assert "OPT-001" in {f.catalog_id for f in failed.value.report.errors}
    assert same(snapshot(module), before) and module.before == {}  # no optimizer step ran
    assert [e.status for e in events if isinstance(e, PreflightEvent)] == ["FAIL"]
    assert preflight.report is failed.value.report


def test_a_clean_module_passes_and_trains_exactly_as_without_the_preflight(tmp_path: Path) -> None:
    plain, audited = TinyModule(), TinyModule()
    lightning_trainer(tmp_path / "a").fit(plain)
    preflight = GuardtowerPreflight(raise_on_error=True, verbose=False)
    lightning_trainer(tmp_path / "b", callbacks=[preflight]).fit(audited)
    assert preflight.report is not None and preflight.report.ok
    assert same(snapshot(plain), snapshot(audited))  # the audit left no trace on the run


def test_preflight_runs_under_the_trainers_autocast(tmp_path: Path) -> None:
    seen: list[torch.dtype] = []
    module = TinyModule()
    module.net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    preflight = GuardtowerPreflight(raise_on_error=True, verbose=False, checks="loss")
    lightning_trainer(tmp_path, callbacks=[preflight], precision="bf16-mixed", max_steps=1).fit(module)
    assert preflight.report is not None and seen and set(seen) == {torch.bfloat16}


def test_an_injected_spike_is_skipped_and_the_counters_reach_the_csv_logger(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    module = TinyModule(spike_at=5)
    guard = guard_callback(tmp_path)
    csv_logger = CSVLogger(str(tmp_path / "logs"), name="run")
    with capture_events() as events:
        lightning_trainer(tmp_path, callbacks=[guard], logger=csv_logger, max_steps=8).fit(module)
    assert same(module.after[5], module.before[5])  # the spiked update never reached the weights
    assert not same(module.after[4], module.before[4]) and not same(module.after[6], module.before[6])
    assert [e.step for e in events if isinstance(e, SkipEvent)] == [5]
    rows = list(csv.DictReader(open(Path(csv_logger.log_dir) / "metrics.csv")))
    skipped = {int(r["step"]): float(r["guardtower/skipped_steps"]) for r in rows if r.get("guardtower/skipped_steps")}
    assert skipped[3] == 0.0 and skipped[max(skipped)] == 1.0 and "train_loss" in rows[0]


def test_the_guard_sees_gradients_before_lightnings_clipping_and_clips_accepted_steps(tmp_path: Path) -> None:
    module = TinyModule(spike_at=6, lr=0.1)
    guard = guard_callback(tmp_path)
    trainer = lightning_trainer(tmp_path, callbacks=[guard], max_steps=8, gradient_clip_val=0.05,
                                accumulate_grad_batches=2)
    trainer.fit(module)
    assert guard.counters()["guardtower/skipped_steps"] == 1.0  # a clipped spike would look like any step
    assert same(module.after[6], module.before[6])
    for step in (3, 4, 7, 8):  # accepted updates: SGD moved by lr * (grad clipped to norm 0.05)
        moved = torch.cat([(module.after[step][k] - module.before[step][k]).flatten() for k in module.before[step]])
        assert 0 < moved.norm() <= 0.1 * 0.05 * 1.001
    assert trainer.gradient_clip_val == 0.05  # given back after fit


def test_manual_optimization_is_guarded_too(tmp_path: Path) -> None:
    module = TinyModule(spike_at=5, manual=True)
    guard = guard_callback(tmp_path)
    lightning_trainer(tmp_path, callbacks=[guard], max_steps=7).fit(module)
    assert same(module.after[5], module.before[5])
    assert guard.counters() == {"guardtower/spikes": 1.0, "guardtower/skipped_steps": 1.0, "guardtower/rollbacks": 0.0}


def test_bad_arguments_are_config_errors_at_construction() -> None:
    with pytest.raises(ConfigError, match="nan_action"):
        GuardtowerGuard(nan_action="explode")
    with pytest.raises(ConfigError, match="model"):
        GuardtowerGuard(model=torch.nn.Linear(1, 1))
    with pytest.raises(ConfigError, match="raise_on_error"):
        GuardtowerPreflight(raise_on_error="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="checks"):
        GuardtowerPreflight(checks="no_such_check")


def test_importing_without_lightning_names_the_extra() -> None:
    code = ("import sys; sys.modules['lightning'] = None; sys.modules['lightning.pytorch'] = None\n"
            "from guardtower.errors import MissingDependencyError\n"
            "try:\n    import guardtower.integrations.lightning\nexcept MissingDependencyError as e:\n"
            "    print('missing:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 'missing: lightning is not installed; install it with: pip install "guardtower[lightning]"' in out.stdout


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
    """tests/_lightning_ddp_worker.py: a 2-rank run killed with SIGKILL at step 13, after its end-of-epoch
    checkpoint at step 8 and a bad batch at step 10, then the run resumed from that checkpoint (what each rank
    saw, per scenario)."""
    out = tmp_path_factory.mktemp("ddp")
    worker = str(Path(__file__).with_name("_lightning_ddp_worker.py"))
    with open(out / "first.log", "w") as log:
        first = subprocess.Popen([sys.executable, worker, str(out), "first"], cwd=out, stdout=log,
                                 stderr=subprocess.STDOUT)
        files = [out / f"first-rank{r}.pt" for r in (0, 1)]
        deadline = time.monotonic() + 300
        while not all(f.exists() for f in files) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            assert all(f.exists() for f in files), (out / "first.log").read_text()[-4000:]
            killed = [torch.load(f, weights_only=False) for f in files]
            os.kill(killed[1]["pid"], signal.SIGKILL)  # rank 1 (Lightning started it), then rank 0
        finally:
            first.kill()
            first.wait(timeout=60)
    assert first.returncode == -signal.SIGKILL
    resume = subprocess.run([sys.executable, worker, str(out), "resume"], cwd=out, capture_output=True, text=True,
                            timeout=300)
    assert resume.returncode == 0, resume.stdout[-3000:] + resume.stderr[-3000:]
    return out, killed, [torch.load(out / f"resume-rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_ddp_preflight_sees_the_wrapper_and_a_rank_local_spike_keeps_the_replicas_identical(
        ddp_runs: tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]) -> None:
    _, ranks, _ = ddp_runs
    for rank in ranks:  # rank 0's gradients were fine at step 5; it skipped with rank 1 (8 and 10: rank 0's Inf)
        assert [(step, reason) for step, reason, _ in rank["skips"]] == [(5, "spike"), (8, "nonfinite"),
                                                                          (10, "nonfinite")]
    assert same(ranks[0]["weights"], ranks[1]["weights"])
    assert same(ranks[1]["after"], ranks[1]["before"])
    for rank in ranks:  # audited through DDP's wrapper on both ranks: no "process group but model not wrapped"
        assert rank["preflight"] != "FAIL" and "dist_wrap" in rank["checks"] and "DDP-003" not in rank["ids"]


def test_a_killed_ddp_run_resumes_with_each_ranks_guard_and_past_its_quarantined_batch(
        ddp_runs: tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]) -> None:
    out, killed, resumed = ddp_runs

    def detector(section: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: v.nan_to_num(1234.5) for k, v in section["detector"]["state"].items()}

    for rank in (0, 1):  # each rank restored its own guard state, not rank 0's (Lightning saves rank 0's only)
        saved, restored = killed[rank]["at_checkpoint"], resumed[rank]["restored"]
        assert same(detector(restored), detector(saved)) and restored["quarantine"] == saved["quarantine"]
        assert {e["rank"] for e in restored["quarantine"]} == {rank}
    assert not same(detector(killed[0]["at_checkpoint"]), detector(killed[1]["at_checkpoint"]))  # the loss slot
    for rank in (0, 1):  # the batch quarantined after the checkpoint (and before the kill) is left out alike
        assert resumed[rank]["skips"] == [(10, "quarantined", {"step": 10, "epoch": 1, "index": 1})]
        assert resumed[rank]["spikes"] == [] and resumed[rank]["bad_forwards"] == 0
        # up to the kill, the resumed run is the run that never stopped; the replicas stay identical
        assert same(resumed[rank]["weights_at_kill"], killed[rank]["weights_at_kill"])
    assert same(resumed[0]["weights"], resumed[1]["weights"])

    # a world-size change: one process resumes the 2-rank checkpoint with rank 0's guard state
    guard = guard_callback(out / "single")
    lightning_trainer(out / "single", callbacks=[guard], max_steps=9).fit(TinyModule(), ckpt_path=out / "epoch0.ckpt")
    assert {e["rank"] for e in guard.guards[0].quarantine.entries} == {0}
    guard.close()


def test_resuming_from_a_checkpoint_restores_the_guards_state(tmp_path: Path) -> None:
    first = guard_callback(tmp_path)
    trainer = lightning_trainer(tmp_path, callbacks=[first], max_steps=6)
    trainer.fit(TinyModule(spike_at=5))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    assert first.counters()["guardtower/skipped_steps"] == 1.0

    resumed = guard_callback(tmp_path)
    lightning_trainer(tmp_path, callbacks=[resumed], max_steps=8).fit(TinyModule(), ckpt_path=tmp_path / "last.ckpt")
    (guard,) = resumed.guards
    assert resumed.counters()["guardtower/skipped_steps"] == 1.0  # the skip before the checkpoint counts
    assert guard.step_count == 8
