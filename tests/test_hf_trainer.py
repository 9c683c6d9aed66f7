"""The Hugging Face callbacks in a real ``Trainer`` on a tiny GPT-2 built from a config (CPU, no hub)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from guardtower.errors import ConfigError, PreflightFailed
from guardtower.testing import capture_events
from _hf_helpers import SpikeAt, TokenDataset, lora, snapshot, stale_optimizer_found, tiny_gpt2, training_args

from transformers import Trainer, TrainerCallback  # noqa: E402

from guardtower.integrations.huggingface import GuardtowerCallback, StabilityGuardCallback  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


class _Recorder(TrainerCallback):  # type: ignore[misc]
    """Keeps the weights after every optimizer step, keyed by the Trainer's global_step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.weights[0] = snapshot(self.model)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.weights[state.global_step] = snapshot(self.model)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------ pre-flight
def test_lora_optimizer_bug_stops_training_before_any_weight_changes(tmp_path: Path) -> None:
    base = tiny_gpt2()
    stale = torch.optim.AdamW(base.parameters(), lr=1e-3)  # built before get_peft_model: adapters missing
    model = lora(base)
    before = snapshot(model)
    callback = GuardtowerCallback(raise_on_error=True, verbose=False)
    assert callback.report is None
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=TokenDataset(),
                      optimizers=(stale, None), callbacks=[callback])
    with capture_events() as events, pytest.raises(PreflightFailed) as failed:
        trainer.train()
    assert stale_optimizer_found(failed.value.report.errors)
    assert callback.report is failed.value.report
    assert trainer.state.global_step == 0
    assert _same(before, snapshot(model))
    assert all(p.grad is None for p in model.parameters())
    preflight = [e for e in events if e.kind == "preflight"]
    assert len(preflight) == 1 and preflight[0].status == "FAIL"
    assert set(preflight[0].error_ids) == {f.catalog_id for f in failed.value.report.errors}


def test_correct_lora_setup_passes_and_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = lora(tiny_gpt2())
    callback = GuardtowerCallback(raise_on_error=True)
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=3), train_dataset=TokenDataset(),
                      callbacks=[callback])
    trainer.train()
    assert callback.report is not None and callback.report.ok
    assert not stale_optimizer_found(callback.report.findings)
    assert trainer.state.global_step == 3
    assert "guardtower pre-flight: PASS" in capsys.readouterr().out


def test_failed_preflight_without_raise_reports_and_training_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tiny_gpt2()
    stale = torch.optim.AdamW(base.parameters(), lr=1e-3)
    model = lora(base)
    callback = GuardtowerCallback()
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=2), train_dataset=TokenDataset(),
                      optimizers=(stale, None), callbacks=[callback])
    trainer.train()
    assert callback.report is not None and not callback.report.ok
    assert trainer.state.global_step == 2
    assert "guardtower pre-flight: FAIL" in capsys.readouterr().out


def test_audit_runs_under_the_trainers_autocast(tmp_path: Path) -> None:
    base = tiny_gpt2()
    stale = torch.optim.AdamW(base.parameters(), lr=1e-3)
    model = lora(base)
    dtypes: list[torch.dtype] = []
    model.base_model.model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    trainer = Trainer(model=model, args=training_args(tmp_path, bf16=True), train_dataset=TokenDataset(),
                      optimizers=(stale, None), callbacks=[GuardtowerCallback(raise_on_error=True, verbose=False)])
    with pytest.raises(PreflightFailed):
        trainer.train()  # only the audit's forward ran: the real step never started
    assert dtypes and set(dtypes) == {torch.bfloat16}


def test_an_evaluation_before_training_is_not_taken_for_the_first_batch(tmp_path: Path) -> None:
    seen: list[torch.Tensor] = []

    class Recording(GuardtowerCallback):
        def run_audit(self, model: Any, args: Any, kwargs: Any) -> Any:
            seen.append(kwargs["input_ids"])
            return super().run_audit(model, args, kwargs)

    eval_set = TokenDataset(n=8, seed=1)
    eval_set.ids.fill_(63)  # evaluation batches are all token 63; training batches are random
    callback = Recording(verbose=False)
    args = training_args(tmp_path, max_steps=2, eval_on_start=True, eval_strategy="steps", eval_steps=100)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), eval_dataset=eval_set,
                      callbacks=[callback])
    trainer.train()
    assert len(seen) == 1 and not bool((seen[0] == 63).all())
    assert callback.report is not None and callback.report.ok


