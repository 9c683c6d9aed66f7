"""Blind batch 37: three parts of five reports each (language models; perception models; everything else that trains
with PyTorch), each collected by a helper who never read the checks nor ran the audit, and whose report named only
each case's bug class (round 13, the round's last fresh batch: measured once on the round's audit, a929613, before
any change for it)."""

from __future__ import annotations

from tests._blind import BlindCase
from tests._blind_batch37_part_a import CASES as _PART_A
from tests._blind_batch37_part_b import CASES as _PART_B
from tests._blind_batch37_part_c import CASES as _PART_C

CASES: list[BlindCase] = [*_PART_A, *_PART_B, *_PART_C]
