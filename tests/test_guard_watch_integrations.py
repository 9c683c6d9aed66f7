"""The loop watch inside the HF Trainer and Lightning callbacks: the trainer's scheduler, accumulation and
planned length reach it; a loop bug in each is caught and its clean twin raises nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow


def _hf_run(tmp_path: Path, callbacks: list[Any], **args: Any) -> list[str]:
    from transformers import Trainer

    from guardtower.integrations.huggingface import StabilityGuardCallback
    from tests._hf_helpers import TokenDataset, tiny_gpt2, training_args

    guard_cb = StabilityGuardCallback(log_dir=str(tmp_path / "sg"), verbose=False)
    trainer = Trainer(model=tiny_gpt2(), args=training_args(tmp_path, **args), train_dataset=TokenDataset(),
                      callbacks=[guard_cb, *callbacks])
    trainer.train()
    assert guard_cb.guard is not None and guard_cb.guard.watch is not None
    watch = guard_cb.guard.watch
    assert watch.accumulation == args.get("gradient_accumulation_steps", 1) and watch.total_steps == 12
    ids = [f.catalog_id for f in watch.findings]
    guard_cb.close()
    return ids


class _HalveLr:
    """A TrainerCallback writing the lr into the param groups behind the Trainer's scheduler."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        class Cb(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
                if state.global_step == 5:
                    for group in optimizer.param_groups:
                        group["lr"] = group["lr"] * 0.5

        self.callback = Cb()


def test_hf_lr_written_behind_the_trainers_scheduler_is_opt_012(tmp_path: Path) -> None:
    assert _hf_run(tmp_path, [_HalveLr().callback], max_steps=12, lr_scheduler_type="linear") == ["OPT-012"]


def test_hf_run_with_accumulation_and_warmup_is_clean(tmp_path: Path) -> None:
    assert _hf_run(tmp_path, [], max_steps=12, gradient_accumulation_steps=2, lr_scheduler_type="linear",
                   warmup_steps=3) == []


def _lightning_run(tmp_path: Path, interval: str) -> list[str]:
    import lightning.pytorch as pl

    from guardtower.integrations.lightning import GuardtowerGuard
    from tests._lightning_helpers import TinyModule

    class Module(TinyModule):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            # sized in optimizer steps (16 batches x 3 epochs); interval="epoch" is the reported bug
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, epochs=3, steps_per_epoch=8)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": interval}}

    callback = GuardtowerGuard(verbose=False, log_dir=str(tmp_path / "sg"), log_counters=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                         num_sanity_val_steps=0, callbacks=[callback], default_root_dir=str(tmp_path))
    trainer.fit(Module())
    guard = callback.guards[0]
    assert guard.watch is not None and guard.watch.accumulation == 2 and guard.watch.total_steps == 24
    ids = [f.catalog_id for f in guard.watch.findings]
    callback.close()
    return ids


def test_lightning_onecycle_with_interval_epoch_is_loop_006(tmp_path: Path) -> None:
    assert _lightning_run(tmp_path, "epoch") == ["LOOP-006"]


def test_lightning_onecycle_with_interval_step_and_accumulation_is_clean(tmp_path: Path) -> None:
    assert _lightning_run(tmp_path, "step") == []


def test_watch_false_reaches_the_guard_through_the_callback(tmp_path: Path) -> None:
    from guardtower.integrations.huggingface import StabilityGuardCallback

    with pytest.raises(Exception, match="watch"):
        StabilityGuardCallback(watch="on")
    assert StabilityGuardCallback(watch=False, verbose=False).guard_kwargs["watch"] is False


def test_loop_bug_corpus_is_caught_and_its_fixed_twins_are_clean() -> None:
    """bench/watch.py's corpus of real loop-bug reports: >= 90% caught, 0 alarms on the fixed twins."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from watch import corpus

    caught, total, alarms = corpus()
    assert total >= 10 and caught / total >= 0.9 and alarms == 0
