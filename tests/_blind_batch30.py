"""Blind batch 30: three parts of five reports each (language models beyond SFT: preference losses, reward models,
pre-training; vision, diffusion, detection and audio; recommenders, tabular, graphs, forecasting and training
utilities), each collected by a helper who never read the checks nor ran the audit, and whose report named only
each case's bug class (round 12, measured once on the round's final audit)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch30_part_a import CASES as _PART_A
from tests._blind_batch30_part_b import CASES as _PART_B
from tests._blind_batch30_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
