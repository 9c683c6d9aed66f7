"""The clean task zoo: correct distillation, encoder-only, encoder-decoder, contrastive, preference-loss and other
common setups (tests/_audit_zoo_tasks.py) get no WARN or FAIL, and a few real steps prove each one trains."""

from __future__ import annotations

import pytest
import torch

from guardtower.preflight import audit
from guardtower.preflight._step import extract_loss

from tests._audit_zoo_tasks import TASKS, Task

pytestmark = pytest.mark.slow


def test_the_task_zoo_is_wide_enough() -> None:
    assert len(TASKS) >= 19 and len({t.name for t in TASKS}) == len(TASKS)


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_correct_task_setup_is_quiet_and_trains(task: Task) -> None:
    torch.manual_seed(0)
    model, step, kwargs = task.build()
    report = audit(model, step, **kwargs)
    loud = [f"{f.severity.label} {f.catalog_id} {f.message}" for f in report if f.severity > 0]
    assert not loud, "\n".join(loud)
    # proof the setup is correct: a few real steps (the schedule stepped too) move every trainable tensor but
    # the ones the setup never runs (an unused pooler)
    opt, scheduler = kwargs["optimizer"], kwargs.get("lr_scheduler")
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items() if p.requires_grad}
    for _ in range(4):
        opt.zero_grad()
        out = step()
        if not task.runs_backward:
            extract_loss(out).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    still = sorted(n for n in before if torch.equal(before[n], params[n]))
    expected = sorted(n for n in before if n.startswith(task.unused))
    assert still == expected, f"{len(still)} trainable tensor(s) did not move: {still[:5]}"
    assert not task.unused or expected, "the setup names unused tensors it does not have"
