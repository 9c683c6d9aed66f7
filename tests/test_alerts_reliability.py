"""2,000 mixed events against a receiver failing 30% of requests: nothing lost, no unexplained duplicate.

Delivery is at-least-once by design: when the client's read timeout (50 ms here) expires on a reply the
receiver did send in time (a loaded machine delays the client thread), the message is retried, or spooled
after the last attempt, although the receiver has it. Receivers drop such duplicates by event id. This
is what made the test fail once on a loaded machine (2 of 2,000 "duplicates/both"): no bug sent an event
twice; the test counted exactly-once. It now requires every duplicate to be explained by such a timeout.
"""

from __future__ import annotations

import pytest

from _alerts_helpers import reliability_run


@pytest.mark.slow
def test_every_event_is_acknowledged_or_spooled_and_publish_stays_cheap(tmp_path) -> None:
    result = reliability_run(str(tmp_path), n_events=2000, failure_rate=0.3, seed=0)
    assert result["lost"] == 0, result
    bus = result["bus"]
    assert result["unknown"] == 0, result
    assert result["duplicates"] + result["both"] <= result["timeouts_on_acknowledged"], result
    assert result["delivered"] + result["spooled"] - result["both"] == 2000
    assert bus["spooled"] > 0 and result["delivered"] > 1500  # both paths really ran
    assert result["requests"] > 2000  # failures were retried
    assert bus["dropped"] == 0 and bus["failed"] == 0 and bus["pending"] == 0, result
    assert bus["delivered"] + bus["spooled"] == bus["published"] == 2000, result
    # what publish costs the training thread: no network, no disk on that thread. Network or disk work would
    # cost every publish; a rare page fault or allocator refill costs one: at most 2 in 2,000 over a millisecond
    assert result["publishes_over_1ms_cpu"] <= 2, result
    # wall clock also counts OS preemption and GIL hand-offs on a shared machine: nearly all stay under 1 ms
    assert result["median_publish_us"] < 200 and result["publishes_over_1ms"] <= 100, result
    assert result["elapsed_s"] < 120
