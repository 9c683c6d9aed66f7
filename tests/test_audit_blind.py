"""The blind batches (tests/_blind_batch1.py .. tests/_blind_batch40.py): real silent-bug reports reproduced by
someone who did not write the checks. Every reproduction proves its bug without the audit, every fixed twin
gets no WARN or FAIL, and every case is caught at WARN or above except the misses written down in the case
(``known_miss``), and every twin is quiet except the false alarms written down (``known_alarm``). The figures come
from ``python bench/blind.py --batch N``."""

from __future__ import annotations

import pytest

from tests._blind import BlindCase, load, outcome

pytestmark = pytest.mark.slow

#: batch -> its reports: 15 each, six for the spot checks at the end of rounds 3 and 4, and the parts of round 6
#: that their collectors finished (15 each), each part measured once before it became a dev set
SIZES = {1: 15, 2: 15, 3: 15, 4: 15, 5: 15, 6: 15, 7: 6, 8: 15, 9: 15, 10: 6, 11: 15, 12: 15, 13: 15, 14: 8, 15: 15,
         16: 15, 17: 15, 18: 13, 19: 15,
         20: 15, 21: 15, 22: 15, 23: 15, 24: 10, 25: 15, 26: 15, 27: 15, 28: 15, 29: 15, 30: 15, 31: 15, 32: 15, 33: 15, 34: 15, 35: 15, 36: 15, 37: 15, 38: 15, 39: 15, 40: 15}
CASES = [case for batch in SIZES for case in load(batch)]


def test_each_batch_holds_its_reports_with_unique_keys() -> None:
    for batch, size in SIZES.items():
        assert len(load(batch)) == size
    keys = [c.key for c in CASES]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_the_bug_is_real_its_twin_is_quiet_and_it_is_caught(case: BlindCase) -> None:
    result = outcome(case)
    assert not result.error, result.error
    assert result.proven, "the reproduction does not show the bug"
    unexpected = [line for line in result.twin_loud if line.split()[1].rstrip(":") not in case.known_alarm]
    assert not unexpected, "\n".join(unexpected)
    for cid in case.known_alarm:  # a false alarm written down must still be there: fixed ones leave the list
        assert any(line.split()[1].rstrip(":") == cid for line in result.twin_loud), f"{cid} fixed: drop it"
    if case.known_miss:
        assert not result.caught, f"caught by {result.caught_by}: drop known_miss"
    else:
        assert result.caught, "\n".join(result.bug_loud) or "no WARN/FAIL on the bug"
