"""2-process gloo DDP Lightning runs; each rank saves what it saw to OUT/<scenario>-rank<r>.pt.

``first``: pre-flight, a spike on rank 1 only at step 5, a bad sample on rank 0 (an Inf: once per epoch, where
the DistributedSampler's shuffle puts it: steps 8 and 10), an end-of-epoch checkpoint at step 8 (on its last batch, the
resume Lightning handles exactly); at step 13 both ranks save and wait to be killed (the test sends SIGKILL). ``resume``: ``fit(ckpt_path=...)`` from that checkpoint up to step 16.
Lightning's "ddp" strategy starts rank 1 by running this script again, so it must be a file run as a script.
Usage: python _lightning_ddp_worker.py OUT first|resume
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).parent))

from _lightning_helpers import TinyModule, lightning_trainer, snapshot  # noqa: E402

from guardtower.events import SkipEvent, SpikeEvent  # noqa: E402
from guardtower.integrations.lightning import GuardtowerGuard, GuardtowerPreflight  # noqa: E402
from guardtower.testing import InMemorySink  # noqa: E402

SPIKE_AT = 5
BAD_SAMPLE = 64
CHECKPOINT = "epoch0.ckpt"
CHECKPOINT_AT, KILL_AT, STEPS = 8, 13, 16  # 8 batches per rank per epoch
WAIT_S = 300  # the killed run waits this long at most for the test's SIGKILL


class Probe(Callback):  # type: ignore[misc]
    """Saves the end-of-epoch checkpoint and this rank's guard state then; records the guard state after a
    restore, the training forwards that met the bad sample, and the weights at KILL_AT."""

    def __init__(self, out: Path, scenario: str, preflight: GuardtowerPreflight, guard: GuardtowerGuard,
                 sink: InMemorySink) -> None:
        self.out, self.scenario, self.preflight, self.guard, self.sink = out, scenario, preflight, guard, sink
        self.result: dict[str, Any] = {"pid": os.getpid()}
        self.bad_forwards = 0

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.net[0].register_forward_hook(self._count)

    def _count(self, module: Any, args: Any, out: Any) -> None:
        self.bad_forwards += int(not bool(torch.isfinite(args[0]).all()))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        (guard,) = self.guard.guards
        self.result["restored"] = guard.state_dict()["guardtower"]  # after GuardtowerGuard restored this rank's

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.scenario == "first" and trainer.global_step == CHECKPOINT_AT:  # the last batch of epoch 0
            (guard,) = self.guard.guards
            self.result["at_checkpoint"] = guard.state_dict()["guardtower"]
            trainer.save_checkpoint(self.out / CHECKPOINT)  # on every rank, as Lightning requires
        if trainer.global_step == KILL_AT:
            self.result["weights_at_kill"] = snapshot(pl_module)
            if self.scenario == "first":
                self.save(trainer, pl_module)
                torch.distributed.barrier()  # both ranks' files are written before the test kills either
                deadline = time.monotonic() + WAIT_S
                while time.monotonic() < deadline:
                    time.sleep(0.1)
                raise SystemExit("not killed")

    def save(self, trainer: Any, pl_module: Any) -> None:
        sink, report = self.sink, self.preflight.report
        assert report is not None
        for guard in self.guard.guards:
            guard.flush()  # every event published so far has reached the sink
        self.result.update(
            preflight=report.status, checks=list(report.checks_run), ids=[f.catalog_id for f in report.findings],
            skips=[(e.step, e.reason, e.batch) for e in sink.events if isinstance(e, SkipEvent)],
            spikes=[e.step for e in sink.events if isinstance(e, SpikeEvent)], bad_forwards=self.bad_forwards,
            weights=snapshot(pl_module), before=pl_module.before.get(SPIKE_AT), after=pl_module.after.get(SPIKE_AT))
        path = self.out / f"{self.scenario}-rank{trainer.global_rank}.pt"
        torch.save(self.result, path.with_suffix(".partial"))
        os.replace(path.with_suffix(".partial"), path)


def main(out: Path, scenario: str) -> None:
    module = TinyModule(spike_at=SPIKE_AT, spike_rank=1)
    module.x[BAD_SAMPLE, 0] = float("inf")
    preflight = GuardtowerPreflight(raise_on_error=True, verbose=False)
    sink = InMemorySink()
    guard = GuardtowerGuard(warmup_steps=2, log_dir=str(out / "sg"), verbose=False, sinks=[sink])
    probe = Probe(out, scenario, preflight, guard, sink)
    trainer = lightning_trainer(out, callbacks=[preflight, guard, probe], max_steps=STEPS, strategy="ddp",
                                devices=2)
    trainer.fit(module, ckpt_path=out / CHECKPOINT if scenario == "resume" else None)
    probe.save(trainer, module)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
