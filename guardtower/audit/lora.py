"""Placeholder: replaced by the lora checks."""
