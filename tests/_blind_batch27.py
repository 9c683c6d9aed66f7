"""Blind batch 27: three parts of five reports each (language models; vision, pose and speech; scientific ML,
metric learning, VAEs, RL and graphs), each collected by a helper who never read the checks nor ran the audit, and
whose report named nothing of what the audit might find (round 11, measured once on its final audit)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch27_part_a import CASES as _PART_A
from tests._blind_batch27_part_b import CASES as _PART_B
from tests._blind_batch27_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
