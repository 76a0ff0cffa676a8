"""Integrations with other libraries: `hf` (transformers' experts implementations)."""
