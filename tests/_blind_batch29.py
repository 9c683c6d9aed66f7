"""Blind batch 29: three parts of five reports each (language-model fine-tuning; vision, tabular and Lightning
training code; training-loop mechanics: accumulation, RL, distillation, samplers, speech seq2seq), each collected
by a helper who never read the checks nor ran the audit (round 12, measured once on the audit as it stood at the
start of the round)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch29_part_a import CASES as _PART_A
from tests._blind_batch29_part_b import CASES as _PART_B
from tests._blind_batch29_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
