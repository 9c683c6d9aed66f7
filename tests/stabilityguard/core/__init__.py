"""``stabilityguard.core``: the original's core package (tests-only shim)."""
