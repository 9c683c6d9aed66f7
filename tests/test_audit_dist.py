"""Distributed audit checks on real torch.distributed: two gloo processes on 127.0.0.1 run every scenario of
``_audit_dist_worker.py`` in one launch; each DDP-00x entry has a triggering scenario and a clean one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from guardtower.failure_modes import CATALOG
from guardtower.severity import Severity

from tests._dist_launch import run_two_ranks

WORKER = Path(__file__).with_name("_audit_dist_worker.py")
DDP_IDS = {f"DDP-00{n}" for n in range(1, 7)}
SUMMARY = "DDP-007"  # the INFO naming the wrapper, on every wrapped model


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Launch two ranks once; return each rank's {scenario: result}."""
    results = run_two_ranks(WORKER, tmp_path_factory.mktemp("dist"))
    for rank, result in enumerate(results):
        errors = {name: r["error"] for name, r in result.items() if "error" in r}
        assert not errors, f"rank {rank} scenario errors: {errors}"
    return results


def ddp_ids(result: dict[str, Any]) -> set[str]:
    return {i for i in result["ids"] if i in DDP_IDS}


pytestmark = pytest.mark.slow


def test_clean_ddp_has_no_distributed_findings_and_stays_usable(ranks) -> None:
    for rank in ranks:
        assert ddp_ids(rank["clean"]) == set()
        assert rank["clean"]["synced_after"] is True  # the audit left DDP's reducer in working order


def test_ddp_001_unused_parameter(ranks) -> None:
    for rank in ranks:
        assert ddp_ids(rank["unused"]) == {"DDP-001"}
        assert rank["unused"]["params"] == ["module.spare.bias", "module.spare.weight"]
        assert "DDP-001" not in rank["unused_allowed"]["ids"]


def test_ddp_002_batchnorm_not_synchronised(ranks) -> None:
    for rank in ranks:
        assert ddp_ids(rank["batchnorm"]) == {"DDP-002"}
        assert "DDP-002" not in rank["batchnorm_frozen"]["ids"]
        assert "DDP-002" not in rank["batchnorm_synced"]["ids"]


def test_ddp_003_process_group_but_model_not_wrapped(ranks) -> None:
    for rank in ranks:
        assert ddp_ids(rank["unwrapped"]) == {"DDP-003"}
        assert "DDP-003" not in rank["clean"]["ids"]
        assert "DDP-003" not in rank["fsdp2"]["fsdp2_sharded"]  # fully_shard counts as wrapped


def test_ddp_004_forward_bypasses_wrapper(ranks) -> None:
    for rank in ranks:
        assert ddp_ids(rank["bypass"]) == {"DDP-004"}
        assert "DDP-004" not in rank["clean"]["ids"]


def test_ddp_005_ranks_start_from_different_weights(ranks) -> None:
    for rank in ranks:  # both ranks see it: the comparison is collective
        assert ddp_ids(rank["diverged"]) == {"DDP-005"}
        assert rank["diverged"]["params"] == ["module.fc2.weight"]
        assert "DDP-005" not in rank["clean"]["ids"]
        assert ddp_ids(rank["different_models"]) == {"DDP-003", "DDP-005"}
        assert rank["different_models"]["counts"] == [4, 6]


def test_ddp_006_every_rank_gets_the_same_batch(ranks) -> None:
    for rank in ranks:
        assert ddp_ids(rank["same_batch"]) == {"DDP-006"}
        assert "DDP-006" not in rank["clean"]["ids"]


def test_fsdp2_same_batch_detected_and_shards_not_mistaken_for_divergence(ranks) -> None:
    for rank in ranks:
        assert set(rank["fsdp2"]["fsdp2_same_batch"]) & DDP_IDS == {"DDP-006"}
        assert set(rank["fsdp2"]["fsdp2_sharded"]) & DDP_IDS == set()


def test_lora_model_under_ddp(ranks) -> None:
    for rank in ranks:
        assert rank["lora_ddp"]["is_peft"] is True
        assert ddp_ids(rank["lora_ddp"]) == set()  # frozen base params are not "unused"
        assert "LORA-004" in rank["lora_ddp"]["ids"]


def test_ddp_007_summary_on_wrapped_models_only(ranks) -> None:
    for rank in ranks:
        assert SUMMARY in rank["clean"]["ids"] and SUMMARY in rank["fsdp2"]["fsdp2_sharded"]
        assert SUMMARY not in rank["unwrapped"]["ids"]


def test_dist_catalog_entries_are_complete() -> None:
    assert {i for i in CATALOG if i.startswith("DDP-")} == DDP_IDS | {SUMMARY}
    for entry_id in DDP_IDS | {SUMMARY}:
        entry = CATALOG[entry_id]
        assert entry.title and entry.summary and entry.why and entry.fix and "distributed" in entry.tags
        assert entry.reference.startswith("https://")
    assert CATALOG["DDP-001"].severity is Severity.ERROR
