"""Bridges to other libraries (HF transformers)."""
