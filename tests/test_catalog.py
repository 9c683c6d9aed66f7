"""The catalog: complete entries, ids in the fixed scheme, CATALOG.md in sync, the CLI prints it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from guardtower.failure_modes import CATALOG, FailureMode, _CORE, catalog, catalog_markdown
from guardtower.cli import main
from guardtower.severity import Severity

ROOT = Path(__file__).resolve().parents[1]
ID = re.compile(r"^[A-Z]+-\d{3}$")

#: meanings users depend on: these ids must keep their titles' subject
FIXED = {
    "LOSS-001": "detach", "LOSS-002": "scalar", "INPUT-001": "input", "GRAD-001": "no gradient",
    "GRAD-002": "exploding", "GRAD-003": "vanishing", "GRAD-004": "zero", "OPT-001": "missing from the optimizer",
    "OPT-002": "frozen", "NAN-001": "forward", "NAN-002": "gradients", "RELU-001": "dead relu", "TIE-001": "tied",
}


@pytest.mark.parametrize("entry", catalog(), ids=lambda m: m.id)
def test_every_entry_is_complete(entry: FailureMode) -> None:
    assert ID.match(entry.id)
    assert isinstance(entry.severity, Severity)
    assert len(entry.title) >= 5
    for field in ("summary", "why", "fix"):
        assert len(getattr(entry, field).strip()) > 20, field
    assert entry.reference.startswith("https://") or entry.reference.startswith("http://")
    assert entry.tags and all(t == t.lower() for t in entry.tags)


def test_fixed_ids_keep_their_meaning() -> None:
    for cid, subject in FIXED.items():
        assert subject in CATALOG[cid].title.lower(), (cid, CATALOG[cid].title)


def test_ids_are_unique_and_sorted_output() -> None:
    ids = [m.id for m in catalog()]
    assert len(ids) == len(set(ids)) == len(CATALOG)
    assert ids == sorted(ids)
    assert len(_CORE) >= 28


def test_catalog_md_is_up_to_date() -> None:
    text = (ROOT / "CATALOG.md").read_text()
    assert text == catalog_markdown(), "CATALOG.md is stale: run `python -m guardtower catalog > CATALOG.md`"


def test_every_catalog_entry_is_declared_by_a_check() -> None:
    from guardtower.preflight._registry import CHECKS

    from guardtower.guard.watch import WATCH_IDS

    declared = {cid for spec in CHECKS.values() for cid in spec.emits} | set(WATCH_IDS)  # the loop watch emits its own
    assert declared <= set(CATALOG), sorted(declared - set(CATALOG))
    # AUDIT-001 is the runner's own: a check that crashed or emitted an id it did not declare
    missing = set(CATALOG) - declared - {"AUDIT-001"}
    assert not missing, f"catalog ids no check declares: {sorted(missing)}"


def test_each_id_is_declared_by_one_check_only() -> None:
    from guardtower.preflight._registry import CHECKS

    owners: dict[str, list[str]] = {}
    for spec in CHECKS.values():
        for cid in spec.emits:
            owners.setdefault(cid, []).append(spec.name)
    assert {cid: names for cid, names in owners.items() if len(names) > 1} == {}


def test_cli_prints_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["catalog"]) == 0
    assert capsys.readouterr().out == catalog_markdown()


def test_cli_prints_json_in_a_subprocess() -> None:
    out = subprocess.run([sys.executable, "-m", "guardtower", "catalog", "--json"], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120).stdout
    entries = json.loads(out)
    assert [e["id"] for e in entries] == [m.id for m in catalog()]
    loss = next(e for e in entries if e["id"] == "LOSS-001")
    assert loss["severity"] == "FAIL" and loss["reference"].startswith("https://") and isinstance(loss["tags"], list)
