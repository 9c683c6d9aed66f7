"""Blind batch 28: three parts of five reports each (language models; vision and speech; RL, forecasting, metric
learning, diffusion and distillation), each collected by a helper who never read the checks nor ran the audit, and
whose report named only each case's bug class (round 11, measured once on its final audit after the review)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch28_part_a import CASES as _PART_A
from tests._blind_batch28_part_b import CASES as _PART_B
from tests._blind_batch28_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
