"""Async inference gateway: HTTP in, dynamic batches out to an inference backend."""

__version__ = "0.9.0"
