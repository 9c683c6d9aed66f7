"""Blind batch 32: three parts of five reports each (LLM instruction tuning, packing and adapters; vision and medical
imaging; speech, TTS, recommendation and distillation), each collected by a helper who never read the checks nor ran
the audit, and whose report named only each case's bug class (round 12, measured once on the round's final audit,
c204fd7)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch32_part_a import CASES as _PART_A
from tests._blind_batch32_part_b import CASES as _PART_B
from tests._blind_batch32_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
