"""Blind batch 39: three parts of five reports each (transformer and LLM training; vision, audio and generative
models; other domains and training-loop infrastructure), each collected by a helper who never read the checks nor ran
the audit, and whose report named only each case's bug class (round 13, after the round's close: measured once on
8c39d88)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch39_part_a import CASES as _PART_A
from tests._blind_batch39_part_b import CASES as _PART_B
from tests._blind_batch39_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