def test_on_train_begin_audits_the_first_batch_when_handed_model_optimizer_and_data() -> None:
    from types import SimpleNamespace

    model = tiny_gpt2()
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=4, shuffle=True)
    rng = torch.get_rng_state()
    good = GuardtowerCallback(raise_on_error=True, verbose=False)
    good.on_train_begin(None, None, SimpleNamespace(), model=model,  # type: ignore[arg-type]
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_dataloader=loader)
    assert good.report is not None and good.report.ok and good._handle is None
    assert torch.equal(torch.get_rng_state(), rng)  # drawing the batch did not reshuffle the real run
    stale = GuardtowerCallback(raise_on_error=True, verbose=False)
    with pytest.raises(PreflightFailed):
        stale.on_train_begin(None, None, SimpleNamespace(), model=model,  # type: ignore[arg-type]
                             optimizer=torch.optim.SGD(tiny_gpt2().parameters(), lr=0.1), train_dataloader=loader)
    assert stale.report is not None and stale.report.by_id("OPT-003")


def test_without_a_dataloader_the_first_real_forward_is_audited() -> None:
    from types import SimpleNamespace

    model = tiny_gpt2()
    callback = GuardtowerCallback(verbose=False)
    callback.on_train_begin(None, None, SimpleNamespace(), model=model,  # type: ignore[arg-type]
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert callback.report is None and callback._handle is not None
    batch = next(iter(torch.utils.data.DataLoader(TokenDataset(), batch_size=4)))
    model.train()
    model(**batch)
    assert callback.report is not None and callback.report.ok and callback._handle is None


# ------------------------------------------------------------------------------------------- the guard
def test_spike_at_step_5_is_skipped_and_training_continues(tmp_path: Path) -> None:
    model = tiny_gpt2()
    recorder = _Recorder(model)
    guard_cb = StabilityGuardCallback(spike_threshold=10.0, warmup_steps=2, log_dir=str(tmp_path / "sg"),
                                      verbose=False)
    args = training_args(tmp_path, max_steps=10)  # the Trainer's default max_grad_norm=1.0 stays on
    assert args.max_grad_norm == 1.0
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(),
                      callbacks=[SpikeAt(model, 5), recorder, guard_cb])
    with capture_events() as events:
        trainer.train()
    assert trainer.state.global_step == 10
    assert _same(recorder.weights[5], recorder.weights[4])
    assert not _same(recorder.weights[6], recorder.weights[5])
    assert not _same(recorder.weights[4], recorder.weights[3])
    spikes = [e for e in events if e.kind == "spike"]
    skips = [e for e in events if e.kind == "skip"]
    assert [e.step for e in spikes] == [5] and [e.step for e in skips] == [5]
    assert spikes[0].ratio > 10.0
    inner = trainer.optimizer.optimizer
    assert inner is guard_cb.guard
    adam_steps = {int(s["step"]) for s in guard_cb.guard.base_optimizer.state.values()}
    assert adam_steps == {9}  # the skipped step did not advance Adam
    assert args.max_grad_norm == 1.0  # restored after training
    last = trainer.state.log_history[-2]  # the last per-step log (the final entry is the train summary)
    assert last["guardtower/skipped_steps"] == 1 and last["guardtower/spikes"] == 1
    assert any(tmp_path.joinpath("sg").glob("*.json"))


def test_rollback_inside_the_trainer_restores_the_last_snapshot(tmp_path: Path) -> None:
    model = tiny_gpt2()
    recorder = _Recorder(model)
    guard_cb = StabilityGuardCallback(nan_action="rollback", rollback_every=3, warmup_steps=2,
                                      log_dir=str(tmp_path / "sg"), verbose=False)
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=8), train_dataset=TokenDataset(),
                      callbacks=[SpikeAt(model, 5), recorder, guard_cb])
    with capture_events() as events:
        trainer.train()
    rollbacks = [e for e in events if e.kind == "rollback"]
    assert [(e.step, e.to_step) for e in rollbacks] == [(5, 3)]
    assert _same(recorder.weights[5], recorder.weights[3])  # steps 4 and 5 undone
    assert trainer.state.global_step == 8 and not _same(recorder.weights[8], recorder.weights[5])
    assert trainer.state.log_history[-2]["guardtower/rollbacks"] == 1


def test_clean_steps_match_an_unguarded_trainer_including_clipping(tmp_path: Path) -> None:
    """With the guard moving the clipping behind its decision, clean runs are bit-for-bit the Trainer's own."""
    finals = []
    for guarded in (False, True):
        model = tiny_gpt2()
        callbacks: list[Any] = [StabilityGuardCallback(log_dir=str(tmp_path / "sg"), verbose=False)] if guarded else []
        trainer = Trainer(model=model, args=training_args(tmp_path / str(guarded), max_steps=4, max_grad_norm=0.05),
                          train_dataset=TokenDataset(), callbacks=callbacks)
        trainer.train()
        finals.append(snapshot(model))
    assert all(torch.allclose(finals[0][k], finals[1][k], atol=1e-6, rtol=0) for k in finals[0])


