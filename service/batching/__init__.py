"""The dynamic batcher and its adaptive policy."""
