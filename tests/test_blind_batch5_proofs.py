"""Blind batch 5 (tests/_blind_batch5.py) without the audit: every reproduction shows its bug and its fixed twin
does not, and both sides' training steps run. The audit's figures for this batch are measured elsewhere, once."""

from __future__ import annotations

import pytest

from tests._blind import BlindCase, load

pytestmark = pytest.mark.slow  # builds tiny transformers Llama, BERT and GPT-2 models

CASES = load(5)


def test_the_batch_holds_fifteen_reports_with_unique_keys_and_sources() -> None:
    assert len(CASES) == 15
    assert len({c.key for c in CASES}) == 15
    assert len({c.source for c in CASES}) == 15
    assert all(not c.known_miss and not c.known_alarm for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_the_bug_is_real_and_its_twin_is_fixed(case: BlindCase) -> None:
    assert case.proof(True), "the reproduction does not show the bug"
    assert not case.proof(False), "the fixed twin still shows the bug"


@pytest.mark.parametrize("bug", [True, False], ids=["bug", "twin"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_each_side_runs_one_training_step(case: BlindCase, bug: bool) -> None:
    model, step, kwargs = case.build(bug)
    step()
    assert "optimizer" in kwargs and "inputs" in kwargs
