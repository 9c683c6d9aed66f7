"""Blind batch 33: three parts of five reports each (transformer language and encoder models; vision and generative
models; training loops across domains), each collected by a helper who never read the checks nor ran the audit, and
whose report named only each case's bug class (round 12, measured once on the final audit after the review's mend,
d57de9f)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch33_part_a import CASES as _PART_A
from tests._blind_batch33_part_b import CASES as _PART_B
from tests._blind_batch33_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
