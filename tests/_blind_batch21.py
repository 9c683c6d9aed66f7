"""Blind batch 21: two parts of five reports each (a third collector did not finish in time), each collected by
a helper who never read the checks and whose report named nothing of its cases before the measurement."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch21_part_b import CASES as _PART_B
from tests._blind_batch21_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_B, *_PART_C]
