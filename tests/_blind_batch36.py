"""Blind batch 36: three parts of five reports each (transformer fine-tuning in production scripts; vision and
generative research code; other domains and training infrastructure), each collected by a helper who never read the
checks nor ran the audit, and whose report named only each case's bug class (round 13; part b measured once on
91e2a38, part c on af28de6, part a on 94ca2a4, each before any change for it)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch36_part_a import CASES as _PART_A
from tests._blind_batch36_part_b import CASES as _PART_B
from tests._blind_batch36_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
