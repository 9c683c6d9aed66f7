"""Blind batch 40: three parts of five reports each (language models and transformers; vision, audio and generative
models; other domains and training-loop plumbing), each collected by a helper who never read the checks nor ran the
audit, and whose report named only each case's bug class (round 13's closing measurement: once, on the final audit
after the review's mend, 43470e8)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch40_part_a import CASES as _PART_A
from tests._blind_batch40_part_b import CASES as _PART_B
from tests._blind_batch40_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
