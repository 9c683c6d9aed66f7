"""Blind batch 23: three parts of five reports each, each collected by a helper who never read the checks and
whose report named nothing of its cases before the measurement (the second fresh batch of round 9)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch23_part_a import CASES as _PART_A
from tests._blind_batch23_part_b import CASES as _PART_B
from tests._blind_batch23_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
