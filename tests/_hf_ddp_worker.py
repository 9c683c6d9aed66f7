"""One rank of a 2-process CPU (gloo) Trainer run with both guardtower callbacks on a PEFT model.

Run by tests/test_hf_distributed.py with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set.
Usage: python _hf_ddp_worker.py OUT_DIR   (runs a stale-optimizer LoRA setup, then a correct one)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _hf_helpers import TokenDataset, tiny_gpt2, training_args  # noqa: E402
from test_hf_trainer import _lora, _SpikeAt  # noqa: E402
from transformers import Trainer  # noqa: E402

from guardtower.errors import PreflightFailed  # noqa: E402
from guardtower.integrations.huggingface import GuardtowerCallback, StabilityGuardCallback  # noqa: E402
from guardtower.testing import capture_events  # noqa: E402


def scenario(out: Path, mode: str) -> dict[str, object]:
    base = tiny_gpt2()
    stale = torch.optim.AdamW(base.parameters(), lr=1e-3) if mode == "stale_optimizer" else None
    model = _lora(base)
    preflight = GuardtowerCallback(raise_on_error=True, verbose=False)
    guard = StabilityGuardCallback(warmup_steps=2, log_dir=str(out / "sg"), verbose=False)
    args = training_args(out / mode, max_steps=8, per_device_train_batch_size=4, ddp_backend="gloo",
                         learning_rate=1e-2)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), optimizers=(stale, None),
                      callbacks=[_SpikeAt(base, 5), preflight, guard])
    result: dict[str, object] = {"world": torch.distributed.get_world_size()}
    with capture_events() as events:
        try:
            trainer.train()
            result["outcome"] = "trained"
        except PreflightFailed as exc:
            result["outcome"] = "preflight_failed"
            result["error_ids"] = sorted({f.catalog_id for f in exc.report.errors})
    trainable = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    result["weights_sha"] = hashlib.sha256(trainable.numpy().tobytes()).hexdigest()
    result["global_step"] = trainer.state.global_step
    result["report_ok"] = None if preflight.report is None else preflight.report.ok
    result["skips"] = [e.step for e in events if e.kind == "skip"]
    result["wrapper"] = type(trainer.model_wrapped).__name__
    return result


def main(out: Path) -> None:
    torch.set_num_threads(1)
    results = {mode: scenario(out, mode) for mode in ("stale_optimizer", "train")}
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
