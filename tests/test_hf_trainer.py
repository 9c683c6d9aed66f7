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
from _hf_helpers import TokenDataset, snapshot, tiny_gpt2, training_args

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback  # noqa: E402

from guardtower.integrations.huggingface import GuardtowerCallback, StabilityGuardCallback  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny models on a shared CPU run faster on one thread than fighting over two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _lora(model: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))


class _Recorder(TrainerCallback):  # type: ignore[misc]
    """Keeps the weights after every optimizer step, keyed by the Trainer's global_step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.weights[0] = snapshot(self.model)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.weights[state.global_step] = snapshot(self.model)


class _SpikeAt(TrainerCallback):  # type: ignore[misc]
    """Scales the final hidden state by 1e4 during the forward of one optimizer step: a gradient spike."""

    def __init__(self, model: Any, step: int) -> None:
        self.step = step
        self.active = False
        model.transformer.ln_f.register_forward_hook(lambda m, i, o: o * 1e4 if self.active else o)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.active = state.global_step + 1 == self.step


def _stale_optimizer_found(found: Any) -> bool:
    """The audit names an optimizer built before get_peft_model: LORA-003 (adapters missing) or OPT-003 (stale)."""
    ids = {getattr(f, "catalog_id", f) for f in found}
    return bool(ids & {"LORA-003", "OPT-003"})


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------ pre-flight
def test_lora_optimizer_bug_stops_training_before_any_weight_changes(tmp_path: Path) -> None:
    base = tiny_gpt2()
    stale = torch.optim.AdamW(base.parameters(), lr=1e-3)  # built before get_peft_model: adapters missing
    model = _lora(base)
    before = snapshot(model)
    callback = GuardtowerCallback(raise_on_error=True, verbose=False)
    assert callback.report is None
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=TokenDataset(),
                      optimizers=(stale, None), callbacks=[callback])
    with capture_events() as events, pytest.raises(PreflightFailed) as failed:
        trainer.train()
    assert _stale_optimizer_found(failed.value.report.errors)
    assert callback.report is failed.value.report
    assert trainer.state.global_step == 0
    assert _same(before, snapshot(model))
    assert all(p.grad is None for p in model.parameters())
    preflight = [e for e in events if e.kind == "preflight"]
    assert len(preflight) == 1 and preflight[0].status == "FAIL"
    assert set(preflight[0].error_ids) == {f.catalog_id for f in failed.value.report.errors}


def test_correct_lora_setup_passes_and_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _lora(tiny_gpt2())
    callback = GuardtowerCallback(raise_on_error=True)
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=3), train_dataset=TokenDataset(),
                      callbacks=[callback])
    trainer.train()
    assert callback.report is not None and callback.report.ok
    assert not _stale_optimizer_found(callback.report.findings)
    assert trainer.state.global_step == 3
    assert "guardtower pre-flight: PASS" in capsys.readouterr().out


def test_failed_preflight_without_raise_reports_and_training_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tiny_gpt2()
    stale = torch.optim.AdamW(base.parameters(), lr=1e-3)
    model = _lora(base)
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
    model = _lora(base)
    dtypes: list[torch.dtype] = []
    model.base_model.model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    trainer = Trainer(model=model, args=training_args(tmp_path, bf16=True), train_dataset=TokenDataset(),
                      optimizers=(stale, None), callbacks=[GuardtowerCallback(raise_on_error=True, verbose=False)])
    with pytest.raises(PreflightFailed):
        trainer.train()  # only the audit's forward ran: the real step never started
    assert dtypes and set(dtypes) == {torch.bfloat16}


# ------------------------------------------------------------------------------------------- the guard
def test_spike_at_step_5_is_skipped_and_training_continues(tmp_path: Path) -> None:
    model = tiny_gpt2()
    recorder = _Recorder(model)
    guard_cb = StabilityGuardCallback(spike_threshold=10.0, warmup_steps=2, log_dir=str(tmp_path / "sg"),
                                      verbose=False)
    args = training_args(tmp_path, max_steps=10)  # the Trainer's default max_grad_norm=1.0 stays on
    assert args.max_grad_norm == 1.0
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(),
                      callbacks=[_SpikeAt(model, 5), recorder, guard_cb])
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
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[_SpikeAt(model, 7), guard_cb])
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
