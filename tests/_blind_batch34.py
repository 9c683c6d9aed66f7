"""Blind batch 34: three parts of five reports each (transformer language and encoder models; vision and generative
models; training loops across domains), each collected by a helper who never read the checks nor ran the audit, and
whose report named only each case's bug class (round 13; part b measured once on the audit as the round began,
9197a7d; parts a and c on 664adfa, after part b's two checks)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch34_part_a import CASES as _PART_A
from tests._blind_batch34_part_b import CASES as _PART_B
from tests._blind_batch34_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
