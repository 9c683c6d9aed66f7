"""Events: strict-JSON round trips, fingerprints, rebuild by kind."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guardtower.errors import ConfigError
from guardtower.events import (
    EVENT_TYPES,
    Event,
    FindingEvent,
    SpikeEvent,
    SkipEvent,
    event_from_record,
    from_json,
    to_json,
)
from guardtower.severity import Severity

_floats = st.floats(allow_nan=True, allow_infinity=True)
_text = st.text(max_size=20)
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53), _floats, _text)
_json_value = st.recursive(
    _json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
    max_leaves=12,
)


def _strategy_for(annotation: str) -> st.SearchStrategy[Any]:
    table: dict[str, st.SearchStrategy[Any]] = {
        "str": _text,
        "int": st.integers(-(2**31), 2**31),
        "int | None": st.none() | st.integers(0, 2**31),
        "float": _floats,
        "float | None": st.none() | _floats,
        "bool": st.booleans(),
        "str | None": st.none() | _text,
        "Severity": st.sampled_from(list(Severity)),
        "tuple[str, ...]": st.lists(_text, max_size=4).map(tuple),
        "tuple[int, ...]": st.lists(st.integers(-(2**31), 2**31), max_size=4).map(tuple),
        "tuple[float, ...]": st.lists(_floats, max_size=4).map(tuple),
        "tuple[tuple[str, float, float], ...]": st.lists(st.tuples(_text, _floats, _floats), max_size=4).map(tuple),
        "dict[str, Any]": st.dictionaries(_text, _json_value, max_size=4),
        "dict[str, float]": st.dictionaries(_text, _floats, max_size=4),
        "dict[str, Any] | None": st.none() | st.dictionaries(_text, _json_value, max_size=4),
        "tuple[dict[str, Any], ...]": st.lists(st.dictionaries(_text, _json_leaf, max_size=4), max_size=3).map(tuple),
        "tuple[tuple[int, str, float, float | None], ...]": st.lists(
            st.tuples(st.integers(0, 2**31), _text, _floats, st.none() | _floats), max_size=4).map(tuple),
    }
    return table[annotation]


@st.composite
def events(draw: st.DrawFn) -> Event:
    cls = draw(st.sampled_from(sorted(EVENT_TYPES.values(), key=lambda c: c.kind)))
    kwargs = {f.name: draw(_strategy_for(str(f.type))) for f in dataclasses.fields(cls)}
    return cls(**kwargs)


def _same(a: Any, b: Any) -> bool:
    """Equality where NaN equals NaN (records carry NaN explicitly)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=200, deadline=None)
@given(events())
def test_every_event_round_trips_through_strict_json(event: Event) -> None:
    line = to_json(event)
    json.loads(line, parse_constant=lambda token: pytest.fail(f"non-strict JSON token {token}"))
    back = from_json(line)
    assert type(back) is type(event)
    for f in dataclasses.fields(event):
        assert _same(getattr(back, f.name), getattr(event, f.name)), f.name
    assert back.fingerprint == event.fingerprint


def test_fingerprint_ignores_step_and_values_but_not_layer_kind_or_run() -> None:
    a = SpikeEvent(run="r", step=1, layer="h.0", ratio=12.0, norm=3.0)
    assert a.fingerprint == SpikeEvent(run="r", step=900, layer="h.0", ratio=1e6, norm=9.0).fingerprint
    assert a.fingerprint != SpikeEvent(run="r", step=1, layer="h.1").fingerprint
    assert a.fingerprint != SpikeEvent(run="other", step=1, layer="h.0").fingerprint
    assert a.fingerprint != SkipEvent(run="r", step=1, layer="h.0").fingerprint


def test_events_are_frozen_and_carry_common_fields() -> None:
    event = FindingEvent(check="loss", catalog_id="LOSS-001", severity=Severity.ERROR)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.step = 3  # type: ignore[misc]
    assert len(event.event_id) == 32 and event.time > 0 and event.rank == 0
    assert event.to_record()["severity"] == "ERROR"


def test_unknown_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="record"):
        event_from_record({"kind": "nope"})


def test_severity_accepts_names_and_labels() -> None:
    assert SpikeEvent(severity="FAIL").severity is Severity.ERROR  # type: ignore[arg-type]
    assert Severity.parse("warn") is Severity.WARN and Severity.ERROR.label == "FAIL"


def test_numpy_and_torch_scalars_become_python_numbers_at_construction() -> None:
    import numpy as np
    import torch

    event = SpikeEvent(step=np.int64(7), ratio=np.float32(2.5), norm=torch.tensor(3.0), loss=torch.tensor(float("nan")),
                       top_layers=(("h.0", np.float64(1.0), np.float16(4.0)),), history_steps=(np.int32(6), 7))
    assert type(event.step) is int and type(event.ratio) is float and type(event.norm) is float
    assert math.isnan(event.loss)  # type: ignore[arg-type]
    assert all(type(v) is float for v in event.top_layers[0][1:])
    assert from_json(to_json(event)).to_record() == event.to_record()  # strict JSON, nothing lost
    finding = FindingEvent(details={"params": [np.int64(3)], "ratio": np.float32(0.5)})
    assert json.dumps(finding.details, allow_nan=False) == '{"params": [3], "ratio": 0.5}'


@pytest.mark.parametrize(("field", "value"), [
    ("ratio", object()), ("loss", __import__("torch").ones(3)), ("top_layers", ({1, 2},)), ("severity", "LOUD"),
])
def test_a_value_that_cannot_become_strict_json_fails_at_the_call_site(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        SpikeEvent(**{field: value})
    assert info.value.argument == field


def test_details_with_non_string_keys_are_rejected() -> None:
    with pytest.raises(ConfigError, match="details"):
        FindingEvent(details={1: "x"})