def test_events_use_the_trainers_global_step_with_gradient_accumulation(tmp_path: Path) -> None:
    model = tiny_gpt2()
    guard_cb = StabilityGuardCallback(warmup_steps=2, log_dir=str(tmp_path / "sg"), verbose=False)
    args = training_args(tmp_path, max_steps=8, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[SpikeAt(model, 7), guard_cb])
    with capture_events() as events:
        trainer.train()
    assert trainer.state.global_step == 8
    assert [e.step for e in events if e.kind == "skip"] == [7]
    assert guard_cb.guard is not None and guard_cb.guard.step_count == 8


# --------------------------------------------------------------------------------------- arguments
def test_bad_arguments_raise_config_error_at_construction() -> None:
    with pytest.raises(ConfigError, match="raise_on_error"):
        GuardtowerCallback(raise_on_error="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="checks"):
        GuardtowerCallback(checks=["no_such_check"])
    with pytest.raises(ConfigError, match="nan_action"):
        StabilityGuardCallback(nan_action="explode")
    with pytest.raises(ConfigError, match="model"):
        StabilityGuardCallback(model=torch.nn.Linear(1, 1))


def test_importing_the_integration_without_transformers_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n"
        "    import guardtower.integrations.huggingface\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    assert out.startswith("MissingDependencyError")
    assert 'pip install "guardtower[hf]"' in out


@pytest.mark.slow
def test_the_trainers_schedule_is_walked_over_its_max_steps(tmp_path: Path) -> None:
    from transformers import Trainer

    reports = {}
    for warmup in (50, 2):  # 50 warmup steps in a 6-step run: it ends inside the warmup; 2 is fine
        callback = GuardtowerCallback(verbose=False)
        args = training_args(tmp_path / str(warmup), max_steps=6, lr_scheduler_type="linear", warmup_steps=warmup)
        Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), callbacks=[callback]).train()
        assert callback.report is not None
        reports[warmup] = callback.report
    (finding,) = reports[50].by_id("SCHED-002")
    assert finding.details["planned_steps"] == 6
    assert not [f for f in reports[2] if f.catalog_id.startswith("SCHED-")]


def test_a_run_resumed_from_a_checkpoint_decides_as_the_uninterrupted_one(tmp_path: Path) -> None:
    """Trainer checkpoints carry each rank's guard state (``guardtower-rank0.pt``): resumed at step 6 with
    ``resume_from_checkpoint``, a fresh callback judges steps 7-12 against the saved baselines and counters."""

    def run(out: Path, resume: str | None) -> tuple[list[Any], StabilityGuardCallback, dict[str, torch.Tensor]]:
        model = tiny_gpt2(seed=1 if resume else 0)  # resumed: other weights, until the checkpoint loads
        callback = StabilityGuardCallback(warmup_steps=2, log_dir=str(out / "sg"), verbose=False)
        args = training_args(out, max_steps=12, save_strategy="steps", save_steps=6)
        trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(),
                          callbacks=[SpikeAt(model, 4), SpikeAt(model, 9), callback])
        with capture_events() as events:
            trainer.train(resume_from_checkpoint=resume)
        return list(events), callback, snapshot(model)

    full_events, full, full_weights = run(tmp_path, None)
    assert (tmp_path / "checkpoint-6" / "guardtower-rank0.pt").is_file()
    resumed_events, resumed, resumed_weights = run(tmp_path / "again", str(tmp_path / "checkpoint-6"))

    def decisions(events: list[Any]) -> list[tuple[Any, ...]]:
        return [(e.step, e.action, e.layer, repr(e.ratio)) for e in events if e.kind == "spike" and e.step > 6]

    assert decisions(resumed_events) == decisions(full_events) and [d[0] for d in decisions(full_events)] == [9]
    assert full.guard is not None and resumed.guard is not None
    assert (resumed.guard.total_spikes, resumed.guard.total_skips) == (full.guard.total_spikes, 2)  # 4 and 9
    a, b = full.guard.detector.state_dict()["state"], resumed.guard.detector.state_dict()["state"]
    assert all(torch.equal(a[k].nan_to_num(1234.5), b[k].nan_to_num(1234.5)) for k in a)
    assert _same(full_weights, resumed_weights)
