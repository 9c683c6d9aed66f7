"""2-process gloo DDP Lightning run: pre-flight, then a spike on rank 1 only; each rank saves what it saw.

Lightning's "ddp" strategy starts rank 1 by running this script again, so it must be a file run as a script.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _lightning_helpers import TinyModule, lightning_trainer  # noqa: E402

from guardtower.integrations.lightning import GuardtowerGuard, GuardtowerPreflight  # noqa: E402

SPIKE_AT = 5


def main(out: Path) -> None:
    module = TinyModule(spike_at=SPIKE_AT, spike_rank=1)
    preflight = GuardtowerPreflight(raise_on_error=True, verbose=False)
    guard = GuardtowerGuard(warmup_steps=2, log_dir=str(out / "sg"), verbose=False)
    trainer = lightning_trainer(out, callbacks=[preflight, guard], max_steps=8, strategy="ddp", devices=2)
    trainer.fit(module)
    assert preflight.report is not None
    torch.save({"preflight": preflight.report.status, "checks": list(preflight.report.checks_run),
                "ids": [f.catalog_id for f in preflight.report.findings],
                "skipped": int(guard.counters()["guardtower/skipped_steps"]), "weights": dict(module.state_dict()),
                "before": module.before[SPIKE_AT], "after": module.after[SPIKE_AT]},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
