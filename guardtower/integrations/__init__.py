"""Integrations with training frameworks. Each submodule imports its framework lazily.

``guardtower.integrations.huggingface``: ``GuardtowerCallback`` and ``StabilityGuardCallback`` for the
Hugging Face ``Trainer`` (needs ``pip install "guardtower[hf]"``).
``guardtower.integrations.lightning``: ``GuardtowerPreflight`` and ``GuardtowerGuard`` for PyTorch Lightning
(needs ``pip install "guardtower[lightning]"``).
"""

__all__: list[str] = []
