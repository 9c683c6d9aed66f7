"""2-process gloo DDP Lightning run with a spike on rank 1 only; each rank saves its weights and counters.

Lightning's "ddp" strategy starts rank 1 by running this script again, so it must be a file run as a script.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _lightning_helpers import TinyModule, lightning_trainer  # noqa: E402

from guardtower.integrations.lightning import GuardtowerGuard  # noqa: E402

SPIKE_AT = 5


def main(out: Path) -> None:
    module = TinyModule(spike_at=SPIKE_AT, spike_rank=1)
    guard = GuardtowerGuard(warmup_steps=2, log_dir=str(out / "sg"), verbose=False)
    trainer = lightning_trainer(out, callbacks=[guard], max_steps=8, strategy="ddp", devices=2)
    trainer.fit(module)
    torch.save({"skipped": int(guard.counters()["guardtower/skipped_steps"]), "weights": dict(module.state_dict()),
                "before": module.before[SPIKE_AT], "after": module.after[SPIKE_AT]},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
