import json

from guardtower.events import SpikeEvent, event_from_record


def test_spike_event_round_trips_through_strict_json_with_non_finite_values() -> None:
    event = SpikeEvent(step=3, layer="h.0.attn", ratio=float("inf"), norm=float("nan"), severity="WARN")
    text = json.dumps(event.to_record(), allow_nan=False)
    back = event_from_record(json.loads(text))
    assert back.to_record() == event.to_record()
    assert back.fingerprint == event.fingerprint
