"""Blind batch 24: two parts of five reports each (LLM fine-tuning; RL, self-supervised, distillation, GAN and
graph training), each collected by a helper who never read the checks and whose report named nothing of its cases
before the measurement (round 10; the third part's collector returned nothing)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch24_part_a import CASES as _PART_A
from tests._blind_batch24_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_C]
