"""Blind batch 35: three parts of five reports each (large-language-model fine-tuning and alignment; vision, audio
and multimodal models; training loops outside mainstream NLP and vision), each collected by a helper who never read
the checks nor ran the audit, and whose report named only each case's bug class (round 13; parts b and c measured
once on e9ab5e9, after batch 34's changes; part a on 4104bd9, after parts b and c's first fixes)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch35_part_a import CASES as _PART_A
from tests._blind_batch35_part_b import CASES as _PART_B
from tests._blind_batch35_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
