"""Tests-only import shim: the original stabilityguard's import paths, served by guardtower.

Lets the original project's GuardedOptimizer tests (tests/test_stabilityguard_guarded_optimizer.py) run
unchanged against guardtower. Not shipped: it lives under tests/ only.
"""

from stabilityguard.core.guarded_optimizer import GuardedOptimizer

__all__ = ["GuardedOptimizer"]
