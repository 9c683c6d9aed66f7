"""``stabilityguard.core.actions``: the original raised ``GradientSpikeError`` from here (tests-only shim)."""

from guardtower.errors import GradientSpikeError

__all__ = ["GradientSpikeError"]
