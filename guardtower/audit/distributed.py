"""Placeholder: replaced by the distributed checks."""
